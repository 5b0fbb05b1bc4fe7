"""Planning, one front door: a model and its example batch in, a plan and its stages out.

    analyze   capture -> shapes -> profile -> group -> costs: the search's inputs
    build     the Plan from the search's result (stages, cut values, simulated step)
    driver    plan_model (analyze, search, build) and split_stages: what partition() and
              compile() call

The passes themselves live in ``rannc_fx.passes``; this package runs them in order.
"""

from .analyze import Analysis, analyze
from .build import build_plan
from .driver import Planned, plan_model, run_search, split_stages

__all__ = [
    "Analysis",
    "Planned",
    "analyze",
    "build_plan",
    "plan_model",
    "run_search",
    "split_stages",
]
