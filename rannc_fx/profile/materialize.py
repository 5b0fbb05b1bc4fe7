"""Measure the ops of a model whose tensors are not on the device: each op made real there.

A model built on the meta device holds no values, and one built elsewhere (on the CPU, planned
for a GPU) would be timed on the wrong hardware. Either is measured as a model on the device is,
one op at a time: the profile walks the graph on fake tensors of the device's type (as the
analytic model does; ``walk``: each distinct signature once per size), and each op it profiles
is made real on the device (its parameters, buffers and inputs as new tensors of the fakes'
shapes, strides and dtypes), timed there by ``opcost.measure_op`` and freed. One op's tensors
are on the device at a time, so a model of any size is measured on one device, on the kernels
that device runs (its fused attention, its autocast dtypes), not a spec's figures.

Values: floating tensors are drawn uniform in [0, 1) from a generator of the profile's own (the
user's RNG is untouched), every other tensor is zeros (a valid index, a mask of nothing). The
kernels a model is made of (GEMMs, attention, normalizations, elementwise ops) cost the same
whatever their values. An op that cannot run on such values (a factorization of a matrix that
is not definite), or whose tensors do not fit the device beside what is there, is counted on
its fakes instead (``count_op``) and priced with the device's spec, with a warning naming it.

    ModuleCall      a module run on other tensors than its own (the fakes, or their real twins)
    Materializer    real tensors on the device in the fakes' shapes; ``call`` maps a whole call
    measure_real    an op's measured costs from its fake call, else its counted ones
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..plan.device import DeviceSpec
from .instruments import differentiable, storage_id
from .opcost import OpCall, OpCost, count_op, measure_op

__all__ = ["Materializer", "ModuleCall", "measure_real"]

log = logging.getLogger("rannc_fx")


@dataclass(frozen=True)
class ModuleCall:
    """``module`` called with ``state`` (parameters and buffers by name) in place of its own."""

    module: nn.Module
    state: dict[str, torch.Tensor]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self.module, self.state, args, kwargs, tie_weights=False)


class Materializer:
    """Real tensors on ``device`` shaped as fake (or meta) ones: floating ones uniform in [0, 1),
    the rest zeros."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor with ``like``'s shape, strides, dtype and ``requires_grad`` on the device."""
        shape, stride = tuple(like.shape), tuple(like.stride())
        # the storage the layout spans, filled, then viewed as ``like`` is: an expanded
        # tensor (stride 0) shares its elements, which no in-place fill may write
        span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(
            shape) else 0
        with unset_fake_temporarily(), torch.no_grad():
            flat = torch.empty(span, dtype=like.dtype, device=self.device)
            if flat.is_floating_point():
                flat.uniform_(0, 1, generator=self.generator)
            else:
                flat.zero_()
            t = flat.as_strided(shape, stride)
        return t.requires_grad_(True) if like.requires_grad and differentiable(t) else t

    def call(self, call: OpCall) -> OpCall:
        """``call`` with every tensor it reads (arguments, a module's state, the parameters it
        differentiates) made real, each once (tied tensors stay tied), and the real twins of
        the state it excluded excluded."""
        twins: dict[int, torch.Tensor] = {}
        excluded: set[int] = set()

        def real(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in twins:
                twins[id(t)] = self.tensor(t)
                if storage_id(t) in call.excluded:
                    excluded.add(storage_id(twins[id(t)]))
            return twins[id(t)]

        fn = call.fn
        if isinstance(fn, ModuleCall):
            fn = ModuleCall(fn.module, {k: real(t) for k, t in fn.state.items()})
        args, kwargs = pytree.tree_map_only(torch.Tensor, real, (call.args, call.kwargs))
        params = tuple(real(p) for p in call.params)
        return dataclasses.replace(call, fn=fn, args=args, kwargs=kwargs, params=params,
                                   excluded=frozenset(excluded))


def measure_real(call: OpCall, materializer: Materializer, *, repeats: int, spec: DeviceSpec,
                 warn: Callable[[str], None]) -> OpCost:
    """The costs of ``call`` (on fakes) measured on real twins of its tensors; where the op
    cannot run on them, counted on the fakes and priced with ``spec``."""
    device = materializer.device
    try:
        with unset_fake_temporarily():
            real = materializer.call(call)
            _, cost = measure_op(real, device=device, repeats=repeats)
        return cost
    except (RuntimeError, ValueError) as e:  # torch.OutOfMemoryError is a RuntimeError
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warn(f"{call.name} could not be measured on {device} with made-up values ({why}); "
             f"its cost is counted and priced with {spec.name}'s figures")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # its tensors are gone: give their blocks back
    _, counted = count_op(call)
    fwd_s, bwd_s = counted.times(spec)
    return dataclasses.replace(counted, fwd_s=fwd_s, bwd_s=bwd_s, policy_s=counted.again(spec))
