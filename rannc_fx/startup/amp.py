"""Autocast on and off with one compiled model: the plan's cut values in each call's dtypes.

Under ``torch.autocast`` the stages compute in a lower precision, so the values that cross
stages (cut values) and the model's outputs come out in other dtypes than without it, and a
rank must know a value's dtype before it posts the receive. The plan holds the dtypes of the
autocast state it was made under (``Config.autocast_dtype``, else the state of the call that
planned). Before the rest of the model is freed, ``AmpSpecs.of`` infers the dtypes of every
value under the other states a training job switches between (autocast off, bfloat16, and on
CUDA float16) with one run on fake tensors at the example's sizes (``infer_dtypes_pass``: no
real compute, and none of the planning shape pass's symbols: 17-40x faster than that pass
under bfloat16 on the suite's models); a call under one of them runs on a copy of the plan
with those dtypes (``retype``), so each value moves in the dtype it has in that call: half
the bytes of float32 for bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..capture.capture import CapturedGraph
from ..capture.graph import amp_state, autocast_as
from ..plan.plan import Plan
from ..profile.fakes import fake_device
from ..shapes.infer import infer_dtypes_pass

__all__ = ["AmpSpecs", "GradScaler", "amp_state", "autocast_as"]

@dataclass
class AmpSpecs:
    """The dtype of every cut value and model output under each autocast state."""

    device_type: str
    planned: str | None  # the state the plan was made under
    dtypes: dict[str | None, dict[str, str | None]]  # state -> value name -> dtype

    @classmethod
    def of(cls, captured: CapturedGraph, flat_inputs: list[Any], plan: Plan, *,
           device_type: str, planned: str | None, batch_dim: int) -> AmpSpecs:
        """Infer the other states' dtypes (the whole model must still be there)."""
        names = {cv.name for cv in plan.cut_values} | {ref.spec.name for ref in plan.outputs}
        names |= {v.name for v in (plan.tail.inputs if plan.tail is not None else ())}
        states: list[str | None] = [None, "bfloat16"] + (["float16"] if device_type == "cuda"
                                                         else [])
        dtypes: dict[str | None, dict[str, str | None]] = {}
        for state in states:
            if state == planned:
                continue
            with autocast_as(device_type, state):
                values = infer_dtypes_pass(captured, flat_inputs, batch_dim=batch_dim,
                                           device=fake_device(device_type))
            dtypes[state] = {n: values[n] for n in names if n in values}
        return cls(device_type, planned, dtypes)

    def retype(self, plan: Plan, state: str | None) -> Plan:
        """``plan`` with its cut values, outputs and tail inputs in the dtypes they have under
        ``state``."""
        if state == self.planned:
            return plan
        if state not in self.dtypes:
            known = ", ".join(str(s) for s in [self.planned, *self.dtypes])
            raise ValueError(
                f"this call runs under autocast({state}), a state the compiled model did not "
                f"prepare (it knows: {known}); plan under it (Config(autocast_dtype=...)) or "
                "use one of those"
            )
        dtypes = self.dtypes[state]

        def spec(s: Any) -> Any:
            new = dtypes.get(s.name, s.dtype)
            return s if new == s.dtype else s.model_copy(update={"dtype": new})

        tail = plan.tail
        if tail is not None:
            tail = tail.model_copy(update={"inputs": tuple(spec(v) for v in tail.inputs)})
        return plan.model_copy(update={
            "tail": tail,
            "cut_values": tuple(cv.model_copy(update={"spec": spec(cv.spec)})
                                for cv in plan.cut_values),
            "outputs": tuple(ref.model_copy(update={"spec": spec(ref.spec)})
                             for ref in plan.outputs),
        })  # fmt: skip


class GradScaler(ShardedGradScaler):
    """``torch.amp.GradScaler`` for a compiled model: an inf or NaN on any rank skips the step
    (and lowers the scale) on every rank.

    torch's own scaler checks only this rank's gradients, so with a pipeline one rank would
    skip a step its peers take and the replicas and shared weights would part. This is
    torch's ``ShardedGradScaler``, which all-reduces that check over the process group; it
    is used like ``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``).
    """

    def __init__(self, device: str | None = None, **kwargs: Any) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device, **kwargs)
