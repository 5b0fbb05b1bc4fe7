"""The DP over the block chain: least sum (or max) of stage weights per (block, state).

This module imports numpy only (no torch). A candidate stage is an edge from block ``start``
to block ``end`` that uses ``reps`` ranks; the state counts what the stages so far used:

* ranks used so far (nothing forced),
* (stages so far, ranks used) with a forced stage count,
* stages so far with forced replica counts.

One DP is O(E * Z) vectorised operations (E edges, Z states) in chunks that stay in cache;
where the states shift, edges that differ only in consecutive replica counts and share their
weight read one window of a row (``windows``), so E counts such runs. A stage's weight here
is one number per edge; ``dp_positioned`` extends the states with the stage's position from the end,
where a 1F1B stage's weight depends on it.

With nothing forced, the state before a stage of r replicas that ends in state z is z - r:
the rows an edge reads, ``D[i][src[r]]``, are then D's row i shifted right by r, read through
a strided view of a left-padded D instead of a (blocks x replicas x states) copy that at 1024
ranks would take 1.6 GB and most of the search's time to fill.

Over several nodes an edge's ``move`` (``nodes.Moves``: its replica count and which of its
boundaries cross nodes) stands for its replica count in the states: ``src[move, z]`` is the
state before it where z is of its class, none elsewhere, so no state shifts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .nodes import Moves, moves, stage_moves, usable_replicas
from .problem import SearchSpace
from .windows import RangeMin, Runs, runs_and_tables

__all__ = ["Edges", "States", "backtrack", "backward", "build_states", "forward", "groups",
           "through_bound"]

_CHUNK = 1 << 15  # elements of the DP temporaries: small enough to stay in cache


@dataclass(frozen=True)
class States:
    """The DP state axis: ranks used so far; (stages, ranks) with a forced stage count;
    stages with forced replicas.

    ``src[r, z]`` is the state before a stage of ``r`` replicas that ends in state ``z``, and
    ``dst[r, z]`` the state after one that starts in ``z``; ``size`` (one past the last state)
    stands for "none" and indexes an always-infinite pad column.
    """

    size: int
    final: int
    src: np.ndarray
    dst: np.ndarray
    replicas: tuple[int, ...]
    shift: bool = False  # src[r, z] = z - r (and dst[r, z] = z + r) wherever it is defined
    # states as blocks of ``width``: src[r] of (block b, n) is (prev[b], n - r) where n >= r
    # (None: no such layout, with forced replicas)
    prev: np.ndarray | None = None
    width: int = 0


def build_states(space: SearchSpace) -> States:
    W = space.world_size
    mv = moves(space)
    if mv is not None:
        return _node_states(space, mv)
    if space.replicas is not None:
        R = space.replicas
        Z, final, reps = len(R) + 1, len(R), tuple(sorted(set(R)))
        src = np.full((W + 1, Z), Z)
        for s, r in enumerate(R):
            src[r, s + 1] = s
    else:
        S = space.stages or 0
        Z = (S + 1) * (W + 1) if S else W + 1
        final, reps = Z - 1, tuple(range(1, W + 1))
        z = np.arange(Z)
        n = z % (W + 1)
        src = np.full((W + 1, Z), Z)
        for r in reps:
            back = z - r - (W + 1 if S else 0)
            src[r] = np.where((n >= r) & (back >= 0), back, Z)
    dst = np.full((W + 1, Z), Z)
    for r in range(W + 1):
        ok = src[r] < Z
        dst[r, src[r][ok]] = np.flatnonzero(ok)
    if space.replicas is not None:
        return States(Z, final, src, dst, reps)
    # block s: s stages so far (forced count), reading block s - 1; or the one block
    prev = np.arange(-1, Z // (W + 1) - 1) if space.stages else np.zeros(1, np.int64)
    return States(Z, final, src, dst, reps, shift=not space.stages, prev=prev, width=W + 1)


def _node_states(space: SearchSpace, mv: Moves) -> States:
    """The states of a multi-node space: as without nodes, with a move (``nodes.Moves``: a
    replica count and whether its boundaries cross nodes) in place of a replica count, each
    only into the states of its class; none shift (each move reads its own rows)."""
    W, nm = space.world_size, len(mv.r)
    if space.replicas is not None:
        R = space.replicas
        Z, final = len(R) + 1, len(R)
        src = np.full((nm, Z), Z)
        for s, k in enumerate(stage_moves(space, mv)):
            if k >= 0:
                src[k, s + 1] = s
        return States(Z, final, src, _dst(src, Z), tuple(sorted(set(R))))
    S, Wu = space.stages or 0, W // mv.unit  # states count ranks in units (nodes.unit)
    Z = (S + 1) * (Wu + 1) if S else Wu + 1
    z = np.arange(Z)
    n = z % (Wu + 1)
    src = np.full((nm, Z), Z)
    for k in range(nm):
        back = z - mv.step[k] - (Wu + 1 if S else 0)
        src[k] = np.where(mv.ok(np.array(k), n) & (back >= 0), back, Z)
    return States(Z, Z - 1, src, _dst(src, Z), usable_replicas(space))


def _dst(src: np.ndarray, Z: int) -> np.ndarray:
    """``dst[k, z]``: the state after a move k that starts in z (Z: none)."""
    dst = np.full(src.shape, Z)
    for k in range(src.shape[0]):
        ok = src[k] < Z
        dst[k, src[k][ok]] = np.flatnonzero(ok)
    return dst


class _Rows:
    """D (B + 1, Z + 1, the last column the always-infinite pad) and its rows as an edge of
    r replicas from block i reads them: ``rows[i, r]`` = ``D[i][src[r]]`` (``dst`` for the
    backward DP) -- a strided view where the states shift, else a kept copy."""

    def __init__(self, states: States, num_blocks: int, *, backward: bool = False):
        B, Z = num_blocks, states.size
        self.states, self.backward = states, backward
        nr = states.src.shape[0]
        if states.shift:
            # D sits inside a row of W infinities on the side the shift reads from
            pad = nr - 1
            self._full = np.full((B + 1, Z + 1 + pad), np.inf)
            off = 0 if backward else pad
            self.D = self._full[:, off : off + Z + 1]
            step = self._full.strides[1]
            self.rows = np.lib.stride_tricks.as_strided(
                self.D, shape=(B + 1, nr, Z), strides=(self._full.strides[0],
                                                       step if backward else -step, step),
                writeable=False)
        else:
            self.D = np.full((B + 1, Z + 1), np.inf)
            self.rows = np.full((B + 1, nr, Z), np.inf)

    def set(self, j: int, values: np.ndarray) -> None:
        self.D[j, : self.states.size] = values
        if not self.states.shift:
            idx = self.states.dst if self.backward else self.states.src
            self.rows[j] = self.D[j][idx]

    def gather(self, i: np.ndarray, r: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``rows[i[k], r[k]]`` for every k, into ``out`` (a view of it for the result)."""
        got = out[: len(i)]
        got[...] = self.rows[i, r]
        return got


@dataclass(frozen=True)
class Edges:
    """Candidate stages of one m: blocks [start, end) on ``reps`` replicas, with t, u, memory
    and the stage's variant (``kind``: an index into ``variants.VARIANTS``, recomputation and
    sharding).

    Sorted by end block (the DPs walk them in groups of one end block).
    """

    start: np.ndarray
    end: np.ndarray
    reps: np.ndarray
    t: np.ndarray
    u: np.ndarray
    mem: np.ndarray
    kind: np.ndarray
    # across nodes, each stage's move (``nodes.Moves``: its replicas and which of its
    # boundaries cross nodes), what the states read; None: its replica count
    move: np.ndarray | None = None

    @property
    def via(self) -> np.ndarray:
        """What indexes the states' ``src`` and ``dst``: the move, else the replica count."""
        return self.reps if self.move is None else self.move

    def take(self, idx: np.ndarray) -> Edges:
        return Edges(self.start[idx], self.end[idx], self.reps[idx], self.t[idx], self.u[idx],
                     self.mem[idx], self.kind[idx],
                     None if self.move is None else self.move[idx])


def groups(key: np.ndarray, num_blocks: int) -> np.ndarray:
    """Edges whose sorted ``key`` is b are [out[b], out[b + 1])."""
    return np.searchsorted(key, np.arange(num_blocks + 2))


def _min_rows(rows: _Rows, i: np.ndarray, r: np.ndarray, w: np.ndarray, buf: np.ndarray, *,
              bottleneck: bool = False) -> np.ndarray:
    """min over k of rows[i[k], r[k]] + w[k] (or max(., w[k])), in chunks that stay in cache."""
    op = np.maximum if bottleneck else np.add
    acc = np.full(buf.shape[1], np.inf)
    for a in range(0, len(i), len(buf)):
        c = rows.gather(i[a : a + len(buf)], r[a : a + len(buf)], buf)
        op(c, w[a : a + len(buf), None], out=c)
        np.minimum(acc, c.min(axis=0), out=acc)
    return acc


def _scratch(states: States) -> np.ndarray:
    return np.empty((max(1, _CHUNK // states.size), states.size))


def forward(e: Edges, w: np.ndarray, states: States, num_blocks: int, *,
            bottleneck: bool = False, hi: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Least sum (or max) of ``w`` over stages from block 0 to each (block, state).

    Returns the values D (B + 1, Z + 1) and ``shifted[i, r, z] = D[i, src[r, z]]`` (a view
    where the states shift) for ``backtrack``. ``hi`` ends each block's group early (edges
    sorted by u, a threshold).
    """
    B, Z = num_blocks, states.size
    lo = groups(e.end, B)
    hi = lo[1:] if hi is None else hi
    rows = _Rows(states, B)
    first = np.full(Z, np.inf)
    first[0] = -np.inf if bottleneck else 0.0
    rows.set(0, first)
    windows = _windows(e, w, states, B, hi)
    if windows is not None:
        _forward_runs(rows, w, *windows, B, bottleneck=bottleneck)
        return rows.D, rows.rows
    buf = _scratch(states)
    for j in range(1, B + 1):
        a, b = lo[j], hi[j]
        if a < b:
            rows.set(j, _min_rows(rows, e.start[a:b], e.via[a:b], w[a:b], buf,
                                  bottleneck=bottleneck))
    return rows.D, rows.rows


def _windows(e: Edges, w: np.ndarray, states: States, num_blocks: int, hi: np.ndarray
             ) -> tuple[Runs, RangeMin] | None:
    """The runs of the edges the DP reads (each end block's first ``hi`` edges, finite
    weights) and the sparse tables they read, if the states have the layout and the tables
    fit in ``_TABLES`` elements; else None (one shifted row per edge)."""
    if states.prev is None:
        return None
    idx = np.flatnonzero((np.arange(len(w)) < hi[e.end]) & (w < np.inf))
    return runs_and_tables(idx, e.end, e.start, e.reps, (w,), num_blocks, states.prev,
                           states.width)


def _forward_runs(rows: _Rows, w: np.ndarray, runs: Runs, tables: RangeMin, num_blocks: int,
                  *, bottleneck: bool) -> None:
    """``forward``'s loop over runs of edges: each reads its window, then adds its weight."""
    Z = rows.states.size
    op = np.maximum if bottleneck else np.add
    tables.set(0, rows.D[0, :Z])
    wr, step = w[runs.first], max(1, _CHUNK // Z)
    for j in range(1, num_blocks + 1):
        a, b = int(runs.groups[j]), int(runs.groups[j + 1])
        if a < b:
            acc = np.full(Z, np.inf)
            for c in range(a, b, step):
                d = min(c + step, b)
                got = tables.window(runs, c, d).reshape(d - c, Z)
                op(got, wr[c:d, None], out=got)
                np.minimum(acc, got.min(axis=0), out=acc)
            rows.set(j, acc)
        tables.set(j, rows.D[j, :Z])  # every row: a ring slot may hold an older one


def backtrack(e: Edges, w: np.ndarray, shifted: np.ndarray, states: States,
              num_blocks: int, *, bottleneck: bool = False, hi: np.ndarray | None = None
              ) -> list[int]:
    """The edges of the plan ``forward`` found (the first best edge of each group)."""
    lo = groups(e.end, num_blocks)
    hi = lo[1:] if hi is None else hi
    j, z, path = num_blocks, states.final, []
    while j > 0:
        a, b = int(lo[j]), int(hi[j])
        prev = shifted[e.start[a:b], e.via[a:b], z]
        k = a + int(np.argmin(np.maximum(prev, w[a:b]) if bottleneck else prev + w[a:b]))
        path.append(k)
        z, j = int(states.src[e.via[k], z]), int(e.start[k])
    return path[::-1]


def backward(e: Edges, states: States, num_blocks: int) -> np.ndarray:
    """Least sum of t over stages from each (block, state) to the end."""
    B, Z = num_blocks, states.size
    order = np.argsort(e.start, kind="stable")
    lo = groups(e.start[order], B)
    rows = _Rows(states, B, backward=True)  # [j, r, z] = P[j, dst[r, z]]
    last = np.full(Z, np.inf)
    last[states.final] = 0.0
    rows.set(B, last)
    buf = _scratch(states)
    ends, reps, t = e.end[order], e.via[order], e.t[order]
    for i in range(B - 1, -1, -1):
        a, b = lo[i], lo[i + 1]
        if a < b:
            rows.set(i, _min_rows(rows, ends[a:b], reps[a:b], t[a:b], buf))
    return rows.D


def through_bound(e: Edges, pre: np.ndarray, post: np.ndarray, states: States,
                  num_blocks: int) -> np.ndarray:
    """Per edge, the least sum of t over the other stages of whole plans that use it."""
    Z, B = states.size, num_blocks
    before = _Rows(states, B)  # [i, r]: best prefix to block i, then a stage of r replicas
    for i in range(B + 1):
        before.set(i, pre[i, :Z])
    buf = _scratch(states)
    lo = groups(e.end, B)
    out = np.empty(len(e.t))
    for j in range(1, B + 1):
        for a in range(lo[j], lo[j + 1], len(buf)):
            b = min(a + len(buf), lo[j + 1])
            c = before.gather(e.start[a:b], e.via[a:b], buf)
            np.add(c, post[j, :Z], out=c)
            out[a:b] = c.min(axis=1)
    return out
