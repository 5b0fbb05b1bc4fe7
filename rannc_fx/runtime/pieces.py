"""Cut tensors into sample pieces along the batch dimension and put them back together
(and integer values, which each rank computes for its own sample count)."""

from __future__ import annotations

import torch

from ..plan.values import ValueSpec
from ..schedules.routing import Transfer

__all__ = [
    "assemble",
    "dtype_of",
    "interleave",
    "ints_value",
    "piece_shape",
    "sample_major",
    "take",
]


def dtype_of(spec: ValueSpec) -> torch.dtype:
    dt = getattr(torch, spec.dtype or "float32")
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"value {spec.name!r} has unknown dtype {spec.dtype!r}")
    return dt


def ints_value(spec: ValueSpec, samples: int) -> int | torch.Size:
    """An integer value (a size the graph computes) for ``samples`` samples."""
    ints = spec.ints_for(samples)
    return ints[0] if spec.kind == "int" else torch.Size(ints)


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


# An interleaved value (ValueSpec.interleave = k blocks) cannot be cut by sample as it is;
# it moves in sample-major order and is interleaved again where it lands. k = 2, 3 samples:
#
#     interleaved   a0 b0 c0 | a1 b1 c1       sample major   a0 a1 | b0 b1 | c0 c1


def sample_major(x: torch.Tensor, spec: ValueSpec, samples: int) -> torch.Tensor:
    """``x`` (``samples`` samples, interleaved) with each sample's rows together."""
    return _swap(x, spec, (_blocks(spec), samples))


def interleave(x: torch.Tensor, spec: ValueSpec, samples: int) -> torch.Tensor:
    """The inverse of ``sample_major``: ``x`` back in the value's interleaved layout."""
    return _swap(x, spec, (samples, _blocks(spec)))


def _blocks(spec: ValueSpec) -> int:
    if spec.interleave is None or spec.batch_dim is None:
        raise ValueError(f"value {spec.name!r} has no known interleaved layout")
    return spec.interleave


def _swap(x: torch.Tensor, spec: ValueSpec, outer: tuple[int, int]) -> torch.Tensor:
    d = spec.batch_dim
    assert d is not None
    inner = spec.shape[d] // _blocks(spec)
    y = x.unflatten(d, (*outer, inner)).transpose(d, d + 1)
    return y.flatten(d, d + 2)
