"""What rank 0 finds before the others split the model, sent to them: its example batch,
then the plan with the graph it captured and the specs, tail and autocast dtypes it found.

Only rank 0 captures the model and infers its values' shapes and dtypes: the others would
take as long again to find the same, since every rank holds rank 0's batch
(``same_example``). They wait while rank 0 plans, then take its graph with the plan
(``broadcast_planning``), bound to their own model's parameters (``capture/portable``). Where
the graph cannot travel, each captures the model itself and takes rank 0's specs for it.
The findings travel as JSON, validated on arrival.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from pydantic import TypeAdapter
from torch import nn
from torch.utils import _pytree as pytree

from ..capture.capture import CapturedGraph
from ..capture.graph import TailNodes
from ..capture.portable import NotPortable, pack
from ..plan.plan import Plan
from ..plan.values import ValueSpec
from ..progress import note
from ..runtime.comm import CommError
from .amp import AmpSpecs

__all__ = ["Planning", "broadcast_planning", "packed", "same_example"]

_VALUES: TypeAdapter[dict[str, ValueSpec]] = TypeAdapter(dict[str, ValueSpec])


@dataclass
class Planning:
    """Rank 0's plan and what it found on the graph: every value's spec, the graph's tail,
    the dtypes under the other autocast states (None for a meta-device model)."""

    plan: Plan
    values: dict[str, ValueSpec]
    tail: TailNodes | None
    amp: AmpSpecs | None
    # the captured graph (``capture/portable``) and the device it was captured on; None
    # where it cannot be sent, and each rank captures the model itself
    graph: bytes | None = None
    home: str = "cpu"

    def to_json(self) -> list[str]:
        amp = self.amp
        return [
            self.plan.to_json(),
            _VALUES.dump_json(self.values).decode(),
            json.dumps(None if self.tail is None else dataclasses.asdict(self.tail)),
            json.dumps(None if amp is None else
                       [amp.device_type, amp.planned, [[s, d] for s, d in amp.dtypes.items()]]),
            self.home,
        ]

    @classmethod
    def from_json(cls, parts: list[str], graph: bytes | None = None) -> Planning:
        plan, values, tail, amp, home = parts
        t = json.loads(tail)
        a = json.loads(amp)
        return cls(
            Plan.from_json(plan), _VALUES.validate_json(values),
            None if t is None else TailNodes(**{k: tuple(v) for k, v in t.items()}),
            None if a is None else AmpSpecs(a[0], a[1], {s: d for s, d in a[2]}),
            graph, home,
        )  # fmt: skip


def packed(captured: CapturedGraph, model: nn.Module) -> bytes | None:
    """Rank 0's graph for the others, or None where it cannot travel (they capture it)."""
    try:
        return pack(captured, model)
    except NotPortable as e:
        note("the captured graph stays on rank 0 (%s): every rank captures the model", e)
        return None


def broadcast_planning(found: Planning | Exception | None, rank: int, world: int, *,
                       what: str = "plan the model") -> Planning:
    """Rank 0's ``Planning`` (or its error, raised on every rank) to every rank; ``what``:
    what rank 0 did to find it, as an error names it."""
    if world == 1:
        if isinstance(found, Exception):
            raise found
        assert found is not None
        return found
    payload: list[Any] = [None, None, None]
    if rank == 0:
        if isinstance(found, Planning):
            payload = ["plan", found.to_json(), found.graph]
        else:
            payload = ["error", f"{type(found).__name__}: {found}", None]
    try:
        dist.broadcast_object_list(payload, src=0)
    except RuntimeError as e:
        why = (
            "another rank died (see its log)"
            if rank == 0
            else f"rank 0 took longer to {what} than Config.timeout_s, or it died (see its log)"
        )
        raise CommError(f"rank {rank}: waiting for rank 0 to {what} failed: {e}; {why}") from e
    kind, body, graph = payload
    if kind == "error":
        if isinstance(found, Exception):
            raise found
        raise RuntimeError(f"rank 0 could not {what}: {body}")
    if isinstance(found, Planning):
        return found
    return Planning.from_json(list(body), graph)


def same_example(args: tuple[Any, ...], kwargs: dict[str, Any],
                 rank: int) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """Rank 0's example batch on every rank, each tensor on the device this rank's was on,
    and whether it was taken (False: this rank's call differs in structure, and keeps its own).

    Capture runs the model on its example where it must (a loss kept whole is recorded and
    probed on it, ``capture/record.py``), so ranks with their own data could capture
    different graphs; with rank 0's every rank captures the graph rank 0 plans."""
    mine, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    # the structure as its text: a pickled TreeSpec warns on arrival (its leaves' class)
    payload: list[Any] = [[x.detach().cpu() if isinstance(x, torch.Tensor) and x.device.type
                           != "meta" else x for x in mine], str(spec)] if rank == 0 else [None, None]
    dist.broadcast_object_list(payload, src=0)
    leaves, theirs = payload
    if theirs != str(spec):  # the first call's structure differs: the call's checks say how
        return args, kwargs, False
    out = [t.to(x.device) if isinstance(t, torch.Tensor) and isinstance(x, torch.Tensor) else t
           for t, x in zip(leaves, mine, strict=True)]
    a, kw = pytree.tree_unflatten(out, spec)
    return tuple(a), dict(kw), True
