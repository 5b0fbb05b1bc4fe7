"""6. Planner: the passes run in order (a model and its example batch in, a plan and its
stages out), and the choice among plans the search does not make (several stages a lane, ZB-H1).

    captured  capture_model: capture and shapes on the example (trace_model, then
              shape_model: every rank of compile() traces; rank 0 gives the others its shapes)
    analyze   capture_model, then profile -> group -> costs: the search's inputs, for the
              Target that pick_target picks (the device's figures, the one cost-model rule)
    build     the Plan from the search's result (stages, cut values, simulated step)
    driver    plan_model (analyze, search, build) and split_stages: what partition() and
              compile() call

    lanes, virtual  several stages a lane (interleaved 1F1B, ZBV) on the searched lanes and others
    zb_choice  whether ZB-H1 pays on the searched stages

The passes themselves live in their folders (capture, shapes, profile, group, search); this
package runs them in order.
"""

from .analyze import Analysis, Target, analyze, launched_node_size, pick_target
from .build import build_plan
from .captured import Captured, capture_model, shape_model, trace_model
from .driver import Planned, plan_model, run_search, split_stages

__all__ = [
    "Analysis",
    "Captured",
    "Planned",
    "Target",
    "analyze",
    "build_plan",
    "capture_model",
    "launched_node_size",
    "pick_target",
    "plan_model",
    "run_search",
    "shape_model",
    "split_stages",
    "trace_model",
]
