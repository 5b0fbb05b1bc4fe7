"""Cut tensors into sample pieces along the batch dimension and put them back together."""

from __future__ import annotations

import torch

from ..plan import ValueSpec
from .routing import Transfer

__all__ = ["assemble", "dtype_of", "piece_shape", "take"]


def dtype_of(spec: ValueSpec) -> torch.dtype:
    dt = getattr(torch, spec.dtype or "float32")
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"value {spec.name!r} has unknown dtype {spec.dtype!r}")
    return dt


def piece_shape(spec: ValueSpec, t: Transfer) -> tuple[int, ...]:
    """The shape of the piece ``t`` moves: the value's shape with the piece's rows."""
    if not t.batched or spec.batch_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.batch_dim] = t.dst_rows(spec)[1]
    return tuple(shape)


def take(x: torch.Tensor, spec: ValueSpec, rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows [start, start + count) of ``x`` along the batch dimension (all of it for None)."""
    if rows is None or spec.batch_dim is None:
        return x
    start, count = rows
    if start == 0 and count == x.shape[spec.batch_dim]:
        return x
    return x.narrow(spec.batch_dim, start, count)


def assemble(
    parts: list[tuple[Transfer, torch.Tensor]], spec: ValueSpec, samples: int, device: torch.device
) -> torch.Tensor:
    """One tensor for ``samples`` samples from disjoint pieces that cover it.

    A single piece that covers everything is returned as is (no copy): the common case of
    equal replica counts, and of a rank that holds its own inputs.
    """
    if not parts:
        raise ValueError(f"no piece of {spec.name!r} reaches this rank; the routes are wrong")
    if len(parts) == 1 and (not parts[0][0].batched or parts[0][0].samples == samples):
        return parts[0][1]
    out = torch.empty(spec.shape_for(samples), dtype=dtype_of(spec), device=device)
    for t, piece in parts:
        take(out, spec, t.dst_rows(spec)).copy_(piece)
    return out
