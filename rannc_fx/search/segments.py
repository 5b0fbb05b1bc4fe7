"""Recomputation layer by layer: what a stage holds while its backward recomputes segments.

This module imports numpy only (no torch). The model's nodes, in run order, fall into
*segments*: a new one starts where the model enters another of its repeated submodules (a
layer: ``group/layers.py`` finds them). A stage that recomputes layer by layer keeps,
after R, only the values that cross a segment start inside it (each counted once, at the
first start it crosses: ``kept``); its backward then runs each segment's forward once more
right before that segment's backward (``runtime/recompute.py``), so one segment's
activations exist at a time. For the stage [i, j) (blocks; segment starts may fall inside a
block):

    s_i, s_j   the segments holding the stage's first and last node (``first[i]``,
               ``last[j]``)
    K          = sum(kept[s_i + 1 .. s_j])          (0 where s_i = s_j)
    a_max      = sum(act[i:j])                      (s_i = s_j: the stage is inside one)
               = max(head[i], act[s_i + 1 .. s_j - 1], tail[j])   (else)
    transient  = K + a_max

``head[b]`` is what the segment holding boundary b's first node makes from there to its end,
``tail[b]`` what the segment ending at boundary b makes from its start to there.

Time: R runs the stage's forward, every segment but the last checkpointed, and the backward
runs each checkpointed segment's forward again; the last segment's activations are kept
from R. So the forwards run again beyond R are F - ``tail_fwd[j]`` (0 where s_i = s_j: a
stage inside one segment recomputes whole). This
transient replaces the stage's activations A in the recomputing stage's memory
(``terms.StageTerms.seg``). A value that crosses a segment start and also enters the stage
(it was made in the stage's first segment before the stage began) is counted in both K and
the stage's inputs: the prediction errs on the safe side there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Segments"]


@dataclass(frozen=True)
class Segments:
    """The segments of the chain, per size (Q) and per block boundary (B + 1).

    ``starts`` names each segment's first node (the first segment's too); ``act`` and
    ``kept`` are (Q, S); ``first``, ``last`` (B + 1,); ``head``, ``tail`` and ``tail_fwd``
    (Q, B + 1), the last the forward seconds of what ``tail`` holds.
    """

    starts: tuple[str, ...]
    act: np.ndarray
    kept: np.ndarray
    first: np.ndarray
    last: np.ndarray
    head: np.ndarray
    tail: np.ndarray
    tail_fwd: np.ndarray

    def inside(self, i: int, j: int) -> tuple[str, ...]:
        """The segment starts inside the stage [i, j): its checkpoints (``Stage.checkpoints``)."""
        return self.starts[int(self.first[i]) + 1:int(self.last[j]) + 1]

    def again(self, k: int, i: np.ndarray, j: np.ndarray, fwd: np.ndarray) -> np.ndarray:
        """The forward seconds the backwards of the stages [i, j) run again, layer by layer
        (every segment but the stage's last); ``fwd`` is each one's F."""
        return np.where(self.first[i] == self.last[j], 0.0, fwd - self.tail_fwd[k][j])

    def transient(self, k: int, i: np.ndarray, j: np.ndarray, act: np.ndarray) -> np.ndarray:
        """K + a_max of the stages [i, j) at size index k; ``act`` is each one's A."""
        si, sj = self.first[i], self.last[j]
        kept = np.concatenate(([0.0], np.cumsum(self.kept[k])))
        K = kept[sj + 1] - kept[si + 1]
        middle = _range_max(self.act[k], si + 1, sj)  # full segments strictly between
        ends = np.maximum(self.head[k][i], self.tail[k][j])
        return np.where(si == sj, act, K + np.maximum(ends, middle))


def _range_max(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(x[lo:hi]) per pair (0 where empty), by a sparse table: log2(len(x)) levels."""
    lo, hi = np.asarray(lo), np.asarray(hi)
    out = np.zeros(np.broadcast(lo, hi).shape)
    if not len(x):
        return out
    levels = [np.asarray(x, float)]
    while 2 ** len(levels) <= len(x):
        prev, h = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.maximum(prev[:-h], prev[h:]))
    n = hi - lo
    ok = n > 0
    lvl = np.zeros(n.shape, np.int64)
    lvl[ok] = np.floor(np.log2(n[ok])).astype(np.int64)
    for L in np.unique(lvl[ok]):
        sel = ok & (lvl == L)
        a, b = lo[sel], hi[sel] - 2 ** int(L)
        out[sel] = np.maximum(levels[L][a], levels[L][b])
    return out
