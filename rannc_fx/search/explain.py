"""Why no plan fits: the least largest-stage memory, and a world size or m that would fit.

This module imports numpy only (no torch). Every figure takes recomputation (unless
``SearchSpace.recompute`` is False) and 1F1B (if among the schedules) into account: a stage
is costed at its least memory, and under 1F1B at its position from the end.
"""

from __future__ import annotations

import math

import numpy as np

from ..schedules.kinds import ONE_F_ONE_B
from . import dp_chain, dp_positioned
from .candidates import Candidates
from .cost_model import blocked, range_max
from .dp_chain import Edges
from .problem import CostTable, SearchSpace
from .terms import TERMS, StageTerms, stage_terms
from .variants import (
    VARIANTS,
    Variant,
    after_transient,
    host_bytes,
    host_state,
    state_saved,
    variants,
)

__all__ = ["NoFeasiblePlan", "no_plan"]

_GIB = 1024**3
_GROW = 64  # how far NoFeasiblePlan looks for a world size that fits


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


def _bottleneck(cands: Candidates, e: Edges) -> float:
    """The least, over plans of the edges, of the largest ``e.mem``."""
    B, st = cands.table.num_blocks, cands.states
    D, _ = dp_chain.forward(e, e.mem, st, B, bottleneck=True)
    return float(D[B, st.final])


def _least_largest(cands: Candidates, ms: list[int]) -> float:
    """The least, over plans, of their largest stage's memory.

    GPipe's (n = m) bounds 1F1B's from above, and every stage at n = 1 from below; the
    layered DP then sees only the stages below the best so far.
    """
    gpipe = [_bottleneck(cands, e) for m in ms if (e := cands.least_memory(m, m)) is not None]
    need = min(gpipe, default=math.inf)
    if ONE_F_ONE_B.name not in cands.space.schedules:
        return need
    low = [(_bottleneck(cands, e), m, e) for m in ms if (e := cands.least_memory(m, 1))
           is not None]
    for lb, m, e in sorted(low, key=lambda x: (x[0], x[1])):
        if lb < need:
            need = min(need, _layered_least(cands, m, e.take(np.flatnonzero(e.mem < need))))
    return need


def _layered_least(cands: Candidates, m: int, e: Edges) -> float:
    """As ``_least_largest`` for 1F1B with m micro-batches over the stages ``e``, each at its
    position from the end (a layer per in-flight count)."""
    sp, B = cands.space, cands.table.num_blocks
    if not len(e.start):
        return math.inf
    ks = {r: cands.size(m, r) for r in np.unique(e.reps).tolist()}
    col = {k: c for c, k in enumerate(dict.fromkeys(ks.values()))}
    stacked = {f: np.stack([getattr(cands.terms(k, m), f) for k in col]) for f in TERMS}
    where = (np.array([col[ks[int(r)]] for r in e.reps]),
             e.end.astype(np.int64) * (e.end - 1) // 2 + e.start)  # (size, pair of cands)
    L = dp_positioned.build_layers(sp, min(m, dp_positioned.max_depth(sp, B)))
    n = np.minimum(L.depth, m)[None, :]

    def weights(idx: np.ndarray) -> np.ndarray:
        at = (where[0][idx], where[1][idx])
        terms = StageTerms(**{f: stacked[f][at][:, None] for f in TERMS}, m=m,
                           host_bw=sp.host_bandwidth or np.inf, host_overlap=sp.host_overlap)
        reps, rows = e.reps[idx].astype(np.int64), where[1][idx]

        def variant(k: int) -> np.ndarray:
            saved, tr = cands.offsets(k, reps, rows, m)
            return terms.memory(n, VARIANTS[k].recompute, tr[:, None], VARIANTS[k].host,
                                reps[:, None] if VARIANTS[k].full else None) - saved[:, None]

        return np.min([variant(k) for k in cands.kinds], axis=0)

    sharded = any(VARIANTS[v].zero or VARIANTS[v].offload for v in cands.kinds)
    chain = dp_positioned.Entries.chain(e.start, e.end, e.reps, e.move)
    V = dp_positioned.forward(chain, weights, L, B,
                              bottleneck=True,  # a stage's weights: its size (and replicas)
                              keys=(where[0], e.reps) if sharded else (where[0],))
    return float(V[B, L.final])


def no_plan(table: CostTable, space: SearchSpace) -> NoFeasiblePlan:
    """Why nothing fits: the least largest-stage memory, and a world size or m that would fit."""
    B, W, G = table.num_blocks, space.world_size, space.global_batch
    cands = Candidates(table, space, dp_chain.build_states(space))
    ms = sorted(set(space.micro_batches))
    need = _least_largest(cands, ms)
    if not math.isfinite(need):
        forced = f", {len(space.replicas or ()) or space.stages} forced stages" if (
            space.replicas or space.stages) else ""
        if table.excluded:
            sizes = ", ".join(map(str, sorted(table.excluded)))
            return NoFeasiblePlan(
                f"no plan of {W} ranks for {B} blocks, global batch {G}, micro-batches "
                f"{ms}{forced} keeps every stage off the micro-batch sizes its nodes cannot "
                f"run ({sizes} sample(s) per replica, for some blocks): a larger global "
                "batch, fewer ranks, or Config(micro_batches=...) with fewer micro-batches "
                "gives each replica more samples")
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
    if grow is None and space.stages is not None:
        split = "" if space.full_shard is not False and space.zero is not False else (
            ", which do not split the parameters without zero=3")
        msg += (f" with the stage count forced to {space.stages} (more ranks only add "
                f"replicas{split}): force more stages, or let the search choose "
                "(Config(stages=None))")
    more = next((m for m in _more_micro_batches(space)
                 if _smallest_world(table, space, m, W, W) is not None), None)
    if more is not None:
        msg += (f"; or use more micro-batches ({more} fit: max_micro_batches={more}; global "
                f"batch {G} allows up to {G}).")
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
    next larger size in it, so a size it names does fit. Sharding (ZeRO-1) is costed at the
    fewest replicas that reach a size; more would keep less state, so with it the size named
    may be more than needed.
    """
    B, G = table.num_blocks, space.global_batch
    r_max, sizes = G // m, np.asarray(table.sizes)
    if r_max < 1:
        return None
    s_max = space.stages or min(B, hi)
    # a stage d stages from the end holds min(m, d) micro-batches under 1F1B, m under GPipe
    one_f = ONE_F_ONE_B.name in space.schedules
    ns = range(1, min(m, s_max) + 1) if one_f else [m]
    iu, ju = np.triu_indices(B + 1, 1)
    kinds = variants(space, table.segments is not None, table.kept is not None)
    grad = np.asarray(table.grad_bytes, float)[iu, ju]
    r_need = {n: np.full(len(iu), np.inf) for n in ns}  # fewest replicas that make it fit
    for k, size in enumerate(sizes.tolist()):
        r = -(-G // (m * int(size)))  # fewest replicas with q <= size
        if r > r_max:
            continue
        terms = stage_terms(table, space, k, iu, ju, range_max(table.workspace[k])[iu, ju], m)
        for n in ns:
            mem = np.min([_at(space, terms, grad, n, r, VARIANTS[v]) for v in kinds], axis=0)
            mem = np.where(blocked(table, G, m, r, iu, ju), np.inf, mem)
            r_need[n] = np.where(mem <= space.memory_budget, np.minimum(r_need[n], r), r_need[n])
    need = {n: np.full((B + 1, B + 1), np.inf) for n in ns}
    for n in ns:
        need[n][iu, ju] = r_need[n]
    # least[d, i]: fewest ranks for d stages over [i, B), the first of them d from the end
    least = np.full((s_max + 1, B + 1), np.inf)
    least[0, B] = 0.0
    for d in range(1, s_max + 1):
        least[d] = (need[min(d, m) if one_f else m] + least[d - 1][None, :]).min(axis=1)
    counts = [space.stages] if space.stages else range(1, s_max + 1)
    fits = [max(lo, int(least[s, 0])) for s in counts
            if np.isfinite(least[s, 0]) and max(lo, least[s, 0]) <= min(hi, s * r_max)]
    return min(fits, default=None)


def _at(space: SearchSpace, terms: StageTerms, grad: np.ndarray, n: int, r: int,
        v: Variant) -> np.ndarray:
    """The stages' memory as variant ``v`` on r replicas (infinite where its offloaded state
    is over the host budget)."""
    rr = np.array(r)
    mem = terms.memory(n, v.recompute, after_transient(space, grad, rr, v.zero, v.offload,
                                                      v.full),
                       v.host, rr if v.full else None) - state_saved(space, grad, rr, v.zero,
                                                                     v.offload)
    host = host_bytes(space, terms.params, grad) if v.host else host_state(
        space, grad, rr, v.zero, v.offload)
    return np.where(host > space.host_budget, np.inf, mem)
