"""A plan given to ``compile(plan=...)``: checked against the model and the Config first.

A plan file is data a user may edit, or one made for another model or other options. What
decides how the model trains must agree with what the model and the Config say, else the
training would silently differ from the one the user configured: the parameters several
stages share (a tied embedding, whose copies would drift apart), the loss reduction, the
BatchNorm statistics' mode, and, where the Config sets them, the schedule, micro-batches,
stages, replicas and rank order. Every rank loads the same file for the same model, so every rank
refuses a disagreement alike, naming each field and both values.
"""

from __future__ import annotations

from pathlib import Path

from torch import fx

from ..capture.capture import CapturedGraph
from ..plan.config import Config
from ..plan.plan import Plan
from ..planner.build import shared_params

__all__ = ["check_given", "load_given"]


def load_given(given: Plan | str | Path, captured: CapturedGraph, world: int) -> Plan:
    """The plan ``given`` (or loaded from its path), for this world size and this model."""
    plan = given if isinstance(given, Plan) else Plan.load(given)
    if plan.world_size != world:
        raise ValueError(
            f"the plan is for {plan.world_size} ranks but {world} are running; launch with "
            f"--nproc-per-node {plan.world_size} or make a plan for {world}"
        )
    fp = captured.fingerprint()
    if plan.model_fingerprint != fp:
        raise ValueError(
            f"the plan was made for another model (fingerprint "
            f"{plan.model_fingerprint[:12]}..., this model's is {fp[:12]}...): its graph, "
            "parameter names, shapes or dtypes differ; make the plan again for this model"
        )
    return plan


def check_given(plan: Plan, captured: CapturedGraph, stages: list[fx.GraphModule],
                cfg: Config) -> None:
    """Refuse a given plan whose fields that change what trains disagree with the model
    (split into ``stages``) or with ``cfg``."""
    params = {n for n, _ in captured.gm.named_parameters(remove_duplicate=False)}
    held = [{n for n, _ in gm.named_parameters(remove_duplicate=False)} & params for gm in stages]
    want = shared_params(captured, held)
    problems = []
    if tuple(plan.shared_params) != want:
        problems.append(f"shared_params: the plan says {_shared(plan.shared_params)}, but its "
                        f"stages share {_shared(want)}")
    for field in ("loss_reduction", "batch_norm"):
        if getattr(plan, field) != getattr(cfg, field):
            problems.append(f"{field}: the plan says {getattr(plan, field)!r}, the Config "
                            f"{getattr(cfg, field)!r}")
    # stages and replicas count lanes (one stage a lane but under interleaved 1F1B and ZBV)
    forced = {"schedule": plan.schedule, "micro_batches": plan.micro_batches,
              "stages": len(plan.lanes),
              "replicas": tuple(plan.stages[lane[0]].replicas for lane in plan.lanes),
              "rank_order": plan.rank_order}
    for field, value in forced.items():
        asked = getattr(cfg, field)
        if asked is not None and asked != value:
            problems.append(f"{field}: the plan says {value!r}, the Config {asked!r}")
    if problems:
        raise ValueError(
            "the plan given to compile() disagrees with the model or the Config: "
            + "; ".join(problems)
            + ". Make the plan again for this model and Config (python -m rannc_fx plan), or "
            "set the Config to the plan's values"
        )


def _shared(shared: tuple[object, ...]) -> str:
    names = [getattr(s, "name", str(s)) for s in shared]
    return "nothing" if not names else ", ".join(names)
