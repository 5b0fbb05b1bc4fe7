"""A plan's stages over another capture of the same model: the graph of its other mode.

A model's forward may branch on ``module.training`` (dropout, batch norm, stochastic depth,
an attention's dropout probability), and both tracers bake the branch taken into the graph.
So ``model.eval()`` gets a graph of its own, captured in eval mode (``startup/modes.py``),
and this module gives it the plan's stages, replicas and schedule: each node runs in the
stage its twin runs in (``capture/twins.py``), a node of one mode only in the latest stage of
what it reads (of a parameter it reads, the stage that holds it). The stages' interfaces, cut
values and outputs are those of the new graph (``stage_interfaces``), with the new graph's
shapes and the plan's dynamic dimensions; costs, memory and the rest stay the plan's.
"""

from __future__ import annotations

from ..capture.capture import CapturedGraph
from ..capture.twins import twins_pass
from ..group.group import CALL_OPS
from ..plan.plan import Block, CutValue, OutputRef, Plan
from ..planner.captured import Captured
from ..shapes.dynamic import dynamic_pass
from .split import stage_interfaces

__all__ = ["restage"]


def restage(plan: Plan, planned: CapturedGraph, other: Captured, *, mode: str) -> Plan:
    """``plan`` for ``other`` (the model captured in the ``mode`` that ``planned`` is not).

    Raises ValueError, naming the node, where the other graph cannot run on the plan's
    stages: it reads a value backwards, or a parameter or buffer no stage of its part holds.
    """
    graph = other.graph
    num = len(plan.stages)
    twin_of = twins_pass(planned.gm.graph, graph.gm.graph)
    planned_stage = plan.node_stage()
    if plan.tail is not None:
        planned_stage.update(dict.fromkeys(plan.tail.nodes, num))
    holder = _holders(plan, planned)
    node_stage: dict[str, int] = {}
    for n in graph.gm.graph.nodes:
        if n.op not in CALL_OPS:
            continue
        reads = [node_stage[a.name] for a in n.all_input_nodes if a.op in CALL_OPS]
        twin = twin_of.get(n.name)
        if twin is not None and twin in planned_stage:
            s = planned_stage[twin]
            if reads and max(reads) > s:
                late = next(a.name for a in n.all_input_nodes
                            if a.op in CALL_OPS and node_stage[a.name] > s)
                raise ValueError(
                    f"in {mode} mode node {n.name!r} (stage {s}, as in the planned graph) reads "
                    f"{late!r}, which runs in the later stage {node_stage[late]}: the model's "
                    f"{mode} graph does not fit the plan's stages; plan in {mode} mode, or "
                    "keep the mode-dependent code within one layer"
                )
        else:  # one mode's only: after what it reads, in the stage holding its state
            state = [holder[str(a.target)] for a in n.all_input_nodes
                     if a.op == "get_attr" and str(a.target) in holder]
            s = max([*reads, *state], default=0)
        node_stage[n.name] = s
    tail_nodes = tuple(name for name, s in node_stage.items() if s == num)
    return _plan_for(plan, other, node_stage, tail_nodes)


def _holders(plan: Plan, planned: CapturedGraph) -> dict[str, int]:
    """Parameter and buffer name (any alias) -> the first stage holding it in ``plan``."""
    out: dict[str, int] = {}
    for st in plan.stages:
        for name in (*st.param_names, *st.buffer_names):
            out.setdefault(name, st.index)
    for alias, canon in planned.aliases.items():
        if canon in out:
            out.setdefault(alias, out[canon])
    return out


def _plan_for(plan: Plan, other: Captured, node_stage: dict[str, int],
              tail_nodes: tuple[str, ...]) -> Plan:
    """The plan with ``other``'s nodes, interfaces, cut values and outputs: one block a stage."""
    graph, num = other.graph, len(plan.stages)
    has_tail = plan.tail is not None
    if bool(tail_nodes) != has_tail:
        raise ValueError(
            "the model mixes its samples (a contrastive loss) in one mode only: its other "
            "mode cannot run on the plan's stages; plan in the mode you train in"
        )
    ifaces = stage_interfaces(graph, node_stage, other.values, num + has_tail)
    cuts = [name for name, _, _ in ifaces[0].cut_values] if ifaces else []
    rebuilt = list(dict.fromkeys(n for i in ifaces for n in i.sizes))
    tail_in = list(ifaces[-1].inputs) if has_tail else []
    sized = [*graph.input_names, *cuts, *graph.output_names, *rebuilt, *tail_in]
    dims = tuple(d.name for d in plan.dynamic_dims)
    dynamic = dynamic_pass(other.formulas, other.values, sized, graph.input_names,
                           wanted=dims if dims else "batch")
    if dynamic.dims != plan.dynamic_dims:
        raise ValueError(
            f"the model's graph in its other mode has dynamic dimensions {list(dynamic.dims)}, "
            f"the plan {list(plan.dynamic_dims)}; plan with Config(dynamic_dims='batch')"
        )
    values = {**other.values, **dynamic.specs}
    order = [n.name for n in graph.gm.graph.nodes if n.name in node_stage]
    blocks, stages = [], []
    twin_names = set(order)
    for st in plan.stages:
        old = plan.blocks[st.first_block : st.end_block]
        nodes = tuple(n for n in order if node_stage[n] == st.index)
        blocks.append(Block(
            index=st.index, nodes=nodes, fwd_ms=sum(b.fwd_ms for b in old),
            bwd_ms=sum(b.bwd_ms for b in old), param_bytes=sum(b.param_bytes for b in old),
            activation_bytes=sum(b.activation_bytes for b in old),
        ))  # fmt: skip
        stages.append(st.model_copy(update={
            "first_block": st.index, "end_block": st.index + 1, "num_nodes": len(nodes),
            "inputs": ifaces[st.index].inputs, "outputs": ifaces[st.index].outputs,
            # where layer-by-layer recomputation starts its segments, as far as both have them
            "checkpoints": tuple(c for c in st.checkpoints if c in twin_names),
        }))
    tail = plan.tail
    if tail is not None:
        by_name = {n.name: n for n in graph.gm.graph.nodes}
        tail = tail.model_copy(update={
            "nodes": tail_nodes,
            "mixing": tuple(n for n in tail_nodes if not any(
                a.name in tail_nodes for a in by_name[n].all_input_nodes)),
            "inputs": tuple(values[v] for v in ifaces[num].inputs),
            "outputs": tuple(i for i, name in enumerate(graph.output_names)
                             if node_stage.get(name) == num),
        })
    data = plan.model_dump()  # validated again: the invariants hold for the new interfaces
    data.update(
        blocks=[b.model_dump() for b in blocks],
        stages=[st.model_dump() for st in stages],
        inputs=[values[n].model_dump() for n in graph.input_names],
        outputs=[OutputRef(index=i, stage=min(node_stage.get(name, 0), num - 1),
                           spec=values[name]).model_dump()
                 for i, name in enumerate(graph.output_names)],
        cut_values=[CutValue(producer=p, consumers=tuple(x for x in c if x < num),
                             spec=values[name]).model_dump()
                    for name, p, c in (ifaces[0].cut_values if ifaces else ())
                    if any(x < num for x in c)],
        sizes=[values[n].model_dump() for n in rebuilt if values[n].formulas],
        tail=tail.model_dump() if tail is not None else None,
    )
    return Plan.model_validate(data)

