"""Several stages a lane: interleaved 1F1B or ZBV on the searched plan's lanes and on every
equal split of the ranks into lanes, simulated.

The search picks ``P`` stages, their replica counts and the micro-batch count for GPipe or
1F1B. Interleaved 1F1B with ``v`` stages a lane (``schedules/virtual.py``) or ZBV
(``v = 2``, a V over the lanes, backwards split) take ``P`` lanes, their replica counts and
``m`` (the searched plan's, or another split of the ranks, ``lanes.lane_choices``), and cut
the blocks into ``v P`` stages, stage ``s`` on the lane the schedule puts it
(``plan.lane_layout``):

- the boundaries minimize the slowest stage's time per micro-batch (forward, backward,
  messages, and the forward again where its lane recomputes), each stage costed at the
  samples per replica of its lane: an exact min-max program over the block chain;
- each stage holds as many micro-batches as the schedule's own list keeps in flight for it,
  point by point (``held_units``; between a split backward's ``B`` and its ``W`` a
  micro-batch holds what its ``W`` reads, ``CostTable.wheld``), and a lane's memory is its
  stages' at the point where their sum peaks (``search.evaluate.lane_memory``), against the
  memory budget;
  where a lane does not fit, its stages first shard their optimizer state over the lane's
  replicas (ZeRO-1, unless ``Config.zero`` is set), then its stage holding the most
  activations recomputes, one at a time, the boundaries balanced again each time (unless
  ``Config.recompute`` is set): selectively first (interleaved 1F1B only: ZBV splits the
  backward it reruns in), then whole; then each recomputing stage, and after them each
  sharding stage, whose lane fits without runs without (or, recomputing whole, selectively);
  where a lane sharding and recomputing everything does not fit the variant is dropped;
- the step is the simulator's (no closed form: the order of a lane's stages is the point).
  A recomputing stage under ZBV holds a micro-batch's inputs until its ``B``, and from its
  ``B`` to its ``W`` what ``W`` reads of what ``R`` rebuilt (``held_units``).

``virtual_variants`` is called after the search (and before ``zero_bubble``): every variant
is cut, then built and simulated in the order of a lower bound of its step
(``lanes.step_bound``) until that bound reaches the best step so far; a variant replaces the
plan only where its simulated step is shorter, so a plan whose bubble is already small
stays as it is. Exact over the lanes tried, not over all plans: lanes of unequal replica
counts other than the searched plan's are not tried, and a variant's stages are balanced
for time, then made to fit, not searched over both at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..plan.plan import Plan, lane_layout
from ..progress import note
from ..schedules.actions import Action, Kind, in_flight
from ..schedules.kinds import KINDS, ONE_F_ONE_B, kind_of, make_schedule
from ..schedules.simulate import ScheduleError
from ..search import SearchResult
from ..search.cost_model import blocked, range_max, samples_per_replica, size_index
from ..search.evaluate import evaluate
from ..search.nodes import PIPELINES
from ..search.problem import Evaluation, StageChoice
from ..search.terms import SELECTIVE, stage_terms
from .analyze import Analysis
from .lanes import Lanes, lane_choices, step_bound, work_s

__all__ = ["balanced_stages", "held_units", "virtual_variants"]

log = logging.getLogger("rannc_fx")

VIRTUAL = (2, 3, 4)  # stages a lane the search tries interleaved 1F1B with


def virtual_variants(a: Analysis, result: SearchResult, plan: Plan,
                     build: Callable[[SearchResult], Plan]) -> Plan:
    """``plan``, or the interleaved (``VIRTUAL`` stages a lane) or ZBV plan with the shortest
    simulated step where that is shorter (or the shortest of the one ``Config.schedule``
    names, where one fits), on the searched plan's lanes and the others of
    ``lanes.lane_choices``, bounded (``lanes.work_s``, ``lanes.step_bound``)."""
    named = None if a.config.schedule is None else kind_of(a.config.schedule)
    forced = named is not None and named.several_a_lane
    if a.space.rank_order == PIPELINES:  # one stage a lane, each pipeline on its own ranks
        if forced:
            raise ValueError(f"schedule={a.config.schedule!r} puts several stages on a lane; "
                             "laid out by pipelines a lane holds one: use rank_order='stages'")
        return plan
    if named is not None and not forced:
        return plan
    if ONE_F_ONE_B.name not in a.space.schedules and not forced:
        return plan  # the step cannot run in the call (several losses, a tail)
    searched = len(result.stages)
    # every schedule with several stages a lane, at each count it may hold
    candidates: list[tuple[str, int]] = [
        (k.name, v) for k in KINDS.values() if k.several_a_lane
        for v in (VIRTUAL if k.lane_stages is None else (k.lane_stages,))]
    if named is not None and forced:
        candidates = [(named.name, named.lane_stages or a.config.virtual_stages or 2)]
    choices = lane_choices(a, result)
    # named: the shortest plan of that schedule, however long; else shorter than ``plan``
    best: Plan | None = None if forced else plan
    best_s = math.inf if forced else 1e-3 * (plan.simulated_step_ms or plan.predicted_step_ms)
    why: str | None = None
    tried = False
    # every variant cut (cheap), then built and simulated best bound first, until the
    # bound reaches the best step found
    cut: list[tuple[float, int, str, int, Lanes, SearchResult]] = []
    for k, lanes in enumerate(choices):
        if k and work_s(a, lanes) >= best_s:
            continue  # no plan on these lanes can be shorter
        base = result if not k else dataclasses.replace(
            result, stages=tuple(StageChoice(0, 0, r) for r in lanes.replicas),
            micro_batches=lanes.m)
        for schedule, v in candidates:
            no = _ineligible(len(lanes.replicas), v, a.table.num_blocks)
            if no is not None:
                why = why or no
                continue
            tried = True
            got = _variant(a, base, schedule, v)
            if got is not None:
                cut.append((step_bound(got.evaluation, lane_layout(schedule, len(got.stages), v),
                                       lanes.m, kind_of(schedule).splits_backward),
                            k, schedule, v, lanes, got))
    for bound, k, schedule, v, lanes, got in sorted(cut, key=lambda x: x[:4]):
        if bound >= best_s:
            break
        try:
            candidate = build(got)
        except ScheduleError as e:  # lowering could not match the lanes' messages
            if forced:
                raise
            note("plan: %s skipped: %s", schedule, e)
            continue
        after = 1e-3 * (candidate.simulated_step_ms or math.inf)
        if after < best_s:
            note("plan: %s with %d stages a lane on %d lanes (%s, m=%d): simulated step "
                 "%.2f ms against %.2f ms (%s)", schedule, v, len(lanes.replicas),
                 "the searched ones" if not k else f"{lanes.replicas[0]} ranks each",
                 lanes.m, 1e3 * after, 1e3 * best_s,
                 "none yet" if best is None else best.schedule)
            best, best_s = candidate, after
    if best is None:
        schedule, v = candidates[0]
        if not tried:
            raise ValueError(f"schedule={schedule!r}: {why}")
        raise ValueError(
            f"schedule={schedule!r} with {v} stages a lane does not fit the memory budget on "
            f"the searched {searched} lanes (replicas {[s.replicas for s in result.stages]}, "
            f"m={result.micro_batches})"
            + (f" nor on any of {len(choices) - 1} other splits of the ranks into lanes"
               if len(choices) > 1 else "")
            + " (with every stage of a lane recomputing where needed, unless Config.recompute "
            "says otherwise: a lane holds more micro-batches of its first stage than 1F1B's "
            "first stage); use schedule='1f1b' or None (searched), or give the devices more "
            "memory")
    return best


def _ineligible(lanes: int, v: int, blocks: int) -> str | None:
    if lanes < 2:
        return "the searched plan has one stage: there is no pipeline to interleave"
    if v * lanes > blocks:
        return f"{v * lanes} stages need as many blocks, the model has {blocks}"
    return None


def _variant(a: Analysis, result: SearchResult, schedule: str, v: int) -> SearchResult | None:
    lanes = len(result.stages)
    if any(st.host or st.full for st in result.stages):  # fetched per use: one stage a lane
        return None
    layout = lane_layout(schedule, v * lanes, v)
    lane_of = {s: p for p, held in enumerate(layout) for s in held}
    reps = [result.stages[lane_of[s]].replicas for s in range(v * lanes)]
    m = result.micro_batches
    sched = make_schedule(schedule, v * lanes, m, v)
    counts = [in_flight(sched[lane_of[s]], s) for s in range(v * lanes)]
    seen: dict[tuple[int, tuple[bool, ...]], np.ndarray] = {}
    memo: dict[Any, Any] = {}  # each stage's costs, once (evaluate)

    def units_of(levels: Sequence[int]) -> list[np.ndarray]:
        out = []  # a selectively recomputing stage holds its micro-batches whole, as a plain one
        for k in range(lanes):
            key = (k, tuple(levels[s] in (1, 2) for s in layout[k]))
            if key not in seen:
                seen[key] = np.asarray(held_units(sched[k], layout[k], key[1]), dtype=float)
            out.append(seen[key])
        return out

    # levels: 0 none, SELECTIVE, 1 whole (layer by layer is not costed on lanes: whole)
    selective = (not kind_of(schedule).splits_backward and a.table.kept is not None
                 and a.space.selective is not False)
    whole = a.space.selective is not True
    if not whole and not selective and any(st.level for st in result.stages):
        return None  # ZBV cannot recompute selectively, and the user forbade the rest
    level = [_level(result.stages[lane_of[s]], selective) for s in range(v * lanes)]
    zero = [(result.stages[lane_of[s]].zero or bool(a.space.zero)) and reps[s] > 1
            for s in range(v * lanes)]
    offload = [result.stages[lane_of[s]].offload or bool(a.space.offload)
               for s in range(v * lanes)]
    host = a.space.offload is None and a.space.host_bandwidth is not None and \
        a.space.host_budget > 0
    while True:
        bounds = balanced_stages(a, reps, m, level)
        if bounds is None:
            return None
        stages = tuple(StageChoice(i, j, r, rho in (1, 2), z, o, selective=rho == SELECTIVE)
                       for (i, j), r, rho, z, o in zip(bounds, reps, level, zero, offload,
                                                       strict=True))
        ev = evaluate(a.table, a.space, stages, m, schedule, lanes=layout,
                      in_flight_counts=counts, lane_units=units_of(level), memo=memo)
        if ev.fits:
            # give back what the lanes can hold after all: recomputation, offloading, sharding
            for field, forced in (("recompute", a.config.recompute),
                                  ("offload", a.space.offload), ("zero", a.space.zero)):
                if forced is None:
                    stages, ev = _undo(a, stages, field, m, schedule, layout, counts,
                                       units_of, ev, selective, memo)
            return dataclasses.replace(result, stages=stages, evaluation=ev, schedule=schedule,
                                       virtual_stages=v)
        # each lane over the budget shards its stages' optimizer state, else offloads it,
        # else recomputes its stage that holds the most activations
        more = False
        for lane in layout:
            if sum(ev.stages[s].memory.total for s in lane) <= a.space.memory_budget:
                continue
            unsharded = [s for s in lane if not zero[s] and reps[s] > 1]
            if unsharded and a.space.zero is None:
                for s in unsharded:
                    zero[s] = True
                more = True
                continue
            kept = [s for s in lane if not offload[s]]
            if kept and host:
                for s in kept:
                    offload[s] = True
                more = True
                continue
            if a.config.recompute is None:  # selectively first, then whole
                for now, then in ((0, SELECTIVE), (SELECTIVE, 1), (0, 1)):
                    free = [s for s in lane if level[s] == now]
                    if free and (selective or then != SELECTIVE) and (whole or then != 1):
                        level[max(free, key=lambda s: ev.stages[s].memory.activations)] = then
                        more = True
                        break
        if not more:
            return None


def _level(st: StageChoice, selective: bool) -> int:
    """A searched stage's recomputation on the lanes: layer by layer runs whole there, and
    so does a selective one where the lanes cannot rerun inside a backward (ZBV)."""
    return SELECTIVE if st.selective and selective else 1 if st.level else 0


def _undo(a: Analysis, stages: tuple[StageChoice, ...], field: str, m: int, schedule: str,
          layout: tuple[tuple[int, ...], ...], counts: list[int],
          units_of: Callable[[Sequence[int]], list[np.ndarray]],
          ev: Evaluation, selective: bool = False, memo: dict[Any, Any] | None = None
          ) -> tuple[tuple[StageChoice, ...], Evaluation]:
    """The same boundaries with each stage that recomputes, slowest forward first, or each
    lane whose stages offload or shard (``field``: the lanes took those whole), running
    without where its lane still fits (a stage recomputing whole: else selectively, where
    ``selective``; for sharding, where that is not slower; balancing again could only move
    boundaries the first pass already weighed)."""
    if field == "recompute":
        order = [[s] for s in sorted((s for s, st in enumerate(stages) if st.level),
                                     key=lambda s: -ev.stages[s].fwd_s)]
    else:
        order = [[s for s in lane if getattr(stages[s], field)] for lane in layout]
    for group in (g for g in order if g):
        lighter = [{field: False}]
        if field == "recompute":
            lighter = [{"recompute": False, "selective": False}] + (
                [{"recompute": False, "selective": True}]
                if selective and any(stages[s].recompute for s in group)
                and a.space.selective is not False else [])
        for change in lighter:
            trial = tuple(dataclasses.replace(st, **change) if k in group else st
                          for k, st in enumerate(stages))
            got = evaluate(a.table, a.space, trial, m, schedule, lanes=layout,
                           in_flight_counts=counts,
                           lane_units=units_of([st.level for st in trial]), memo=memo)
            if got.fits and (field != "zero" or got.step_s <= ev.step_s):
                stages, ev = trial, got
                break
    return stages, ev


def held_units(actions: Sequence[Action], lane: Sequence[int],
               recompute: Sequence[bool] | None = None
               ) -> list[tuple[tuple[float, float, float], ...]]:
    """At every point of a lane's compute list, per stage of ``lane`` (in its order), the
    micro-batches it holds only the inputs of, those it holds whole, and those between a
    split backward's B and its W, holding what their W reads (``search.evaluate.lane_memory``;
    during a split B a micro-batch counts whole: B frees what W does not read as it makes the
    gradients it keeps for W):
    a stage that recomputes (``recompute[k]``) holds a micro-batch's inputs from its F to its
    B (during a split B, the whole micro-batch R rebuilt instead); any other holds it whole
    from its F to its B; a split one, then, until its W, what its W reads."""
    rc = list(recompute) if recompute is not None else [False] * len(lane)
    split = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.W}
    pos = {s: k for k, s in enumerate(lane)}
    inputs, whole, pending = [0.0] * len(lane), [0.0] * len(lane), [0.0] * len(lane)

    def point() -> tuple[tuple[float, float, float], ...]:
        return tuple(zip(inputs, whole, pending, strict=True))

    out = [point()]
    for a in actions:
        k = pos[a.stage]
        later = (a.stage, a.microbatch) in split
        if a.kind is Kind.F:
            if rc[k]:
                inputs[k] += 1
            else:
                whole[k] += 1
        elif a.kind is Kind.B:
            if later:  # during B: the micro-batch whole (recomputing: R rebuilt it)
                if rc[k]:
                    inputs[k] -= 1
                    whole[k] += 1
                    out.append(point())
                whole[k] -= 1
                pending[k] += 1
            elif rc[k]:
                inputs[k] -= 1  # its backward's activations: the lane's transient
            else:
                whole[k] -= 1
        elif a.kind is Kind.W:
            pending[k] -= 1
        out.append(point())
    return sorted(set(out))


def balanced_stages(a: Analysis, replicas: list[int], m: int,
                    recompute: Sequence[int]) -> list[tuple[int, int]] | None:
    """Block ranges of ``len(replicas)`` stages in chain order that minimize the slowest
    stage's time per micro-batch, stage ``s`` costed at the samples per replica of its
    ``replicas[s]`` and its recomputation level ``recompute[s]`` (rho: 0, 1, 2 or 3; a bool
    reads as 0 or 1), never one holding a block that cannot run its size (None when the
    table lacks that size, or no such stages exist)."""
    table, space = a.table, a.space
    B, n = table.num_blocks, len(replicas)
    kidx = size_index(table)
    i, j = np.triu_indices(B + 1, k=1)
    cost: dict[tuple[int, int], np.ndarray] = {}
    for r, rho in set(zip(replicas, recompute, strict=True)):
        q = samples_per_replica(space.global_batch, m, r)
        if q not in kidx:
            return None
        k = kidx[q]
        ws = range_max(np.asarray(table.workspace[k], float))[i, j]
        c = np.full((B + 1, B + 1), np.inf)
        c[i, j] = np.where(blocked(table, space.global_batch, m, r, i, j), np.inf,
                           stage_terms(table, space, k, i, j, ws, m).time(int(rho)))
        cost[r, rho] = c
    best = np.full(B + 1, np.inf)
    best[0] = 0.0
    back = np.zeros((n, B + 1), dtype=int)
    for s in range(n):
        # best[j] after s + 1 stages: min over i of max(best[i] before, time of [i, j))
        both = np.maximum(best[:, None], cost[replicas[s], recompute[s]])
        back[s] = np.argmin(both, axis=0)
        best = both[back[s], np.arange(B + 1)]
    if not np.isfinite(best[B]):
        return None
    out, j_end = [], B
    for s in reversed(range(n)):
        i_start = int(back[s, j_end])
        out.append((i_start, j_end))
        j_end = i_start
    return out[::-1]
