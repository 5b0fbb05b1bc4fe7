"""The first call on every rank: plan (or receive the plan), split, place, build executors.

Planning measures the link between ranks (unless ``Config.link_bandwidth`` and
``link_latency`` are given) and, on every rank at once, the optimizer step and gradient
accumulation per tensor size; rank 0 alone captures the model, infers the values' shapes,
profiles (timing the user's optimizer too), searches and infers the dtypes of the other
autocast states while the model is whole (``amp.py``), and broadcasts the plan with its graph
and what it found (``planned.py``), which the others bind to their own model. A
meta-device model, or one whose tensors are not on the rank's device, is planned with the
analytic cost model for the rank's device (``planner.pick_target``); the measured link goes
into that device's spec. Each rank then splits the graph, checks with the others that they
built alike and takes rank 0's seed (``sync.py``), places its own stage (``placement.py``),
builds its executors (and the plan's process groups), takes rank 0's values into its stage
(``sync.py``; ``Config.sync_module_states``), frees every other parameter and buffer of the
model, and prunes the optimizer to the parameters it still holds, before ZeRO shards it. With
a plan given (a file), every rank captures and infers alone.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from ..capture.capture import CapturedGraph, batch_size_of, retarget_device_pass
from ..capture.graph import untouched
from ..capture.portable import NotPortable, unpack
from ..plan.config import Config
from ..plan.device import DeviceSpec, device_of
from ..plan.plan import Plan
from ..plan.values import ValueSpec
from ..planner import (
    Captured,
    Planned,
    Target,
    capture_model,
    launched_node_size,
    pick_target,
    plan_model,
    shape_model,
    split_stages,
    trace_model,
)
from ..profile.fakes import fake_device
from ..profile.optimizer import ParameterCosts, parameter_costs
from ..progress import note
from ..runtime import BatchSizes, StageExecutor
from ..runtime.accumulation import Accumulation
from ..runtime.comm import Groups, agree
from ..runtime.full_shard import shard_stages
from ..runtime.lane import LaneModules, graph_modules
from ..runtime.trainable import Trainable
from ..runtime.zero import shard_optimizer
from ..state.checkpoint import StateNames
from .amp import AmpSpecs, amp_state, autocast_as
from .given import check_given, load_given
from .modes import Modes
from .placement import InitFn, Placement, free_others, place_stage
from .planned import Planning, broadcast_planning, packed, same_example
from .probe import measure_link
from .sync import Layout, check_alike, sync_stages

__all__ = ["Ready", "set_up_rank"]


@dataclass
class Ready:
    """What the first call leaves on this rank."""

    captured: CapturedGraph
    stage: fx.GraphModule | LaneModules  # this rank's stage, or its lane's stages
    plan: Plan
    placement: Placement
    names: StateNames  # this rank's part under the original names
    batches: BatchSizes  # the executors, one per batch size, autocast state and mode
    modes: Modes  # the graph of each mode (train, eval)


def set_up_rank(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    config: Config,
    device: torch.device,
    given: Plan | str | Path | None,
    init: InitFn | None,
    accumulation: Accumulation | None = None,
) -> Ready:
    """Plan (rank 0) or receive the plan, split, place this rank's stage and build its
    executors (sharing ``accumulation``, the model's ``no_sync()`` state); the rest of
    ``model`` is freed."""
    cfg = config
    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    planned = given is None and rank == 0
    home = device_of(model)  # where the model's tensors are: the graph is captured there
    target = _target(home, device, cfg, world) if given is None else None
    param_costs = None
    if target is not None and world > 1 and target.measure_on is not None:
        # every rank at once: ranks that share a host's memory bandwidth step side by side
        dist.barrier()
        param_costs = parameter_costs(
            optimizer, target.measure_on, target.spec, cfg.optimizer_state_factor,
            repeats=cfg.profile_repeats,
        )  # fmt: skip
    alike = True  # whether this rank holds rank 0's batch
    if world > 1:  # every rank holds rank 0's batch: the same graph everywhere (where one is
        args, kwargs, alike = same_example(args, kwargs, rank)  # captured again), even where
        # it depends on the data; the other mode's graph is captured on it too
    amp_type = home.type if home.type != "meta" else device.type
    planned_amp = cfg.autocast_dtype or amp_state(amp_type)
    modes = Modes(model, args, kwargs, config=cfg, device=device, rank=rank, amp_type=amp_type,
                  planned_amp=planned_amp, home=home, world=world,
                  alike=alike)  # before any tensor moves or is freed

    def amp_specs(captured: CapturedGraph, plan: Plan) -> AmpSpecs | None:
        """The other autocast states' dtypes, while the model is whole."""
        if home.type == "meta":
            return None
        return AmpSpecs.of(
            captured, captured.flatten_inputs(args, kwargs), plan, device_type=amp_type,
            planned=planned_amp, batch_dim=cfg.batch_dim,
        )  # fmt: skip

    with untouched(model), autocast_as(amp_type, planned_amp):
        if planned:
            assert target is not None
            try:
                here = _plan_here(model, optimizer, args, kwargs, world, cfg, target, param_costs)
                plan, captured, values = here.plan, here.captured, here.values
                found = Planning(plan, values, captured.tail, amp_specs(captured, plan),
                                 packed(captured, model) if world > 1 else None, str(home))
            except Exception as e:
                broadcast_planning(e, rank, world)  # the others must hear of it, not time out
                raise
        elif given is None and not alike:  # its own batch: its own graph, while rank 0 plans
            traced = trace_model(model, args, kwargs, cfg)
        elif given is not None:
            cap = capture_model(model, args, kwargs, cfg, device=fake_device(device.type))
            captured, values = cap.graph, cap.values
    if given is None:
        found = broadcast_planning(found if planned else None, rank, world)
        plan, amp = found.plan, found.amp
        if not planned:
            captured, values = _rank0_graph(found, model, home, args, kwargs, cfg, alike,
                                            traced if not alike else None, amp_type, planned_amp)
    else:
        plan = load_given(given, captured, world)
        with untouched(model):
            amp = amp_specs(captured, plan)
    stages = split_stages(captured, values, plan, debug=cfg.debug)
    if given is not None:
        check_given(plan, captured, stages, cfg)
    mine = [st.index for st in plan.stages_of_rank(rank)]
    stage: fx.GraphModule | LaneModules = (
        stages[mine[0]] if len(mine) == 1 else LaneModules({s: stages[s] for s in mine}))
    if home != device:
        for gm in graph_modules(stage):
            retarget_device_pass(gm, device)  # export baked the capture device in
    layout = Layout.of(stages, plan)  # what each lane holds, before placement replaces it
    seed = check_alike(layout, world)  # rank 0's: a meta-device model's values are drawn from it
    try:
        placement = place_stage(
            model, stage, device, holders=(captured.gm,), optimizer=optimizer,
            init=init, seed=seed, host_params=any(plan.stages[s].host_params for s in mine),
        )  # fmt: skip
    except RuntimeError as e:
        agree([str(e)], "cannot place the stages", error=RuntimeError)
        raise
    agree([], "cannot place the stages", error=RuntimeError)
    held = {id(t) for t in (*stage.parameters(), *stage.buffers())}
    names = StateNames.of(model, held)  # before the rest is freed: whole-model shapes
    device_type = device.type
    planned_mode = modes.planned(captured, plan, stage,
                                 amp.retype if amp is not None else _planned_only(planned_amp))

    def other(training: bool) -> tuple[Plan, fx.GraphModule | LaneModules,
                                       Callable[[Plan, str | None], Plan]]:
        made = modes.of(training)
        return made.plan, made.module, made.retype

    modules = dict(zip(sorted(mine), graph_modules(stage), strict=True))
    trainable = Trainable(plan, modules, rank=rank, optimizer=optimizer,
                          placed=placement.replaced)
    batches = BatchSizes(
        plan, stage, device=device, timeout_s=cfg.timeout_s, planned=planned_amp,
        state=lambda: amp_state(device_type), retype=planned_mode.retype,
        check=cfg.check_batches, training=modes.planned_mode, other=other,
        accumulation=accumulation, trainable=trainable,
    )  # fmt: skip
    if cfg.sync_module_states and isinstance(batches.default, StageExecutor):
        _sync(stages, plan, layout, batches.default.groups, device)  # rank 0 holds them all
    free_others(model, stage, placement)
    trainable.own_groups()  # the optimizer keeps only the stage's parameters
    shard_stages(plan, modules, rank, optimizer)  # ZeRO-3: each replica keeps its rows
    shard_optimizer(
        optimizer, plan, rank, dict(modules),
        lambda: batches.default.groups,  # type: ignore[union-attr]
        owners=trainable.owners,
    )  # fmt: skip
    note("compiled %s for %d rank(s) in %.2f s total (plan, split, placement)",
         captured.model_name, world, time.perf_counter() - started)
    return Ready(captured, stage, plan, placement, names, batches, modes)


def _rank0_graph(
    found: Planning, model: nn.Module, home: torch.device, args: tuple[Any, ...],
    kwargs: dict[str, Any], cfg: Config, alike: bool, traced: Captured | None,
    amp_type: str, planned_amp: str | None,
) -> tuple[CapturedGraph, dict[str, ValueSpec]]:
    """The graph rank 0 planned, on this rank's model, with its values' specs: sent with the
    plan, or captured here where it could not travel (with rank 0's specs, unless this rank's
    batch differed in structure and its own graph was traced while rank 0 planned)."""
    if alike and found.graph is not None:
        there = torch.device(found.home)
        try:
            captured = unpack(found.graph, model, moved=None if "meta" in (
                there.type, home.type) else (there, home))
        except NotPortable as e:  # check_alike says how the models differ
            note("rank 0's graph does not fit this rank's model (%s): capturing it here", e)
        else:
            return captured, found.values
    with untouched(model), autocast_as(amp_type, planned_amp):
        if traced is None:
            traced = trace_model(model, args, kwargs, cfg)
        cap = shape_model(traced, cfg, given=(found.values, found.tail) if alike else None)
    return cap.graph, cap.values


def _plan_here(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, args: tuple[Any, ...],
    kwargs: dict[str, Any], world: int, cfg: Config, target: Target,
    param_costs: ParameterCosts | None,
) -> Planned:
    """Rank 0: capture, profile and search for the global batch of all ranks."""
    local = batch_size_of(list(_leaves(args, kwargs)), cfg.batch_dim)
    return plan_model(
        model, args, kwargs, world_size=world, config=cfg, global_batch=local * world,
        optimizer=optimizer, param_costs=param_costs, device=target,
    )  # fmt: skip


def _target(home: torch.device, device: torch.device, cfg: Config, world: int) -> Target:
    """What rank 0 plans for: this rank's device, with the link measured between the ranks
    (every rank takes part) unless ``Config`` gives every figure."""
    # the nodes of this launch (torchrun's LOCAL_WORLD_SIZE), not the preset's guess
    node = cfg.devices_per_node or launched_node_size(world)
    spec = DeviceSpec.of(device).model_copy(update={"devices_per_node": node})
    measured = (cfg.link_bandwidth, cfg.link_latency, cfg.allreduce_bandwidth) + (
        (cfg.network_bandwidth, cfg.network_latency) if node is not None and node < world
        else ())
    if world > 1 and None in measured:
        link = measure_link(device, node=node)
        if link is not None:
            spec = link.applied_to(spec)  # Config's figures, where set, still win
    return pick_target(home, device, cfg, spec=spec)


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    yield from torch.utils._pytree.tree_leaves((args, kwargs))


def _planned_only(planned: str | None) -> Callable[[Plan, str | None], Plan]:
    def retype(plan: Plan, state: str | None) -> Plan:
        if state != planned:
            raise ValueError(
                f"this call runs under autocast({state}) but the model, built on the meta "
                f"device, was planned under autocast({planned}) and its values' dtypes under "
                "other states cannot be inferred there: call it under the state it was "
                "planned for (Config(autocast_dtype=...)), or build it on the CPU"
            )
        return plan

    return retype


def _sync(stages: list[fx.GraphModule], plan: Plan, layout: Layout, groups: Groups,
          device: torch.device) -> None:
    """Rank 0's values into every rank's stage; a failure on any rank raises on all."""
    try:
        sync_stages(stages, plan, layout, groups, device=device)
    except RuntimeError as e:
        agree([str(e)], "cannot start from rank 0's model", error=RuntimeError)
        raise
    agree([], "cannot start from rank 0's model", error=RuntimeError)
