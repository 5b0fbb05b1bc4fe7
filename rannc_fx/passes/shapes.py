"""Infer every value's per-sample shape, batch dimension and integer formula (FakeTensorProp)."""

# INTERFACE (to be implemented)

from __future__ import annotations

from typing import Any

import torch

from ..plan import ValueSpec
from .capture import CapturedGraph

__all__ = ["dtype_itemsize", "infer_values_pass", "inputs_for_samples"]


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``"float32"``."""
    return getattr(torch, dtype).itemsize


def inputs_for_samples(
    flat_inputs: list[torch.Tensor], batch: int, samples: int, *, batch_dim: int = 0, fake: bool = False
) -> list[torch.Tensor]:
    """The model's flat inputs resized from ``batch`` to ``samples`` along ``batch_dim``.

    Tensors whose ``batch_dim`` size is ``batch`` are the batched ones: real inputs are sliced
    (or tiled when ``samples > batch``); with ``fake=True`` they become meta tensors of the new
    shape. Other inputs pass unchanged.
    """
    out = []
    for t in flat_inputs:
        if not isinstance(t, torch.Tensor) or t.dim() <= batch_dim or t.shape[batch_dim] != batch:
            out.append(t)
            continue
        if fake or t.device.type == "meta":
            shape = list(t.shape)
            shape[batch_dim] = samples
            out.append(torch.empty(shape, dtype=t.dtype, device="meta"))
            continue
        reps = -(-samples // batch)
        if reps > 1:
            tile = [1] * t.dim()
            tile[batch_dim] = reps
            t = t.repeat(*tile)
        out.append(t.narrow(batch_dim, 0, samples).clone())
    return out


def infer_values_pass(
    captured: CapturedGraph, flat_inputs: list[torch.Tensor], *, batch_dim: int = 0
) -> dict[str, ValueSpec]:
    """ValueSpec of every placeholder and call node, from shape propagation at 2-3 batch sizes.

    No real compute runs (FakeTensorMode), so a meta-device model works. Raises ValueError
    naming the node when a value's size is not proportional to the sample count (or an integer
    not affine in it), since micro-batching would then change its meaning.
    """
    raise NotImplementedError
