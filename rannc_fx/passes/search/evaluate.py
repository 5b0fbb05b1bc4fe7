"""One plan's step time and per-stage costs under the cost model (``model``'s formulas).

This module imports numpy only (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .model import (
    SCHEDULES,
    CostTable,
    Evaluation,
    SearchSpace,
    StageChoice,
    StageCost,
    allreduce_s,
    bottleneck_s,
    held_bytes,
    in_flight,
    kept_cuts,
    outputs_held,
    range_sum,
    samples_per_replica,
    size_index,
    stage_terms,
)

__all__ = ["evaluate", "plan_step"]


def _stage(table: CostTable, space: SearchSpace, kidx: dict[int, int], st: StageChoice,
           m: int, n: int) -> tuple[StageCost, float, float, float]:
    """The stage's costs, its t, its u and its memory as the kernel computes them."""
    i, j, r, rho = st.start, st.end, st.replicas, st.recompute
    q = samples_per_replica(space.global_batch, m, r)
    if q not in kidx:
        raise ValueError(f"the cost table has no costs for {q} samples per replica; "
                         "build it for needed_sizes(space)")
    k, ii, jj = kidx[q], np.array([i]), np.array([j])
    terms = stage_terms(table, space, k, ii, jj, np.array([table.workspace[k, i:j].max()]), m)
    t = float(terms.time(rho)[0])
    grad = float(table.grad_bytes[i, j])
    ar = float(allreduce_s(space, np.array([grad]), np.array([r]))[0])
    opt, acc = float(range_sum(table.optimizer_s, ii, jj)[0]), float(
        range_sum(table.accumulate_s, ii, jj)[0])
    u = float(bottleneck_s(m, np.array([t]), np.array([acc]), np.array([ar + opt]))[0])
    fwd, act, cuts = float(table.fwd[k, i:j].sum()), float(terms.act[0]), float(terms.cuts[0])
    cout = float(terms.cout[0])
    kept = float(kept_cuts(np.array([cuts]), np.array([cout]), n, rho)[0])
    cost = StageCost(
        samples=q, fwd_s=fwd, bwd_s=float(table.bwd[k, i:j].sum()), comm_s=float(terms.comm[0]),
        allreduce_s=ar, optimizer_s=opt, accumulate_s=acc,
        params=round(float(table.param_bytes[i, j])), grads=round(grad),
        optimizer_state=round(grad * space.optimizer_state_factor),
        activations=round(act if rho else n * act), comm_buffers=round(kept),
        overlap=round(grad + (act if rho else n * act) + kept
                      - float(held_bytes(np.array([grad]), np.array([act]), np.array([cuts]),
                                         np.array([cout]), n, m, rho)[0])),
        workspace=round(float(terms.ws[0])), recompute=rho, in_flight=n,
        recompute_s=fwd if rho else 0.0,
        outputs=round(float(outputs_held(table, space, k, ii, jj, m)[0])),
    )
    return cost, t, u, float(terms.memory(n, rho)[0])


def plan_step(ts: Sequence[float], us: Sequence[float]) -> float:
    """step = sum_s t_s + max_s u_s, summed in stage order (the search sums the same way)."""
    return sum(ts) + max(us)


def evaluate(table: CostTable, space: SearchSpace, stages: tuple[StageChoice, ...],
             micro_batches: int, schedule: str = "gpipe", *,
             lanes: Sequence[Sequence[int]] | None = None,
             in_flight_counts: Sequence[int] | None = None) -> Evaluation:
    """Predicted step time and per-stage costs of a plan; ``fits`` checks the memory budget.

    Each stage recomputes as its ``StageChoice.recompute`` says. ``"zbh1"`` (not searched:
    ``planner/zero_bubble.py``) is costed with every stage holding min(m, S) micro-batches
    and 1F1B's step formula; the simulator times its split backward. A schedule with several
    stages a lane (``"interleaved"``, ``"zbv"``: ``planner/virtual.py``) gives the stages of
    each lane (``lanes``: they share its ranks, so the replica counts of one lane count once
    and their memory adds up against the budget) and the micro-batches each stage holds
    (``in_flight_counts``, counted off the schedule); its step is the simulator's, the
    formula's here only a lower bound.
    """
    m, end = micro_batches, 0
    virtual = schedule in ("interleaved", "zbv")
    if schedule not in (*SCHEDULES, "zbh1") and not virtual:
        raise ValueError(f"schedule={schedule!r}: expected one of "
                         f"{(*SCHEDULES, 'zbh1', 'interleaved', 'zbv')}")
    if virtual and (lanes is None or in_flight_counts is None):
        raise ValueError(f"schedule={schedule!r} needs the lanes and each stage's in-flight count")
    lanes = lanes if lanes is not None else [[s] for s in range(len(stages))]
    for st in stages:
        if st.start != end or st.end <= st.start or st.replicas < 1:
            raise ValueError(f"stages {stages} must cover blocks 0.. in order, each non-empty "
                             "with at least one replica")
        if m * st.replicas > space.global_batch:
            raise ValueError(f"{m} micro-batches x {st.replicas} replicas exceed the global "
                             f"batch {space.global_batch}")
        end = st.end
    if end != table.num_blocks or sum(stages[lane[0]].replicas for lane in lanes) != \
            space.world_size or any(stages[s].replicas != stages[lane[0]].replicas
                                    for lane in lanes for s in lane):
        raise ValueError(f"stages {stages} must end at block {table.num_blocks} and their "
                         f"replicas sum to the world size {space.world_size} (a lane's counted "
                         "once, the same on each of its stages)")
    kidx, S = size_index(table), len(stages)
    counts = (list(in_flight_counts) if in_flight_counts is not None
              else [in_flight(schedule, m, S - s, S) for s in range(S)])
    got = [_stage(table, space, kidx, st, m, counts[s]) for s, st in enumerate(stages)]
    step = plan_step([g[1] for g in got], [g[2] for g in got])
    return Evaluation(step, tuple(g[0] for g in got),
                      all(sum(got[s][3] for s in lane) <= space.memory_budget for lane in lanes))
