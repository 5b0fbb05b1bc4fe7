"""The 1F1B DP: stages whose weight depends on their position from the end.

This module imports numpy only (no torch). Under 1F1B a stage d stages from the end holds
n = min(m, d) micro-batches in flight, so whether it fits, and whether it must recompute,
depends on d. A variant of a stage (recomputing or not) is an *entry* that is valid where
lo <= n <= fit. Past D = 1 + (the largest of the entries' limits fit and lo - 1 that are
below m) nothing changes any more, so positions d >= D are one layer.

The DP walks the blocks forward; the state after a stage is (its position d, capped at D;
ranks used so far). The stage before one at d sits at min(d + 1, D) -- one source per state,
so the min-plus is the usual one, with the entry's weight picked by the state's layer:

    stage     0     1    ...  S-3   S-2   S-1        (S stages; d = S - s)
    layer     D     D    ...   3     2     1         (d >= D share layer D)
    start: (every layer, 0 ranks) at block 0       final: (layer 1, all ranks) at block B

With a forced stage count (or forced replicas) the stages so far give d = S - s exactly, and
the layer is just a function of the state. The weights of a group of entries are computed
per layer as needed (a callback), so nothing of size entries x layers is kept.

An entry reads the DP row of its start block through ``source(r)`` (the states before a
stage of r replicas): the same ranks less r in the layer ``prev`` names. Given the arrays an
entry's weights are a function of (``keys``), entries that differ only in consecutive replica
counts read one window of that row (``windows``). Otherwise (or with forced replicas) the
shifted rows are kept for the (start, r) pairs the entries use while they fit in ``_ROWS``
elements -- after the search's bounds few pairs are left -- and are gathered entry by entry
past that (slower per element, but memory stays blocks x states).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .dp_chain import groups
from .nodes import Moves, moves, stage_moves
from .problem import SearchSpace
from .windows import RangeMin, Runs, runs_and_tables

__all__ = ["Entries", "Layers", "Weights", "backtrack", "build_layers", "forward", "max_depth"]

_CHUNK = 1 << 16  # elements of the DP temporaries (half a MiB)
_RUNS_CHUNK = 1 << 18  # the same for runs: more per numpy call, fewer calls (2 MiB)
_ROWS = 1 << 22  # elements of the kept shifted rows (32 MiB)

# entries idx -> their weights per state block, (len(idx), blocks)
Weights = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Layers:
    """The states: blocks of ``width`` columns, block b holding stages at ``depth[b]``.

    ``source(r, z)``: the state before a stage of r replicas that ends in state z; ``size``
    (one past the last state) stands for "none" and indexes an always-infinite pad column.
    Unless replicas are forced that is the same ranks less r in block ``prev[b]`` (-1: none),
    computed as needed: a table of it would hold (W + 1) x size entries (1025 x 31775 at
    1024 ranks and 31 layers).
    """

    size: int
    width: int
    depth: np.ndarray
    init: np.ndarray
    final: int
    replica_rows: int  # W + 1: replica counts 0..W (across nodes: the moves)
    prev: np.ndarray | None = None
    table: np.ndarray | None = None  # forced replicas: source as a (W + 1, size) table
    # across nodes, what an entry's ``via`` names: a move (``nodes.Moves``), valid only
    # into the states of its class
    moves: Moves | None = None

    def source(self, r: np.ndarray, z: np.ndarray | int) -> np.ndarray:
        """The states before stages of ``r`` replicas (rows; across nodes, moves) ending in
        states ``z``."""
        r = np.asarray(r)
        if np.ndim(z):
            r = r[:, None]
        if self.prev is None:
            assert self.table is not None
            return self.table[r, z]
        b, n = np.divmod(z, self.width)
        p = self.prev[b]
        if self.moves is None:
            return np.where((n >= r) & (p >= 0), p * self.width + n - r, self.size)
        step = self.moves.step[r]
        ok = (n >= step) & (p >= 0) & self.moves.ok(r, n)
        return np.where(ok, p * self.width + n - step, self.size)


def max_depth(space: SearchSpace, num_blocks: int) -> int:
    """The most stages a plan of the space can have (no position from the end is larger)."""
    if space.replicas is not None:
        return len(space.replicas)
    return space.stages or min(num_blocks, space.world_size)


def build_layers(space: SearchSpace, cap: int) -> Layers:
    """States for positions from the end capped at ``cap`` (the D above)."""
    W, mv = space.world_size, moves(space)
    rows = W + 1 if mv is None else len(mv.r)
    Wu = W if mv is None else W // mv.unit  # ranks in the states' units (``nodes.unit``)
    if space.replicas is not None:  # block s: s stages so far, the last S - s + 1 from the end
        S = len(space.replicas)
        depth = np.minimum(S + 1 - np.arange(S + 1), cap)
        table = np.full((rows, S + 1), S + 1)
        for k, r in enumerate(space.replicas):
            if mv is None:
                table[r, k + 1] = k
        for k, move in enumerate(stage_moves(space, mv) if mv is not None else ()):
            if move >= 0:
                table[move, k + 1] = k
        return Layers(S + 1, 1, depth, np.array([0]), S, rows, table=table)
    if space.stages:  # as above, by ranks used too; block s reads block s - 1
        S, width = int(space.stages), Wu + 1
        depth = np.minimum(S + 1 - np.arange(S + 1), cap)
        return _tabled(Layers((S + 1) * width, width, depth, np.array([0]), S * width + Wu,
                              rows, prev=np.arange(-1, S), moves=mv))
    # block b: stages b + 1 from the end; the one before sits in block b + 1 (capped)
    width, nb = Wu + 1, cap
    return _tabled(Layers(nb * width, width, np.arange(1, nb + 1), np.arange(nb) * width, Wu,
                          rows, prev=np.minimum(np.arange(1, nb + 1), nb - 1), moves=mv))


def _tabled(L: Layers) -> Layers:
    """Across nodes, ``source`` of every move at every state as a table, made once: a few
    dozen moves (``nodes.Moves``) make it small, and the DPs read it for every entry."""
    if L.moves is None:
        return L
    table = L.source(np.arange(len(L.moves.r)), np.arange(L.size))
    return dataclasses.replace(L, table=table, prev=None)


@dataclass(frozen=True)
class Entries:
    """Stage variants of one m: blocks [start, end) on ``reps`` replicas, of variant ``kind``
    (an index into ``variants.VARIANTS``), valid where the in-flight count n is in [lo, fit]; ``edge`` is the stage's
    index among the relaxed edges. Sorted by end block."""

    start: np.ndarray
    end: np.ndarray
    reps: np.ndarray
    t: np.ndarray
    u: np.ndarray
    kind: np.ndarray
    lo: np.ndarray
    fit: np.ndarray
    edge: np.ndarray
    move: np.ndarray | None = None  # across nodes, as ``dp_chain.Edges.move``

    @property
    def via(self) -> np.ndarray:
        """What ``Layers.source`` reads: the move, else the replica count."""
        return self.reps if self.move is None else self.move

    @classmethod
    def chain(cls, start: np.ndarray, end: np.ndarray, reps: np.ndarray,
              move: np.ndarray | None = None) -> Entries:
        """Stages with no costs of their own, for a DP whose weights come from elsewhere."""
        none = np.zeros(0)
        return cls(start, end, reps, none, none, none, none, none, none, move)

    def take(self, idx: np.ndarray) -> Entries:
        fields = {f: getattr(self, f)[idx] for f in _FIELDS}
        return Entries(**fields, move=None if self.move is None else self.move[idx])

    def valid(self, idx: np.ndarray, n: np.ndarray) -> np.ndarray:
        """(len(idx), len(n)): whether entries ``idx`` are valid at in-flight counts ``n``."""
        return (self.lo[idx, None] <= n) & (n <= self.fit[idx, None])


_FIELDS = ("start", "end", "reps", "t", "u", "kind", "lo", "fit", "edge")


class _Rows:
    """The shifted DP rows ``V[start][source(reps)]`` of the entries, by block."""

    def __init__(self, e: Entries, V: np.ndarray, L: Layers) -> None:
        self.e, self.V, self.L = e, V, L
        self.z = np.arange(L.size)
        key = e.start.astype(np.int64) * L.replica_rows + e.via
        self.pairs, self.row = np.unique(key, return_inverse=True)
        self.kept = len(self.pairs) * L.size <= _ROWS
        if self.kept:  # one row per (start, r) pair, filled as each start block is done
            self.table = np.full((len(self.pairs), L.size), np.inf)
            self.lo = np.searchsorted(self.pairs // L.replica_rows, np.arange(len(V) + 1))

    def done(self, i: int) -> None:
        """Block i's row of V is final."""
        if self.kept and self.lo[i] < self.lo[i + 1]:
            reps = self.pairs[self.lo[i] : self.lo[i + 1]] % self.L.replica_rows
            self.table[self.lo[i] : self.lo[i + 1]] = self.V[i][self.L.source(reps, self.z)]

    def get(self, a: int, b: int) -> np.ndarray:
        """(b - a, Z): the shifted rows of entries [a, b)."""
        if self.kept:
            return np.take(self.table, self.row[a:b], axis=0)
        e, stride = self.e, self.V.shape[1]
        return np.take(self.V, (e.start[a:b].astype(np.int64) * stride)[:, None]
                       + self.L.source(e.via[a:b], self.z))


def forward(e: Entries, weights: Weights, L: Layers, num_blocks: int, *,
            bottleneck: bool = False, keys: tuple[np.ndarray, ...] | None = None
            ) -> np.ndarray:
    """Least sum (or max) of the weights over stages from block 0 to each (block, state).

    ``keys``: arrays of the entries (by index) whose equality means equal weights, for
    ``windows``. Returns V (B + 1, Z + 1), its last column the pad.
    """
    B, Z = num_blocks, L.size
    V = np.full((B + 1, Z + 1), np.inf)
    V[0, L.init] = -np.inf if bottleneck else 0.0
    op = np.maximum if bottleneck else np.add
    windows = None if keys is None or L.prev is None or L.moves is not None else runs_and_tables(
        np.arange(len(e.start)), e.end, e.start, e.reps, keys, B, L.prev, L.width,
        kind=e.kind if len(e.kind) else None)  # a chain's entries have no variants
    if windows is not None:
        _forward_runs(V, weights, *windows, L, B, op)
        return V
    nb, lo = len(L.depth), groups(e.end, B)
    rows, step = _Rows(e, V, L), max(1, _CHUNK // Z)
    rows.done(0)
    for j in range(1, B + 1):
        acc = V[j, :Z]
        for a in range(int(lo[j]), int(lo[j + 1]), step):
            b = min(a + step, int(lo[j + 1]))
            c = rows.get(a, b)
            v = c.reshape(b - a, nb, L.width)
            op(v, weights(np.arange(a, b))[:, :, None], out=v)
            np.minimum(acc, c.min(axis=0), out=acc)
        rows.done(j)
    return V


def _forward_runs(V: np.ndarray, weights: Weights, runs: Runs, tables: RangeMin, L: Layers,
                  num_blocks: int, op: np.ufunc) -> None:
    """``forward``'s loop over runs of entries: each reads its window, then adds its weight."""
    Z = L.size
    step = max(1, _RUNS_CHUNK // Z)
    tables.set(0, V[0, :Z])
    for j in range(1, num_blocks + 1):
        acc = V[j, :Z]
        for a in range(int(runs.groups[j]), int(runs.groups[j + 1]), step):
            b = min(a + step, int(runs.groups[j + 1]))
            got = tables.window(runs, a, b)
            op(got, weights(runs.first[a:b])[:, :, None], out=got)
            np.minimum(acc, got.reshape(b - a, Z).min(axis=0), out=acc)
        tables.set(j, acc)


def backtrack(e: Entries, weights: Weights, V: np.ndarray, L: Layers, num_blocks: int, *,
              bottleneck: bool = False) -> list[int]:
    """The entries of the plan ``forward`` found (the first best entry of each group)."""
    lo = groups(e.end, num_blocks)
    j, z, path = num_blocks, L.final, []
    while j > 0:
        a, b = int(lo[j]), int(lo[j + 1])
        col = L.source(e.via[a:b], z)
        w = weights(np.arange(a, b))[:, z // L.width]
        prev = V[e.start[a:b], col]
        k = int(np.argmin(np.maximum(prev, w) if bottleneck else prev + w))
        path.append(a + k)
        z, j = int(col[k]), int(e.start[a + k])
    return path[::-1]
