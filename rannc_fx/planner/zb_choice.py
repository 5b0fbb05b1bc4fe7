"""Whether ZB-H1 pays: the search's own ZB-H1 plan, or the searched plan's stages under the
zero-bubble schedule, simulated.

ZB-H1 (``schedules/generators.py``: 1F1B's order with each backward split into ``B`` and ``W``)
differs from 1F1B in its memory and its step. Two plans are tried:

* the search's optimum under ZB-H1 (``search_pass`` with ``schedules=("zbh1",)``,
  ``search.zerobubble``): exact over stage boundaries, replicas, micro-batches,
  sharding and offloading, for stages that do not recompute and keep their parameters on
  the device, with ZB-H1's memory in closed form (``StageTerms.memory_zbh1``: what its lists
  hold at their two corners) and its step by the closed form for equal stages
  (``StageTerms.zbh1_times``);
* the searched plan's stages as ZB-H1, each recomputing as the search chose, memory counted
  off its own lists as interleaved 1F1B's and ZBV's are (``virtual.held_units``,
  ``search.evaluate.lane_memory``, one stage a lane: a micro-batch whole from its ``F`` to
  its ``B``, then until its ``W`` what the weight GEMMs read and the gradients kept for
  them, ``CostTable.wheld``; recomputing, only its inputs until ``B``, then the same of
  what ``R`` rebuilt until ``W``).

Each is built where it fits, and the shorter by the simulator (``B`` and ``W`` each their
share of a backward, plus what splitting costs) replaces the searched plan only where its
simulated step is shorter: a one-stage plan, or one whose bottleneck stage leaves no bubble
worth filling, stays as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from ..plan.plan import Plan
from ..progress import note
from ..schedules.actions import in_flight
from ..schedules.kinds import ONE_F_ONE_B, ZBH1, kind_of
from ..search import NoFeasiblePlan, SearchResult, search_pass
from ..search.evaluate import evaluate
from ..search.problem import Evaluation, StageChoice
from .analyze import Analysis
from .virtual import held_units

__all__ = ["searched", "step_ms", "zbh1_evaluation", "zero_bubble"]

log = logging.getLogger("rannc_fx")


def zero_bubble(a: Analysis, result: SearchResult, plan: Plan,
                build: Callable[[SearchResult], Plan]) -> Plan:
    """``plan`` (built from ``result``, or a schedule tried on its lanes), or a ZB-H1 plan
    where one fits and its simulated step is shorter (or where ``Config(schedule="zbh1")``
    asks for it and one fits): the search's own ZB-H1 optimum (``searched``, predicted
    shorter than both ``result`` and ``plan``), or ``result``'s stages run as ZB-H1
    (``_on_stages``), whichever the simulator finds shorter."""
    forced = a.config.schedule is not None and kind_of(a.config.schedule) is ZBH1
    if not forced and (a.config.schedule is not None
                       or ONE_F_ONE_B.name not in a.space.schedules):
        return plan  # a schedule named, or a model that cannot run the step in the call
    if len(result.stages) < 2 and not forced:
        return plan
    why: list[str] = []
    own = searched(a, build, None if forced else result,
                   None if forced else 1e-3 * step_ms(plan))
    found = [(p, how) for p, how in ((own, "searched"),
                                     (_on_stages(a, result, build, why), "on the searched stages"))
             if p is not None]
    if not found:
        if forced:
            raise ValueError(why[0] if why else
                             "schedule='zbh1' found no plan: the search's ZB-H1 plans (stages "
                             "that do not recompute, parameters on the device) do not fit")
        return plan
    zb, how = min(found, key=lambda x: step_ms(x[0]))
    before, after = step_ms(plan), step_ms(zb)
    if forced or after < before:
        note("plan: ZB-H1 (split backward, %s): simulated step %.2f ms against %.2f ms with "
             "%s%s", how, after, before, plan.schedule,
             "" if after < before else " (named in Config)")
        return zb
    return plan


def step_ms(plan: Plan) -> float:
    """The plan's step: the simulator's, where its schedule was simulated."""
    return plan.simulated_step_ms or plan.predicted_step_ms


def searched(a: Analysis, build: Callable[[SearchResult], Plan],
             result: SearchResult | None = None, best_s: float | None = None) -> Plan | None:
    """The search's optimum under ZB-H1 (``search_pass`` with ``schedules=("zbh1",)``: its
    stages do not recompute and keep their parameters on the device), built; None where
    no such plan fits, or (given the searched ``result``, and ``best_s``, the simulated step
    of the best plan so far) none is predicted shorter than either (its closed form against
    the result's formula, and against that step: the closed form is the simulator's step on
    equal stages and below it on the plans measured, so a plan it puts above cannot win;
    the search then prunes from the start)."""
    below = min(result.evaluation.step_s if result is not None else math.inf,
                best_s if best_s is not None else math.inf)
    try:
        zb = search_pass(a.table, dataclasses.replace(a.space, schedules=(ZBH1.name,)),
                         below=below)
    except NoFeasiblePlan:
        return None
    return build(zb)


def _on_stages(a: Analysis, result: SearchResult, build: Callable[[SearchResult], Plan],
               why: list[str]) -> Plan | None:
    """``result``'s stages (recomputing as the search chose) as ZB-H1, built where they fit;
    else None, with the reason in ``why``."""
    stages, m = result.stages, result.micro_batches
    if any(st.host or st.full for st in stages):  # fetched per use: GPipe and 1F1B only
        return None
    if any(st.layers or st.selective for st in stages):  # recomputing inside one backward
        why.append(
            "schedule='zbh1' splits each backward in two (B, W), and the searched plan "
            "recomputes stages "
            f"{[s for s, st in enumerate(stages) if st.layers or st.selective]} layer by "
            "layer or selectively, which reruns forwards inside one backward, and no plan "
            "of stages that do not recompute fits; use Config(recompute_layers=False, "
            "recompute_selective=False) with schedule='zbh1', or another schedule")
        return None
    ev = zbh1_evaluation(a, stages, m)
    if not ev.fits:
        why.append(
            "schedule='zbh1' holds on each stage the micro-batches its 1F1B order keeps in "
            "flight plus those whose weight backwards it holds back (up to one a stage "
            "before it, each with the gradients its weight GEMMs read), and neither the "
            "searched plan's stages nor any plan of stages that do not recompute fit that in "
            "the memory budget; use schedule='1f1b' or None (searched), or give the devices "
            "more memory")
        return None
    return build(dataclasses.replace(result, stages=stages, schedule=ZBH1.name, evaluation=ev))


def zbh1_evaluation(a: Analysis, stages: tuple[StageChoice, ...], m: int) -> Evaluation:
    """``stages`` under ZB-H1 with ``m`` micro-batches: each stage's memory at the peak of
    what its list holds (``held_units``), the step by ZB-H1's closed form
    (``StageTerms.zbh1_times``; the simulator's is the plan's)."""
    S = len(stages)
    sched = ZBH1.make(S, m)
    return evaluate(a.table, a.space, stages, m, ZBH1.name, lanes=[[s] for s in range(S)],
                    in_flight_counts=[in_flight(sched[s], s) for s in range(S)],
                    lane_units=[held_units(sched[s], [s], [st.recompute])
                                for s, st in enumerate(stages)])
