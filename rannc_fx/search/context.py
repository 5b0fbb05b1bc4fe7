"""What every DP of one search shares: the space, the states, the candidates and the
incumbent (``Run``, ``Best``), and the threshold scan over the bottleneck both kinds of DP
run (``bisect``: ``scan``'s docstring has the algorithm).

This module imports numpy only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..schedules.kinds import GPIPE, ONE_F_ONE_B, ZBH1
from . import dp_chain, dp_positioned
from .candidates import Candidates
from .evaluate import plan_step
from .inflight import Positioned
from .nodes import crossing_at
from .problem import SEARCHED, CostTable, SearchSpace, StageChoice
from .variants import choice

__all__ = ["Best", "Run", "Scanned", "SearchProgress", "bisect", "key", "least_bottleneck",
           "u_candidates"]

# (steps done, steps in all, DPs run, best step so far in s): a step is the bounds or the scan
# of one micro-batch count under one schedule. Plain numbers, so the caller decides how to say it.
SearchProgress = Callable[[int, int, int, float], None]


def key(step: float, stages: tuple[StageChoice, ...], m: int, schedule: str
         ) -> tuple[object, ...]:
    return (step, len(stages), m, SEARCHED.index(schedule),
            tuple((s.start, s.end, s.replicas) for s in stages))


@dataclass
class Best:
    """The incumbent plan; ties go to fewer stages, fewer micro-batches, GPipe, lexicographic."""

    step: float = math.inf
    m: int = 0
    schedule: str = GPIPE.name
    stages: tuple[StageChoice, ...] = ()
    dps: int = 0

    def offer(self, ts: list[float], us: list[float], stages: tuple[StageChoice, ...], m: int,
              schedule: str) -> tuple[float, float]:
        """Offer a plan given its stages' t and u; returns its (sum of t, max u)."""
        step = plan_step(ts, us)
        if key(step, stages, m, schedule) < key(self.step, self.stages, self.m, self.schedule):
            self.step, self.stages, self.m, self.schedule = step, stages, m, schedule
        return sum(ts), max(us)


class Run:
    """What every DP of one search shares: the space, the states, the incumbent."""

    def __init__(self, table: CostTable, space: SearchSpace,
                 progress: SearchProgress | None = None) -> None:
        self.space, self.B = space, table.num_blocks
        self.states = dp_chain.build_states(space)
        self.cands = Candidates(table, space, self.states)
        self.best = Best()
        self.most_stages = dp_positioned.max_depth(space, self.B)
        self.progress = progress
        schedules = (ONE_F_ONE_B.name in space.schedules) + (ZBH1.name in space.schedules) + 1
        self.steps, self.total = 0, 2 * schedules * len(set(space.micro_batches))


    def ran(self, dps: int) -> None:
        """Count DPs (and tell the caller: one DP can take seconds on a large table)."""
        self.best.dps += dps
        self.step(0)

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.progress is not None:
            self.progress(self.steps, self.total, self.best.dps, self.best.step)

    def label(self, m: int, alike: bool, schedule: str = ONE_F_ONE_B.name) -> str:
        """The schedule to report for a 1F1B plan (``alike``: GPipe runs it the same); a
        forced 1F1B stays 1F1B, as the user asked; ZB-H1 is ZB-H1."""
        if schedule != ONE_F_ONE_B.name:
            return schedule
        return GPIPE.name if alike and GPIPE.name in self.space.schedules else ONE_F_ONE_B.name

    def offer_1f1b(self, stages: tuple[StageChoice, ...], m: int) -> None:
        """Offer a GPipe plan at its 1F1B cost (only 1F1B searched): each stage at its
        position, with its first variant that fits (it fits as under GPipe, or better)."""
        ts, us, out, S, first = [], [], [], len(stages), 0
        for s, st in enumerate(stages):
            at = crossing_at(self.space, s, first, st.replicas, S)
            got = self.cands.stage(st.start, st.end, st.replicas, m, min(m, S - s), at)
            first += st.replicas
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



class Scanned(Protocol):
    """A DP the scan drives (``scan.Flat``, ``positions.Layered``): its candidate stages'
    u (``e.u``) and lower bounds (``lb``), which it can drop (``keep``), and its DP at a
    threshold U (``dp``: the least sum of t, and the plan's max u)."""

    lb: np.ndarray

    @property
    def e(self) -> dp_chain.Edges | dp_positioned.Entries: ...

    def keep(self, mask: np.ndarray) -> None: ...

    def dp(self, U: float, *, strict: bool = False) -> tuple[float, float]: ...


def bisect(p: Scanned, best: Best, cands: np.ndarray, s_top: float) -> None:
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


def u_candidates(p: Scanned, u_min: float, u_top: float, step: float) -> np.ndarray:
    return np.unique(p.e.u[(p.e.u >= u_min) & (p.e.u < u_top) & (p.lb < step)])



def least_bottleneck(run: Run, e: dp_chain.Edges, s_inf: float, *, prune: bool
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
    bot, shifted = dp_chain.forward(kept, kept.u, st, B, bottleneck=True)
    run.ran(1)
    if not np.isfinite(bot[B, st.final]):
        return math.inf, []
    path = dp_chain.backtrack(kept, kept.u, shifted, st, B, bottleneck=True)
    return float(bot[B, st.final]), keep[path].tolist()
