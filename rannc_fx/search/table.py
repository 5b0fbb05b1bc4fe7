"""Turn per-node profiles into the per-block cost arrays the search reads (a CostTable)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from operator import attrgetter

import numpy as np
import torch

from ..capture.capture import CapturedGraph
from ..group.group import BlockGraph
from ..group.layers import layer_segments
from ..plan.values import ValueSpec
from ..profile.optimizer import SizeCurve
from ..profile.profile import Profile
from ..progress import note
from ..shapes.tail import TailCost
from . import CostTable

__all__ = ["build_cost_table", "interpolation_weights", "range_sums"]

_FIELDS = ("fwd_s", "bwd_s", "saved_bytes", "workspace_bytes", "kept_bytes", "again_s",
           "rebuilt_bytes", "wheld_bytes", "cast_bytes")


def interpolation_weights(batch_sizes: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """``W`` (Q, P) with ``W @ v`` = a profiled series ``v`` read at each of ``sizes``.

    Linear between neighbouring profiled sizes and along the end segments beyond them; with
    one profiled size, proportional to the sample count (``Profile.at``, before its clamp).
    """
    bs = np.asarray(batch_sizes, dtype=float)
    q = np.asarray(sizes, dtype=float)
    w = np.zeros((len(q), len(bs)))
    if len(bs) == 1:
        w[:, 0] = q / bs[0]
        return w
    hi = np.clip(np.searchsorted(bs, q, side="left"), 1, len(bs) - 1)
    lo = hi - 1
    t = (q - bs[lo]) / (bs[hi] - bs[lo])
    rows = np.arange(len(q))
    w[rows, lo] = 1.0 - t
    w[rows, hi] = t
    return w


def _node_series(profile: Profile, names: Sequence[str], field: str) -> np.ndarray:
    """(N, P): one node's profiled ``field`` per row; nodes the profile lacks cost nothing."""
    p = len(profile.batch_sizes)
    zero = (0.0,) * p
    return np.array(
        [c.series(field) if (c := profile.nodes.get(n)) is not None else zero for n in names],
        dtype=float,
    ).reshape(len(names), p)


def range_sums(num_blocks: int, items: Sequence[tuple[int, int, float]]) -> np.ndarray:
    """``out[i, j] = sum of w over items (lo, hi, w) with i <= lo and hi < j``; (B, B + 1)."""
    m = np.zeros((num_blocks + 1, num_blocks + 1))
    if items:
        lo, hi, w = (np.asarray(c) for c in zip(*items, strict=True))
        np.add.at(m, (lo.astype(np.int64), hi.astype(np.int64) + 1), w)
    # suffix sum over lo, prefix sum over hi + 1 <= j
    acc = np.cumsum(m[::-1], axis=0)[::-1]
    acc = np.cumsum(acc, axis=1)
    return acc[:num_blocks, :]


def _shared_once(uses: dict[int, list[int]], nbytes: dict[int, int] | dict[int, float]
                 ) -> list[tuple[int, int, float]]:
    """Items for ``range_sums`` that count each tensor once in any range holding a user block.

    Uses u1 < u2 < ... inside a range are consecutive, so (#uses in range) - (#consecutive
    pairs in range) is 1 when any use is in the range and 0 otherwise.
    """
    items: list[tuple[int, int, float]] = []
    for key, blocks in uses.items():
        us = sorted(set(blocks))
        w = float(nbytes[key])
        items.extend((u, u, w) for u in us)
        items.extend((a, b, -w) for a, b in zip(us, us[1:], strict=False))
    return items


def _per_tensor(num_blocks: int, grad_uses: dict[int, list[int]], grads: dict[int, int],
                curve: SizeCurve | None) -> np.ndarray | None:
    """Range sums of ``curve`` read at each gradient's size, each tensor once."""
    if curve is None:
        return None
    seconds = curve(np.array(list(grads.values()), float))
    weights = {k: float(s) for k, s in zip(grads, seconds, strict=True)}
    return range_sums(num_blocks, _shared_once(grad_uses, weights))


def build_cost_table(
    captured: CapturedGraph,
    blocks: BlockGraph,
    profile: Profile,
    values: dict[str, ValueSpec],
    *,
    sizes: Sequence[int],
    optimizer: SizeCurve | None = None,
    accumulate: SizeCurve | None = None,
    tail: TailCost | None = None,
) -> CostTable:
    """Per-block forward/backward time, saved and workspace bytes and cut bytes at each size.

    Parameter and gradient bytes are given for every block range, each tensor counted once
    however many blocks (or names, for tied weights) read it; gradients only for parameters
    that require them. ``optimizer`` and ``accumulate`` price each such parameter tensor by
    its size for the ranges' optimizer step and gradient accumulation.

    The tail's nodes (``shapes.tail``) run once a step on the whole batch, not per
    micro-batch: they cost nothing per micro-batch here, and what the tail holds while it
    runs (``tail.held_bytes``) is the last block's workspace, on top of the activations every
    micro-batch holds then. Its time is the same for every plan (``build`` adds it to the step).

    A node that raised at a profiled size (``Profile.failures``) rules that size out for its
    block (``CostTable.excluded``); a tail node's does not (the tail runs on the whole batch).
    """
    t0 = time.perf_counter()
    nb = len(blocks.blocks)
    names = [n for b in blocks.blocks for n in b]
    owner = np.repeat(np.arange(nb), [len(b) for b in blocks.blocks])
    w = interpolation_weights(profile.batch_sizes, sizes)  # (Q, P)
    per_block, per_node = {}, {}
    for field in _FIELDS:
        # clamped per node, as Profile.at does, before summing (or taking the max) per block
        node_vals = np.maximum(_node_series(profile, names, field) @ w.T, 0.0)  # (N, Q)
        if tail is not None and captured.tail is not None:
            node_vals[np.isin(names, captured.tail.nodes)] = 0.0
        acc = np.zeros((nb, len(sizes)))
        (np.maximum if field == "workspace_bytes" else np.add).at(acc, owner, node_vals)
        per_block[field] = acc.T.copy()  # (Q, B)
        if field in ("saved_bytes", "fwd_s"):
            per_node[field] = node_vals

    if tail is not None:
        last = per_block["workspace_bytes"][:, nb - 1]
        np.maximum(last, float(tail.held_bytes), out=last)
    q = np.asarray(sizes, dtype=float)

    def bytes_at(spec: ValueSpec) -> np.ndarray:  # at each size, affine in the samples
        one, two = spec.nbytes_for(1), spec.nbytes_for(2)
        return (two - one) * q + (2 * one - two)

    segments = layer_segments(captured.gm, blocks, values, per_node["saved_bytes"],
                              per_node["fwd_s"], bytes_at)

    cut = np.zeros((len(sizes), nb + 1))
    for b, crossing in enumerate(blocks.boundary):
        for v in crossing:
            cut[:, b] += bytes_at(values[v])
    # batched model outputs (logits): kept by their stage until they go home
    out = np.zeros((len(sizes), nb))
    where = blocks.block_of()
    made = set(captured.tail.nodes) if captured.tail is not None else set()
    for name in dict.fromkeys(captured.output_names):
        spec = values.get(name)
        if spec is not None and spec.kind == "tensor" and spec.batch_dim is not None:
            if name in where and name not in made:  # the tail's: in its held bytes
                out[:, where[name]] += bytes_at(spec)

    # keyed by tensor identity: a tied weight under two names is one tensor
    uses: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for b, ps in enumerate(blocks.params):
        for p in ps:
            t = attrgetter(p)(captured.gm)
            assert isinstance(t, torch.Tensor), f"{p} is not a tensor"
            tensors[id(t)] = t
            uses.setdefault(id(t), []).append(b)
    nbytes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    grads = {k: nbytes[k] for k, t in tensors.items()
             if isinstance(t, torch.nn.Parameter) and t.requires_grad}
    grad_uses = {k: uses[k] for k in grads}
    excluded: dict[int, set[int]] = {}
    for f in profile.failures:
        if f.node in where and f.node not in made:
            excluded.setdefault(f.samples, set()).add(where[f.node])
    table = CostTable(
        sizes=np.asarray(sizes, dtype=np.int64),
        fwd=per_block["fwd_s"],
        bwd=per_block["bwd_s"],
        act=per_block["saved_bytes"],
        kept=per_block["kept_bytes"],
        redo=per_block["again_s"],
        rebuilt=per_block["rebuilt_bytes"],
        wheld=per_block["wheld_bytes"],
        casts=per_block["cast_bytes"] if per_block["cast_bytes"].any() else None,
        workspace=per_block["workspace_bytes"],
        cut=cut,
        param_bytes=range_sums(nb, _shared_once(uses, nbytes)),
        grad_bytes=range_sums(nb, _shared_once(grad_uses, grads)),
        optimizer_s=_per_tensor(nb, grad_uses, grads, optimizer),
        accumulate_s=_per_tensor(nb, grad_uses, grads, accumulate),
        out=out if out.any() else None,
        segments=segments,
        shared=tuple((tuple(sorted(set(bs))), float(nbytes[k]), float(grads.get(k, 0)),
                      float(optimizer(np.array([float(grads[k])]))[0])
                      if optimizer is not None and k in grads else 0.0)
                     for k, bs in uses.items() if len(set(bs)) > 1),
        excluded={q: tuple(sorted(bs)) for q, bs in sorted(excluded.items())},
    )
    note("cost table of %d blocks at %d sizes in %.2f s", nb, len(sizes),
         time.perf_counter() - t0)
    return table
