"""The search pass: the exact optimum of the cost model by a threshold scan over the bottleneck.

This module imports numpy only (no torch); the cost model is in ``cost_model``'s docstring.

Algorithm (exact). step = sum_s t_s + max_s u_s. For one m (and schedule), a DP over the
states -- (block j, ranks used so far), (block, stages, ranks) when the stage count is forced,
(block, stages) when the replicas are -- gives S(U), the least sum_s t_s over plans whose
stages all have u_s <= U. The optimum is the least S(U) + U over the u values of the stages,
and since S never grows with U:

* a DP at U settles every U' in [u_plan, U] (u_plan: the max u of the plan it returns), and
* S(U_b) + U_a bounds S(U') + U' from below for every U' in [U_a, U_b].

So the scan bisects the sorted candidate values of U, lower half first (S is often flat for a
long way), and drops a range once its bound reaches the best step found so far. Before it,
per m (the most micro-batches first): a min-sum DP (S_inf, and a plan), a bottleneck DP
(U_min, the least max u, and a plan) over the stages whose S_inf + u is within the best step
(an m none of whose plans can beat it is skipped, exactly as the bound would skip it), then, for an m whose S_inf + U_min is below the best step, one DP with every stage
whose u can still win (it often settles the m), and a backward min-sum DP that bounds each
stage by the least ``sum t + max(u, U_min)`` of a plan through it; the scan's DPs see only the
stages whose bound is below the best step.

ZB-H1, where the space names it, runs last with the incumbent of the others: the same
layered scans over ``zb_view.ZeroBubble``'s views (``positions.search_zbh1``), once with held = m
and once per forced stage count below m.

GPipe (n = m for every stage) is the plain DP of ``dp_chain``: each stage is one edge, without
recomputation if it fits, else with it. It runs first, for every m, whatever the schedules:
1F1B runs a GPipe plan at the same cost or less (without GPipe among the schedules its plans
are offered at their 1F1B cost), and exactly alike unless one of its stages does not fit at
n = m as it is. So 1F1B needs a DP of its own only for an m where such a stage can still win;
there its S_inf, U_min, bounds and first plans (an incumbent for GPipe's scan too) come from
the relaxed edges (each stage at its cheapest variant, as if last) on the plain DP, and the
scan's DPs are the layered DPs of ``dp_positioned`` over the variants whose bound is below the best
step, with D taken from those variants only. Any stage whose t + u reaches the best step is
dropped before a scan (a plan's step is at least any of its stages' t + u).

Cost. With E <= W * B * (B + 1) / 2 stages that fit and Z states (W + 1 when nothing is forced),
one DP is O(E * Z) vectorised operations; a layered one O(E' * D * Z) over the E' surviving
variants. Where the states shift, E and E' count runs of consecutive replica counts with the
same weight (``windows``): at 1024 ranks 49 k runs for 1.6 M stages. Measured counts are in
benchmarks/results/search_time_cpu_202611.md. Reproducible:
the same inputs give the same plan; of the plans the search compares, equal steps go to fewer
stages, then fewer micro-batches, then GPipe, then the lexicographically smaller stages (and
within a DP to the earliest candidate stage). A 1F1B plan whose stages would all run alike
under GPipe (always so with m = 1) is reported as GPipe when GPipe is a candidate.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from ..schedules.kinds import GPIPE, ONE_F_ONE_B, ZBH1
from . import dp_chain as kernel
from .context import Run, SearchProgress, bisect, least_bottleneck, u_candidates
from .cost_model import _check
from .evaluate import evaluate
from .explain import NoFeasiblePlan, no_plan
from .positions import Layered, first_positioned, scan_layered, search_zbh1
from .problem import SCHEDULES, CostTable, SearchResult, SearchSpace
from .variants import choice

__all__ = ["SearchProgress", "search_pass"]

logger = logging.getLogger("rannc_fx")


class Flat:
    """GPipe's DP of one m: one edge per stage. Without GPipe among the schedules its plans
    are offered at their 1F1B cost: that is the same for every plan whose stages can still
    win unless one of them does not fit at n = m as it is -- which the layered DP covers."""

    def __init__(self, run: Run, e: kernel.Edges, m: int) -> None:
        self.run, self.e, self.m = run, e, m
        self.lb = np.zeros(0)
        self.lo: np.ndarray | None = None  # groups once the edges are sorted by u

    def offer(self, path: list[int]) -> tuple[float, float]:
        """Offer the plan of ``path``; returns its (sum of t, max u) as this DP costs it."""
        e, run = self.e, self.run
        stages = tuple(choice(int(e.start[k]), int(e.end[k]), int(e.reps[k]), int(e.kind[k]))
                       for k in path)
        ts, us = [float(x) for x in e.t[path]], [float(x) for x in e.u[path]]
        if GPIPE.name in run.space.schedules:
            run.best.offer(ts, us, stages, self.m, GPIPE.name)
        else:
            run.offer_1f1b(stages, self.m)
        return sum(ts), max(us)

    def dp(self, U: float, *, strict: bool = False) -> tuple[float, float]:
        """Least sum of t with the stages whose u is <= U (< U), offered: (sum, its max u)."""
        e, B, st = self.e, self.run.B, self.run.states
        ok = e.u < U if strict else e.u <= U
        if self.lo is None:
            w, hi = np.where(ok, e.t, np.inf), None
        else:
            w, hi = e.t, self.lo[:-1] + np.bincount(e.end[ok], minlength=B + 1)
        D, shifted = kernel.forward(e, w, st, B, hi=hi)
        self.run.ran(1)
        if not np.isfinite(D[B, st.final]):
            return math.inf, math.inf
        return self.offer(kernel.backtrack(e, w, shifted, st, B, hi=hi))

    def bound(self, pre: np.ndarray, u_min: float) -> None:
        e, B, st = self.e, self.run.B, self.run.states
        post = kernel.backward(e, st, B)
        self.lb = kernel.through_bound(e, pre, post, st, B) + e.t + np.maximum(e.u, u_min)

    def keep(self, mask: np.ndarray) -> None:
        idx = np.flatnonzero(mask)
        if self.lo is None:
            idx = idx[np.lexsort((self.e.u[idx], self.e.end[idx]))]  # by u within each end block
        self.e, self.lb = self.e.take(idx), self.lb[idx]
        self.lo = kernel.groups(self.e.end, self.run.B)


def _scan_flat(p: Flat, pre: np.ndarray, u_min: float) -> None:
    best, s_inf = p.run.best, float(pre[p.run.B, p.run.states.final])
    # One DP with every stage whose u can still win often settles this m on its own.
    s_top, u_top = p.dp(best.step - s_inf, strict=True)
    if s_top + u_min >= best.step:
        return
    p.bound(pre, u_min)
    cands = u_candidates(p, u_min, u_top, best.step)
    p.keep(p.lb < best.step)
    bisect(p, best, cands, s_top)


def _first_flat(run: Run, m: int) -> tuple[float, np.ndarray, float] | None:
    """The least sum and the least bottleneck of one m, their plans offered: (bound, S, U)."""
    e = run.cands.gpipe(m)
    if e is None or not len(e.t):
        return None
    B, st, p = run.B, run.states, Flat(run, e, m)
    pre, shifted = kernel.forward(e, e.t, st, B)
    if not np.isfinite(pre[B, st.final]):
        return None
    run.ran(1)
    p.offer(kernel.backtrack(e, e.t, shifted, st, B))
    s_inf = float(pre[B, st.final])
    # only 1F1B searched: a plan is offered at its 1F1B cost, which may be below its edges'
    u_min, path = least_bottleneck(run, e, s_inf, prune=GPIPE.name in run.space.schedules)
    if path:
        p.offer(path)
    return s_inf + u_min, pre, u_min


def search_pass(
    table: CostTable, space: SearchSpace, *, progress: SearchProgress | None = None,
    below: float = math.inf,
) -> SearchResult:
    """The plan with the least predicted step time whose stages fit the memory budget.

    ``progress`` is called after every DP and every step (see ``SearchProgress``), for the
    caller's progress lines; the driver logs the search's line from the result. ``below``:
    only a plan whose step is shorter than that (a plan in hand; its bounds prune the
    search from the start), else ``NoFeasiblePlan`` saying so.
    """
    t0 = time.perf_counter()
    _check(table, space)
    run, ms = Run(table, space, progress), sorted(set(space.micro_batches))
    run.best.step = below
    flat: list[tuple[float, int, np.ndarray, float]] = []
    # per m: the least sum, the least bottleneck, and their plans; the most micro-batches
    # first, whose plans are often best at scale and prune the others' bottleneck DPs
    for m in ms[::-1] if set(SCHEDULES) & set(space.schedules) else []:
        if (got := _first_flat(run, m)) is not None:
            flat.append((got[0], m, got[1], got[2]))
        run.step(1 if got is not None else 2)  # no plan at this m: nothing to scan either
    # 1F1B where a stage's position matters: its relaxed plans are incumbents for the scans
    layered: list[tuple[float, int, np.ndarray, float]] = []
    for m in ms if ONE_F_ONE_B.name in space.schedules else []:
        # only where a stage that can still win does not fit at n = m as it is; never at
        # m = 1, where n = min(1, d) = m at every position
        ff = run.cands.one_f_one_b(m, run.best.step, gains_only=True) if m > 1 else None
        got = first_positioned(run, ff) if ff is not None and ff.depth() > 1 else None
        if got is not None:
            layered.append((got[0], m, got[1], got[2]))
        run.step(1 if got is not None else 2)
    for lower, m, pre, u_min in sorted(flat, key=lambda x: (x[0], x[1])):
        if lower < run.best.step and (e := run.cands.gpipe(m)) is not None:
            e = e.take(np.flatnonzero(e.t + e.u < run.best.step))  # step >= any stage's t + u
            _scan_flat(Flat(run, e, m), pre, u_min)
        run.step()
    for lower, m, pre, u_min in sorted(layered, key=lambda x: (x[0], x[1])):
        if lower < run.best.step and (ff := run.cands.one_f_one_b(m, run.best.step)) is not None:
            scan_layered(Layered(run, ff), pre, u_min)
        run.step()
    if ZBH1.name in space.schedules:
        search_zbh1(run, ms)
    best = run.best
    if not best.stages and math.isfinite(below):
        raise NoFeasiblePlan(f"no plan under {'/'.join(space.schedules)} fits with a "
                             f"predicted step shorter than {1e3 * below:.2f} ms")
    if not best.stages and not set(SCHEDULES) & set(space.schedules):
        raise NoFeasiblePlan(
            f"no ZB-H1 plan fits {space.world_size} devices of "
            f"{space.memory_budget / 2**20:.1f} MiB: its stages do not recompute and keep "
            "their parameters on the device, and each holds min(m, stages) micro-batches "
            "from their forward to their weight backward; search 1F1B too "
            "(schedules=('1f1b', 'zbh1')) to be told what would fit")
    if not best.stages:
        raise no_plan(table, space)
    result = SearchResult(best.m, best.stages,
                          evaluate(table, space, best.stages, best.m, best.schedule),
                          time.perf_counter() - t0, best.schedule, best.dps)
    logger.debug("search ran %d DPs", best.dps)
    return result
