"""Measure (real tensors) or count (fake tensors) one op's time, FLOPs, bytes, saved and transient memory.

An :class:`OpCall` is one node's work with its inputs bound. :func:`measure_op` times it on the
device it lives on; :func:`count_op` runs it under ``FakeTensorMode`` and counts FLOPs and
bytes moved instead. Both report what autograd saves for backward, split so that the profile
pass can charge every saved storage to the node that made it exactly once::

    saved_internal   bytes of saved storages the op made and did not return
    saved_inputs     positions of input tensors whose storage autograd saved
    saved_outputs    positions of output tensors whose storage autograd saved
    kept_bytes       bytes of the outputs selective recomputation keeps (``selective.kept``
                     ops' outputs), and ``kept_flops`` / ``kept_moved`` what those ops cost:
                     the rest of the forward is what it runs again (``OpCost.again``);
                     measured, ``policy_s``: what the forward under the policy and its
                     rerun take beyond the plain forward
    cast_bytes       of the saved internal bytes, autocast's copies of parameters that need a
                     gradient (its cache makes each once a step, not once a call)
    kept_outputs     positions of output tensors whose storage a kept op made
    kept_saved       bytes of storages made and saved inside the op that a kept op made
                     (with ``kept_outputs``, what of the saved bytes selective recomputation
                     keeps rather than rebuilds)
    views            per output tensor, the position of the input whose storage it shares
                     (a view, or the input an in-place op returns), else None

Storages of parameters and buffers (``OpCall.excluded``) are never counted as saved.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..plan import selective
from ..plan.device import DeviceSpec
from .flops import Flops
from .instruments import (
    CudaPeak,
    OpTracker,
    SavedLog,
    differentiable,
    first_positions,
    storage_id,
    tensors,
)
from .timing import time_call

__all__ = ["OpCall", "OpCost", "count_op", "measure_op", "run_op"]

log = logging.getLogger("rannc_fx")


@dataclass
class OpCall:
    """One node's work: ``fn(*args, **kwargs)`` with real or fake inputs bound.

    ``params`` are tensors the op differentiates besides its inputs (a module's parameters);
    ``mutates`` says the op writes to an input, so every run gets clones of the inputs.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    params: tuple[torch.Tensor, ...] = ()
    mutates: bool = False
    excluded: frozenset[int] = field(default_factory=frozenset)
    name: str = ""  # for messages: the node and its op

    def inputs(self) -> list[torch.Tensor]:
        return tensors((self.args, self.kwargs))

    def bind(self) -> tuple[Callable[[], Any], list[torch.Tensor]]:
        """A no-argument call and the inputs it uses: fresh clones when the op ``mutates``."""
        args, kwargs = self.args, self.kwargs
        if self.mutates:
            args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
        fn = self.fn
        return (lambda: fn(*args, **kwargs)), tensors((args, kwargs))

    def grad_inputs(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for t in [*self.inputs(), *self.params]:
            if t.requires_grad and differentiable(t):
                seen.setdefault(id(t), t)
        return list(seen.values())


@dataclass(frozen=True)
class OpCost:
    """What one op costs: seconds (measured) or FLOPs and bytes (analytic), and memory."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    dtype: str = "float32"
    workspace: int = 0
    saved_internal: int = 0
    saved_inputs: tuple[int, ...] = ()
    saved_outputs: tuple[int, ...] = ()
    views: tuple[int | None, ...] = ()
    kept_bytes: int = 0
    kept_flops: float = 0.0
    kept_moved: float = 0.0
    policy_s: float = 0.0
    kept_outputs: tuple[int, ...] = ()
    kept_saved: int = 0
    cast_bytes: int = 0
    # held between a split backward's B and W (``opcost_bw.WeightHeld``)
    w_inputs: tuple[int, ...] = ()
    w_outputs: tuple[int, ...] = ()
    w_internal: int = 0
    w_grads: int = 0

    def times(self, spec: DeviceSpec | None) -> tuple[float, float]:
        """(forward, backward) seconds; with ``spec``, from the roofline of FLOPs and bytes."""
        if spec is None:
            return self.fwd_s, self.bwd_s
        rate = spec.flops_for(self.dtype) * spec.efficiency

        def roof(flops: float, nbytes: float) -> float:
            return max(flops / rate, nbytes / spec.memory_bandwidth)

        return roof(self.fwd_flops, self.fwd_bytes), roof(self.bwd_flops, self.bwd_bytes)

    def again(self, spec: DeviceSpec | None) -> float:
        """The seconds selective recomputation adds to a micro-batch: with ``spec``, the
        forward less its kept ops (``selective.kept``) priced on their roofline; measured,
        ``policy_s`` (the policy's dispatch mode in Python costs the forward and the rerun a
        few microseconds an op, which only a measurement sees)."""
        if spec is None:
            return self.policy_s
        fwd = self.times(spec)[0]
        if not self.kept_moved:
            return fwd
        rate = spec.flops_for(self.dtype) * spec.efficiency
        return max(0.0, fwd - max(self.kept_flops / rate, self.kept_moved / spec.memory_bandwidth))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v != getattr(_ZERO, k)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> OpCost:
        d = dict(d)
        for k in ({"saved_inputs", "saved_outputs", "views", "kept_outputs", "w_inputs",
                   "w_outputs"} & d.keys()):
            d[k] = tuple(d[k])
        return cls(**d)


_ZERO = OpCost()


# -- running ---------------------------------------------------------------------------------


@dataclass
class _Run:
    out: Any
    workspace: int
    moved: int
    saved: tuple[int, tuple[int, ...], tuple[int, ...]]
    views: tuple[int | None, ...]
    kept: tuple[int, float, float]  # selective.kept ops: output bytes, FLOPs, bytes moved
    kept_outputs: tuple[int, ...]  # outputs a kept op made
    kept_saved: int  # internal saved storages a kept op made
    cast_bytes: int  # saved copies of parameters in another dtype (autocast's)


def _instrumented(call: OpCall, device: torch.device | None) -> _Run:
    """One forward run that logs saved tensors, allocations and bytes moved (autocast's
    cache off: each run casts its weights itself, as the first call of a step does)."""
    run, bound = call.bind()
    log = SavedLog()
    known = set(call.excluded) | {storage_id(t) for t in bound}
    tracker = OpTracker(known, params=call.excluded)
    cuda = CudaPeak(device) if device is not None and device.type == "cuda" else None
    hooks = torch.autograd.graph.saved_tensors_hooks(log.pack, log.unpack)
    with torch.enable_grad(), hooks, cuda or contextlib.nullcontext(), _uncached(), tracker:
        out = run()
    outs = tensors(out)
    out_bytes = sum(t.numel() * t.element_size() for t in outs)
    workspace = max(tracker.peak, cuda.peak if cuda else 0, out_bytes)
    first: dict[int, int] = {}
    for i, t in enumerate(bound):
        first.setdefault(storage_id(t), i)
    views = tuple(first.get(storage_id(t)) for t in outs)
    kept = (tracker.kept_bytes, float(tracker.kept_flops), float(tracker.kept_moved))
    mine = {storage_id(t) for t in bound} | {storage_id(t) for t in outs}
    kept_saved = sum(n for sid, n in log.storages.items()
                     if sid in tracker.kept and sid not in mine and sid not in call.excluded)
    kept_outputs = first_positions([storage_id(t) for t in outs], tracker.kept)
    casts = sum(n for sid, n in tracker.casts.items() if sid in log.storages)
    return _Run(out, workspace, tracker.moved, log.classify(bound, outs, call.excluded), views,
                kept, kept_outputs, kept_saved, casts)


@contextlib.contextmanager
def _uncached() -> Iterator[None]:
    """Autocast's cache of cast weights off (a cast made by an earlier op would hide)."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def run_op(call: OpCall, *, grad: bool = True) -> Any:
    """Run the op once for its outputs alone, as training would (grad mode decides kernels),
    or with ``grad=False`` as a ``no_grad`` region of the graph does."""
    with torch.set_grad_enabled(grad):
        return call.bind()[0]()


def _backward(call: OpCall, out: Any) -> Callable[[], Any] | None:
    """A call computing the op's input and parameter gradients, or None without a grad path."""
    outs = [t for t in tensors(out) if t.requires_grad and t.grad_fn is not None]
    gin = call.grad_inputs()
    if not outs or not gin:
        return None
    gouts = [torch.ones_like(t) for t in outs]
    return lambda: torch.autograd.grad(outs, gin, gouts, retain_graph=True, allow_unused=True)


def _dtype(call: OpCall, out: Any) -> str:
    for t in [*call.inputs(), *tensors(out)]:
        if differentiable(t):
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def measure_op(call: OpCall, *, device: torch.device, repeats: int = 3) -> tuple[Any, OpCost]:
    """Time the op's forward and backward on ``device``; return its outputs and costs."""
    first = _instrumented(call, device)
    with torch.enable_grad():
        fwd_s = time_call(call.bind()[0], device, repeats)
        out = call.bind()[0]()
        policy_s = max(0.0, time_call(_rerun(call.bind()[0]), device, repeats) - fwd_s)
    bwd = _backward(call, out)
    bwd_s = 0.0
    if bwd is not None:
        try:
            bwd_s = time_call(bwd, device, repeats)
        except RuntimeError as e:  # no derivative for this op: nothing runs backward
            log.debug("%s has no backward (%s); costing it 0", call.name, e)
    internal, ins, outs = first.saved
    kept, kept_flops, kept_moved = first.kept
    return out, OpCost(
        fwd_s=fwd_s, bwd_s=bwd_s, fwd_bytes=first.moved, workspace=first.workspace,
        saved_internal=internal, saved_inputs=ins, saved_outputs=outs, views=first.views,
        kept_bytes=kept, kept_flops=kept_flops, kept_moved=kept_moved,
        kept_outputs=first.kept_outputs, kept_saved=first.kept_saved,
        cast_bytes=first.cast_bytes, policy_s=policy_s,
    )


def _rerun(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` under selective recomputation's forward mode, then again as its backward
    reruns it (the kept ops' outputs taken from what the first run stored)."""
    def run() -> Any:
        fwd, again = selective.contexts()
        with fwd:
            fn()
        with again:
            return fn()
    return run


def count_op(call: OpCall) -> tuple[Any, OpCost]:
    """Count the op's forward and backward FLOPs and bytes on fake tensors."""
    with Flops() as fwd_fc:
        first = _instrumented(call, None)
    bwd = _backward(call, first.out)
    bwd_flops, bwd_bytes = 0, 0
    if bwd is not None:
        tracker = OpTracker(set())
        try:
            with Flops() as bwd_fc, tracker:
                bwd()
            bwd_flops, bwd_bytes = bwd_fc.total, tracker.moved
        except RuntimeError as e:
            log.debug("%s has no backward (%s); costing it 0", call.name, e)
    internal, ins, outs = first.saved
    kept, kept_flops, kept_moved = first.kept
    return first.out, OpCost(
        fwd_flops=fwd_fc.total, bwd_flops=bwd_flops,
        fwd_bytes=first.moved, bwd_bytes=bwd_bytes, dtype=fwd_fc.dtype or _dtype(call, first.out),
        workspace=first.workspace,
        saved_internal=internal, saved_inputs=ins, saved_outputs=outs, views=first.views,
        kept_bytes=kept, kept_flops=kept_flops, kept_moved=kept_moved,
        kept_outputs=first.kept_outputs, kept_saved=first.kept_saved,
        cast_bytes=first.cast_bytes,
    )

