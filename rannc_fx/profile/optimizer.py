"""Parameter costs the per-node profile does not see: gradient accumulation and the optimizer.

Both are per parameter tensor and depend on its size the way memory-bound loops do: a fixed
cost per tensor (a kernel launch, a Python loop iteration on CPU), then a cost per byte that
grows once the tensors no longer fit the caches (Adam on this project's CPU: 1.5 ns per byte
at 4 MiB, 2.0 at 16 MiB). So each is a ``SizeCurve``, seconds for one tensor of n bytes,
measured at a few sizes and read per tensor by ``costs`` into per-block-range sums.

* Accumulation. The profile times each node's backward with ``torch.autograd.grad``, which
  returns fresh gradients; in a step every micro-batch after the first adds into ``.grad``
  (``AccumulateGrad``: an in-place add), ``m - 1`` times per step. For a large-vocabulary
  head or embedding that is tens of ms per micro-batch on a CPU.
* The optimizer step. Every replica of a stage steps the stage's parameters after the
  gradient all-reduce. With the user's optimizer and a real device, ``optimizer_curve`` times
  that optimizer's class with its own settings on scratch tensors; otherwise it estimates
  ``3 + 2 f`` bytes moved per parameter byte (f = ``optimizer_state_factor``) at the device's
  memory bandwidth.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..plan.device import DeviceSpec
from ..progress import note
from .timing import time_call

__all__ = [
    "ParameterCosts",
    "SizeCurve",
    "accumulate_curve",
    "analytic_curve",
    "measure",
    "optimizer_curve",
    "parameter_costs",
]

# Sizes (elements) timed: many small tensors give the fixed cost per tensor; 1 MiB and 16 MiB
# in fp32 the per-byte cost. Each size is timed over 16 MiB of tensors, as a step streams a
# stage's whole parameter set: one 1 MiB tensor stepped again and again stays in the cache and
# ran up to 2x faster (0.6-1.4 ns per byte for Adam here, against 1.3-1.6 over 16 of them).
_SMALL, _SMALL_NUMEL = 32, 64
_SIZES = (1 << 18, 1 << 22)


@dataclass(frozen=True)
class SizeCurve:
    """Seconds to process one tensor of ``n`` bytes: linear between the measured sizes (at
    least two), the smallest one's time below them, the last segment's slope beyond them."""

    nbytes: tuple[float, ...]
    seconds: tuple[float, ...]
    source: str  # for the log: how the figures were found

    def __call__(self, n: float | np.ndarray) -> np.ndarray:
        x, y = np.asarray(self.nbytes, float), np.asarray(self.seconds, float)
        n = np.asarray(n, float)
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        return np.where(n > x[-1], y[-1] + (n - x[-1]) * slope, np.interp(n, x, y))

    def describe(self) -> str:
        pairs = zip(self.nbytes, self.seconds, strict=True)
        cells = ", ".join(f"{_size(b)} {1e6 * s:.3g} us" for b, s in pairs)
        return f"{cells} ({self.source})"


@dataclass(frozen=True)
class ParameterCosts:
    """Both curves: what ``costs.build_cost_table`` reads per parameter tensor."""

    optimizer: SizeCurve
    accumulate: SizeCurve


def parameter_costs(
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | None,
    spec: DeviceSpec,
    optimizer_state_factor: float,
    *,
    repeats: int = 3,
) -> ParameterCosts:
    """The optimizer and accumulation curves, measured on ``device`` (None: analytic), each
    size timed ``repeats`` times after a first run (``Config.profile_repeats``).

    Under ``compile()`` every rank measures at once, so that ranks sharing a host's memory
    bandwidth (CPU processes) are timed as they will run: side by side.
    """
    t0 = time.perf_counter()
    costs = ParameterCosts(
        optimizer_curve(optimizer, device, spec, optimizer_state_factor, repeats=repeats),
        accumulate_curve(device, spec, repeats=repeats),
    )
    note("costed the optimizer step and gradient accumulation per tensor in %.2f s: %s; %s",
         time.perf_counter() - t0, costs.optimizer.describe(), costs.accumulate.describe())
    return costs


def analytic_curve(bytes_per_byte: float, spec: DeviceSpec, what: str) -> SizeCurve:
    """Streaming ``bytes_per_byte`` bytes per tensor byte at the effective memory bandwidth."""
    per_byte = bytes_per_byte / (spec.memory_bandwidth * spec.efficiency)
    return SizeCurve((0.0, float(1 << 30)), (0.0, per_byte * (1 << 30)),
                     f"{what}: analytic, {spec.name} memory bandwidth")


def _curve(
    run: Callable[[list[int]], float], elem: int, what: str
) -> SizeCurve:
    """Time ``run(shapes)`` (seconds for those tensors) at each size; seconds per tensor."""
    xs, ys = [float(_SMALL_NUMEL * elem)], [run([_SMALL_NUMEL] * _SMALL) / _SMALL]
    for n in _SIZES:
        k = max(1, _SIZES[-1] // n)
        xs.append(float(n * elem))
        ys.append(max(run([n] * k) / k, ys[-1]))  # never cheaper than a smaller tensor
    return SizeCurve(tuple(xs), tuple(ys), what)


def measure(
    optimizer: torch.optim.Optimizer, device: torch.device, *, repeats: int = 3
) -> SizeCurve | None:
    """Time ``type(optimizer)`` with the user's settings on scratch tensors on ``device``;
    None when it cannot be rebuilt that way (a wrapper, a closure-only optimizer)."""
    dtype = _dtype_of(optimizer)

    def run(shapes: list[int]) -> float:
        # ones, not random draws: a step streams the same bytes whatever they hold (no
        # subnormals here), and drawing 16 MiB twice a size cost a quarter of the measurement
        ps = [torch.nn.Parameter(torch.ones(n, device=device, dtype=dtype)) for n in shapes]
        for p in ps:
            p.grad = torch.full_like(p, 0.5)
        opt = type(optimizer)(ps, **_constructor_kwargs(optimizer))
        opt.step()  # the first step allocates the state
        return time_call(opt.step, device, repeats)

    name = type(optimizer).__name__
    try:
        with torch.no_grad():
            return _curve(run, _elem(dtype), f"measured {name} on {device}")
    except Exception as e:  # any optimizer that cannot be rebuilt from its defaults
        note("optimizer %s not measured (%s); its step is estimated", name, e)
        return None


def optimizer_curve(
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | None,
    spec: DeviceSpec,
    optimizer_state_factor: float,
    *,
    repeats: int = 3,
) -> SizeCurve:
    """Measured when there is an optimizer and a device to measure on, else analytic."""
    curve = (measure(optimizer, device, repeats=repeats)
             if optimizer is not None and device is not None else None)
    return curve or analytic_curve(3 + 2 * optimizer_state_factor, spec, "optimizer step")


def accumulate_curve(
    device: torch.device | None, spec: DeviceSpec, dtype: torch.dtype = torch.float32,
    *, repeats: int = 3,
) -> SizeCurve:
    """Adding one micro-batch's gradient into ``.grad`` (read two tensors, write one)."""
    if device is None:
        return analytic_curve(3, spec, "gradient accumulation")

    def run(shapes: list[int]) -> float:
        grads = [torch.zeros(n, dtype=dtype, device=device) for n in shapes]
        new = [torch.ones_like(g) for g in grads]

        def add() -> None:
            for g, x in zip(grads, new, strict=True):
                g.add_(x)

        return time_call(add, device, repeats)

    return _curve(run, _elem(dtype), f"measured add_ on {device}")


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``defaults`` without the keys the constructor does not take (AdamW records
    ``decoupled_weight_decay``, which only its base class accepts)."""
    params = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def _dtype_of(optimizer: torch.optim.Optimizer) -> torch.dtype:
    return next(
        (p.dtype for g in optimizer.param_groups for p in g["params"] if p.is_floating_point()),
        torch.float32,
    )


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _size(nbytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.0f} {unit}"
    return f"{nbytes:.0f} B"

