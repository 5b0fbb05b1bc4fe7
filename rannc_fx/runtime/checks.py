"""Checks that a plan, a stage module and what a step passes agree, before anything moves.

Each raises with the names and values involved and what to do, so a mismatch is a clear error
on the rank that sees it instead of a garbled message stream or a silently lost gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from ..plan.plan import CutValue, Plan, Stage
from ..plan.values import ValueSpec
from ..schedules import routing
from .lane import LaneModules, graph_modules
from .pieces import dtype_of

__all__ = [
    "check_world",
    "rank_stages",
    "stage_modules",
    "check_inputs",
    "check_outputs_routable",
    "check_stage_interface",
    "check_stage_outputs",
    "graph_of",
    "input_shapes",
]


def check_world(plan: Plan) -> None:
    """The process group runs (where the plan has several ranks) and has the plan's size."""
    if plan.world_size > 1 and not dist.is_initialized():
        raise RuntimeError(
            f"the plan is for {plan.world_size} ranks but no process group is running; "
            "launch with torchrun and call rannc_fx.runtime.init_distributed() first"
        )
    if dist.is_initialized() and dist.get_world_size() != plan.world_size:
        raise ValueError(
            f"the plan is for {plan.world_size} ranks but the process group has "
            f"{dist.get_world_size()}; launch with --nproc-per-node {plan.world_size} or "
            "make a plan for this world size"
        )


def rank_stages(plan: Plan, rank: int) -> tuple[tuple[Stage, ...], Stage]:
    """The stages ``rank`` runs (one, or a lane's several) and the main one: the one holding
    model outputs, else the first."""
    stages = plan.stages_of_rank(rank)
    owners = {r.stage for r in plan.outputs}
    held = [st for st in stages if st.index in owners]
    return stages, held[0] if held else stages[0]


def stage_modules(plan: Plan, rank: int, stages: Sequence[Stage],
                  module: fx.GraphModule | LaneModules) -> dict[int, fx.GraphModule]:
    """Each of ``stages``' GraphModule in ``module`` (one, or ``LaneModules`` of a lane's
    stages), checked to be the stages this rank runs."""
    mods = graph_modules(module)
    held_ix = list(module.indices) if isinstance(module, LaneModules) else None
    if len(mods) != len(stages) or held_ix not in (None, [st.index for st in stages]):
        raise ValueError(
            f"rank {rank} runs stage(s) {[st.index for st in stages]} under "
            f"schedule {plan.schedule!r} but its module holds "
            f"{held_ix if held_ix is not None else 'one'}: give it that stage's GraphModule, "
            "or LaneModules of its stages"
        )
    return {st.index: m for st, m in zip(stages, mods, strict=True)}


def graph_of(module: nn.Module) -> fx.Graph:
    g = getattr(module, "graph", None)
    if not isinstance(g, fx.Graph):
        raise TypeError(f"the stage module must be an fx.GraphModule, got {type(module).__name__}")
    return g


def check_outputs_routable(plan: Plan) -> None:
    """Refuse a plan with a model output whose interleaved layout is unknown, when the plan
    splits the batch: its rows could not be handed back to the ranks by sample."""
    if plan.world_size == 1 and plan.micro_batches == 1:
        return  # the one rank computes the whole batch at once: nothing is cut
    for ref in plan.outputs:
        spec = ref.spec
        if spec.interleaved and spec.interleave is None:
            raise ValueError(
                f"model output {ref.index} ({spec.name!r}, {spec.shape} per sample) has rows "
                f"of different samples interleaved along dimension {spec.batch_dim} in a way "
                f"rannc_fx cannot undo, and this plan splits the batch ({plan.micro_batches} "
                f"micro-batch(es) on {plan.world_size} rank(s)), so each rank would get other "
                "samples' rows; return it with the batch as a dimension of its own (e.g. "
                "out.view(seq, batch, -1) rather than out.view(-1, n)), or compute the loss "
                "inside the model and return that"
            )


def check_stage_interface(plan: Plan, stage: Stage, module: nn.Module) -> list[ValueSpec]:
    """The spec of each of the stage module's inputs; raises where module and plan disagree."""
    graph_inputs = {spec.name: spec for spec in plan.inputs}
    cuts = {cv.name: cv for cv in plan.cut_values}
    n_placeholders = sum(1 for n in graph_of(module).nodes if n.op == "placeholder")
    if n_placeholders != len(stage.inputs):
        raise ValueError(
            f"stage {stage.index}'s module takes {n_placeholders} inputs but the plan lists "
            f"{len(stage.inputs)} ({list(stage.inputs)}); the module and plan do not match"
        )
    specs: list[ValueSpec] = []
    for name in stage.inputs:
        if name in graph_inputs:
            specs.append(graph_inputs[name])
        elif name in cuts and stage.index in cuts[name].consumers:
            specs.append(cuts[name].spec)
        else:
            raise ValueError(
                f"stage {stage.index} input {name!r} is neither a graph input nor a cut value "
                "the plan sends to this stage"
            )
    returned = set(stage.outputs)
    for ref in plan.outputs:
        if ref.stage == stage.index and ref.spec.name not in returned and not plan.tail_output(
            ref.index
        ):
            raise ValueError(
                f"model output {ref.index} ({ref.spec.name!r}) is assigned to stage "
                f"{stage.index}, which does not return it"
            )
    for name in stage.outputs:
        if name in cuts and cuts[name].producer != stage.index:
            raise ValueError(f"stage {stage.index} returns {name!r}, produced by another stage")
    if plan.tail is not None and stage.index == len(plan.stages) - 1 and not isinstance(
        getattr(module, "tail", None), nn.Module
    ):
        raise ValueError(f"stage {stage.index} runs the plan's tail but its module has no "
                         "'tail' submodule; make its modules with split_pass")
    return specs


def input_shapes(plan: Plan, local: int) -> list[tuple[int, ...] | None]:
    """Each graph input's shape on one rank (None: not a tensor), for ``check_inputs``."""
    return [spec.shape_for(local) if spec.kind == "tensor" else None for spec in plan.inputs]


def check_inputs(
    plan: Plan,
    flat: Sequence[Any],
    shapes: Sequence[tuple[int, ...] | None],
    local: int,
    device: torch.device,
) -> list[Any]:
    """This rank's flat inputs, on ``device``; their count and per-rank shapes as planned."""
    specs = plan.inputs
    if len(flat) != len(specs):
        raise ValueError(
            f"the model got {len(flat)} tensor inputs but the plan was made for "
            f"{len(specs)} ({[s.name for s in specs]}); call it as when it was planned"
        )
    out = []
    for j, (t, spec, want) in enumerate(zip(flat, specs, shapes, strict=True)):
        if want is not None:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input {j} ({spec.name!r}) must be a tensor, got {type(t)}")
            if t.shape != want:
                raise ValueError(
                    f"input {j} ({spec.name!r}) has shape {tuple(t.shape)} but the plan "
                    f"expects {want} on each rank (global batch {plan.global_batch} over "
                    f"{plan.world_size} ranks: {local} samples per rank)"
                )
            if t.device != device:
                t = t.to(device)
        out.append(t)
    return out


def check_stage_outputs(
    stage: Stage, cuts: dict[str, CutValue], samples: int, outs: tuple[Any, ...]
) -> None:
    """A cut value whose shape, dtype or need for a gradient differs from the plan would
    garble the p2p stream or lose gradients silently: stop with the value's name."""
    if len(outs) != len(stage.outputs):
        raise ValueError(
            f"stage {stage.index} returned {len(outs)} values; the plan lists "
            f"{len(stage.outputs)} ({list(stage.outputs)})"
        )
    for name, o in zip(stage.outputs, outs, strict=True):
        cv = cuts.get(name)
        if cv is None or cv.spec.kind != "tensor":
            continue
        want = (cv.spec.shape_for(samples), dtype_of(cv.spec))
        if not isinstance(o, torch.Tensor) or (tuple(o.shape), o.dtype) != want:
            got = (tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else type(o)
            raise ValueError(
                f"stage {stage.index} made cut value {name!r} as {got} for {samples} samples "
                f"but the plan says {want}; the plan does not describe this model (make it "
                "again)"
            )
        if o.requires_grad and not routing.needs_grad(cv.spec) and torch.is_grad_enabled():
            raise ValueError(
                f"cut value {name!r} needs a gradient but the plan says it does not "
                "(requires_grad=False), so its gradient would be lost; make the plan again"
            )
