"""Whether ZB-H1 pays: the searched plan's stages under the zero-bubble schedule, simulated.

The search's programs cost GPipe and 1F1B exactly. ZB-H1 (``runtime/schedule.py``: 1F1B's
order with each backward split into ``B`` and ``W``) runs the same stages; what differs is
its memory (``search.model.in_flight``: a held ``W`` keeps its micro-batch's activations and
the gradients its weight GEMMs read; stages that recompute are not costed for it, so such a
plan stays as it is) and its step, which the simulator times on the plan's per-stage costs (``B`` and ``W`` half a
backward each, plus what splitting costs: ``simulate.SPLIT_OVERHEAD``). So the searched plan
is rebuilt as ZB-H1 where that fits the memory budget, and kept only where its simulated step
is shorter than the searched schedule's: a one-stage plan, or one whose bottleneck stage
leaves no bubble worth filling, stays as it is.

Not exact over all plans (a plan the search rejected for 1F1B might be best under ZB-H1);
the search costing ZB-H1 itself is the next step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from ..passes.search import SearchResult
from ..passes.search.evaluate import evaluate
from ..plan import Plan
from .analyze import Analysis

__all__ = ["zero_bubble"]

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
    if any(s.recompute for s in result.stages):
        if forced:
            raise ValueError(
                "schedule='zbh1' with recomputation: a held weight backward keeps its recomputed "
                "activations, which the cost model does not count yet; use recompute=False, or "
                "schedule='1f1b' or None (searched)"
            )
        return plan
    ev = evaluate(a.table, a.space, result.stages, result.micro_batches, "zbh1")
    if not ev.fits:
        if forced:
            raise ValueError(
                "schedule='zbh1' holds up to min(m, S) micro-batches on every stage (until their "
                "weight backwards), and the searched plan's stages do not fit that in the memory "
                "budget; use schedule='1f1b' or None (searched), or give the devices more memory"
            )
        return plan
    zb = build(dataclasses.replace(result, schedule="zbh1", evaluation=ev))
    before, after = plan.simulated_step_ms or 0.0, zb.simulated_step_ms or 0.0
    if forced or after < before:
        log.info("plan: ZB-H1 (split backward) on the searched stages: simulated step %.2f ms "
                 "against %.2f ms with %s%s", after, before, plan.schedule,
                 "" if after < before else " (named in Config)")
        return zb
    return plan
