"""Candidate stages of one micro-batch count: their costs, recomputation and in-flight limits.

This module imports numpy only (no torch). Every stage [i, j) x replica count r is costed
from ``model.StageTerms`` (computed once per size and reused for every m):

* ``gpipe(m)``: the stages as the GPipe DP sees them (n = m), each without recomputation if
  it fits, else with it (or as ``SearchSpace.recompute`` forces), dropped if neither fits;
* ``one_f_one_b(m)``: under 1F1B, for each stage the largest n with which it fits without and
  with recomputation, its variants (as ``layers.Entries`` on demand), and the relaxed edges --
  each stage at its cheapest variant, as if it were the last stage (n = 1): a lower bound on
  its weight at any position, for the bounds of the search;
* ``stage(...)``: one stage at a given n (a GPipe plan re-costed under 1F1B);
* ``least_memory(m, n)``: every stage at its least memory (for ``NoFeasiblePlan``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernel import Edges, States
from .layers import Entries
from .model import (
    CostTable,
    SearchSpace,
    StageTerms,
    allreduce_s,
    bottleneck_s,
    range_max,
    range_sum,
    samples_per_replica,
    size_index,
    stage_terms,
)

__all__ = ["Candidates", "OneFOneB", "depth_limit", "max_in_flight"]


def max_in_flight(terms: StageTerms, recompute: bool, m: int, budget: float) -> np.ndarray:
    """The largest n in [0, m] with ``terms.memory(n, recompute) <= budget`` (0: none).

    Memory grows with n, so a division estimates the limit and the formula itself settles
    it: the limit agrees with ``evaluate`` to the last bit.
    """
    per = terms.cuts - terms.cout if recompute else terms.act + terms.cuts
    one = terms.memory(1, recompute)
    with np.errstate(divide="ignore", invalid="ignore"):
        est = np.floor(1 + (budget - one) / per)
    est = np.where(per > 0, est, np.where(one <= budget, m, 0))
    n = np.clip(np.nan_to_num(est, nan=0.0), 0, m).astype(np.int64)
    while True:
        up = (n < m) & (terms.memory(n + 1, recompute) <= budget)
        down = (n > 0) & (terms.memory(n, recompute) > budget)
        if not (up.any() or down.any()):
            return n
        n += up.astype(np.int64) - down.astype(np.int64)


def depth_limit(fit: np.ndarray, lo: np.ndarray, m: int) -> int:
    """D: 1 + the largest in-flight limit below m of variants valid for n in [lo, fit].

    From d = D on, n = min(m, d) is past every limit below m, so nothing changes any more;
    D = 1: every variant runs alike at every position (as under GPipe).
    """
    lim = np.concatenate((fit, lo - 1))
    lim = lim[lim < m]
    return 1 + int(lim.max()) if len(lim) else 1


@dataclass(frozen=True)
class OneFOneB:
    """The 1F1B view of one m: the relaxed edges, and per edge both variants' t, u and the
    largest n that fits (0: none; -1: the variant is not allowed, its t and u meaningless).

    Variant 0 (no recomputation) is valid for n in [1, fit0]; variant 1 where variant 0
    does not fit, n in [fit0 + 1, fit1] (from 1 when variant 0 is not allowed).
    """

    m: int
    edges: Edges
    t: np.ndarray  # (edges, 2)
    u: np.ndarray
    fit: np.ndarray

    @property
    def lo(self) -> np.ndarray:
        return np.stack([np.ones(len(self.fit), np.int64), np.maximum(self.fit[:, 0], 0) + 1],
                        axis=1)

    @property
    def exists(self) -> np.ndarray:
        """(edges, 2): whether the variant is valid anywhere."""
        return self.fit >= self.lo

    def depth(self) -> int:
        ok = self.exists
        return depth_limit(self.fit[ok], self.lo[ok], self.m)

    def entries(self, mask: np.ndarray) -> Entries:
        """The variants in ``mask`` (edges, 2), sorted by (end, reps, start, variant)."""
        e, lo = self.edges, self.lo
        x, v = np.nonzero(mask & self.exists)
        order = np.lexsort((v, e.start[x], e.reps[x], e.end[x]))
        x, v = x[order], v[order]
        return Entries(e.start[x], e.end[x], e.reps[x], self.t[x, v], self.u[x, v],
                       v.astype(bool), lo[x, v], self.fit[x, v], x)

    def exact(self, path: list[int]) -> tuple[list[float], list[float], list[bool],
                                               bool] | None:
        """t, u and recomputation of the stages of ``path`` at their true positions, and
        whether every one fits at n = m (so GPipe runs them alike); None if one does not fit."""
        ts, us, rhos, alike = [], [], [], True
        for s, x in enumerate(path):
            n = min(self.m, len(path) - s)
            kind = next((v for v in (0, 1) if self.fit[x, v] >= n), None)
            if kind is None:
                return None
            ts.append(float(self.t[x, kind]))
            us.append(float(self.u[x, kind]))
            rhos.append(bool(kind))
            alike &= bool(self.fit[x, kind] >= self.m)  # GPipe (n = m) picks the same variant
        return ts, us, rhos, alike


class Candidates:
    """Every stage of a space, costed per micro-batch count."""

    def __init__(self, table: CostTable, space: SearchSpace, states: States) -> None:
        self.table, self.space, self.states = table, space, states
        self.kidx = size_index(table)
        ju, iu = np.tril_indices(table.num_blocks + 1, -1)  # every i < j, ordered by (j, i)
        self.iu, self.ju = iu, ju
        self.acc = range_sum(table.accumulate_s, iu, ju)
        self.opt = range_sum(table.optimizer_s, iu, ju)
        self.grad = np.asarray(table.grad_bytes, float)[iu, ju]
        self._terms: dict[tuple[int, int], StageTerms] = {}
        self._fixed: np.ndarray | None = None
        self.live = self._live()

    def _live(self) -> np.ndarray:
        """The stages (indices into iu, ju) that may fit at some size, ascending.

        With every activation, cut, workspace and output size nonnegative, a stage's memory
        (``model.stage_memory``) is at least fl(fl(params + fl(grads * factor)) + grads): the
        gradients are held at its peak, and rounding is monotone. A stage above the budget by
        that alone fits nowhere; at 1024 ranks most long stages are such, and the (stages x
        replica counts) arrays below then skip them.
        """
        t, sp = self.table, self.space
        every = np.arange(len(self.iu))
        parts = [t.act, t.cut, t.workspace] + ([] if t.out is None else [t.out])
        if not (all(bool(np.all(np.asarray(x) >= 0)) for x in parts)
                and sp.output_bytes >= 0):
            return every
        params = np.asarray(t.param_bytes, float)[self.iu, self.ju]
        least = params + self.grad * sp.optimizer_state_factor + self.grad
        return every[~(least > sp.memory_budget)]

    def terms(self, k: int, m: int) -> StageTerms:
        """The cost model's terms of every stage [i, j) at size index k with m micro-batches."""
        if (k, m) not in self._terms:
            ws = range_max(self.table.workspace[k])[self.iu, self.ju]
            self._terms[(k, m)] = stage_terms(self.table, self.space, k, self.iu, self.ju, ws, m)
        return self._terms[(k, m)]

    def replicas(self, m: int) -> np.ndarray:
        """The replica counts a stage may have with m micro-batches."""
        sp = self.space
        if sp.replicas is not None and max(sp.replicas) * m > sp.global_batch:
            return np.zeros(0, np.int64)
        return np.array([r for r in self.states.replicas if r * m <= sp.global_batch], np.int64)

    def size(self, m: int, r: int) -> int:
        return self.kidx[samples_per_replica(self.space.global_batch, m, r)]

    def _u(self, m: int, t: np.ndarray, reps: np.ndarray, rows: np.ndarray | None = None
           ) -> np.ndarray:
        """u of the stages (rows; all if None) at each replica count (columns) given t."""
        if self._fixed is None:  # ar_s + opt_s of every stage at every replica count, once
            every = np.arange(1, self.space.world_size + 1)
            self._fixed = allreduce_s(self.space, self.grad[:, None], every[None, :]) \
                + self.opt[:, None]
        fixed = self._fixed[:, reps - 1] if rows is None else self._fixed[rows[:, None], reps - 1]
        acc = self.acc if rows is None else self.acc[rows]
        return bottleneck_s(m, t, acc[:, None], fixed)

    def _edges(self, keep: np.ndarray, reps: np.ndarray, t: np.ndarray, u: np.ndarray,
               mem: np.ndarray, rho: np.ndarray, rows: np.ndarray | None = None) -> Edges:
        """Edges from the flat indices ``keep`` of (stage rows x replica columns) arrays."""
        pair, col = np.divmod(keep, len(reps))
        if rows is not None:
            pair = rows[pair]
        small = np.int32  # halves the index arrays; blocks and ranks are far below 2**31
        return Edges(self.iu.astype(small)[pair], self.ju.astype(small)[pair],
                     reps.astype(small)[col], t.ravel()[keep], u.ravel()[keep],
                     mem.ravel()[keep], rho.ravel()[keep])

    def gpipe(self, m: int) -> Edges | None:
        """Stages under GPipe (n = m) that fit, each without recomputation if it can, else with
        it. None when no replica count is allowed."""
        reps = self.replicas(m)
        if not len(reps):
            return None
        sp, rows = self.space, self.live
        P = len(rows)
        T, M, RHO = np.empty((P, len(reps))), np.empty((P, len(reps))), np.empty(
            (P, len(reps)), bool)
        done: dict[int, int] = {}  # size index -> a column already holding its t and memory
        for c, r in enumerate(reps.tolist()):
            k = self.size(m, r)
            if k in done:
                T[:, c], M[:, c], RHO[:, c] = T[:, done[k]], M[:, done[k]], RHO[:, done[k]]
                continue
            done[k], terms = c, self.terms(k, m).take(rows)
            if sp.recompute is not None:
                RHO[:, c] = sp.recompute
                T[:, c], M[:, c] = terms.time(sp.recompute), terms.memory(m, sp.recompute)
                continue
            mem0, mem1 = terms.memory(m, False), terms.memory(m, True)
            rho = (mem0 > sp.memory_budget) & (mem1 <= sp.memory_budget)
            RHO[:, c], M[:, c] = rho, np.where(rho, mem1, mem0)
            T[:, c] = np.where(rho, terms.time(True), terms.time(False))
        keep = np.flatnonzero(M.ravel() <= sp.memory_budget)
        return self._edges(keep, reps, T, self._u(m, T, reps, rows), M, RHO, rows)

    def least_memory(self, m: int, n: int) -> Edges | None:
        """Every stage with its least memory (over the allowed variants) at n in flight."""
        reps = self.replicas(m)
        if not len(reps):
            return None
        M = np.empty((len(self.iu), len(reps)))
        for c, r in enumerate(reps.tolist()):
            terms = self.terms(self.size(m, r), m)
            M[:, c] = np.min([terms.memory(n, v) for v in self.variants()], axis=0)
        zero = np.zeros(M.shape)
        return self._edges(np.arange(M.size), reps, zero, zero, M, zero.astype(bool))

    def variants(self) -> list[bool]:
        """The recomputation choices a stage may take."""
        rc = self.space.recompute
        return [False, True] if rc is None else [rc]

    def stage(self, i: int, j: int, r: int, m: int, n: int) -> tuple[float, float, bool] | None:
        """t, u and recomputation of the stage [i, j) on r replicas with n in flight, its
        first variant that fits; None if none does."""
        pair, terms = np.array([j * (j - 1) // 2 + i]), self.terms(self.size(m, r), m)
        for v in self.variants():
            if terms.memory(n, v)[pair][0] <= self.space.memory_budget:
                t = terms.time(v)[pair]
                return float(t[0]), float(self._u(m, t[:, None], np.array([r]), pair)[0, 0]), v
        return None

    def one_f_one_b(self, m: int, below: float = np.inf, *, gains_only: bool = False
                    ) -> OneFOneB | None:
        """Stages under 1F1B whose cheapest t + u is below ``below`` (a plan with a stage has
        a step of at least its t + u); None when none is left, or with ``gains_only`` when
        every one of them fits at n = m as it is (1F1B then runs them as GPipe does)."""
        reps = self.replicas(m)
        if not len(reps):
            return None
        sp, R, allowed = self.space, len(reps), [int(v) for v in self.variants()]
        ks = [self.size(m, r) for r in reps.tolist()]
        live = self.live  # the others fit nowhere: they never make an edge
        by_k = {k: self.terms(k, m).take(live) for k in dict.fromkeys(ks)}
        # no variant beats the first allowed one's t + u: only stages that can still win
        t_first = np.stack([by_k[k].time(bool(allowed[0])) for k in ks], axis=1)
        can_win = t_first + self._u(m, t_first, reps, live) < below
        if gains_only:
            full = np.stack([by_k[k].memory(m, bool(allowed[0])) for k in ks], axis=1)
            if not (can_win & (full > sp.memory_budget)).any():
                return None
        rows = live[can_win.any(axis=1)]
        T, FIT = np.zeros((len(rows), R, 2)), np.full((len(rows), R, 2), -1, np.int64)
        done: dict[int, int] = {}  # size index -> a column already holding its figures
        for c, k in enumerate(ks):
            if k in done:
                T[:, c], FIT[:, c] = T[:, done[k]], FIT[:, done[k]]
                continue
            done[k], terms = c, self.terms(k, m).take(rows)
            for v in allowed:
                T[:, c, v] = terms.time(bool(v))
                FIT[:, c, v] = max_in_flight(terms, bool(v), m, sp.memory_budget)
        U = np.stack([self._u(m, T[:, :, v], reps, rows) for v in (0, 1)], axis=2)
        # a stage's cheapest variant that fits somewhere (at n = 1) stands for it
        rho = FIT[:, :, 0] < 1
        t, u = np.where(rho, T[:, :, 1], T[:, :, 0]), np.where(rho, U[:, :, 1], U[:, :, 0])
        ok = (np.where(rho, FIT[:, :, 1], FIT[:, :, 0]) >= 1) & (t + u < below)
        keep = np.flatnonzero(ok.ravel())
        if not len(keep):
            return None
        edges = self._edges(keep, reps, t, u, np.zeros(t.shape), rho, rows)
        return OneFOneB(m, edges, T.reshape(-1, 2)[keep], U.reshape(-1, 2)[keep],
                        FIT.reshape(-1, 2)[keep])
