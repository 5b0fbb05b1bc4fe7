"""Whether ZB-H1 pays: the searched plan's stages under the zero-bubble schedule, simulated.

The search's programs cost GPipe and 1F1B exactly. ZB-H1 (``runtime/schedule.py``: 1F1B's
order with each backward split into ``B`` and ``W``) runs the same stages; what differs is
its memory and its step. Its memory is counted off its own lists as interleaved 1F1B's and
ZBV's are (``virtual.held_units``, ``search.evaluate.lane_memory``, one stage a lane): a
stage holds a micro-batch whole from its ``F`` to its ``B``, then until its ``W`` what the
weight GEMMs read and the gradients kept for them (``CostTable.wheld``); recomputing, only
its inputs until ``B``, then the same of what ``R`` rebuilt until ``W``. Its step is the simulator's, on
the plan's per-stage costs (``B`` and ``W`` each their share of a backward, plus what
splitting costs: ``simulate.SPLIT_OVERHEAD``). So the searched plan is rebuilt as ZB-H1
(each stage recomputing as the search chose) where that fits the memory budget, and kept
only where its simulated step is shorter than the searched schedule's: a one-stage plan, or
one whose bottleneck stage leaves no bubble worth filling, stays as it is. (Recomputing more
stages to make it fit would rarely pay: the stage ZB-H1 fills up is the last, which holds
the held-back weight backwards' rebuilt activations recomputing or not.)

Not exact over all plans (a plan the search rejected for 1F1B might be best under ZB-H1);
the search costing ZB-H1 itself is the next step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from ..passes.search import SearchResult
from ..passes.search.evaluate import evaluate
from ..passes.search.model import Evaluation, StageChoice
from ..plan import Plan
from ..progress import note
from ..runtime.actions import in_flight
from ..runtime.schedule import make_schedule
from .analyze import Analysis
from .virtual import held_units

__all__ = ["zero_bubble", "zbh1_evaluation"]

log = logging.getLogger("rannc_fx")


def zero_bubble(a: Analysis, result: SearchResult, plan: Plan,
                build: Callable[[SearchResult], Plan]) -> Plan:
    """``plan`` (built from ``result``), or its ZB-H1 variant where that fits and its
    simulated step is shorter (or where ``Config(schedule="zbh1")`` asks for it and it fits)."""
    forced = a.config.schedule == "zbh1"
    if not forced and (a.config.schedule is not None or "1f1b" not in a.space.schedules):
        return plan  # a schedule named, or a model that cannot run the step in the call
    if len(result.stages) < 2 and not forced:
        return plan
    stages, m = result.stages, result.micro_batches
    if any(st.host for st in stages):  # parameters in host memory: GPipe and 1F1B only
        return plan
    if any(st.layers or st.selective for st in stages):  # recomputing inside one backward
        if forced:
            raise ValueError(
                "schedule='zbh1' splits each backward in two (B, W), and the searched plan "
                "recomputes stages "
                f"{[s for s, st in enumerate(stages) if st.layers or st.selective]} layer by "
                "layer or selectively, which reruns forwards inside one backward; use "
                "Config(recompute_layers=False, recompute_selective=False) with "
                "schedule='zbh1', or another schedule")
        return plan
    ev = zbh1_evaluation(a, stages, m)
    if not ev.fits:
        if forced:
            raise ValueError(
                "schedule='zbh1' holds on each stage the micro-batches its 1F1B order keeps in "
                "flight plus those whose weight backwards it holds back (up to one a stage "
                "before it, each with the gradients its weight GEMMs read), and the searched "
                "plan's stages do not fit that in the memory budget; use schedule='1f1b' or "
                "None (searched), or give the devices more memory"
            )
        return plan
    zb = build(dataclasses.replace(result, stages=stages, schedule="zbh1", evaluation=ev))
    before, after = plan.simulated_step_ms or 0.0, zb.simulated_step_ms or 0.0
    if forced or after < before:
        note("plan: ZB-H1 (split backward) on the searched stages: simulated step %.2f ms "
             "against %.2f ms with %s%s", after, before, plan.schedule,
             "" if after < before else " (named in Config)")
        return zb
    return plan


def zbh1_evaluation(a: Analysis, stages: tuple[StageChoice, ...], m: int) -> Evaluation:
    """``stages`` under ZB-H1 with ``m`` micro-batches: each stage's memory at the peak of
    what its list holds (``held_units``), the step by 1F1B's formula (the simulator's is the
    plan's)."""
    S = len(stages)
    sched = make_schedule("zbh1", S, m)
    return evaluate(a.table, a.space, stages, m, "zbh1", lanes=[[s] for s in range(S)],
                    in_flight_counts=[in_flight(sched[s], s) for s in range(S)],
                    lane_units=[held_units(sched[s], [s], [st.recompute])
                                for s, st in enumerate(stages)])
