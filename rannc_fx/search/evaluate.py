"""One plan's step time and per-stage costs under the cost model (``cost_model``'s formulas).

This module imports numpy only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..plan.parts import MemoryEstimate
from ..schedules.kinds import GPIPE, ZBH1, kind_of
from .cost_model import blocked, bottleneck_s, in_flight, range_sum, samples_per_replica, size_index
from .nodes import PIPELINES, crossing_at, crossing_s, legal, multi_node
from .problem import CostTable, Evaluation, SearchSpace, StageChoice, StageCost
from .terms import SELECTIVE, held_bytes, kept_cuts, outputs_held, reruns, stage_terms
from .variants import (
    after_transient,
    allreduce_s,
    host_bytes,
    host_state,
    host_step_s,
    shard_s,
    state_saved,
    update_s,
)

__all__ = ["evaluate", "held_once", "lane_memory", "plan_step"]


def _stage(table: CostTable, space: SearchSpace, kidx: dict[int, int], st: StageChoice,
           m: int, n: int, zb: int = 0, split: bool = False, queue: bool = True,
           cross: tuple[bool, bool] = (False, False), *, memo: dict[Any, Any] | None = None,
           ) -> tuple[StageCost, float, float, float,
                      tuple[float, float, float, float, float, float]]:
    """The stage's costs, its t, its u and its memory as the kernel computes them, and one
    micro-batch's held parts as ``lane_memory`` reads them; ``split``: t and u under ZB-H1
    (``StageTerms.zbh1_times``); ``zb``: its memory too, holding that many micro-batches from
    F to W, n = min(zb, d) (``StageTerms.memory_zbh1``); ``cross``: whether its in- and
    out-boundary cross nodes (their messages on the network, ``nodes.crossing_s``).
    ``memo``: ``evaluate``'s, where the blocks' terms are kept too (the same for every
    variant of the stage)."""
    i, j, r, rho = st.start, st.end, st.replicas, st.level
    zeta, omega = st.zero and r > 1, st.offload
    q = samples_per_replica(space.global_batch, m, r)
    if q not in kidx:
        raise ValueError(f"the cost table has no costs for {q} samples per replica; "
                         "build it for needed_sizes(space)")
    k, ii, jj = kidx[q], np.array([i]), np.array([j])
    key = ("terms", k, i, j, m)
    terms = None if memo is None else memo.get(key)
    if terms is None:
        terms = stage_terms(table, space, k, ii, jj, np.array([table.workspace[k, i:j].max()]),
                            m)
        if memo is not None:
            memo[key] = terms
    if any(cross):
        x = (cross[0] * crossing_s(space, terms.cuts - terms.cout)
             + cross[1] * crossing_s(space, terms.cout))
        terms = replace(terms, comm=terms.comm + x)
    hp, full = st.host, st.full and r > 1
    grad = float(table.grad_bytes[i, j])
    g, rr = np.array([grad]), np.array([r])
    gather, scatter = shard_s(space, terms.params, g, rr, rho) if full else (0.0 * g, 0.0 * g)
    t = float(terms.time(rho, hp, (gather, scatter) if full else None)[0])
    ar = float(allreduce_s(space, g, rr, zeta)[0])
    opt, acc = float(range_sum(table.optimizer_s, ii, jj)[0]), float(
        range_sum(table.accumulate_s, ii, jj)[0])
    up = update_s(space, g, np.array([opt]), rr, zeta, omega, hp, full)
    # without the host traffic
    base = update_s(space, g, np.array([opt]), rr, zeta, full=full)
    u = float(bottleneck_s(m, np.array([t]), np.array([acc]), up)[0])
    saved = state_saved(space, g, rr, zeta, omega)
    tr = after_transient(space, g, rr, zeta, omega, full)
    host = float((host_bytes(space, terms.params, g) if hp
                  else host_state(space, g, rr, zeta, omega))[0])
    # host_params: the device holds two windows of parameters and one of gradients
    window = float(terms.window[0])
    whole = 1 - 1 / r  # fully sharded: the tensors shared with other stages stay whole
    params, grads = (2 * window, window) if hp else (
        float(table.param_bytes[i, j]) / r + whole * float(terms.apart_p[0]) + 2 * window,
        grad / r + whole * float(terms.apart_g[0]) + window) if full else (
        float(table.param_bytes[i, j]), grad)
    cuts = float(terms.cuts[0])
    act = float(terms.held(rho)[0])
    cout = float(terms.cout[0])
    rerun, selective = reruns(rho), rho == SELECTIVE
    kept = float(kept_cuts(np.array([cuts]), np.array([cout]), n, rerun)[0])
    keep = terms.keep if selective else None
    held = float(held_bytes(np.array([grads]), np.array([act]), np.array([cuts]),
                            np.array([cout]), n, m, rerun, keep)[0])
    # activations: one micro-batch's (recomputing), or n micro-batches' (what selective
    # recomputation keeps of each, and one micro-batch's rebuilt in its backward)
    acts = act if rerun else n * float(terms.keep[0]) + act if selective else n * act
    casts = float(terms.shared_casts(rho)[0])  # weight copies the micro-batches share
    # the largest transient: an op's workspace, or the all-reduce's copy beyond what the
    # backwards held (memory = fixed + max(held + ws, G + tr))
    ws = max(float(terms.ws[0]), grads + float(tr[0]) - held)
    state = 0.0 if hp else grad * space.optimizer_state_factor - float(saved[0]) + (
        whole * float(terms.apart_s[0]) if full else 0.0)
    fetch = float(terms.fetch_s(rho)[0]) if hp else float(gather[0])
    step_s = float(host_step_s(space, g)[0])  # host_params: the optimizer step on the host
    cost = StageCost(
        samples=q, fwd_s=float(table.fwd[k, i:j].sum()), bwd_s=float(table.bwd[k, i:j].sum()), comm_s=float(terms.comm[0]),
        allreduce_s=0.0 if full else ar,
        optimizer_s=step_s if hp else opt / r if zeta else opt,
        accumulate_s=acc, gather_s=float(base[0]) - ar - opt / r if zeta and not full else 0.0,
        zero=zeta, full=full, scatter_s=float(scatter[0]),
        offload=omega, host_s=float(up[0] - ar - step_s if hp else up[0] - base[0]),
        host_state=round(host), host=hp, fetch_s=fetch, fetch_overlap=space.host_overlap,
        window=round(window) if hp or full else 0,
        memory=MemoryEstimate(
            params=round(params), grads=round(grads), optimizer_state=round(state),
            activations=round(acts + casts), comm_buffers=round(kept), workspace=round(ws),
            outputs=round(float(outputs_held(table, space, k, ii, jj, m)[0])),
            overlap=round(grads + acts + kept - held)),
        recompute=rerun, selective=selective, in_flight=n,
        recompute_s=float(terms.recomputed(rho)[0]),
    )
    mem = float((terms.memory(n, rho, tr, hp, rr if full else None)
                 - (0.0 if hp else saved))[0])
    if zb:  # ZB-H1: its corner (``zb_view.ZeroBubble``)
        if rho or hp or full:
            raise ValueError(f"stage {st} recomputes or keeps its parameters on the host: "
                             "ZB-H1 costs it off its lists (evaluate's lanes)")
        nw, w = int(terms.zbh1_whole(n)[0]), float(terms.wheld[0])
        acts = nw * act + (zb - nw) * w
        mem = float((terms.memory_zbh1(n, zb, tr) - saved)[0])
        cost = replace(cost, in_flight=zb, memory=cost.memory.model_copy(update=dict(
            activations=round(acts + casts), comm_buffers=round(nw * cuts), overlap=0,
            workspace=round(max(float(terms.ws[0]), float(tr[0]) - acts - nw * cuts)))))
    if split:
        tz, uz = terms.zbh1_times(rho, np.array([acc]), up, queue)
        t, u = float(tz[0]), float(uz[0])
    if host > space.host_budget:  # offloaded state the host cannot hold
        mem = math.inf
    if blocked(table, space.global_batch, m, r, ii, jj)[0]:  # a block that cannot run q
        mem = math.inf
    # what its backward rebuilds: recomputing, its activations and outputs; selectively,
    # the activations no kept op made
    rebuilt, rebuilt_out = (act, cout) if rerun else (act, 0.0) if selective else (0.0, 0.0)
    each = float(terms.keep[0]) if selective else act  # a micro-batch's, held whole
    return cost, t, u, mem, (each, cuts, cout, rebuilt, rebuilt_out, float(terms.wheld[0]))


def plan_step(ts: Sequence[float], us: Sequence[float]) -> float:
    """step = sum_s t_s + max_s u_s, summed in stage order (the search sums the same way)."""
    return sum(ts) + max(us)


def evaluate(table: CostTable, space: SearchSpace, stages: tuple[StageChoice, ...],
             micro_batches: int, schedule: str = GPIPE.name, *,
             lanes: Sequence[Sequence[int]] | None = None,
             in_flight_counts: Sequence[int] | None = None,
             lane_units: Sequence[Sequence[Sequence[tuple[float, float, float]]] | np.ndarray]
             | None = None,
             memo: dict[Any, Any] | None = None,
             ) -> Evaluation:
    """Predicted step time and per-stage costs of a plan; ``fits`` checks the memory budget.

    Each stage recomputes as its ``StageChoice.recompute`` says. The schedules the search
    does not cost itself -- ZB-H1 (``"zbh1"``, ``planner/zb_choice.py``) and those with
    several stages a lane (``"interleaved"``, ``"zbv"``: ``planner/virtual.py``) -- give the
    stages of each lane (``lanes``: they share its ranks, so the replica counts of one lane
    count once and their memory adds up against the budget), the micro-batches each stage
    holds (``in_flight_counts``, counted off the schedule) and ``lane_units``, per lane, the
    micro-batches each of its stages holds at every point of the lane's list
    (``lane_memory``): a lane's stages reach their peaks at different points, so the lane's
    memory is the largest sum, not the sum of the largest. Their step is the simulator's,
    the formula's here only a lower bound.

    A plan with a stage holding a block that cannot run a size its micro-batches hold
    (``cost_model.blocked``) does not fit.

    ``memo``: a dict the caller keeps across calls with the same table, space, micro-batch
    count and schedule, in which each stage's costs are kept (a caller trying one change
    at a time to many stages costs each stage once).
    """
    m, end = micro_batches, 0
    # ZB-H1 without lanes: the search's own, its closed form (stages that do not recompute)
    kind = kind_of(schedule)
    closed = kind is ZBH1 and lanes is None and lane_units is None
    listed = not kind.plain and not closed  # counted off the schedule's own lists
    if listed and (lanes is None or in_flight_counts is None or lane_units is None):
        raise ValueError(f"schedule={schedule!r} needs the lanes, each stage's in-flight count "
                         "and what each lane holds along its list (lane_units)")
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
    cross = crossings(space, stages, lanes)
    zb = min(m, S) if closed else 0
    counts = (list(in_flight_counts) if in_flight_counts is not None
              else [min(zb, S - s) if zb else in_flight(schedule, m, S - s)
                    for s in range(S)])
    def cost(st: StageChoice, n: int, x: tuple[bool, bool]) -> Any:
        args = (st, m, n, zb, kind is ZBH1, S > 2, x)
        if memo is None:
            return _stage(table, space, kidx, *args)
        if args not in memo:
            memo[args] = _stage(table, space, kidx, *args, memo=memo)
        return memo[args]

    got = [cost(st, counts[s], cross[s]) for s, st in enumerate(stages)]
    step = plan_step([g[1] for g in got], [g[2] for g in got])
    costs = [g[0] for g in got]
    if lane_units is None:
        return Evaluation(step, tuple(costs), all(
            sum(got[s][3] for s in lane) <= space.memory_budget for lane in lanes))
    fits = not any(blocked(table, space.global_batch, m, st.replicas, np.array([st.start]),
                           np.array([st.end]))[0] for st in stages)
    for lane, units in zip(lanes, lane_units, strict=True):
        shares = lane_memory([costs[s] for s in lane], [got[s][4] for s in lane], units)
        shares = held_once(table, space, [stages[s] for s in lane], shares)
        for s, c in zip(lane, shares, strict=True):
            costs[s] = c
        fits = fits and sum(c.memory.total for c in shares) <= space.memory_budget and \
            sum(c.host_state for c in shares) <= space.host_budget
    return Evaluation(step, tuple(costs), fits)


def crossings(space: SearchSpace, stages: Sequence[StageChoice],
              lanes: Sequence[Sequence[int]]) -> list[tuple[bool, bool]]:
    """Per stage, whether its in- and out-boundary cross nodes: the ranks of the stages on
    both sides (each lane's, lanes laid out in order) do not all lie in one node. ValueError
    where a lane's ranks lie over part of a node (``nodes.legal``)."""
    S = len(stages)
    if not multi_node(space):
        return [(False, False)] * S
    if space.rank_order == PIPELINES:  # replica k's pipeline on ranks kS .. kS + S - 1
        if any(len(lane) > 1 for lane in lanes):
            raise ValueError("rank_order='pipelines' lays out one stage a lane")
        return [crossing_at(space, s, 0, st.replicas, S) for s, st in enumerate(stages)]
    N, first, ranks = space.devices_per_node, 0, [(0, 0)] * S
    for lane in lanes:
        r = stages[lane[0]].replicas
        if not legal(space, first, r):
            raise ValueError(f"stages {list(lane)} on ranks {first}..{first + r - 1} lie over "
                             f"part of a node of {N} devices: a stage lies inside one node or "
                             "over whole nodes")
        for s in lane:
            ranks[s] = (first, first + r)
        first += r

    def apart(a: tuple[int, int], b: tuple[int, int]) -> bool:  # not both in one node
        return min(a[0], b[0]) // N != (max(a[1], b[1]) - 1) // N

    return [(s > 0 and apart(ranks[s - 1], ranks[s]),
             s < S - 1 and apart(ranks[s], ranks[s + 1])) for s in range(S)]


def held_once(table: CostTable, space: SearchSpace, stages: Sequence[StageChoice],
              costs: Sequence[StageCost]) -> list[StageCost]:
    """A lane's stages with a tensor that several of them use (``table.shared``) counted on
    the first only: the lane's ranks hold one copy of it, one gradient and one optimizer
    state, and reduce and step it once (ZBV puts the first stage, with a tied embedding, and
    the last, with the LM head tied to it, on one lane)."""
    out = list(costs)
    for blocks, pb, gb, opt_s in table.shared:
        users = [k for k, st in enumerate(stages) if any(st.start <= b < st.end for b in blocks)]
        for k in users[1:]:
            st, c = stages[k], out[k]
            if st.host or st.full:  # fetched per use, counted as windows
                continue
            r = st.replicas
            zeta = st.zero and r > 1
            state = gb * space.optimizer_state_factor / (r if zeta else 1)
            host = state if st.offload else 0.0
            grads = c.memory.grads - round(gb)
            # the all-reduce of what gradients the stage has left (none: no all-reduce)
            ar = float(allreduce_s(space, np.array([float(grads)]), np.array([r]), zeta)[0])
            memory = c.memory.model_copy(update=dict(
                params=round(c.memory.params - pb), grads=grads,
                optimizer_state=round(c.memory.optimizer_state - (state - host))))
            out[k] = replace(c, memory=memory, host_state=round(c.host_state - host),
                             allreduce_s=ar if grads > 0 else 0.0,
                             optimizer_s=max(0.0, c.optimizer_s - (opt_s / r if zeta else opt_s))
                             if grads > 0 else 0.0)
    return out


def lane_memory(costs: Sequence[StageCost],
                per_mb: Sequence[tuple[float, float, float, float, float, float]],
                units: Sequence[Sequence[tuple[float, float, float]]] | np.ndarray
                ) -> list[StageCost]:
    """The stages of one lane with their memory as shares of the lane's peak.

    ``per_mb[s]``: one micro-batch's activations A (what it keeps of them where the stage
    recomputes selectively), cut values in and out c, out alone o, the activations and
    outputs its backward rebuilds beside what it holds (recomputing: A and o; selectively:
    the activations no kept op made, and none), and w, what it holds between a split
    backward's ``B`` and its ``W`` (``CostTable.wheld``: what ``W`` reads and the gradients
    ``B`` keeps for it);
    ``units[t][s]``: at point t of the lane's list, the micro-batches stage s holds only the
    inputs of (a recomputing stage's, forward to backward), those it holds whole
    (activations and cut values: forward to a backward, counted whole during a split ``B``,
    which frees what ``W`` does not read as it makes the gradients it keeps), and those
    between a split ``B`` and their ``W``. The lane holds every stage's parameters,
    gradients, optimizer state and outputs, the largest workspace, at its peak point t* the
    sum over stages of inputs * (c - o) + whole * (A + c) + split * w, and, where a stage
    recomputes without a split backward, once for the lane the largest A + o (one
    micro-batch's activations during its backward; selectively, its A). Each stage gets its part at t*, so that the
    stages' memory adds up to the lane's.
    """
    u = np.asarray(units, dtype=float)  # (points, stages, 3)
    a_, c_, o_, w_ = (np.array([x[k] for x in per_mb]) for k in (0, 1, 2, 5))
    peak = u[int(np.argmax((u[:, :, 0] * (c_ - o_) + u[:, :, 1] * (a_ + c_)
                            + u[:, :, 2] * w_).sum(axis=1)))]
    # a recomputing stage whose backward is split holds what R rebuilt as ``whole`` units;
    # the others' backwards are the transient
    rc = [s for s, c in enumerate(costs)
          if (c.recompute and not u[:, s, 1].any()) or c.selective]
    transient = max(rc, key=lambda s: per_mb[s][3] + per_mb[s][4], default=None)
    widest = max(range(len(costs)), key=lambda s: costs[s].memory.workspace)
    out = []
    for s, c in enumerate(costs):
        a, cuts, o, rebuilt, rebuilt_out, w = per_mb[s]
        if s != transient:
            rebuilt = rebuilt_out = 0.0
        inputs, whole, split = (float(x) for x in peak[s])
        act = whole * a + split * w + rebuilt
        comm = inputs * (cuts - o) + whole * cuts + rebuilt_out
        out.append(replace(c, memory=c.memory.model_copy(update=dict(
            activations=round(act), comm_buffers=round(comm), overlap=0,
            workspace=c.memory.workspace if s == widest else 0))))
    return out
