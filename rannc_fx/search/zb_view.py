"""ZB-H1's view of one micro-batch count for the layered DP (``inflight.Positioned``): per
stage and replica count, its variants' t and u under ZB-H1 and the positions where each is
the one the stage runs.

This module imports numpy only (no torch). ZB-H1 (``cost_model``'s docstring) runs stages that do
not recompute and keep their parameters on the device, each holding held = min(m, S)
micro-batches from F to W; ``StageTerms.memory_zbh1`` and ``zbh1_times`` are its formulas.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..schedules.kinds import ZBH1
from .candidates import Candidates
from .inflight import Positioned
from .terms import StageTerms
from .variants import TWIN, VARIANTS

__all__ = ["ZeroBubble", "fits"]


class ZeroBubble:
    """The views of one search's candidates under ZB-H1, with one micro-batch count's
    costs kept for the views that follow (held and S differ, they do not)."""

    def __init__(self, cands: Candidates) -> None:
        self.cands = cands
        # key, below, rows, T, U, UP of one m (``_costs``)
        self._kept: tuple[Any, ...] | None = None

    def view(self, m: int, held: int, below: float = np.inf, queue: bool = True,
             stages: int = 0) -> Positioned | None:
        """Stages under ZB-H1 holding ``held`` = min(m, S) micro-batches from F to W, at their
        variants without recomputation and with their parameters on the device (those the
        split backward runs as it is): t and u by ``StageTerms.zbh1_times``, and where each
        variant is the one the stage runs, x = min(held, d) in [lo, fit]. A stage's memory
        moves with x the same way for every variant (up where a micro-batch whole weighs at
        least what it holds between B and W, else down: ``memory_zbh1``), so where a variant
        fits is a run of x from one end, and where it runs, an interval. None when no
        stage is left below ``below`` (its cheapest t + u); ``queue``: three stages or more
        (``zbh1_times``); ``stages``: the view is of plans of that many stages (0: any)."""
        reps = self.cands.replicas(m)
        kinds = [v for v in self.cands.kinds if not VARIANTS[v].recompute and not VARIANTS[v].host
                 and not VARIANTS[v].full]
        if not len(reps) or not kinds:
            return None
        sp, R, K = self.cands.space, len(reps), len(kinds)
        ks = [self.cands.size(m, r) for r in reps.tolist()]
        rows, T, U, UP = self._costs(m, reps, ks, kinds, below, queue)
        # (rows, columns, the allowed kinds in chain order): V of these only
        FIT = np.full((len(rows), R, K), -1, np.int64)
        for k in dict.fromkeys(ks):  # the columns of one size at once: (rows, columns) arrays
            cols = np.flatnonzero(np.array(ks) == k)
            wide = self.cands.terms(k, m).take(rows).column()
            for c, v in enumerate(kinds):
                saved, tr = self.cands.offsets(v, reps[cols][None, :], rows, m)
                FIT[:, cols, c] = fits(wide, held, saved, tr, sp.memory_budget, UP[:, cols])
        for c, v in enumerate(kinds):  # ``dominated``, on these kinds' axis
            if v in TWIN and TWIN[v] in kinds:
                FIT[:, :, c][U[:, :, kinds.index(TWIN[v])] < U[:, :, c]] = -1
        # in x' (x where memory grows with it, held + 1 - x where it falls) each variant fits
        # on [1, FIT]; it runs past the variants before it
        before = np.maximum.accumulate(np.maximum(FIT, 0), axis=2)
        lo = np.concatenate((np.ones((len(rows), R, 1), np.int64), before[:, :, :-1] + 1), axis=2)
        up3 = UP[:, :, None]
        LO = np.where(up3, lo, held + 1 - FIT)
        HI = np.where(up3, FIT, held + 1 - lo)
        HI[FIT < 0] = -1
        ok_v = HI >= LO
        # the relaxed edge: the stage at its cheapest variant that runs somewhere (the same t
        # for each; u the least of them)
        first = np.argmax(ok_v, axis=2)
        t = np.take_along_axis(T, first[:, :, None], 2)[:, :, 0]
        u = np.where(ok_v, U, np.inf).min(axis=2)
        keep = np.flatnonzero((ok_v.any(axis=2) & (t + u < below)).ravel())
        if not len(keep):
            return None
        kind = np.asarray(kinds)[first]
        edges = self.cands.edges(keep, reps, t, u, np.zeros(t.shape), kind, rows)
        t_, u_, hi_, lo_ = (x.reshape(-1, K)[keep] for x in (T, U, HI, LO))
        return self.cands.positioned(m, edges, t_, u_, hi_, first=lo_, held=held,
                                     schedule=ZBH1.name, stages=stages, kinds=tuple(kinds))

    def _costs(self, m: int, reps: np.ndarray, ks: list[int], kinds: list[int],
               below: float, queue: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The live stages whose ZB-H1 t + u at one of ``kinds`` is below ``below`` at some
        replica count (a plan with a stage has a step of at least its t + u), and their t,
        u (rows, replica counts, kinds) and whether their memory grows with x (rows, replica
        counts). Kept for the views of one m that follow (held and S differ, these do not);
        a later ``below`` is never higher (the incumbent only falls), so they filter it."""
        key = (m, queue, tuple(kinds))
        if self._kept is not None and self._kept[0] == key and below <= self._kept[1]:
            rows, T, U, UP = self._kept[2:]
            win = (T + U < below).any(axis=(1, 2))
            return rows[win], T[win], U[win], UP[win]
        self._kept = None  # one m at a time: at 1024 ranks these take gigabytes
        rows = self.cands.live
        win = np.zeros(len(rows), bool)
        for k in dict.fromkeys(ks):  # which rows can win, before the (rows, R, K) arrays
            cols = np.flatnonzero(np.array(ks) == k)
            wide, acc = self.cands.terms(k, m).take(rows).column(), self.cands.acc[rows][:, None]
            for v in kinds:
                up = self.cands.fixed_u(v)[rows[:, None], self.cands.col[reps[cols]]]
                t, u = wide.zbh1_times(0, acc, up, queue)
                win |= (t + u < below).any(axis=1)
        rows = rows[win]
        R, K = len(reps), len(kinds)
        T, U = np.zeros((len(rows), R, K)), np.zeros((len(rows), R, K))
        UP = np.zeros((len(rows), R), bool)
        for k in dict.fromkeys(ks):
            cols = np.flatnonzero(np.array(ks) == k)
            terms = self.cands.terms(k, m).take(rows)
            wide, acc = terms.column(), self.cands.acc[rows][:, None]
            UP[:, cols] = (terms.held(0) + terms.cuts >= terms.wheld)[:, None]
            for c, v in enumerate(kinds):
                up = self.cands.fixed_u(v)[rows[:, None], self.cands.col[reps[cols]]]
                T[:, cols, c], U[:, cols, c] = wide.zbh1_times(0, acc, up, queue)
        self._kept = (key, below, rows, T, U, UP)
        return rows, T, U, UP


def fits(terms: StageTerms, held: int, saved: np.ndarray, transient: np.ndarray,
         budget: float, up: np.ndarray) -> np.ndarray:
    """Per element, how many x' in 1..held fit under ZB-H1 (``memory_zbh1`` less ``saved``),
    x' = x where ``up`` (memory grows with x), else held + 1 - x: a run from x' = 1
    (bisection on the formula itself)."""
    lo = np.zeros(up.shape, np.int64)  # fits at x' <= lo (0: nowhere)
    hi = np.full(up.shape, held, np.int64)
    while (open_ := lo < hi).any():
        mid = (lo + hi + 1) // 2
        x = np.where(up, mid, held + 1 - mid)
        good = terms.memory_zbh1(x, held, transient) - saved <= budget
        lo = np.where(open_ & good, mid, lo)
        hi = np.where(open_ & ~good, mid - 1, hi)
    return lo


