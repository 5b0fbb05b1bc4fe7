"""Search stage boundaries, per-stage replica counts and the micro-batch count exactly.

This module imports numpy only (no torch): the kernel works on a CostTable of arrays.

Cost model (all times in seconds, sizes in bytes). A stage covers blocks [i, j) with r
replicas; with m micro-batches each replica handles q = ceil(global_batch / (m * r)) samples
per micro-batch, and ``k`` is the index of q in ``table.sizes``.

    t_s      = sum(fwd[k, i:j]) + sum(bwd[k, i:j])
               + 2 * (cut[k, i] + cut[k, j]) / link_bw + 2 * link_lat * ([i > 0] + [j < B])
    ar_s     = 2 * (r - 1) / r * grad_bytes[i, j] / ar_bw + 2 * (r - 1) * link_lat
                         (ring all-reduce; ar_bw = allreduce_bandwidth, else link_bw)
    acc_s    = accumulate_s[i, j]             (micro-batch 2.. adds its gradients into .grad)
    opt_s    = optimizer_s[i, j]              (the optimizer step of the range's parameters)
    step     = sum_s t_s  +  max_s ((m - 1) * (t_s + acc_s) + ar_s + opt_s)
    memory_s = param_bytes[i, j] + grad_bytes[i, j] * (1 + optimizer_state_factor)
               + m * sum(act[k, i:j]) + m * (cut[k, i] + cut[k, j]) + max(workspace[k, i:j])

``sum_s t_s`` is the pipeline's fill and drain; the max term is the steady state of the
bottleneck stage (with its gradient accumulation) plus its gradient all-reduce and its optimizer step (every replica steps the
stage's parameters; stages step in parallel). A plan is feasible when every stage's memory is
within ``memory_budget``, replica counts sum to ``world_size`` and m * r <= global_batch.

Algorithm (exact). Write u_s = (m - 1) * (t_s + acc_s) + ar_s + opt_s, so step = sum_s t_s + max_s u_s. For one
m, a DP over the states (block j, ranks used so far) -- (block, stages, ranks) when the stage
count is forced, (block, stages) when the replicas are -- gives S(U), the least sum_s t_s over
plans whose stages all have u_s <= U. The optimum is the least S(U) + U over the u values of
the stages, and since S never grows with U:

* a DP at U settles every U' in [u_plan, U] (u_plan: the max u of the plan it returns), and
* S(U_b) + U_a bounds S(U') + U' from below for every U' in [U_a, U_b].

So the scan bisects the sorted candidate values of U, lower half first (S is often flat for a
long way), and drops a range once its bound reaches the best step found so far. Before it,
per m: a min-sum DP (S_inf, and a plan), a bottleneck DP (U_min, the least max u, and a
plan), then, for an m whose S_inf + U_min is below the best step, one DP with every stage
whose u can still win (it often settles the m), and a backward min-sum DP that bounds each
stage by the least ``sum t + max(u, U_min)`` of a plan through it; the scan's DPs see only the
stages whose bound is below the best step.

Cost. With E <= W * B * (B + 1) / 2 stages that fit and Z states (W + 1 when nothing is forced),
one DP is O(E * Z) vectorised operations in chunks that stay in cache. Each m costs two such DPs,
three more if it is not pruned, and then the scan's DPs over the surviving stages; measured
counts are in benchmarks/results/search_time_cpu_202611.md (tens of DPs where a plain scan of
every candidate U would run millions). Reproducible: the same inputs give the same plan; of the
plans the search compares, equal steps go to fewer stages, then fewer micro-batches, then the
lexicographically smaller stages (and within a DP to the earliest candidate stage).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CostTable",
    "Evaluation",
    "NoFeasiblePlan",
    "SearchResult",
    "SearchSpace",
    "StageChoice",
    "StageCost",
    "brute_force",
    "evaluate",
    "needed_sizes",
    "samples_per_replica",
    "search_pass",
]

logger = logging.getLogger("rannc_fx")

_GIB = 1024**3
_GROW = 64  # how far NoFeasiblePlan looks for a world size that fits
_CHUNK = 1 << 15  # elements of the DP temporaries: small enough to stay in cache


@dataclass(frozen=True)
class CostTable:
    """Per-block costs at each per-replica micro-batch size in ``sizes``.

    Shapes: sizes (Q,); fwd, bwd, act, workspace (Q, B); cut (Q, B + 1) with cut[:, 0] and
    cut[:, B] zero; param_bytes and grad_bytes (B, B + 1), entry [i, j] for the block range
    [i, j) with shared parameters counted once (only i < j is read); optimizer_s and
    accumulate_s (B, B + 1) likewise give the seconds of the range's optimizer step and of
    adding one micro-batch's gradients into ``.grad`` (None: free).
    """

    sizes: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    act: np.ndarray
    workspace: np.ndarray
    cut: np.ndarray
    param_bytes: np.ndarray
    grad_bytes: np.ndarray
    optimizer_s: np.ndarray | None = None
    accumulate_s: np.ndarray | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.fwd.shape[1])


@dataclass(frozen=True)
class SearchSpace:
    world_size: int
    global_batch: int
    memory_budget: float
    link_bandwidth: float
    optimizer_state_factor: float = 2.0
    link_latency: float = 0.0  # seconds per message
    allreduce_bandwidth: float | None = None  # None: link_bandwidth
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)  # candidates; forced = one candidate
    stages: int | None = None  # forced stage count
    replicas: tuple[int, ...] | None = None  # forced replica counts (implies stages)


@dataclass(frozen=True)
class StageChoice:
    start: int
    end: int  # exclusive
    replicas: int


@dataclass(frozen=True)
class StageCost:
    """One replica of one stage: samples per micro-batch, times (s) and memory parts (bytes)."""

    samples: int
    fwd_s: float
    bwd_s: float
    comm_s: float
    allreduce_s: float
    optimizer_s: float
    accumulate_s: float  # per micro-batch after the first
    params: int
    grads: int
    optimizer_state: int
    activations: int
    comm_buffers: int
    workspace: int

    @property
    def memory(self) -> int:
        return (self.params + self.grads + self.optimizer_state + self.activations
                + self.comm_buffers + self.workspace)


@dataclass(frozen=True)
class Evaluation:
    step_s: float
    stages: tuple[StageCost, ...]
    fits: bool


@dataclass(frozen=True)
class SearchResult:
    micro_batches: int
    stages: tuple[StageChoice, ...]
    evaluation: Evaluation
    seconds: float = 0.0  # wall time of the search


class NoFeasiblePlan(ValueError):
    """No plan fits; the message says by how much and what would fit.

    ``largest_stage_bytes`` is the least, over plans, of the largest stage's memory (infinite
    when no plan exists at all); ``world_size`` the smallest larger world size that fits and
    ``micro_batches`` a larger micro-batch count that fits, or None.
    """

    def __init__(self, message: str, *, largest_stage_bytes: float = math.inf,
                 world_size: int | None = None, micro_batches: int | None = None) -> None:
        super().__init__(message)
        self.largest_stage_bytes = largest_stage_bytes
        self.world_size = world_size
        self.micro_batches = micro_batches


def samples_per_replica(global_batch: int, micro_batches: int, replicas: int) -> int:
    return -(-global_batch // (micro_batches * replicas))


def needed_sizes(space: SearchSpace) -> tuple[int, ...]:
    """Every per-replica micro-batch size the search may look up, ascending."""
    reps = sorted(set(space.replicas)) if space.replicas else range(1, space.world_size + 1)
    return tuple(sorted({
        samples_per_replica(space.global_batch, m, r)
        for m in set(space.micro_batches) for r in reps if m * r <= space.global_batch
    }))


# -- evaluation and the brute-force oracle ----------------------------------------------------
def _size_index(table: CostTable) -> dict[int, int]:
    return {int(q): k for k, q in enumerate(np.asarray(table.sizes).tolist())}


def _interval_costs(table: CostTable, space: SearchSpace, k: int, m: int, i: np.ndarray,
                    j: np.ndarray, ws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """t and memory of the stages [i, j) at size index k, given their largest workspace.

    The one place the formulas are written: evaluate() and the kernel agree bit for bit.
    """
    grad = np.asarray(table.grad_bytes, float)[i, j]
    fixed = np.asarray(table.param_bytes, float)[i, j] + grad * (1 + space.optimizer_state_factor)
    cut = np.asarray(table.cut[k], float)
    fb = np.concatenate(([0.0], np.cumsum(table.fwd[k] + table.bwd[k])))
    act = np.concatenate(([0.0], np.cumsum(table.act[k])))
    both = cut[i] + cut[j]
    t = fb[j] - fb[i] + 2 * both / space.link_bandwidth + _latency_s(space, table.num_blocks, i, j)
    return t, fixed + m * (act[j] - act[i] + both) + ws


def _latency_s(space: SearchSpace, num_blocks: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Per micro-batch, one message each way across each cut boundary of the stage."""
    return 2 * space.link_latency * ((i > 0).astype(float) + (j < num_blocks).astype(float))


def _allreduce_s(table: CostTable, space: SearchSpace, i: np.ndarray, j: np.ndarray,
                 reps: np.ndarray) -> np.ndarray:
    """ar_s of the stages [i, j) at each replica count: (len(i), len(reps))."""
    grad = np.asarray(table.grad_bytes, float)[i, j][:, None]
    r = np.asarray(reps, float)[None, :]
    bw = space.allreduce_bandwidth or space.link_bandwidth
    return 2 * (r - 1) / r * grad / bw + 2 * (r - 1) * space.link_latency


def _range(arr: np.ndarray | None, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``arr[i, j]`` for an optional per-range array (None: zeros)."""
    return np.zeros(len(i)) if arr is None else np.asarray(arr, float)[i, j]


def _stage_cost(table: CostTable, space: SearchSpace, kidx: dict[int, int], st: StageChoice,
                m: int) -> tuple[StageCost, float]:
    """The stage's costs, and its memory as the kernel computes it (for ``fits``)."""
    i, j, r = st.start, st.end, st.replicas
    q = samples_per_replica(space.global_batch, m, r)
    if q not in kidx:
        raise ValueError(f"the cost table has no costs for {q} samples per replica; "
                         "build it for needed_sizes(space)")
    k, bw = kidx[q], space.link_bandwidth
    param, grad = float(table.param_bytes[i, j]), float(table.grad_bytes[i, j])
    cut = float(table.cut[k, i]) + float(table.cut[k, j])
    ws = float(table.workspace[k, i:j].max())
    ii, jj = np.array([i]), np.array([j])
    _, mem = _interval_costs(table, space, k, m, ii, jj, np.array([ws]))
    cost = StageCost(
        samples=q,
        fwd_s=float(table.fwd[k, i:j].sum()),
        bwd_s=float(table.bwd[k, i:j].sum()),
        comm_s=2 * cut / bw + float(_latency_s(space, table.num_blocks, ii, jj)[0]),
        allreduce_s=float(_allreduce_s(table, space, ii, jj, np.array([r]))[0, 0]),
        optimizer_s=float(_range(table.optimizer_s, ii, jj)[0]),
        accumulate_s=float(_range(table.accumulate_s, ii, jj)[0]),
        params=round(param), grads=round(grad),
        optimizer_state=round(grad * space.optimizer_state_factor),
        activations=round(m * float(table.act[k, i:j].sum())), comm_buffers=round(m * cut),
        workspace=round(ws),
    )
    return cost, float(mem[0])


def _step(costs: Sequence[StageCost], m: int) -> float:
    ts = [c.fwd_s + c.bwd_s + c.comm_s for c in costs]
    return sum(ts) + max((m - 1) * (t + c.accumulate_s) + (c.allreduce_s + c.optimizer_s)
                         for t, c in zip(ts, costs, strict=True))


def evaluate(table: CostTable, space: SearchSpace, stages: tuple[StageChoice, ...],
             micro_batches: int) -> Evaluation:
    """Predicted step time and per-stage costs of a plan; ``fits`` checks the memory budget."""
    m, end = micro_batches, 0
    for st in stages:
        if st.start != end or st.end <= st.start or st.replicas < 1:
            raise ValueError(f"stages {stages} must cover blocks 0.. in order, each non-empty "
                             "with at least one replica")
        if m * st.replicas > space.global_batch:
            raise ValueError(f"{m} micro-batches x {st.replicas} replicas exceed the global "
                             f"batch {space.global_batch}")
        end = st.end
    if end != table.num_blocks or sum(s.replicas for s in stages) != space.world_size:
        raise ValueError(f"stages {stages} must end at block {table.num_blocks} and their "
                         f"replicas sum to the world size {space.world_size}")
    kidx = _size_index(table)
    pairs = [_stage_cost(table, space, kidx, st, m) for st in stages]
    costs = tuple(c for c, _ in pairs)
    return Evaluation(_step(costs, m), costs, all(mem <= space.memory_budget for _, mem in pairs))


def _stage_counts(space: SearchSpace, num_blocks: int) -> range:
    if space.replicas is not None:
        return range(len(space.replicas), len(space.replicas) + 1)
    if space.stages is not None:
        return range(space.stages, space.stages + 1)
    return range(1, min(num_blocks, space.world_size) + 1)


def brute_force(table: CostTable, space: SearchSpace) -> SearchResult:
    """The same optimum by enumerating every partition, replica assignment and m (tiny inputs)."""
    _check(table, space)
    t0, B, W, kidx = time.perf_counter(), table.num_blocks, space.world_size, _size_index(table)
    memo: dict[tuple[StageChoice, int], tuple[StageCost, float]] = {}
    best: tuple[float, int, int, tuple[StageChoice, ...]] | None = None
    for m in sorted(set(space.micro_batches)):
        for S in _stage_counts(space, B):
            comps = ([space.replicas] if space.replicas is not None else
                     [tuple(b - a for a, b in zip((0, *c), (*c, W), strict=True))
                      for c in itertools.combinations(range(1, W), S - 1)])
            for cuts in itertools.combinations(range(1, B), S - 1):
                bounds = (0, *cuts, B)
                for reps in comps:
                    if max(reps) * m > space.global_batch:
                        continue
                    stages = tuple(StageChoice(a, b, r) for a, b, r in
                                   zip(bounds[:-1], bounds[1:], reps, strict=True))
                    pairs = [memo.get((st, m)) or memo.setdefault(
                        (st, m), _stage_cost(table, space, kidx, st, m)) for st in stages]
                    if any(mem > space.memory_budget for _, mem in pairs):
                        continue
                    key = (_step([c for c, _ in pairs], m), S, m, stages)
                    if best is None or _key(key) < _key(best):
                        best = key
    if best is None:
        raise _no_plan(table, space)
    _, _, m, stages = best
    return SearchResult(m, stages, evaluate(table, space, stages, m), time.perf_counter() - t0)


def _key(k: tuple[float, int, int, tuple[StageChoice, ...]]) -> tuple[object, ...]:
    step, n, m, stages = k
    return step, n, m, tuple((s.start, s.end, s.replicas) for s in stages)


def _check(table: CostTable, space: SearchSpace) -> None:
    B, Q = table.num_blocks, len(table.sizes)
    shapes = {"fwd": (Q, B), "bwd": (Q, B), "act": (Q, B), "workspace": (Q, B),
              "cut": (Q, B + 1), "param_bytes": (B, B + 1), "grad_bytes": (B, B + 1)}
    for name, shape in shapes.items():
        if np.shape(getattr(table, name)) != shape:
            raise ValueError(f"CostTable.{name} has shape {np.shape(getattr(table, name))}, "
                             f"expected {shape} for {Q} sizes and {B} blocks")
    if B < 1 or space.world_size < 1 or space.global_batch < 1 or space.link_bandwidth <= 0:
        raise ValueError(f"need blocks, world size, global batch and link bandwidth > 0: {space}")
    if not space.micro_batches or min(space.micro_batches) < 1:
        raise ValueError(f"micro_batches={space.micro_batches}: need counts >= 1")
    if space.replicas is not None:
        if min(space.replicas, default=0) < 1 or sum(space.replicas) != space.world_size:
            raise ValueError(f"replicas={list(space.replicas)} must be >= 1 and sum to the "
                             f"world size {space.world_size}")
        if space.stages is not None and space.stages != len(space.replicas):
            raise ValueError(f"stages={space.stages} but replicas={list(space.replicas)}")
    if space.stages is not None and space.stages < 1:
        raise ValueError(f"stages={space.stages}: need at least one stage")
    missing = sorted(set(needed_sizes(space)) - set(_size_index(table)))
    if missing:
        raise ValueError(f"the cost table has no costs for {missing} samples per replica; "
                         "build it for needed_sizes(space)")


# -- the DP kernel ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _States:
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


def _build_states(space: SearchSpace) -> _States:
    W = space.world_size
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
    return _States(Z, final, src, dst, reps)


@dataclass(frozen=True)
class _Edges:
    """Candidate stages of one m: blocks [start, end) on ``reps`` replicas, with t, u, memory.

    Sorted by end block (the DPs walk them in groups of one end block).
    """

    start: np.ndarray
    end: np.ndarray
    reps: np.ndarray
    t: np.ndarray
    u: np.ndarray
    mem: np.ndarray

    def take(self, idx: np.ndarray) -> _Edges:
        return _Edges(self.start[idx], self.end[idx], self.reps[idx], self.t[idx], self.u[idx],
                      self.mem[idx])


def _groups(key: np.ndarray, num_blocks: int) -> np.ndarray:
    """Edges whose sorted ``key`` is b are [out[b], out[b + 1])."""
    return np.searchsorted(key, np.arange(num_blocks + 2))


def _range_max(x: np.ndarray) -> np.ndarray:
    """(B + 1, B + 1) array whose [i, j] is max(x[i:j]) for i < j."""
    B = len(x)
    rows = np.where(np.arange(B)[None, :] >= np.arange(B)[:, None], x[None, :], -np.inf)
    out = np.full((B + 1, B + 1), -np.inf)
    out[:B, 1:] = np.maximum.accumulate(rows, axis=1)
    return out


def _edges(table: CostTable, space: SearchSpace, states: _States, kidx: dict[int, int],
           m: int, *, fits_only: bool = True) -> _Edges | None:
    """Every stage a plan with m micro-batches may use; None when no replica count is allowed."""
    if space.replicas is not None and max(space.replicas) * m > space.global_batch:
        return None
    reps = np.array([r for r in states.replicas if r * m <= space.global_batch], np.int64)
    if not len(reps):
        return None
    ju, iu = np.tril_indices(table.num_blocks + 1, -1)  # every i < j, ordered by (j, i)
    T, M = np.empty((len(iu), len(reps))), np.empty((len(iu), len(reps)))
    done: dict[int, int] = {}  # size index -> a column already holding its t and memory
    for c, r in enumerate(reps.tolist()):
        k = kidx[samples_per_replica(space.global_batch, m, r)]
        if k not in done:
            done[k] = c
            ws = _range_max(table.workspace[k])[iu, ju]
            T[:, c], M[:, c] = _interval_costs(table, space, k, m, iu, ju, ws)
        else:
            T[:, c], M[:, c] = T[:, done[k]], M[:, done[k]]
    acc = _range(table.accumulate_s, iu, ju)
    U = (m - 1) * (T + acc[:, None]) + (_allreduce_s(table, space, iu, ju, reps)
                                        + _range(table.optimizer_s, iu, ju)[:, None])
    if fits_only:
        keep = np.flatnonzero(M.ravel() <= space.memory_budget)
    else:
        keep = np.arange(M.size)
    pair, col = np.divmod(keep, len(reps))
    small = np.int32  # halves the index arrays; blocks and ranks are far below 2**31
    return _Edges(iu.astype(small)[pair], ju.astype(small)[pair], reps.astype(small)[col],
                  T.ravel()[keep], U.ravel()[keep], M.ravel()[keep])


def _min_rows(table: np.ndarray, rows: np.ndarray, w: np.ndarray, buf: np.ndarray, *,
              bottleneck: bool = False) -> np.ndarray:
    """min over k of table[rows[k]] + w[k] (or max(., w[k])), in chunks that stay in cache."""
    op = np.maximum if bottleneck else np.add
    acc = np.full(table.shape[1], np.inf)
    for a in range(0, len(rows), len(buf)):
        c = buf[: min(len(buf), len(rows) - a)]
        np.take(table, rows[a : a + len(buf)], axis=0, out=c)
        op(c, w[a : a + len(buf), None], out=c)
        np.minimum(acc, c.min(axis=0), out=acc)
    return acc


def _scratch(states: _States) -> np.ndarray:
    return np.empty((max(1, _CHUNK // states.size), states.size))


def _forward(e: _Edges, w: np.ndarray, states: _States, num_blocks: int, *,
             bottleneck: bool = False, hi: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Least sum (or max) of ``w`` over stages from block 0 to each (block, state).

    Returns the values D (B + 1, Z + 1) and ``shifted[i, r, z] = D[i, src[r, z]]`` for
    ``_backtrack``. ``hi`` ends each block's group early (edges sorted by u, a threshold).
    """
    B, Z, nr = num_blocks, states.size, states.src.shape[0]
    lo = _groups(e.end, B)
    hi = lo[1:] if hi is None else hi
    D = np.full((B + 1, Z + 1), np.inf)
    D[0, 0] = -np.inf if bottleneck else 0.0
    shifted = np.full((B + 1, nr, Z), np.inf)
    shifted[0] = D[0][states.src]
    flat, rows, buf = shifted.reshape(-1, Z), e.start * nr + e.reps, _scratch(states)
    for j in range(1, B + 1):
        a, b = lo[j], hi[j]
        if a < b:
            D[j, :Z] = _min_rows(flat, rows[a:b], w[a:b], buf, bottleneck=bottleneck)
            shifted[j] = D[j][states.src]
    return D, shifted


def _backtrack(e: _Edges, w: np.ndarray, shifted: np.ndarray, states: _States,
               num_blocks: int, *, bottleneck: bool = False, hi: np.ndarray | None = None
               ) -> list[int]:
    """The edges of the plan ``_forward`` found (the first best edge of each group)."""
    lo = _groups(e.end, num_blocks)
    hi = lo[1:] if hi is None else hi
    j, z, path = num_blocks, states.final, []
    while j > 0:
        a, b = int(lo[j]), int(hi[j])
        prev = shifted[e.start[a:b], e.reps[a:b], z]
        k = a + int(np.argmin(np.maximum(prev, w[a:b]) if bottleneck else prev + w[a:b]))
        path.append(k)
        z, j = int(states.src[e.reps[k], z]), int(e.start[k])
    return path[::-1]


def _backward(e: _Edges, states: _States, num_blocks: int) -> np.ndarray:
    """Least sum of t over stages from each (block, state) to the end."""
    B, Z, nr = num_blocks, states.size, states.dst.shape[0]
    order = np.argsort(e.start, kind="stable")
    lo = _groups(e.start[order], B)
    P = np.full((B + 1, Z + 1), np.inf)
    P[B, states.final] = 0.0
    shifted = np.full((B + 1, nr, Z), np.inf)  # [j, r, z] = P[j, dst[r, z]]
    shifted[B] = P[B][states.dst]
    flat, buf = shifted.reshape(-1, Z), _scratch(states)
    rows, t = (e.end * nr + e.reps)[order], e.t[order]
    for i in range(B - 1, -1, -1):
        a, b = lo[i], lo[i + 1]
        if a < b:
            P[i, :Z] = _min_rows(flat, rows[a:b], t[a:b], buf)
            shifted[i] = P[i][states.dst]
    return P


def _through_bound(e: _Edges, pre: np.ndarray, post: np.ndarray, states: _States,
                   num_blocks: int) -> np.ndarray:
    """Per edge, the least sum of t over whole plans that use it."""
    Z, nr = states.size, states.src.shape[0]
    before = pre[:, states.src].reshape(-1, Z)  # [i * nr + r]: best prefix, then r replicas
    rows, buf = e.start * nr + e.reps, _scratch(states)
    lo = _groups(e.end, num_blocks)
    out = np.empty(len(e.t))
    for j in range(1, num_blocks + 1):
        for a in range(lo[j], lo[j + 1], len(buf)):
            b = min(a + len(buf), lo[j + 1])
            c = buf[: b - a]
            np.take(before, rows[a:b], axis=0, out=c)
            np.add(c, post[j, :Z], out=c)
            out[a:b] = c.min(axis=1)
    return out + e.t


@dataclass
class _Best:
    """The incumbent plan; ties go to fewer stages, then fewer micro-batches, then lexicographic."""

    step: float = math.inf
    m: int = 0
    stages: tuple[StageChoice, ...] = ()
    dps: int = 0
    improved: int = 0  # bumps whenever step drops, so callers refilter their edges

    def offer(self, e: _Edges, path: list[int], m: int) -> tuple[float, float]:
        """Offer a plan; returns its (sum of t, max u)."""
        s, umax = float(e.t[path].sum()), float(e.u[path].max())
        stages = tuple(StageChoice(int(e.start[k]), int(e.end[k]), int(e.reps[k])) for k in path)
        new = (s + umax, len(stages), m, stages)
        if _key(new) < _key((self.step, len(self.stages), self.m, self.stages)):
            if new[0] < self.step:
                self.improved += 1
            self.step, self.m, self.stages = new[0], m, stages
        return s, umax


def _threshold_dp(e: _Edges, states: _States, num_blocks: int, best: _Best, m: int,
                  hi: np.ndarray | None = None, w: np.ndarray | None = None) -> tuple[float, float]:
    """Least sum of t with the allowed stages, offered to ``best``: (sum, the plan's max u)."""
    w = e.t if w is None else w
    D, shifted = _forward(e, w, states, num_blocks, hi=hi)
    best.dps += 1
    if not np.isfinite(D[num_blocks, states.final]):
        return math.inf, math.inf
    return best.offer(e, _backtrack(e, w, shifted, states, num_blocks, hi=hi), m)


def _search_m(e: _Edges, states: _States, num_blocks: int, m: int, best: _Best,
              pre: np.ndarray, u_min: float) -> None:
    """Scan the bottleneck value U for one m (see the module docstring)."""
    B = num_blocks
    s_inf = float(pre[B, states.final])
    # One DP with every stage whose u can still win often settles this m on its own.
    s_top, u_top = _threshold_dp(e, states, B, best, m,
                                 w=np.where(e.u < best.step - s_inf, e.t, np.inf))
    if s_top + u_min >= best.step:
        return
    lb = _through_bound(e, pre, _backward(e, states, B), states, B) + np.maximum(e.u, u_min)
    cands = np.unique(e.u[(e.u >= u_min) & (e.u < u_top) & (lb < best.step)])
    keep = np.flatnonzero(lb < best.step)
    keep = keep[np.lexsort((e.u[keep], e.end[keep]))]  # by u within each end block
    kept, lb = e.take(keep), lb[keep]
    lo = _groups(kept.end, B)
    stack: list[tuple[int, int, float]] = [(0, len(cands) - 1, s_top)]
    while stack:
        a, b, s_lb = stack.pop()
        b = min(b, int(np.searchsorted(cands, best.step - s_lb)) - 1)
        if b < a or s_lb + cands[a] >= best.step:
            continue
        drop = lb >= best.step  # stages that can no longer beat the incumbent
        if np.count_nonzero(drop) * 8 > len(lb):
            kept, lb = kept.take(np.flatnonzero(~drop)), lb[~drop]
            lo = _groups(kept.end, B)
        hi = lo[:-1] + np.bincount(kept.end[kept.u <= cands[b]], minlength=B + 1)
        s_b, u_plan = _threshold_dp(kept, states, B, best, m, hi=hi)
        if s_b + cands[a] >= best.step:
            continue
        b2 = int(np.searchsorted(cands, u_plan)) - 1  # S is flat on [u_plan, cands[b]]
        if b2 >= a:
            mid = (a + b2) // 2
            stack += [(mid + 1, b2, s_b), (a, mid, s_b)]  # lower half first: S is often flat


def search_pass(table: CostTable, space: SearchSpace) -> SearchResult:
    """The plan with the least predicted step time whose stages fit the memory budget."""
    t0 = time.perf_counter()
    _check(table, space)
    B, kidx, states = table.num_blocks, _size_index(table), _build_states(space)
    best, bounds = _Best(), []
    ms = sorted(set(space.micro_batches))
    for m in ms:  # per m: the least sum, the least bottleneck, and their plans
        e = _edges(table, space, states, kidx, m)
        if e is None or not len(e.t):
            continue
        pre, shifted = _forward(e, e.t, states, B)
        if not np.isfinite(pre[B, states.final]):
            continue
        best.offer(e, _backtrack(e, e.t, shifted, states, B), m)
        bot, shifted = _forward(e, e.u, states, B, bottleneck=True)
        best.offer(e, _backtrack(e, e.u, shifted, states, B, bottleneck=True), m)
        best.dps += 2
        u_min = float(bot[B, states.final])
        bounds.append((float(pre[B, states.final]) + u_min, m, pre, u_min))
    if not bounds:
        raise _no_plan(table, space)
    for lower, m, pre, u_min in sorted(bounds, key=lambda x: (x[0], x[1])):
        if lower < best.step:
            e = _edges(table, space, states, kidx, m)
            assert e is not None
            _search_m(e, states, B, m, best, pre, u_min)
    result = SearchResult(best.m, best.stages, evaluate(table, space, best.stages, best.m),
                          time.perf_counter() - t0)
    logger.info(
        "searched %d blocks x %d ranks x %d micro-batch counts in %.1f s: %d stages, m=%d, "
        "predicted %.1f ms", B, space.world_size, len(ms), result.seconds, len(best.stages),
        best.m, 1e3 * result.evaluation.step_s)
    logger.debug("search ran %d DPs", best.dps)
    return result


# -- explaining infeasibility ----------------------------------------------------------------
def _no_plan(table: CostTable, space: SearchSpace) -> NoFeasiblePlan:
    """Why nothing fits: the least largest-stage memory, and a world size or m that would fit."""
    B, W, G = table.num_blocks, space.world_size, space.global_batch
    kidx, states, ms = _size_index(table), _build_states(space), sorted(set(space.micro_batches))
    need = math.inf
    for m in ms:
        e = _edges(table, space, states, kidx, m, fits_only=False)
        if e is not None and len(e.t):
            D, _ = _forward(e, e.mem, states, B, bottleneck=True)
            need = min(need, float(D[B, states.final]))
    if not math.isfinite(need):
        forced = f", {len(space.replicas or ()) or space.stages} forced stages" if (
            space.replicas or space.stages) else ""
        return NoFeasiblePlan(
            f"no plan of {W} ranks exists for {B} blocks, global batch {G}, micro-batches "
            f"{ms}{forced}: every stage needs at least one block and 1 to "
            "global_batch / micro_batches replicas")
    budget = space.memory_budget
    msg = (f"no plan fits {W} devices of {_size(budget)}: the best plan's largest stage "
           f"needs {_size(need)} ({_size(need - budget)} over).")
    if space.replicas is not None:
        msg += " The replica counts are forced; change them, or the budget."
        return NoFeasiblePlan(msg, largest_stage_bytes=need)
    grow = min((w for m in ms if (w := _smallest_world(table, space, m, W + 1, _GROW * W))
                is not None), default=None)
    msg += (f" The smallest world size that fits is {grow}" if grow is not None else
            f" No world size up to {_GROW * W} fits")
    more = next((m for m in _more_micro_batches(space)
                 if _smallest_world(table, space, m, W, W) is not None), None)
    if more is not None:
        msg += f"; or use more micro-batches ({more} fit; global batch {G} allows up to {G})."
    elif G > ms[-1]:
        msg += f"; more micro-batches (global batch {G} allows up to {G}) do not fit either."
    else:
        msg += f"; global batch {G} allows no more micro-batches."
    return NoFeasiblePlan(msg, largest_stage_bytes=need, world_size=grow, micro_batches=more)


def _size(nbytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB, so small budgets do not read as 0.01 GiB."""
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= _GIB else f"{nbytes / 2**20:.1f} MiB"


def _more_micro_batches(space: SearchSpace) -> list[int]:
    m, out = max(space.micro_batches), []
    while m * 2 < space.global_batch:
        m *= 2
        out.append(m)
    return out + [space.global_batch] if space.global_batch > max(space.micro_batches) else out


def _smallest_world(table: CostTable, space: SearchSpace, m: int, lo: int, hi: int) -> int | None:
    """The least world size in [lo, hi] with a plan whose stages fit, or None.

    A cheap memory-only check that assumes a stage never needs more memory with more replicas
    (fewer samples each). A replica count whose samples are not in the table is costed at the
    next larger size in it, so a size it names does fit.
    """
    B, G = table.num_blocks, space.global_batch
    r_max, sizes = G // m, np.asarray(table.sizes)
    if r_max < 1:
        return None
    iu, ju = np.triu_indices(B + 1, 1)
    r_need = np.full(len(iu), np.inf)  # fewest replicas that make each stage fit
    for k, size in enumerate(sizes.tolist()):
        r = -(-G // (m * int(size)))  # fewest replicas with q <= size
        if r > r_max:
            continue
        _, mem = _interval_costs(table, space, k, m, iu, ju,
                                 _range_max(table.workspace[k])[iu, ju])
        r_need = np.where(mem <= space.memory_budget, np.minimum(r_need, r), r_need)
    need = np.full((B + 1, B + 1), np.inf)
    need[iu, ju] = r_need
    s_max = space.stages or min(B, hi)
    least = np.full((s_max + 1, B + 1), np.inf)  # [s, j]: fewest ranks for s stages over [0, j)
    least[0, 0] = 0.0
    for j in range(1, B + 1):
        least[1:, j] = (least[:-1, :j] + need[:j, j]).min(axis=1)
    counts = [space.stages] if space.stages else range(1, s_max + 1)
    fits = [max(lo, int(least[s, B])) for s in counts
            if np.isfinite(least[s, B]) and max(lo, least[s, B]) <= min(hi, s * r_max)]
    return min(fits, default=None)
