"""Range minima over replica counts: a run of stages reads one window of a DP row.

This module imports numpy only (no torch). Where the states shift (``dp_chain.States.shift``,
the layers of ``dp_positioned``), a stage of r replicas that ends in state (layer b, ranks n) reads
the DP row of its start block at (layer prev[b], ranks n - r). Stages that differ only in
their replica count, over consecutive counts lo..hi, and share one weight read

    min over r in [lo, hi] of row[prev[b], n - r]
        = min(ST_l[prev[b], n - hi], ST_l[prev[b], n - lo - 2^l + 1])

with ST_l[x] = min(row[x : x + 2^l]) and 2^l <= hi - lo + 1 < 2^(l + 1) (a sparse table,
built once per row). Such runs are common: a stage's t, memory and in-flight limits depend on
its samples per replica q = ceil(global_batch / (m r)) alone, so consecutive counts with the
same q agree (at 1024 ranks and one micro-batch, 1.6 M candidate stages form 49 k runs).

Adding the shared weight after the minimum gives the DP the same values, bit for bit, as
adding it to each shifted row first: rounding is monotone, so
min(fl(a + w), fl(b + w)) = fl(min(a, b) + w), and likewise for max(., w).

    row of block i   . . . a b c d e f . .      (layer prev[b], ranks)
    stage r = 3..5   reads, at ranks n:  min(row[n-5], row[n-4], row[n-3])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RangeMin", "Runs", "find_runs", "runs_and_tables"]

_TABLES = 1 << 23  # elements of the sparse tables of the window minima (64 MiB)
MEAN_RUN = 2  # the least mean run length that reads windows (two reads per run, one per row)


@dataclass(frozen=True)
class Runs:
    """Runs of stages that read one window each, grouped by end block.

    Run k covers replica counts [lo[k], hi[k]] of stages from block ``start[k]``; ``first[k]``
    is the index (among the stages given to ``find_runs``) of one of them, whose weight
    stands for the run. Runs ending at block b are [groups[b], groups[b + 1]).
    """

    start: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    first: np.ndarray
    groups: np.ndarray
    level: np.ndarray  # floor(log2(hi - lo + 1)): the sparse-table level the run reads

    def span(self, end: np.ndarray) -> int:
        """The most blocks a run covers (how many DP rows must stay readable)."""
        return int((end - self.start).max()) if len(self.start) else 1


def find_runs(idx: np.ndarray, end: np.ndarray, start: np.ndarray, reps: np.ndarray,
              keys: Sequence[np.ndarray], num_blocks: int, *, kind: np.ndarray | None = None,
              longest: int | None = None) -> tuple[Runs, np.ndarray]:
    """The runs of the stages ``idx``: same end, start and ``kind``, consecutive replica
    counts, equal ``keys`` (the arrays their weight is a function of); runs longer than
    ``longest`` counts are cut (fewer sparse-table levels).

    Returns the runs (``first`` indexes the full arrays) and each run's end block.
    """
    if not len(idx):
        empty = np.zeros(0, np.int64)
        return Runs(empty, empty, empty, empty, np.zeros(num_blocks + 2, np.int64),
                    empty), empty
    e, s, r = (np.asarray(a)[idx].astype(np.int64) for a in (end, start, reps))
    k = np.zeros(len(idx), np.int64) if kind is None else np.asarray(kind)[idx].astype(np.int64)
    order_key = ((e * (num_blocks + 1) + s) * (int(k.max()) + 1) + k) * (int(r.max()) + 2) + r
    if len(order_key) > 1 and (np.diff(order_key) < 0).any():
        order = np.argsort(order_key, kind="stable")
        idx, e, s, r, k = idx[order], e[order], s[order], r[order], k[order]
    new = np.ones(len(idx), bool)
    new[1:] = (e[1:] != e[:-1]) | (s[1:] != s[:-1]) | (k[1:] != k[:-1]) | (r[1:] != r[:-1] + 1)
    for key in keys:
        v = np.asarray(key)[idx]
        new[1:] |= v[1:] != v[:-1]
    heads = np.flatnonzero(new)
    size = np.diff(np.append(heads, len(idx)))
    if longest is not None and (size > longest).any():  # cut: pieces of ``longest`` counts
        pieces = -(-size // longest)
        heads = np.repeat(heads, pieces) + longest * (
            np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces))
        size = np.diff(np.append(heads, len(idx)))
    tails = heads + size - 1
    ends = e[heads]
    runs = Runs(s[heads], r[heads], r[tails], idx[heads],
                np.searchsorted(ends, np.arange(num_blocks + 2)),
                np.frexp(size.astype(float))[1].astype(np.int64) - 1)
    return runs, ends


class RangeMin:
    """Sparse tables of the last ``ring`` DP rows, each as (layers, width) state blocks.

    ``prev[b]`` is the layer of the row a stage ending in layer b reads (-1: none, an
    infinite row). Rows are left-padded with ``pad`` (the largest replica count) infinities.
    """

    def __init__(self, *, ring: int, prev: np.ndarray, width: int, pad: int, levels: int):
        self.ring, self.prev, self.pad = ring, np.asarray(prev), pad
        nb = len(self.prev)
        self.st = np.full((levels, ring, nb, pad + width), np.inf)
        s = self.st.strides
        # view[l, slot, r, b, n] = st[l, slot, b, pad + n - r]
        self.view = np.lib.stride_tricks.as_strided(
            self.st[..., pad:], shape=(levels, ring, pad + 1, nb, width),
            strides=(s[0], s[1], -s[3], s[2], s[3]), writeable=False)

    def set(self, i: int, row: np.ndarray) -> None:
        """Block i's DP row (layers * width states) is final: tabulate its window minima.

        What is never written stays infinite from the start: the pads, the layers no stage
        reads (``prev < 0``) and each level's last ``h`` cells."""
        st, pad = self.st, self.pad
        slot = i % self.ring
        blocks = row.reshape(-1, st.shape[3] - pad)
        ok = self.prev >= 0
        st[0, slot, ok, pad:] = blocks[self.prev[ok]]
        for lv in range(1, len(st)):
            h = 1 << (lv - 1)
            np.minimum(st[lv - 1, slot, :, :-h], st[lv - 1, slot, :, h:],
                       out=st[lv, slot, :, :-h])

    def window(self, runs: Runs, a: int, b: int) -> np.ndarray:
        """(b - a, layers, width): the window minima of runs [a, b)."""
        lv, slot = runs.level[a:b], runs.start[a:b] % self.ring
        lo, hi = runs.lo[a:b], runs.hi[a:b]
        got = self.view[lv, slot, hi]
        wide = np.flatnonzero(hi > lo)
        if len(wide):  # a run of one count reads one shifted row
            w = wide
            other = self.view[lv[w], slot[w], lo[w] + (1 << lv[w]) - 1]
            got[w] = np.minimum(got[w], other)
        return got


def runs_and_tables(idx: np.ndarray, end: np.ndarray, start: np.ndarray, reps: np.ndarray,
                    keys: tuple[np.ndarray, ...], num_blocks: int, prev: np.ndarray,
                    width: int, *, kind: np.ndarray | None = None
                    ) -> tuple[Runs, RangeMin] | None:
    """``find_runs`` and a ``RangeMin`` for them within ``_TABLES`` elements (runs
    cut to fewer levels where needed); None when not even one level fits, or when most
    runs hold one count."""
    runs, ends = find_runs(idx, end, start, reps, keys, num_blocks, kind=kind)
    if len(runs.start) * MEAN_RUN > len(idx):
        return None  # mostly runs of one count (a bottleneck DP): a shifted row reads faster
    ring = runs.span(ends) + 1
    pad = int(runs.hi.max()) if len(runs.hi) else 1
    row = ring * len(prev) * (pad + width)
    levels = int(runs.level.max()) + 1 if len(runs.level) else 1
    if row * levels > _TABLES:
        if row > _TABLES:
            return None
        levels = _TABLES // row
        runs, _ = find_runs(idx, end, start, reps, keys, num_blocks, kind=kind,
                            longest=1 << (levels - 1))
    return runs, RangeMin(ring=ring, prev=prev, width=width, pad=pad, levels=levels)
