"""Assemble the Plan from the search's result: blocks, stages with their predicted costs, cut
values, outputs, shared parameters, and the simulated step of the schedule the runtime runs."""

from __future__ import annotations

import logging

from ..capture.capture import CapturedGraph
from ..plan.plan import (
    Block,
    CutValue,
    ExcludedSize,
    OutputRef,
    Plan,
    SharedParam,
    Stage,
    Tail,
    lane_layout,
)
from ..plan.values import SAMPLES, ValueSpec
from ..progress import note
from ..schedules.kinds import name_of
from ..schedules.program import keep, program_of
from ..search import SearchResult, StageChoice
from ..search.nodes import PIPELINES
from ..shapes.dynamic import Dynamic, dynamic_pass
from ..split.interface import StageInterface, dimension_source
from ..split.split import stage_interfaces
from .analyze import Analysis

log = logging.getLogger("rannc_fx")

__all__ = ["build_plan", "shared_params"]


def _checkpoints(a: Analysis, choice: StageChoice) -> tuple[str, ...]:
    """Where a stage that recomputes layer by layer starts its segments (none in the tail,
    which runs outside the stage)."""
    if not choice.layers or a.table.segments is None:
        return ()
    tail = set(a.captured.tail.nodes) if a.captured.tail is not None else set()
    return tuple(n for n in a.table.segments.inside(choice.start, choice.end) if n not in tail)


def build_plan(a: Analysis, result: SearchResult, *, search_seconds: float = 0.0) -> Plan:
    """Assemble the Plan: blocks and stages with predicted costs, cut values, outputs."""
    captured, values, profile, blocks, space = a.captured, a.values, a.profile, a.blocks, a.space
    ms = 1e3
    node_stage: dict[str, int] = {}
    block_stage: list[int] = []
    for s, choice in enumerate(result.stages):
        for b in range(choice.start, choice.end):
            block_stage.append(s)
            for name in blocks.blocks[b]:
                node_stage[name] = s
    num = len(result.stages)
    if captured.tail is not None:  # the tail as one more "stage" to the interfaces: its own
        node_stage.update(dict.fromkeys(captured.tail.nodes, num))  # inputs and sizes
    ifaces = stage_interfaces(captured, node_stage, values, num + (captured.tail is not None))
    dynamic = _dynamic(a, ifaces)
    values = {**values, **dynamic.specs}  # the values the runtime sizes, with their formulas
    rebuilt = dict.fromkeys(n for i in ifaces for n in i.sizes)

    param_bytes = _param_bytes(captured)
    plan_blocks = []
    for b, nodes in enumerate(blocks.blocks):
        samples = result.evaluation.stages[block_stage[b]].samples
        plan_blocks.append(Block(
            index=b,
            nodes=nodes,
            fwd_ms=ms * sum(profile.at(n, "fwd_s", samples) for n in nodes),
            bwd_ms=ms * sum(profile.at(n, "bwd_s", samples) for n in nodes),
            param_bytes=sum(param_bytes.get(p, 0) for p in blocks.params[b]),
            activation_bytes=int(sum(profile.at(n, "saved_bytes", samples) for n in nodes)),
        ))

    stage_params: list[set[str]] = [set() for _ in result.stages]
    for b, read in enumerate(blocks.params):
        stage_params[block_stage[b]].update(read)
    params_set = {n for n, _ in captured.gm.named_parameters(remove_duplicate=False)}

    stages: list[Stage] = []
    first_rank, rank = {}, 0  # ranks go to the lanes in order; a lane's stages share them
    for lane in lane_layout(result.schedule, len(result.stages), result.virtual_stages):
        first_rank.update(dict.fromkeys(lane, rank))
        rank += result.stages[lane[0]].replicas
    pipelines = space.rank_order == PIPELINES  # replica k's pipeline on ranks kS .. kS + S - 1
    for s, (choice, cost) in enumerate(zip(result.stages, result.evaluation.stages, strict=True)):
        names = sorted(stage_params[s])
        checkpoints = _checkpoints(a, choice)
        stages.append(Stage(
            index=s,
            first_block=choice.start,
            end_block=choice.end,
            replicas=choice.replicas,
            ranks=tuple(k * num + s for k in range(choice.replicas)) if pipelines
            else tuple(range(first_rank[s], first_rank[s] + choice.replicas)),
            samples=cost.samples,
            num_nodes=sum(len(blocks.blocks[b]) for b in range(choice.start, choice.end)),
            param_names=tuple(n for n in names if n in params_set),
            buffer_names=tuple(n for n in names if n not in params_set),
            inputs=ifaces[s].inputs,
            outputs=ifaces[s].outputs,
            fwd_ms=ms * cost.fwd_s,
            bwd_ms=ms * cost.bwd_s,
            comm_ms=ms * cost.comm_s,
            allreduce_ms=ms * cost.allreduce_s,
            optimizer_ms=ms * cost.optimizer_s,
            accumulate_ms=ms * cost.accumulate_s,
            recompute=choice.recompute,
            checkpoints=checkpoints,
            again_ms=ms * (cost.recompute_s if choice.selective else
                           cost.recompute_s - cost.fwd_s if checkpoints else 0.0),
            selective=choice.selective,
            zero=3 if cost.full else (2 if space.grad_shards else 1) if cost.zero else 0,
            gather_ms=ms * cost.gather_s,
            offload=cost.offload,
            host_ms=ms * cost.host_s,
            host_bytes=cost.host_state,
            host_params=cost.host,
            window_bytes=cost.window,
            fetch_ms=ms * cost.fetch_s,
            scatter_ms=ms * cost.scatter_s,
            memory=cost.memory,
        ))

    cut_values = tuple(
        CutValue(producer=p, consumers=tuple(x for x in c if x < num), spec=values[name])
        for name, p, c in ifaces[0].cut_values if any(x < num for x in c)  # not the tail's
    ) if ifaces else ()
    outputs = tuple(
        OutputRef(index=i, stage=min(node_stage.get(name, 0), num - 1), spec=values[name])
        for i, name in enumerate(captured.output_names)
    )
    tail = (_tail(a, values, ifaces[num], node_stage, num, result.stages[-1].replicas)
            if captured.tail is not None else None)
    # the tail runs between the last forward and the first backward: on the critical path
    tail_ms = tail.fwd_ms + tail.bwd_ms if tail is not None else 0.0
    # buffers read by several stages (a rotary embedding's inv_freq) are copied into each:
    # only parameters have gradients to sum over their holders
    shared = shared_params(captured, [names & params_set for names in stage_params])

    excluded = _excluded(a, node_stage, num)
    plan = Plan(
        model_fingerprint=captured.fingerprint(),
        tracer=captured.tracer,
        world_size=space.world_size,
        global_batch=space.global_batch,
        micro_batches=result.micro_batches,
        schedule=name_of(result.schedule),
        virtual_stages=result.virtual_stages,
        rank_order="pipelines" if pipelines else "stages",
        loss_reduction=a.config.loss_reduction,
        batch_norm=a.config.batch_norm,
        device=a.spec,
        cost_model=a.cost_model,
        memory_budget=int(space.memory_budget),
        optimizer_state_factor=space.optimizer_state_factor,
        blocks=tuple(plan_blocks),
        stages=tuple(stages),
        inputs=tuple(values[n] for n in captured.input_names),
        dynamic_dims=dynamic.dims,
        outputs=outputs,
        cut_values=cut_values,
        sizes=tuple(values[n] for n in rebuilt if values[n].formulas),
        shared_params=shared,
        tail=tail,
        predicted_step_ms=ms * result.evaluation.step_s + tail_ms,
        search_seconds=search_seconds,
        excluded_sizes=excluded,
        notes=tuple(x.note() for x in excluded),
    )
    program = program_of(plan)
    simulated = ms * program.simulation.makespan + tail_ms
    update = {"simulated_step_ms": simulated}
    if result.virtual_stages > 1:  # no closed form: the formula would miss the interleaving
        update["predicted_step_ms"] = simulated
    return keep(plan.model_copy(update=update), program)  # the same schedule: lowered once


def _tail(a: Analysis, values: dict[str, ValueSpec], iface: StageInterface,
          node_stage: dict[str, int], num: int, replicas: int) -> Tail:
    """The plan's tail: what it reads from the last stage, the outputs it makes, and its time
    (the gather among the last stage's ``replicas`` included) and bytes at the whole batch."""
    captured = a.captured
    assert captured.tail is not None
    foreign = [v for v in iface.inputs if node_stage.get(v) != num - 1]
    if foreign:
        raise ValueError(f"the tail reads {foreign}, which the last stage does not make; the "
                         "graph's tail inputs were not inserted (passes.tail)")
    cost = a.tail
    assert cost is not None
    # each replica receives the other replicas' rows of every input
    gather = (cost.input_bytes / 2 * (replicas - 1) / replicas / a.space.link_bandwidth
              + 2 * (replicas - 1) * len(iface.inputs) * a.space.link_latency)
    ms = 1e3
    return Tail(
        nodes=captured.tail.nodes,
        mixing=captured.tail.mixing,
        inputs=tuple(values[v] for v in iface.inputs),
        outputs=tuple(i for i, name in enumerate(captured.output_names)
                      if node_stage.get(name) == num),
        fwd_ms=ms * (cost.fwd_s + gather),
        bwd_ms=ms * cost.bwd_s,
        activation_bytes=cost.activation_bytes,
        input_bytes=cost.input_bytes,
    )


def _dynamic(a: Analysis, ifaces: list[StageInterface]) -> Dynamic:
    """``dynamic_pass`` over every value the runtime or a stage sizes: inputs, cut values,
    outputs, and the integers stages rebuild; a dimension that a stage rebuilding an integer
    cannot read from its own inputs is pinned."""
    captured = a.captured
    cuts = [name for name, _, _ in ifaces[0].cut_values] if ifaces else []
    rebuilt = list(dict.fromkeys(n for i in ifaces for n in i.sizes))
    tail_in = list(ifaces[-1].inputs) if captured.tail is not None else []
    sized = [*captured.input_names, *cuts, *captured.output_names, *rebuilt, *tail_in]
    wanted = a.config.dynamic_dims
    while True:
        dynamic = dynamic_pass(a.formulas, a.values, sized, captured.input_names, wanted=wanted)
        specs = {**a.values, **dynamic.specs}
        unread = {
            name for i in ifaces for n in i.sizes for f in specs[n].formulas for _, names in f
            for name in names if name != SAMPLES and dimension_source(i.inputs, specs, name) is None
        }
        if not unread:
            return dynamic
        note("plan: %s pinned at the example's size: a stage rebuilds a size in it but "
             "none of its inputs has that dimension", ", ".join(sorted(unread)))
        wanted = tuple(d.name for d in dynamic.dims if d.name not in unread) or "batch"


def _excluded(a: Analysis, node_stage: dict[str, int], num: int) -> tuple[ExcludedSize, ...]:
    """The sizes each stage never runs: those where a node it holds raised when profiled
    (the tail's nodes run on the whole batch only)."""
    found: dict[tuple[int, int], list[str]] = {}
    first: dict[tuple[int, int], str] = {}
    for f in a.profile.failures:
        s = node_stage.get(f.node, num)
        if s < num:
            found.setdefault((s, f.samples), []).append(f.node)
            first.setdefault((s, f.samples), f.error)
    return tuple(ExcludedSize(stage=s, samples=q, nodes=tuple(nodes), error=first[(s, q)])
                 for (s, q), nodes in sorted(found.items()))


def _param_bytes(captured: CapturedGraph) -> dict[str, int]:
    gm = captured.gm
    out = {n: p.numel() * p.element_size() for n, p in gm.named_parameters(remove_duplicate=False)}
    out.update(
        {n: b.numel() * b.element_size() for n, b in gm.named_buffers(remove_duplicate=False)}
    )
    return out


def shared_params(captured: CapturedGraph, stage_params: list[set[str]]) -> tuple[SharedParam, ...]:
    """Parameters (under any of their names) that more than one stage reads."""
    canon = captured.aliases
    users: dict[str, set[int]] = {}
    for s, names in enumerate(stage_params):
        for n in names:
            users.setdefault(canon.get(n, n), set()).add(s)
    aliases_of: dict[str, list[str]] = {}
    for alias, c in canon.items():
        aliases_of.setdefault(c, []).append(alias)
    return tuple(
        SharedParam(name=n, aliases=tuple(sorted(aliases_of.get(n, []))), stages=tuple(sorted(s)))
        for n, s in sorted(users.items())
        if len(s) > 1
    )
