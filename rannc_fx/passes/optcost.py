"""Parameter costs the per-node profile does not see: gradient accumulation and the optimizer.

The profile times each node's backward with ``torch.autograd.grad``, which returns fresh
gradients. In a step, every micro-batch after the first adds its gradients into ``.grad``
(``AccumulateGrad``: read two tensors, write one), ``m - 1`` times per step per stage:
``accumulate_rate`` prices that per gradient byte (measured with ``add_`` on the device, else
from memory bandwidth). For a large-vocabulary head or embedding it is tens of ms per
micro-batch on a CPU, which is what makes more micro-batches cost more there.

How long the optimizer step takes: a time per gradient byte and one per parameter tensor.
Every replica of a stage steps all of the stage's parameters after the gradient all-reduce,
so the step is part of a stage's per-step time (``search`` adds it next to the all-reduce).
An optimizer step is memory-bound: its time grows with the bytes it streams, plus a fixed
cost per tensor (a kernel launch, or a Python loop iteration on CPU).

With the user's optimizer and a real device, ``measure`` times that optimizer's class with its
own hyper-parameters on scratch tensors: one large tensor for the per-byte rate, many small
ones for the per-tensor rate. Otherwise ``analytic`` estimates the per-byte rate from the
device's memory bandwidth and ``optimizer_state_factor``.
"""

from __future__ import annotations

import inspect
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..device import DeviceSpec

__all__ = ["OptimizerRate", "accumulate_rate", "analytic", "measure", "optimizer_rate"]

log = logging.getLogger("rannc_fx")

_BIG = 1 << 22  # elements of the tensor that gives the per-byte rate (16 MiB in fp32: beyond
# the caches, where large parameters stream from memory; at 4 MiB Adam ran 25 % faster on CPU)
_SMALL, _SMALL_NUMEL = 32, 64  # tensors (and their size) that give the per-tensor rate
_ACCUMULATED = 1 << 22  # elements of the tensors ``accumulate_rate`` adds (16 MiB in fp32)


@dataclass(frozen=True)
class OptimizerRate:
    s_per_byte: float  # per byte of the parameters stepped (gradient bytes)
    s_per_tensor: float
    source: str  # for the log: how the rates were found


def analytic(spec: DeviceSpec, optimizer_state_factor: float) -> OptimizerRate:
    """Read parameter, gradient and state, write parameter and state: ``3 + 2 f`` bytes moved
    per parameter byte, at the device's effective memory bandwidth."""
    per_byte = (3 + 2 * optimizer_state_factor) / (spec.memory_bandwidth * spec.efficiency)
    return OptimizerRate(per_byte, 0.0, f"analytic ({spec.name} memory bandwidth)")


def measure(
    optimizer: torch.optim.Optimizer, device: torch.device, *, repeats: int = 3
) -> OptimizerRate | None:
    """Time ``type(optimizer)`` with ``optimizer.defaults`` on scratch tensors on ``device``;
    None when it cannot be rebuilt that way (a wrapper, a closure-only optimizer)."""
    dtype = next(
        (p.dtype for g in optimizer.param_groups for p in g["params"] if p.is_floating_point()),
        torch.float32,
    )

    def timed(shapes: list[int]) -> float:
        ps = [torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype)) for n in shapes]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = type(optimizer)(ps, **_constructor_kwargs(optimizer))
        opt.step()  # the first step allocates the state
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    try:
        with torch.no_grad():
            many = timed([_SMALL_NUMEL] * _SMALL)
            one = timed([_BIG])
    except Exception as e:  # any optimizer that cannot be rebuilt from its defaults
        log.info("optimizer %s not measured (%s); its step is estimated", type(optimizer).__name__, e)
        return None
    elem = torch.empty((), dtype=dtype).element_size()
    per_tensor = many / _SMALL
    per_byte = max(one - per_tensor, 0.0) / (_BIG * elem)
    return OptimizerRate(per_byte, per_tensor, f"measured {type(optimizer).__name__} on {device}")


def optimizer_rate(
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | None,
    spec: DeviceSpec,
    optimizer_state_factor: float,
) -> OptimizerRate:
    """Measured when there is an optimizer and a device to measure on, else analytic."""
    rate = measure(optimizer, device) if optimizer is not None and device is not None else None
    rate = rate or analytic(spec, optimizer_state_factor)
    log.info("optimizer step: %.3g ns per byte, %.3g us per tensor (%s)",
             rate.s_per_byte * 1e9, rate.s_per_tensor * 1e6, rate.source)
    return rate


def accumulate_rate(
    device: torch.device | None, spec: DeviceSpec, dtype: torch.dtype = torch.float32,
    *, repeats: int = 3,
) -> float:
    """Seconds per gradient byte to add one micro-batch's gradient into ``.grad``."""
    if device is None:
        return 3 / (spec.memory_bandwidth * spec.efficiency)
    grad = torch.zeros(_ACCUMULATED, dtype=dtype, device=device)
    new = torch.ones_like(grad)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        grad.add_(new)
        _sync(device)
        times.append(time.perf_counter() - t0)
    per_byte = statistics.median(times[1:]) / (grad.numel() * grad.element_size())
    log.info("gradient accumulation: %.3g ns per byte (measured on %s)", per_byte * 1e9, device)
    return per_byte


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``defaults`` without the keys the constructor does not take (AdamW records
    ``decoupled_weight_decay``, which only its base class accepts)."""
    params = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
