"""Candidate stages of one micro-batch count: their costs, variants and in-flight limits.

This module imports numpy only (no torch). Every stage [i, j) x replica count r is costed
from ``terms.StageTerms`` (computed once per size and reused for every m). A stage's
variants (``variants.VARIANTS``: recomputation, sharding, offloading) form a chain; a stage
takes the first that fits:

* ``gpipe(m)``: the stages as the GPipe DP sees them (n = m), each at its first variant that
  fits among those ``SearchSpace.recompute`` and ``zero`` allow, dropped if none does;
* ``one_f_one_b(m)``: under 1F1B, for each stage the largest n with which each variant fits,
  its variants (as ``dp_positioned.Entries`` on demand), and the relaxed edges --
  each stage at its cheapest variant, as if it were the last stage (n = 1): a lower bound on
  its weight at any position, for the bounds of the search;
* ``stage(...)``: one stage at a given n (a GPipe plan re-costed under 1F1B);
* ``least_memory(m, n)``: every stage at its least memory (for ``NoFeasiblePlan``).

A stage holding a block that cannot run a size its replicas' micro-batches hold
(``cost_model.blocked``) fits nowhere with that m and r: ``offsets`` takes -inf off its memory, as
for offloaded state the host cannot hold, so every path above drops it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .cost_model import blocked, bottleneck_s, range_max, range_sum, samples_per_replica, size_index
from .dp_chain import Edges, States
from .inflight import Positioned, max_in_flight
from .nodes import classes, crossing_s, moves
from .problem import CostTable, SearchSpace
from .terms import StageTerms, block_params, stage_terms
from .variants import (
    VARIANTS,
    after_transient,
    dominated,
    host_bytes,
    host_state,
    shard_s,
    state_saved,
    update_s,
    variants,
)

__all__ = ["Candidates"]

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
        self.params = np.asarray(table.param_bytes, float)[iu, ju]
        self.kinds = variants(space, table.segments is not None, table.kept is not None)
        if space.layers and space.recompute is not False and table.segments is None:
            raise ValueError("recompute_layers=True, but the model has no layers to recompute "
                             "one by one (children of an nn.ModuleList or nn.Sequential of alike modules): "
                             "use recompute_layers=None or False")
        self._terms: dict[tuple[int, int], StageTerms] = {}
        self._fixed: dict[tuple[bool, bool, bool, bool], np.ndarray] = {}
        self._saved: dict[tuple[bool, bool], np.ndarray] = {}
        self._blocked: dict[tuple[int, int], np.ndarray] = {}
        self.moves = moves(space)
        # the replica counts stages may have, and each one's column in the tables by count
        self.counts = np.array(states.replicas, np.int64)
        self.col = np.full(space.world_size + 1, -1, np.int64)
        self.col[self.counts] = np.arange(len(self.counts))
        self.live = self._live()

    def _live(self) -> np.ndarray:
        """The stages (indices into iu, ju) that may fit at some size, ascending.

        With every activation, cut, workspace and output size nonnegative, a stage's memory
        (``terms.stage_memory``) is at least fl(fl(params + fl(grads * factor)) + grads): the
        gradients are held at its peak, and rounding is monotone; ZeRO-1 on every rank keeps
        1 / world_size of the state (a relative 1e-9 below that for its rounding); with its
        parameters in host memory, where the host holds them, three of its largest block's
        parameter bytes; fully sharded over every rank, 1 / world_size of its parameters,
        gradients and state and three of its largest block's parameter bytes. A stage above
        the budget by that alone fits nowhere; at 1024 ranks
        most long stages are such, and the (stages x replica counts) arrays below then skip
        them.
        """
        t, sp = self.table, self.space
        every = np.arange(len(self.iu))
        parts = [t.act, t.cut, t.workspace] + ([] if t.out is None else [t.out])
        if not (all(bool(np.all(np.asarray(x) >= 0)) for x in parts)
                and sp.output_bytes >= 0):
            return every
        params = np.asarray(t.param_bytes, float)[self.iu, self.ju]
        if any(VARIANTS[v].offload for v in self.kinds):
            least = (params + self.grad) * (1 - 1e-9)
        elif any(VARIANTS[v].zero for v in self.kinds) and sp.world_size > 1:
            least = (params + self.grad * sp.optimizer_state_factor / sp.world_size
                     + self.grad) * (1 - 1e-9)
        else:
            least = params + self.grad * sp.optimizer_state_factor + self.grad
        window = block_params(t)[self.iu, self.ju]
        if any(VARIANTS[v].full for v in self.kinds) and sp.world_size > 1:
            W = sp.world_size
            least = np.minimum(least, ((params + self.grad * (1 + sp.optimizer_state_factor))
                                       / W + 3 * window) * (1 - 1e-9))
        if any(VARIANTS[v].host for v in self.kinds):
            # two windows and the gradients' one, where the host holds the stage
            held = host_bytes(sp, params, self.grad) <= sp.host_budget
            least = np.where(held, np.minimum(least, 3 * window * (1 - 1e-9)), least)
        return every[~(least > sp.memory_budget)]

    def terms(self, k: int, m: int) -> StageTerms:
        """The cost model's terms of every stage [i, j) at size index k with m micro-batches."""
        if (k, m) not in self._terms:
            ws = range_max(self.table.workspace[k])[self.iu, self.ju]
            self._terms[(k, m)] = stage_terms(self.table, self.space, k, self.iu, self.ju, ws, m)
        return self._terms[(k, m)]

    def memory(self, terms: StageTerms, n: int, kind: int, r: int | np.ndarray,
               rows: np.ndarray | None = None) -> np.ndarray:
        """The memory of the stages ``terms`` holds (rows of them, all if None) on r replicas
        with n in flight, as variant ``kind`` (infinite where its host share does not fit)."""
        saved, tr = self.offsets(kind, r, rows, terms.m)
        v = VARIANTS[kind]
        return terms.memory(n, v.recompute, tr, v.host, r if v.full else None) - saved

    def offsets(self, kind: int, r: int | np.ndarray, rows: np.ndarray | None = None,
                m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """What variant ``kind`` on r replicas takes off the stages' memory (``state_saved``;
        -inf where the offloaded state is over the host budget, or, with m micro-batches,
        where the stage holds a block that cannot run its size) and its ``after_transient``
        (``r``: one count, one per row, or a (1, columns) row of them for every row)."""
        v, sp = VARIANTS[kind], self.space
        grad = self.grad if rows is None else self.grad[rows]
        if np.ndim(r) == 2:  # (1, columns): one replica count a column, every row
            grad = grad[:, None]
        saved = self.saved(v.zero, v.offload, r, rows)
        if v.offload:
            over = host_state(sp, grad, np.array(r), v.zero, True) > sp.host_budget
            saved = np.where(over, -np.inf, saved)
        if v.host:
            params = self.params if rows is None else self.params[rows]
            if np.ndim(r) == 2:
                params = params[:, None]
            over = host_bytes(sp, params, grad) > sp.host_budget
            saved = np.where(over, -np.inf, saved)
        if m is not None and self.table.excluded:
            saved = np.where(self.blocked(m, r, rows), -np.inf, saved)
        return saved, after_transient(sp, grad, np.array(r), v.zero, v.offload, v.full)

    def blocked(self, m: int, r: int | np.ndarray, rows: np.ndarray | None = None
                ) -> np.ndarray:
        """``cost_model.blocked`` of the stages (rows; all if None) on r replicas with m
        micro-batches, shaped as ``offsets`` takes r."""
        def every(count: int) -> np.ndarray:
            if (m, count) not in self._blocked:
                self._blocked[(m, count)] = blocked(self.table, self.space.global_batch, m,
                                                    count, self.iu, self.ju)
            got = self._blocked[(m, count)]
            return got if rows is None else got[rows]

        if np.ndim(r) == 2:  # (1, columns)
            return np.stack([every(int(x)) for x in np.asarray(r)[0]], axis=1)
        if np.ndim(r):  # one count per row
            assert rows is not None
            by_count = {int(x): every(int(x)) for x in np.unique(r)}
            return np.array([by_count[int(x)][k] for k, x in enumerate(np.asarray(r))], bool)
        return every(int(r))

    def saved(self, zero: bool, offload: bool, r: int | np.ndarray,
              rows: np.ndarray | None = None) -> np.ndarray:
        """``variants.state_saved`` of the stages (rows; all if None) on r replicas (one count,
        or one per row)."""
        key = (zero, offload)
        if key not in self._saved:  # every replica count (rows) for every stage, once
            self._saved[key] = state_saved(self.space, self.grad[None, :],
                                           self.counts[:, None], zero, offload)
        table = self._saved[key]  # (replica counts, stages)
        if np.ndim(r) == 2:  # (1, columns)
            picked = table[self.col[np.asarray(r)[0]]]  # (columns, stages)
            return (picked if rows is None else picked[:, rows]).T
        if np.ndim(r):
            assert rows is not None
            return table[self.col[np.asarray(r)], rows]
        row = table[self.col[int(r)]]
        return row if rows is None else row[rows]

    def replicas(self, m: int) -> np.ndarray:
        """The replica counts a stage may have with m micro-batches."""
        sp = self.space
        if sp.replicas is not None and max(sp.replicas) * m > sp.global_batch:
            return np.zeros(0, np.int64)
        return np.array([r for r in self.states.replicas if r * m <= sp.global_batch], np.int64)

    def size(self, m: int, r: int) -> int:
        return self.kidx[samples_per_replica(self.space.global_batch, m, r)]

    def _u(self, m: int, t: np.ndarray, reps: np.ndarray, rows: np.ndarray | None = None,
           kind: int = 0) -> np.ndarray:
        """u of the stages (rows; all if None) at each replica count (columns) given t, as
        variant ``kind`` (its sharding and offloading)."""
        f = self.fixed_u(kind)  # up_s of every stage at every replica count, once
        up = f[:, self.col[reps]] if rows is None else f[rows[:, None], self.col[reps]]
        acc = self.acc if rows is None else self.acc[rows]
        return bottleneck_s(m, t, acc[:, None], up)

    def edges(self, keep: np.ndarray, reps: np.ndarray, t: np.ndarray, u: np.ndarray,
               mem: np.ndarray, kind: np.ndarray, rows: np.ndarray | None = None) -> Edges:
        """Edges from the flat indices ``keep`` of (stage rows x replica columns) arrays."""
        pair, col = np.divmod(keep, len(reps))
        if rows is not None:
            pair = rows[pair]
        small = np.int32  # halves the index arrays; blocks and ranks are far below 2**31
        return Edges(self.iu.astype(small)[pair], self.ju.astype(small)[pair],
                     reps.astype(small)[col], t.ravel()[keep], u.ravel()[keep],
                     mem.ravel()[keep], kind.ravel()[keep].astype(np.int8))

    def placed(self, e: Edges, m: int) -> tuple[Edges, np.ndarray, np.ndarray]:
        """Across nodes, each stage once per class (``nodes.classes``), its t and u with
        what its messages take longer where its boundaries cross nodes (t + x, u + (m - 1)
        x: every schedule's t and u hold t so); the edges, which stage each one is, and its
        x. In one node: ``e`` as it is."""
        if self.moves is None:
            return e, np.arange(len(e.t)), np.zeros(len(e.t))
        src, move, x = classes(self.moves, self.space, e.reps, e.start, e.end,
                               lambda r: self.table.cut[self.size(m, r)], self.table.num_blocks)
        out = Edges(e.start[src], e.end[src], e.reps[src], e.t[src] + x,
                    e.u[src] + (m - 1) * x, e.mem[src], e.kind[src], move.astype(np.int32))
        return out, src, x

    def positioned(self, m: int, e: Edges, t: np.ndarray, u: np.ndarray, fit: np.ndarray,
                   first: np.ndarray | None = None, **kw: object) -> Positioned:
        """``Positioned`` of the edges (their variants' t, u, fit and lo by row), each stage
        once per class across nodes (``placed``)."""
        e, src, x = self.placed(e, m)
        if self.moves is not None:
            t, u, fit = t[src] + x[:, None], u[src] + (m - 1) * x[:, None], fit[src]
            first = None if first is None else first[src]
        return Positioned(m, e, t, u, fit, first=first, **kw)  # type: ignore[arg-type]

    def gpipe(self, m: int) -> Edges | None:
        """Stages under GPipe (n = m) that fit, each at its first variant that fits. None when
        no replica count is allowed."""
        reps = self.replicas(m)
        if not len(reps):
            return None
        sp, rows = self.space, self.live
        P, R = len(rows), len(reps)
        T, U, M = (np.full((P, R), np.inf) for _ in range(3))
        KIND = np.full((P, R), self.kinds[-1], np.int64)
        ks = np.array([self.size(m, r) for r in reps.tolist()])
        for k in dict.fromkeys(ks.tolist()):  # the columns of one size at once
            cols = np.flatnonzero(ks == k)
            terms = self.terms(k, m).take(rows)
            wide, rr = terms.column(), reps[cols]
            times = {_rh(v): self.times(terms, v, rr, wide) for v in self.kinds}
            us = np.zeros((P, len(cols), len(VARIANTS)))
            for v in self.kinds:
                us[:, :, v] = self._u(m, times[_rh(v)], rr, rows, v)
            skip = dominated(us, self.kinds)
            unset = np.ones((P, len(cols)), bool)
            t, u, mem_, kind = (np.full((P, len(cols)), x) for x in (np.inf, np.inf, np.inf,
                                                                      self.kinds[-1]))
            for v in self.kinds:
                mem = self.memory(wide, m, v, rr[None, :], rows)
                take = unset & ~skip[:, :, v] & (mem <= sp.memory_budget)
                t[take] = times[_rh(v)][take]
                u[take], mem_[take], kind[take] = us[:, :, v][take], mem[take], v
                unset &= ~take
            T[:, cols], U[:, cols], M[:, cols], KIND[:, cols] = t, u, mem_, kind
        keep = np.flatnonzero(M.ravel() <= sp.memory_budget)
        return self.placed(self.edges(keep, reps, T, U, M, KIND, rows), m)[0]

    def least_memory(self, m: int, n: int) -> Edges | None:
        """Every stage with its least memory (over the allowed variants) at n in flight."""
        reps = self.replicas(m)
        if not len(reps):
            return None
        M = np.empty((len(self.iu), len(reps)))
        for c, r in enumerate(reps.tolist()):
            terms = self.terms(self.size(m, r), m)
            M[:, c] = np.min([self.memory(terms, n, v, r) for v in self.kinds], axis=0)
        zero = np.zeros(M.shape)
        e = self.placed(self.edges(np.arange(M.size), reps, zero, zero, M,
                                   zero.astype(np.int64)), m)[0]
        return dataclasses.replace(e, t=np.zeros(len(e.t)), u=np.zeros(len(e.u)))

    def stage(self, i: int, j: int, r: int, m: int, n: int,
              at: tuple[bool, bool] = (False, False)) -> tuple[float, float, int] | None:
        """t, u and variant of the stage [i, j) on r replicas with n in flight, its first
        variant that fits; None if none does. ``at``: whether its in- and out-boundary
        cross nodes (``nodes.crossing_at``)."""
        pair, terms = np.array([j * (j - 1) // 2 + i]), self.terms(self.size(m, r), m)
        ts, us = np.zeros(len(VARIANTS)), np.zeros(len(VARIANTS))
        cut = np.asarray(self.table.cut[self.size(m, r)], float)
        x = float(at[0] * crossing_s(self.space, cut[i]) + at[1] * crossing_s(self.space, cut[j]))
        for v in self.kinds:
            t = self.times(terms.take(pair), v, np.array([r]))[:, 0] + x
            ts[v], us[v] = t[0], self._u(m, t[:, None], np.array([r]), pair, v)[0, 0]
        skip = dominated(us, self.kinds)
        one = terms.take(pair)
        for v in self.kinds:
            if not skip[v] and self.memory(one, n, v, r, pair)[0] <= self.space.memory_budget:
                return float(ts[v]), float(us[v]), v
        return None

    def one_f_one_b(self, m: int, below: float = np.inf, *, gains_only: bool = False
                    ) -> Positioned | None:
        """Stages under 1F1B whose cheapest t + u is below ``below`` (a plan with a stage has
        a step of at least its t + u); None when none is left, or with ``gains_only`` when
        every one of them fits at n = m as it is (1F1B then runs them as GPipe does)."""
        reps = self.replicas(m)
        if not len(reps):
            return None
        sp, R, V, first = self.space, len(reps), len(VARIANTS), self.kinds[0]
        ks = [self.size(m, r) for r in reps.tolist()]
        live = self.live  # the others fit nowhere: they never make an edge
        by_k = {k: self.terms(k, m).take(live) for k in dict.fromkeys(ks)}
        # no variant beats the first allowed one's t + u: only stages that can still win
        t_first = np.concatenate([self.times(by_k[k], first, reps[c : c + 1])
                                  for c, k in enumerate(ks)], axis=1)
        can_win = t_first + self._u(m, t_first, reps, live, first) < below
        if gains_only:
            full = np.stack([self.memory(by_k[k], m, self.kinds[0], r, live)
                             for k, r in zip(ks, reps.tolist(), strict=True)], axis=1)
            if not (can_win & (full > sp.memory_budget)).any():
                return None
        rows = live[can_win.any(axis=1)]
        T, FIT = np.zeros((len(rows), R, V)), np.full((len(rows), R, V), -1, np.int64)
        for k in dict.fromkeys(ks):  # the columns of one size at once: (rows, columns) arrays
            cols = np.flatnonzero(np.array(ks) == k)
            terms = self.terms(k, m).take(rows)
            wide = terms.column()
            for v in self.kinds:
                rho, host, sharded = _rh(v)
                T[:, cols, v] = self.times(terms, v, reps[cols], wide)
                FIT[:, cols, v] = max_in_flight(wide, rho, m, sp.memory_budget,
                                                *self.offsets(v, reps[cols][None, :], rows, m),
                                                host=host,
                                                full=reps[cols][None, :] if sharded else None)
        U = np.stack([self._u(m, T[:, :, v], reps, rows, v) for v in range(V)], axis=2)
        FIT[dominated(U, self.kinds)] = -1
        # a stage's first variant that fits somewhere (at n = 1) stands for it
        fits = FIT >= 1
        kind = np.where(fits.any(axis=2), np.argmax(fits, axis=2), 0)
        t = np.take_along_axis(T, kind[:, :, None], 2)[:, :, 0]
        u = np.take_along_axis(U, kind[:, :, None], 2)[:, :, 0]
        ok = fits.any(axis=2) & (t + u < below)
        keep = np.flatnonzero(ok.ravel())
        if not len(keep):
            return None
        edges = self.edges(keep, reps, t, u, np.zeros(t.shape), kind, rows)
        return self.positioned(m, edges, T.reshape(-1, V)[keep], U.reshape(-1, V)[keep],
                               FIT.reshape(-1, V)[keep])

    def fixed_u(self, kind: int) -> np.ndarray:
        """up_s of every stage (rows) at every replica count a stage may have (columns:
        ``col`` of the count) as variant ``kind``."""
        v = VARIANTS[kind]
        key = (v.zero, v.offload, v.host, v.full)
        if key not in self._fixed:
            self._fixed[key] = update_s(self.space, self.grad[:, None], self.opt[:, None],
                                        self.counts[None, :], v.zero, v.offload, v.host,
                                        v.full)
        return self._fixed[key]

    def times(self, terms: StageTerms, kind: int, reps: np.ndarray,
              wide: StageTerms | None = None) -> np.ndarray:
        """(stages of ``terms``, replica counts ``reps``): t as variant ``kind``; only a
        fully sharded stage's depends on its replica count (its collectives span them).
        ``wide``: ``terms.column()``, where the caller has it."""
        v = VARIANTS[kind]
        if not v.full:
            return np.broadcast_to(terms.time(v.recompute, v.host)[:, None],
                                   (len(terms.fb), len(reps)))
        shard = shard_s(self.space, terms.params[:, None], terms.grads[:, None],
                        np.asarray(reps)[None, :], v.recompute)
        return (terms.column() if wide is None else wide).time(v.recompute, shard=shard)


def _rh(kind: int) -> tuple[int, bool, bool]:
    """Variant ``kind``'s recomputation level, whether its parameters are on the host and
    whether they are fully sharded: what its t depends on."""
    v = VARIANTS[kind]
    return v.recompute, v.host, v.full
