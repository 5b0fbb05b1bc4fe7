"""The scans where a stage's cost depends on its position from the end: 1F1B's (its
in-flight count) and ZB-H1's (the micro-batches it holds), over ``inflight.Positioned``
views with ``dp_positioned``' DP (``scan``'s docstring has the algorithm).

This module imports numpy only (no torch).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..schedules.kinds import ONE_F_ONE_B
from . import dp_chain, dp_positioned
from .context import Run, bisect, least_bottleneck, u_candidates
from .inflight import Positioned, depth_limit
from .variants import choice
from .zb_view import ZeroBubble

__all__ = ["Layered", "first_positioned", "scan_layered", "search_zbh1"]


class Layered:
    """The 1F1B (or ZB-H1) DP of one m over the variants of the stages (see ``dp_positioned``)."""

    def __init__(self, run: Run, ff: Positioned) -> None:
        self.run, self.ff, self.m = run, ff, ff.m
        self.e, self.lb = ff.entries(np.zeros(ff.fit.shape, bool)), np.zeros(0)
        self.L = self._layers(1)

    def _layers(self, cap: int) -> dp_positioned.Layers:
        """The states, positions capped at ``cap``; a view of exactly S stages (ZB-H1's
        with fewer stages than micro-batches) has positions 1..S and S + 1, where its first
        stage starts and no stage is (``dp``)."""
        S = self.ff.stages
        if not S:
            return dp_positioned.build_layers(self.run.space, cap)
        L = dp_positioned.build_layers(self.run.space, S + 1)
        return dataclasses.replace(L, init=L.init[S : S + 1])

    def depth(self) -> int:
        return depth_limit(self.e.fit, self.e.lo, self.ff.limit)

    def dp(self, U: float, *, strict: bool = False) -> tuple[float, float]:
        run, B, L, m = self.run, self.run.B, self.L, self.m
        e = self.e.take(np.flatnonzero(self.e.u < U if strict else self.e.u <= U))
        n = np.minimum(L.depth, self.ff.limit)
        at = L.depth <= (self.ff.stages or L.depth.max())  # no stage at S + 1

        def weights(idx: np.ndarray) -> np.ndarray:
            return np.where(e.valid(idx, n) & at, e.t[idx, None], np.inf)

        V = dp_positioned.forward(e, weights, L, B, keys=(e.t, e.lo, e.fit))
        run.ran(1)
        if not np.isfinite(V[B, L.final]):
            return math.inf, math.inf
        path = dp_positioned.backtrack(e, weights, V, L, B)
        stages = tuple(choice(int(e.start[k]), int(e.end[k]), int(e.reps[k]), int(e.kind[k]))
                       for k in path)
        alike = bool((e.fit[path] >= m).all())
        return run.best.offer([float(x) for x in e.t[path]], [float(x) for x in e.u[path]],
                              stages, m, run.label(m, alike, self.ff.schedule))

    def bound(self, pre: np.ndarray, u_min: float) -> None:
        """Bound each variant through the relaxed edges' DPs; keep those below the best step."""
        ff, B, st = self.ff, self.run.B, self.run.states
        through = dp_chain.through_bound(ff.edges, pre, dp_chain.backward(ff.edges, st, B), st, B)
        lb = through[:, None] + ff.t + np.maximum(ff.u, u_min)
        self.e = ff.entries(lb < self.run.best.step)
        self.lb = lb[self.e.edge, ff.column(self.e.kind)]
        self.keep(np.ones(len(self.lb), bool))

    def keep(self, mask: np.ndarray) -> None:
        idx = np.flatnonzero(mask)
        self.e, self.lb = self.e.take(idx), self.lb[idx]
        self.L = self._layers(min(self.depth(), self.run.most_stages))


def scan_layered(p: Layered, pre: np.ndarray, u_min: float) -> None:
    run, best = p.run, p.run.best
    p.bound(pre, u_min)  # from the relaxed edges: as cheap as GPipe's bounds
    if not len(p.lb) or (p.depth() == 1 and p.ff.schedule == ONE_F_ONE_B.name):
        return  # what is left runs alike under GPipe, whose DP was searched already
    s_top, u_top = p.dp(best.step - float(pre[run.B, run.states.final]), strict=True)
    if s_top + u_min >= best.step:
        return
    bisect(p, best, u_candidates(p, u_min, u_top, best.step), s_top)


def first_positioned(run: Run, ff: Positioned) -> tuple[float, np.ndarray, float] | None:
    """As ``scan``'s ``_first_flat`` on the relaxed edges: bounds, and their plans offered if they fit
    (at their true cost, never below the relaxed edges')."""
    e, B, st = ff.edges, run.B, run.states
    pre, shifted = dp_chain.forward(e, e.t, st, B)
    if not np.isfinite(pre[B, st.final]):
        return None
    run.ran(1)
    run.offer_exact(ff, dp_chain.backtrack(e, e.t, shifted, st, B))
    s_inf = float(pre[B, st.final])
    u_min, path = least_bottleneck(run, e, s_inf, prune=True)
    if path:
        run.offer_exact(ff, path)
    return s_inf + u_min, pre, u_min


def search_zbh1(run: Run, ms: list[int]) -> None:
    """ZB-H1 (``zb_view.ZeroBubble``): a stage holds min(m, S) micro-batches from F to W,
    so its memory depends on the stage count S where S < m, on its position d alone where
    S >= m. Per m: the layered DP with min(m, S) taken as m (exact for S >= 3 and S >= m;
    for fewer stages it counts more held than they hold, so its plans fit, and one or two
    stages a queue of W they do not have), then, for each S in [1, m) and S = 1, 2, one over
    plans of exactly S stages (its first stage at position S: ``Layered``), bounded through
    the relaxed edges' DPs over any stage count. A forced stage count, or forced replicas,
    is one S."""
    forced = len(run.space.replicas) if run.space.replicas is not None else run.space.stages
    zb_views = ZeroBubble(run.cands)
    for m in ms:
        if forced:
            views = [(min(m, forced), 0, forced > 2)]
        else:
            views = [(m, 0, True)] + [(min(m, S), S, S > 2) for S in sorted(
                {*range(1, min(m, run.most_stages + 1)), *range(1, min(2, run.most_stages) + 1)})]
        for held, S, queue in sorted(views, key=lambda v: not v[2]):  # one cost table each
            zb = zb_views.view(m, held, run.best.step, queue=queue, stages=S)
            got = first_positioned(run, zb) if zb is not None else None
            if zb is not None and got is not None and got[0] < run.best.step:
                scan_layered(Layered(run, zb), got[1], got[2])
        run.step(2)
