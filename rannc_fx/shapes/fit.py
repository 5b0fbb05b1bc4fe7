"""Fit a ValueSpec to a value seen at several sample counts: shape per sample, integers affine.

Propagation (``shapes``) runs the graph at each of ``SAMPLE_COUNTS``; what changes between
those runs is what micro-batching will do to a value. So a value that fits no spec (a dimension
not proportional to the sample count, an integer not ``a * samples + c``, a non-integer that
changes) is refused here, naming its node, before any plan is made for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..plan.values import ValueSpec
from .symbolic import Leaf

__all__: list[str] = []  # private to infer_values_pass, which calls _spec


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _spec(name: str, vals: list[Any], samples: Sequence[int]) -> ValueSpec:
    v0 = vals[0]
    if isinstance(v0, torch.Tensor | Leaf):
        dims, shape = _fit_shape(name, [tuple(v.shape) for v in vals], samples)
        return ValueSpec(
            name=name, kind="tensor", dtype=str(v0.dtype).removeprefix("torch."), shape=shape,
            batch_dim=dims[0] if dims else None, mixed=dims[1:], requires_grad=v0.requires_grad,
        )
    if _is_int(v0):
        return ValueSpec(name=name, kind="int", int_coeffs=(_fit_int(name, [int(v) for v in vals], samples),))
    if isinstance(v0, (tuple, list)) and v0 and all(
        isinstance(v, (tuple, list)) and len(v) == len(v0) and all(_is_int(x) for x in v) for v in vals
    ):
        coeffs = tuple(
            _fit_int(f"{name}[{i}]", [int(v[i]) for v in vals], samples) for i in range(len(v0))
        )
        return ValueSpec(name=name, kind="ints", int_coeffs=coeffs)
    if not any(isinstance(x, torch.Tensor | Leaf) for x in pytree.tree_leaves(v0)):
        if any(not _equal(v, v0) for v in vals[1:]):
            raise ValueError(
                f"node {name} is {vals[0]!r}, {vals[1]!r}, {vals[2]!r} at "
                f"{', '.join(map(str, samples))} samples: a non-integer that depends on the sample "
                "count changes meaning under micro-batching; compute it from tensors instead"
            )
    return ValueSpec(name=name, kind="constant")


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _fit_shape(
    name: str, shapes: list[tuple[int, ...]], samples: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The dimensions that grow with the sample count (the batch dimension first, then any
    that also do: a value that mixes samples) and the shape for one sample."""

    def seen() -> str:  # for the messages only: formatting every node's shapes costs seconds
        return ", ".join(f"{list(s)} at {n}" for s, n in zip(shapes, samples, strict=True))

    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"node {name} changes rank with the sample count ({seen()})")
    varying = tuple(d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1)
    shape = list(shapes[0])
    for d in varying:
        rows = shapes[0][d] // samples[0]
        if rows < 1 or any(s[d] != rows * n for s, n in zip(shapes, samples, strict=True)):
            raise ValueError(
                f"node {name} has dimension {d} that grows with the sample count but not in "
                f"proportion to it ({seen()}): a micro-batch would not hold whole samples (e.g. "
                "a fixed row concatenated to the batch); keep per-sample data along the batch "
                "dimension"
            )
        shape[d] = rows
    return varying, tuple(shape)


def _fit_int(name: str, vals: list[int], samples: Sequence[int]) -> tuple[int, int]:
    (v0, v1, v2), (s0, s1, s2) = vals, samples
    if (v1 - v0) % (s1 - s0) == 0:
        a = (v1 - v0) // (s1 - s0)
        c = v0 - a * s0
        if v2 == a * s2 + c:
            return a, c
    raise ValueError(
        f"integer {name} is {v0}, {v1}, {v2} at {s0}, {s1}, {s2} samples: not a * samples + c, "
        "so no micro-batch size can be planned for it; compute it from tensor sizes that are"
    )
