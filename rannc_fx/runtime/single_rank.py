"""One rank, one micro-batch, no recomputation: call the stage, plain autograd.

The stage is then the whole model on the whole batch, so nothing moves, nothing is reduced
and no bridge is needed: ``loss.backward()`` is autograd through the stage. Its outputs are
those of the general path (batched ones detached), and so are gradients and buffers.
``build_executor`` picks it where it applies; it has ``StageExecutor``'s interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from ..plan.device import device_of
from ..plan.plan import Plan
from ..schedules import routing
from .accumulation import Accumulation
from .batchnorm import DeferredBatchNorm
from .checks import (
    check_inputs,
    check_outputs_routable,
    check_stage_interface,
    check_stage_outputs,
    input_shapes,
)
from .comm import Groups
from .executor import StageExecutor
from .lane import LaneModules
from .pieces import dtype_of, ints_value
from .trainable import Trainable

__all__ = ["AloneExecutor", "build_executor", "runs_alone"]


def runs_alone(plan: Plan) -> bool:
    kinds = {spec.kind for spec in plan.inputs}
    return (
        plan.world_size == 1
        and plan.micro_batches == 1
        and not plan.stages[0].recompute
        and not plan.stages[0].selective
        and not plan.stages[0].host_params
        and plan.tail is None
        and kinds <= {"tensor", "int", "ints"}
    )


def build_executor(
    plan: Plan,
    module: fx.GraphModule | LaneModules,
    *,
    device: torch.device | str | None = None,
    timeout_s: float | None = None,
    groups: Groups | None = None,
    accumulation: Accumulation | None = None,
    trainable: Trainable | None = None,
) -> StageExecutor | AloneExecutor:
    """The executor for this rank: the fast path where ``runs_alone``, else the interpreter
    (``accumulation`` and ``trainable``: the model's, shared by its executors)."""
    if runs_alone(plan):
        assert isinstance(module, fx.GraphModule)  # one rank runs one stage
        return AloneExecutor(plan, module, device=device)
    return StageExecutor(plan, module, device=device, timeout_s=timeout_s, groups=groups,
                         accumulation=accumulation, trainable=trainable)


class AloneExecutor:
    """The one-rank fast path; ``forward(flat_inputs)`` like ``StageExecutor.forward``."""

    def __init__(self, plan: Plan, module: fx.GraphModule, *,
                 device: torch.device | str | None = None):
        if not runs_alone(plan):
            raise ValueError("the fast path runs one rank, one micro-batch, no recomputation")
        check_outputs_routable(plan)
        self.plan, self.module = plan, module
        self.rank, self.replica = 0, 0
        self.stage = plan.stages[0]
        self.device = torch.device(device) if device is not None else device_of(module)
        check_stage_interface(plan, self.stage, module)
        self._local = routing.local_batch(plan)
        self._in_shapes = input_shapes(plan, self._local)
        slot = {spec.name: i for i, spec in enumerate(plan.inputs)}
        out_pos = {name: p for p, name in enumerate(self.stage.outputs)}
        self._cuts = {cv.name: cv for cv in plan.cut_values}
        # (graph input slot, or -1 and the value)
        self._args: list[tuple[int, Any]] = []
        for name in self.stage.inputs:
            spec = plan.inputs[slot[name]]
            if spec.kind in ("int", "ints"):
                self._args.append((-1, ints_value(spec, self._local)))
            else:
                self._args.append((slot[name], None))
        # (stage output position, how it comes back, or -1 and the value): as the general path
        # returns it, detached where that one detaches
        self._outs: list[tuple[int, str, Any]] = []
        for ref in plan.outputs:
            spec = ref.spec
            if spec.kind != "tensor":
                self._outs.append((-1, "value", ints_value(spec, self._local)))
            elif spec.batch_dim is not None:
                self._outs.append((out_pos[spec.name], "detach", None))
            elif dtype_of(spec).is_floating_point or dtype_of(spec).is_complex:
                self._outs.append((out_pos[spec.name], "as is", None))
            else:
                self._outs.append((out_pos[spec.name], "copy", None))

    def forward(self, flat_inputs: Sequence[Any], *, sync: bool = True) -> list[Any]:
        """``sync`` is ignored: one rank sums nothing over ranks (``model.no_sync()``)."""
        local = check_inputs(self.plan, flat_inputs, self._in_shapes, self._local, self.device)
        deferred = DeferredBatchNorm.of(self.module)  # made by another size's executor
        if deferred is not None:  # the whole batch: torch's own update, in the call
            deferred.begin(whole=True)
        outs = self.module(*[local[j] if j >= 0 else v for j, v in self._args])
        if deferred is not None:
            deferred.commit(deferred.sums())  # nothing left to add: the calls updated them
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        if len(outs) != len(self.stage.outputs):
            check_stage_outputs(self.stage, self._cuts, self._local, tuple(outs))  # raises
        flat: list[Any] = []
        for pos, how, v in self._outs:
            if how == "as is":
                flat.append(outs[pos])
            elif how == "detach":
                flat.append(outs[pos].detach())
            elif how == "copy":
                flat.append(outs[pos].detach().clone())
            else:
                flat.append(v)
        return flat
