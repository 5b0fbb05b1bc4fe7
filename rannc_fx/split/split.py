"""Build one fx.GraphModule per stage from the plan's node-to-stage assignment (split_module).

    interface        each stage's inputs and outputs and the cut values, from the graph and the
                     node-to-stage assignment alone (``build`` names them in the plan from it)
    staged           the staged copy: the graph in stage order, recomputed values rebuilt
    split            ``split_pass``: the staged copy, ``split_module``, the per-stage modules

The search decides which stage each node runs in (``Plan.node_stage``);
``torch.fx.passes.split_module`` builds the per-stage graphs. Around it:

* before: the graph is copied in stage order, and every recomputed value a stage reads from
  elsewhere (``group.recomputed_values``) is rebuilt inside that stage: a size as
  ``a * samples + c`` from the stage's sample count, a data-free value (a mask) by running its
  chain again (``staged``). So only tensors ever cross stages.
* after: each partition becomes ``stage_<s>``, a GraphModule with placeholders in the order
  of ``plan.stages[s].inputs``, returning a flat tuple in the order of ``outputs``, holding
  the captured graph's own parameter and buffer objects under their original names.
  (``split_module`` passes parameters to partitions as inputs and renames modules
  ``a.b`` -> ``a_b``; the stages own theirs instead.) A buffer or constant that several
  stages read is held by each of them: one object here, a copy with the same values on each
  rank under ``compile()``. Only parameters are shared state across ranks (their gradients
  are summed over their holders); a tensor the forward writes must therefore be read by one
  stage only (``check_written_state``).

Running stage 0, 1, ... in order, each on the values its ``inputs`` name, reproduces the
captured graph bit for bit.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.passes.split_module import split_module

from ..capture.capture import CapturedGraph
from ..group.group import CALL_OPS, recomputed_values, written_state
from ..plan.plan import Plan
from ..plan.values import ValueSpec
from ..progress import note
from .interface import StageInterface, stage_interfaces
from .staged import ORIGIN, STAGE, TARGET, VALUE, StagedCopy

__all__ = [
    "StageInterface",
    "check_written_state",
    "run_stages",
    "split_pass",
    "stage_interfaces",
]

# -- per-stage modules -----------------------------------------------------------------------


def _stage_module(sub: fx.GraphModule, captured: CapturedGraph, s: int, inputs: tuple[str, ...],
                  outputs: tuple[str, ...], recomputed: frozenset[str],
                  name: str | None = None) -> fx.GraphModule:
    """A partition as ``stage_<s>``: plan-ordered placeholders, own parameters, flat outputs."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_value: dict[str, fx.Node] = {}
    data_inputs = {}
    attr_inputs = []
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            if n.meta.get(ORIGIN) == "get_attr":
                attr_inputs.append(n)
            else:
                data_inputs[n.meta[VALUE]] = n
    extra = sorted(set(data_inputs) - set(inputs))
    if extra:
        raise ValueError(
            f"stage {s} reads {extra}, which the plan does not list among its inputs "
            f"{list(inputs)}; the plan was made for another graph: make it again"
        )
    for value in inputs:
        ph = g.placeholder(value)
        by_value[value] = ph
        if value in data_inputs:
            env[data_inputs[value]] = ph
    for n in attr_inputs:
        target = str(n.meta[TARGET])
        env[n] = g.get_attr(target)
    for n in sub.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        new = g.node_copy(n, env.__getitem__)
        if n.op in ("call_module", "get_attr"):
            new.target = str(n.meta[TARGET])
        env[n] = new
        if VALUE in n.meta:
            by_value[n.meta[VALUE]] = new
    missing = [o for o in outputs if o not in by_value]
    if missing:
        raise ValueError(f"stage {s} must return {missing} but does not compute them")
    g.output(tuple(by_value[o] for o in outputs))
    _drop_unused(g, lambda n: n.meta.get(VALUE, "") in recomputed or VALUE not in n.meta)
    root = {
        str(n.target): operator.attrgetter(str(n.target))(captured.gm)
        for n in g.nodes if n.op in ("get_attr", "call_module")
    }
    g.lint()
    return fx.GraphModule(root, g, class_name=name or f"stage_{s}")  # generates its code


def attach_tail(stage: fx.GraphModule, tail: fx.GraphModule) -> None:
    """Make ``tail`` the ``tail`` submodule of the last stage's module, which also holds
    the tail's parameters and buffers under their own names (it owns them: the optimizer,
    placement and checkpoints see the stage's names; the tail's entries are the same objects)."""
    for target, t in [*tail.named_parameters(), *tail.named_buffers()]:
        *path, leaf = target.split(".")
        mod: nn.Module = stage
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        if hasattr(mod, leaf):
            continue
        if isinstance(t, nn.Parameter):
            mod.register_parameter(leaf, t)
        else:
            mod.register_buffer(leaf, t)
    stage.add_module("tail", tail)


def _drop_unused(g: fx.Graph, removable: Callable[[fx.Node], bool]) -> None:
    """Erase unread nodes: recomputed values ``removable`` allows, then unread attributes.

    A rebuilt size or mask whose readers all run elsewhere is dead here; side effects stay.
    """
    for n in reversed(list(g.nodes)):
        if n.users:
            continue
        if n.op == "get_attr" or (
            n.op in CALL_OPS and removable(n) and not (n.op == "call_function" and n.is_impure())
        ):
            g.erase_node(n)


def _values_from_plan(captured: CapturedGraph, plan: Plan) -> dict[str, ValueSpec]:
    """ValueSpecs by shape propagation on inputs shaped as the plan's input specs say."""
    from ..profile.fakes import fake_device
    from ..shapes.infer import infer_values_pass

    state = [*captured.gm.parameters(), *captured.gm.buffers()]
    device = state[0].device if state else torch.device("cpu")
    samples = max(2, max(st.samples for st in plan.stages))
    flat = [
        torch.zeros(v.shape_for(samples), dtype=getattr(torch, v.dtype or "float32"), device=device)
        for v in plan.inputs
    ]
    bd = next((v.batch_dim for v in plan.inputs if v.batch_dim is not None), 0)
    return infer_values_pass(captured, flat, batch_dim=bd,
                             device=fake_device(plan.device.device_type))


def split_pass(
    captured: CapturedGraph, plan: Plan, *, values: dict[str, ValueSpec] | None = None
) -> list[fx.GraphModule]:
    """One GraphModule per stage of ``plan``: ``stage_0``, ``stage_1``, ...

    ``values`` are the captured graph's ValueSpecs (``infer_values_pass``); without them they
    are inferred again from the plan's input specs.
    """
    t0 = time.perf_counter()
    if values is None:
        values = _values_from_plan(captured, plan)
    # what the plan sizes (inputs, cut values, rebuilt integers) with its formulas
    values = {**values, **{v.name: v for v in (*plan.inputs, *plan.sizes)},
              **{v.name: v for v in (plan.tail.inputs if plan.tail is not None else ())},
              **{cv.name: cv.spec for cv in plan.cut_values}}
    num = len(plan.stages)
    node_stage = plan.node_stage()
    if plan.tail is not None:  # the tail is one more partition, attached to the last stage
        node_stage.update(dict.fromkeys(plan.tail.nodes, num))
    recomputed = recomputed_values(captured.gm, values)
    ifaces = stage_interfaces(captured, node_stage, values, num + (plan.tail is not None),
                              recomputed=recomputed)
    for st, iface in zip(plan.stages, ifaces, strict=False):
        if (st.inputs, st.outputs) != (iface.inputs, iface.outputs):
            raise ValueError(
                f"stage {st.index} of the plan takes {list(st.inputs)} and returns "
                f"{list(st.outputs)}, but on this graph it takes {list(iface.inputs)} and returns "
                f"{list(iface.outputs)}: the plan was made for another graph; make it again"
            )
    staged = StagedCopy(captured, node_stage, values, ifaces, recomputed)
    graph = staged.build()
    # Only the graphs of split_module's modules (its input, each partition, the top) are read:
    # lazy modules never generate and compile their code, two thirds of the split's time.
    with _use_lazy_graph_module(True):
        parts = split_module(
            _make_graph_module(captured.gm, graph), captured.gm, lambda n: int(n.meta[STAGE]),
            keep_original_node_name=True,
        )
    stages = []
    for st in plan.stages:
        sub = getattr(parts, f"submod_{st.index}", None)
        if sub is None:  # no node of this graph runs there (a mode's graph: restage)
            sub = fx.GraphModule(nn.Module(), fx.Graph())
            sub.graph.output(())
        assert isinstance(sub, fx.GraphModule)
        stages.append(_stage_module(sub, captured, st.index, st.inputs, st.outputs,
                                    staged.recomputed))
    if plan.tail is not None:
        sub = parts.get_submodule(f"submod_{num}")
        assert isinstance(sub, fx.GraphModule)
        tail_names = tuple(ifaces[num].outputs)
        expect = tuple(captured.output_names[j] for j in plan.tail.outputs)
        tail_in = tuple(v.name for v in plan.tail.inputs)
        if (ifaces[num].inputs, tail_names) != (tail_in, expect):
            raise ValueError(
                f"the plan's tail takes {list(tail_in)} and returns {list(expect)}, but "
                f"on this graph it takes {list(ifaces[num].inputs)} and returns "
                f"{list(tail_names)}: the plan was made for another graph; make it again"
            )
        tail = _stage_module(sub, captured, num, tail_in, tail_names, staged.recomputed,
                             name="tail")
        attach_tail(stages[-1], tail)
    check_written_state(captured, stages)
    note("split %d nodes into %d stages (%d cut values) in %.2f s", len(node_stage), num,
         len(ifaces[0].cut_values) if ifaces else 0, time.perf_counter() - t0)
    return stages


def check_written_state(captured: CapturedGraph, stages: list[fx.GraphModule]) -> None:
    """Refuse a parameter, buffer or constant that the forward writes (a BatchNorm's running
    statistics, a counter) and that more than one stage reads: each stage would write only its
    own copy, and the others would read stale values.

    group_pass keeps every reader of such a tensor in one block, so a plan from the search
    never does this; a plan made by hand or for another graph can.
    """
    written = written_state(captured.gm)
    if not written:
        return
    holders: dict[int, list[int]] = {}
    for s, gm in enumerate(stages):
        held = {id(t) for t in (*gm.parameters(), *gm.buffers())}
        held.update(
            id(v) for n in gm.graph.nodes if n.op == "get_attr"
            if isinstance(v := operator.attrgetter(str(n.target))(gm), torch.Tensor)
        )
        for i in held & written.keys():
            holders.setdefault(i, []).append(s)
    for i, readers in holders.items():
        if len(readers) > 1:
            name, writer = written[i]
            raise ValueError(
                f"{name!r} is written in the forward (by node {writer!r}) and read by stages "
                f"{readers}; each stage holds its own copy of a buffer, so the write would not "
                "reach the other stages and their copies would go stale. Keep its readers in "
                "one stage: make the plan again with this version of rannc_fx (its grouping "
                "does), or give each place that uses it its own module (one BatchNorm per "
                "call rather than one called in several places)"
            )


def run_stages(stages: list[fx.GraphModule], plan: Plan, flat_inputs: list[Any],
               input_names: list[str], output_names: list[str]) -> list[Any]:
    """Run the stages one after another in this process, routing values by name, then the
    tail (the last stage's ``tail`` submodule) on what it reads."""
    env: dict[str, Any] = dict(zip(input_names, flat_inputs, strict=True))
    for spec, gm in zip(plan.stages, stages, strict=True):
        outs = gm(*(env[name] for name in spec.inputs))
        env.update(zip(spec.outputs, outs, strict=True))
    if plan.tail is not None:
        tail = stages[-1].get_submodule("tail")
        outs = tail(*(env[v.name] for v in plan.tail.inputs))
        env.update((output_names[j], o) for j, o in zip(plan.tail.outputs, outs, strict=True))
    return [env[name] for name in output_names]
