"""The search pass: the exact optimum of the cost model by a threshold scan over the bottleneck.

This module imports numpy only (no torch); the cost model is in ``model``'s docstring.

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
layered scans over ``Candidates.zero_bubble``'s views (``_search_zbh1``), once with held = m
and once per forced stage count below m.

GPipe (n = m for every stage) is the plain DP of ``kernel``: each stage is one edge, without
recomputation if it fits, else with it. It runs first, for every m, whatever the schedules:
1F1B runs a GPipe plan at the same cost or less (without GPipe among the schedules its plans
are offered at their 1F1B cost), and exactly alike unless one of its stages does not fit at
n = m as it is. So 1F1B needs a DP of its own only for an m where such a stage can still win;
there its S_inf, U_min, bounds and first plans (an incumbent for GPipe's scan too) come from
the relaxed edges (each stage at its cheapest variant, as if last) on the plain DP, and the
scan's DPs are the layered DPs of ``layers`` over the variants whose bound is below the best
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

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import kernel, layers
from .candidates import Candidates
from .evaluate import evaluate, plan_step
from .explain import NoFeasiblePlan, no_plan
from .inflight import Positioned, depth_limit
from .model import (
    SEARCHED,
    CostTable,
    SearchResult,
    SearchSpace,
    StageChoice,
    _check,
)
from .variants import (
    choice,
)

__all__ = ["SearchProgress", "search_pass"]

logger = logging.getLogger("rannc_fx")

# (steps done, steps in all, DPs run, best step so far in s): a step is the bounds or the scan
# of one micro-batch count under one schedule. Plain numbers, so the caller decides how to say it.
SearchProgress = Callable[[int, int, int, float], None]


def _key(step: float, stages: tuple[StageChoice, ...], m: int, schedule: str
         ) -> tuple[object, ...]:
    return (step, len(stages), m, SEARCHED.index(schedule),
            tuple((s.start, s.end, s.replicas) for s in stages))


@dataclass
class _Best:
    """The incumbent plan; ties go to fewer stages, fewer micro-batches, GPipe, lexicographic."""

    step: float = math.inf
    m: int = 0
    schedule: str = "gpipe"
    stages: tuple[StageChoice, ...] = ()
    dps: int = 0

    def offer(self, ts: list[float], us: list[float], stages: tuple[StageChoice, ...], m: int,
              schedule: str) -> tuple[float, float]:
        """Offer a plan given its stages' t and u; returns its (sum of t, max u)."""
        step = plan_step(ts, us)
        if _key(step, stages, m, schedule) < _key(self.step, self.stages, self.m, self.schedule):
            self.step, self.stages, self.m, self.schedule = step, stages, m, schedule
        return sum(ts), max(us)


class _Run:
    """What every DP of one search shares: the space, the states, the incumbent."""

    def __init__(self, table: CostTable, space: SearchSpace,
                 progress: SearchProgress | None = None) -> None:
        self.space, self.B = space, table.num_blocks
        self.states = kernel.build_states(space)
        self.cands = Candidates(table, space, self.states)
        self.best = _Best()
        self.most_stages = layers.max_depth(space, self.B)
        self.progress = progress
        schedules = ("1f1b" in space.schedules) + ("zbh1" in space.schedules) + 1
        self.steps, self.total = 0, 2 * schedules * len(set(space.micro_batches))


    def ran(self, dps: int) -> None:
        """Count DPs (and tell the caller: one DP can take seconds on a large table)."""
        self.best.dps += dps
        self.step(0)

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.progress is not None:
            self.progress(self.steps, self.total, self.best.dps, self.best.step)

    def label(self, m: int, alike: bool, schedule: str = "1f1b") -> str:
        """The schedule to report for a 1F1B plan (``alike``: GPipe runs it the same); a
        forced 1F1B stays 1F1B, as the user asked; ZB-H1 is ZB-H1."""
        if schedule != "1f1b":
            return schedule
        return "gpipe" if alike and "gpipe" in self.space.schedules else "1f1b"

    def offer_1f1b(self, stages: tuple[StageChoice, ...], m: int) -> None:
        """Offer a GPipe plan at its 1F1B cost (only 1F1B searched): each stage at its
        position, with its first variant that fits (it fits as under GPipe, or better)."""
        ts, us, out, S = [], [], [], len(stages)
        for s, st in enumerate(stages):
            got = self.cands.stage(st.start, st.end, st.replicas, m, min(m, S - s))
            assert got is not None  # fewer in flight than under GPipe
            ts.append(got[0])
            us.append(got[1])
            out.append(choice(st.start, st.end, st.replicas, got[2]))
        alike = all((a.level, a.zero) == (b.level, b.zero)
                    for a, b in zip(stages, out, strict=True))
        self.best.offer(ts, us, tuple(out), m, self.label(m, alike))

    def offer_exact(self, ff: Positioned, path: list[int]) -> None:
        """Offer a plan of relaxed edges at its true 1F1B cost, if it fits."""
        got = ff.exact(path)
        if got is not None:
            ts, us, kinds, alike = got
            e = ff.edges
            stages = tuple(choice(int(e.start[x]), int(e.end[x]), int(e.reps[x]), kind)
                           for x, kind in zip(path, kinds, strict=True))
            self.best.offer(ts, us, stages, ff.m, self.label(ff.m, alike, ff.schedule))


class _Flat:
    """GPipe's DP of one m: one edge per stage. Without GPipe among the schedules its plans
    are offered at their 1F1B cost: that is the same for every plan whose stages can still
    win unless one of them does not fit at n = m as it is -- which the layered DP covers."""

    def __init__(self, run: _Run, e: kernel.Edges, m: int) -> None:
        self.run, self.e, self.m = run, e, m
        self.lb = np.zeros(0)
        self.lo: np.ndarray | None = None  # groups once the edges are sorted by u

    def offer(self, path: list[int]) -> tuple[float, float]:
        """Offer the plan of ``path``; returns its (sum of t, max u) as this DP costs it."""
        e, run = self.e, self.run
        stages = tuple(choice(int(e.start[k]), int(e.end[k]), int(e.reps[k]), int(e.kind[k]))
                       for k in path)
        ts, us = [float(x) for x in e.t[path]], [float(x) for x in e.u[path]]
        if "gpipe" in run.space.schedules:
            run.best.offer(ts, us, stages, self.m, "gpipe")
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


class _Layered:
    """The 1F1B (or ZB-H1) DP of one m over the variants of the stages (see ``layers``)."""

    def __init__(self, run: _Run, ff: Positioned) -> None:
        self.run, self.ff, self.m = run, ff, ff.m
        self.e, self.lb = ff.entries(np.zeros(ff.fit.shape, bool)), np.zeros(0)
        self.L = self._layers(1)

    def _layers(self, cap: int) -> layers.Layers:
        """The states, positions capped at ``cap``; a view of exactly S stages (ZB-H1's
        with fewer stages than micro-batches) has positions 1..S and S + 1, where its first
        stage starts and no stage is (``dp``)."""
        S = self.ff.stages
        if not S:
            return layers.build_layers(self.run.space, cap)
        L = layers.build_layers(self.run.space, S + 1)
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

        V = layers.forward(e, weights, L, B, keys=(e.t, e.lo, e.fit))
        run.ran(1)
        if not np.isfinite(V[B, L.final]):
            return math.inf, math.inf
        path = layers.backtrack(e, weights, V, L, B)
        stages = tuple(choice(int(e.start[k]), int(e.end[k]), int(e.reps[k]), int(e.kind[k]))
                       for k in path)
        alike = bool((e.fit[path] >= m).all())
        return run.best.offer([float(x) for x in e.t[path]], [float(x) for x in e.u[path]],
                              stages, m, run.label(m, alike, self.ff.schedule))

    def bound(self, pre: np.ndarray, u_min: float) -> None:
        """Bound each variant through the relaxed edges' DPs; keep those below the best step."""
        ff, B, st = self.ff, self.run.B, self.run.states
        through = kernel.through_bound(ff.edges, pre, kernel.backward(ff.edges, st, B), st, B)
        lb = through[:, None] + ff.t + np.maximum(ff.u, u_min)
        self.e = ff.entries(lb < self.run.best.step)
        self.lb = lb[self.e.edge, ff.column(self.e.kind)]
        self.keep(np.ones(len(self.lb), bool))

    def keep(self, mask: np.ndarray) -> None:
        idx = np.flatnonzero(mask)
        self.e, self.lb = self.e.take(idx), self.lb[idx]
        self.L = self._layers(min(self.depth(), self.run.most_stages))


def _bisect(p: _Flat | _Layered, best: _Best, cands: np.ndarray, s_top: float) -> None:
    """Scan the candidate values of U (see the module docstring)."""
    stack: list[tuple[int, int, float]] = [(0, len(cands) - 1, s_top)]
    while stack:
        a, b, s_lb = stack.pop()
        b = min(b, int(np.searchsorted(cands, best.step - s_lb)) - 1)
        if b < a or s_lb + cands[a] >= best.step:
            continue
        drop = p.lb >= best.step  # stages that can no longer beat the incumbent
        if np.count_nonzero(drop) * 8 > len(p.lb):
            p.keep(~drop)
        s_b, u_plan = p.dp(float(cands[b]))
        if s_b + cands[a] >= best.step:
            continue
        b2 = int(np.searchsorted(cands, u_plan)) - 1  # S is flat on [u_plan, cands[b]]
        if b2 >= a:
            mid = (a + b2) // 2
            stack += [(mid + 1, b2, s_b), (a, mid, s_b)]  # lower half first: S is often flat


def _candidates(p: _Flat | _Layered, u_min: float, u_top: float, step: float) -> np.ndarray:
    return np.unique(p.e.u[(p.e.u >= u_min) & (p.e.u < u_top) & (p.lb < step)])


def _scan_flat(p: _Flat, pre: np.ndarray, u_min: float) -> None:
    best, s_inf = p.run.best, float(pre[p.run.B, p.run.states.final])
    # One DP with every stage whose u can still win often settles this m on its own.
    s_top, u_top = p.dp(best.step - s_inf, strict=True)
    if s_top + u_min >= best.step:
        return
    p.bound(pre, u_min)
    cands = _candidates(p, u_min, u_top, best.step)
    p.keep(p.lb < best.step)
    _bisect(p, best, cands, s_top)


def _scan_layered(p: _Layered, pre: np.ndarray, u_min: float) -> None:
    run, best = p.run, p.run.best
    p.bound(pre, u_min)  # from the relaxed edges: as cheap as GPipe's bounds
    if not len(p.lb) or (p.depth() == 1 and p.ff.schedule == "1f1b"):
        return  # what is left runs alike under GPipe, whose DP was searched already
    s_top, u_top = p.dp(best.step - float(pre[run.B, run.states.final]), strict=True)
    if s_top + u_min >= best.step:
        return
    _bisect(p, best, _candidates(p, u_min, u_top, best.step), s_top)


def _least_bottleneck(run: _Run, e: kernel.Edges, s_inf: float, *, prune: bool
                      ) -> tuple[float, list[int]]:
    """U_min, the least max u over plans of the edges, and such a plan (edge indices);
    (inf, []) when every plan's step exceeds the incumbent's.

    With ``prune`` (each plan offered costs at least its edges' t and u), a plan through an
    edge has a step of at least fl(S_inf + u) (rounding is monotone), so the DP sees only the
    edges where that is within the best step: its values up to their largest u, hence U_min
    and the plan it backtracks, are those of the DP over every edge; when no plan is left,
    every one of this m loses to the incumbent (whose step only falls), so the m is skipped
    as the bound S_inf + U_min would skip it.
    """
    B, st = run.B, run.states
    keep = np.flatnonzero(s_inf + e.u <= run.best.step) if prune else np.arange(len(e.u))
    if not len(keep):
        return math.inf, []
    kept = e.take(keep) if len(keep) < len(e.u) else e
    bot, shifted = kernel.forward(kept, kept.u, st, B, bottleneck=True)
    run.ran(1)
    if not np.isfinite(bot[B, st.final]):
        return math.inf, []
    path = kernel.backtrack(kept, kept.u, shifted, st, B, bottleneck=True)
    return float(bot[B, st.final]), keep[path].tolist()


def _first_flat(run: _Run, m: int) -> tuple[float, np.ndarray, float] | None:
    """The least sum and the least bottleneck of one m, their plans offered: (bound, S, U)."""
    e = run.cands.gpipe(m)
    if e is None or not len(e.t):
        return None
    B, st, p = run.B, run.states, _Flat(run, e, m)
    pre, shifted = kernel.forward(e, e.t, st, B)
    if not np.isfinite(pre[B, st.final]):
        return None
    run.ran(1)
    p.offer(kernel.backtrack(e, e.t, shifted, st, B))
    s_inf = float(pre[B, st.final])
    # only 1F1B searched: a plan is offered at its 1F1B cost, which may be below its edges'
    u_min, path = _least_bottleneck(run, e, s_inf, prune="gpipe" in run.space.schedules)
    if path:
        p.offer(path)
    return s_inf + u_min, pre, u_min


def _first_1f1b(run: _Run, ff: Positioned) -> tuple[float, np.ndarray, float] | None:
    """As ``_first_flat`` on the relaxed edges: bounds, and their plans offered if they fit
    (at their true cost, never below the relaxed edges')."""
    e, B, st = ff.edges, run.B, run.states
    pre, shifted = kernel.forward(e, e.t, st, B)
    if not np.isfinite(pre[B, st.final]):
        return None
    run.ran(1)
    run.offer_exact(ff, kernel.backtrack(e, e.t, shifted, st, B))
    s_inf = float(pre[B, st.final])
    u_min, path = _least_bottleneck(run, e, s_inf, prune=True)
    if path:
        run.offer_exact(ff, path)
    return s_inf + u_min, pre, u_min


def _search_zbh1(run: _Run, ms: list[int]) -> None:
    """ZB-H1 (``Candidates.zero_bubble``): a stage holds min(m, S) micro-batches from F to W,
    so its memory depends on the stage count S where S < m, on its position d alone where
    S >= m. Per m: the layered DP with min(m, S) taken as m (exact for S >= 3 and S >= m;
    for fewer stages it counts more held than they hold, so its plans fit, and one or two
    stages a queue of W they do not have), then, for each S in [1, m) and S = 1, 2, one over
    plans of exactly S stages (its first stage at position S: ``_Layered``), bounded through
    the relaxed edges' DPs over any stage count. A forced stage count, or forced replicas,
    is one S."""
    forced = len(run.space.replicas) if run.space.replicas is not None else run.space.stages
    for m in ms:
        if forced:
            views = [(min(m, forced), 0, forced > 2)]
        else:
            views = [(m, 0, True)] + [(min(m, S), S, S > 2) for S in sorted(
                {*range(1, min(m, run.most_stages + 1)), *range(1, min(2, run.most_stages) + 1)})]
        for held, S, queue in sorted(views, key=lambda v: not v[2]):  # one cost table each
            zb = run.cands.zero_bubble(m, held, run.best.step, queue=queue, stages=S)
            got = _first_1f1b(run, zb) if zb is not None else None
            if zb is not None and got is not None and got[0] < run.best.step:
                _scan_layered(_Layered(run, zb), got[1], got[2])
        run.step(2)


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
    run, ms = _Run(table, space, progress), sorted(set(space.micro_batches))
    run.best.step = below
    flat: list[tuple[float, int, np.ndarray, float]] = []
    # per m: the least sum, the least bottleneck, and their plans; the most micro-batches
    # first, whose plans are often best at scale and prune the others' bottleneck DPs
    for m in ms[::-1] if {"gpipe", "1f1b"} & set(space.schedules) else []:
        if (got := _first_flat(run, m)) is not None:
            flat.append((got[0], m, got[1], got[2]))
        run.step(1 if got is not None else 2)  # no plan at this m: nothing to scan either
    # 1F1B where a stage's position matters: its relaxed plans are incumbents for the scans
    layered: list[tuple[float, int, np.ndarray, float]] = []
    for m in ms if "1f1b" in space.schedules else []:
        # only where a stage that can still win does not fit at n = m as it is; never at
        # m = 1, where n = min(1, d) = m at every position
        ff = run.cands.one_f_one_b(m, run.best.step, gains_only=True) if m > 1 else None
        got = _first_1f1b(run, ff) if ff is not None and ff.depth() > 1 else None
        if got is not None:
            layered.append((got[0], m, got[1], got[2]))
        run.step(1 if got is not None else 2)
    for lower, m, pre, u_min in sorted(flat, key=lambda x: (x[0], x[1])):
        if lower < run.best.step and (e := run.cands.gpipe(m)) is not None:
            e = e.take(np.flatnonzero(e.t + e.u < run.best.step))  # step >= any stage's t + u
            _scan_flat(_Flat(run, e, m), pre, u_min)
        run.step()
    for lower, m, pre, u_min in sorted(layered, key=lambda x: (x[0], x[1])):
        if lower < run.best.step and (ff := run.cands.one_f_one_b(m, run.best.step)) is not None:
            _scan_layered(_Layered(run, ff), pre, u_min)
        run.step()
    if "zbh1" in space.schedules:
        _search_zbh1(run, ms)
    best = run.best
    if not best.stages and math.isfinite(below):
        raise NoFeasiblePlan(f"no plan under {'/'.join(space.schedules)} fits with a "
                             f"predicted step shorter than {1e3 * below:.2f} ms")
    if not best.stages and not {"gpipe", "1f1b"} & set(space.schedules):
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
