"""Timing a call on a device: the median of repeats, a call shorter than 0.2 ms looped (CUDA
events on a GPU, so queued kernels are counted)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["median_seconds", "time_call"]

# A timed repeat runs the op this long at least (tiny ops are looped); seconds.
_MIN_REPEAT_S = 2e-4
_MAX_INNER = 64


def _once(fn: Callable[[], Any], device: torch.device) -> float:
    return median_seconds(fn, device, repeats=1, inner=1)


def median_seconds(
    fn: Callable[[], Any], device: torch.device, *, repeats: int, inner: int = 1
) -> float:
    """Median seconds per call over ``repeats`` timings of ``inner`` calls each (CUDA events
    on a GPU, so queued kernels are counted)."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def time_call(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds per call after one warm-up call, looping calls shorter than 0.2 ms."""
    warm = _once(fn, device)
    inner = max(1, min(_MAX_INNER, math.ceil(_MIN_REPEAT_S / max(warm, 1e-7))))
    return median_seconds(fn, device, repeats=repeats, inner=inner)
