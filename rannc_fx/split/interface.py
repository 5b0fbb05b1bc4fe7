"""Each stage's interface: the values it takes and returns, and the cut values between stages.

A function of the captured graph and the node-to-stage assignment alone, with no graph built:
``build`` names every stage's inputs and outputs in the plan from it, and ``split_pass`` checks
a plan against it before splitting. A recomputed value (a size, a mask) is never a cut value;
a stage that rebuilds a size counts its samples on its first batched tensor input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import fx

from ..capture.capture import CapturedGraph
from ..group.group import CALL_OPS, recomputed_values
from ..plan.values import ValueSpec

__all__ = ["StageInterface", "dimension_source", "stage_interfaces"]


@dataclass(frozen=True)
class StageInterface:
    inputs: tuple[str, ...]  # graph-input placeholders and cut values, in placeholder order
    outputs: tuple[str, ...]  # values the stage returns: cut values and model outputs, in order
    cut_values: tuple[tuple[str, int, tuple[int, ...]], ...]  # (value, producer, consumers)
    sizes: tuple[str, ...] = ()  # integers it rebuilds from its inputs' sizes (read elsewhere)


def _stage_of(node_stage: dict[str, int], node: fx.Node, num_stages: int) -> int:
    s = node_stage.get(node.name)
    if s is None:
        raise ValueError(
            f"node {node.name!r} ({node.op} {node.target}) is in no stage: the plan's blocks "
            "must hold every call node of the captured graph; make the plan again for this graph"
        )
    if not 0 <= s < num_stages:
        raise ValueError(f"node {node.name!r} is assigned to stage {s} of {num_stages}")
    return s


def _local_reads(node: fx.Node, s: int, node_stage: dict[str, int],
                 recomputed: frozenset[str], values: dict[str, ValueSpec]) -> list[fx.Node]:
    """Recomputed values from outside stage ``s`` that running ``node`` there needs rebuilt.

    A data-free value is rebuilt by running its chain again (so its inputs are rebuilt too);
    a size from the sample count alone.
    """
    out: dict[fx.Node, None] = {}
    stack = [a for a in node.all_input_nodes if a.op in CALL_OPS]
    while stack:
        a = stack.pop()
        if a in out or node_stage.get(a.name) == s or a.name not in recomputed:
            continue
        out[a] = None
        if values[a.name].kind not in ("int", "ints"):
            stack.extend(b for b in a.all_input_nodes if b.op in CALL_OPS)
    return list(out)


def stage_interfaces(
    captured: CapturedGraph, node_stage: dict[str, int], values: dict[str, ValueSpec], num_stages: int,
    *, recomputed: frozenset[str] | None = None,
) -> list[StageInterface]:
    """Each stage's inputs and outputs, and the cut values between stages.

    Inputs: the graph inputs the stage reads (placeholder order), then the cut values it
    receives (node order). Outputs: the cut values it sends (node order), then the model's
    output leaves it produces (leaf order; a graph input returned as is comes from stage 0).
    Recomputed values (sizes, data-free values) are never cut values; a stage that rebuilds a
    size needs a batched tensor input to count its samples, or this raises ValueError.
    ``recomputed``: ``recomputed_values`` of the graph, if the caller has them already.
    """
    gm = captured.gm
    if recomputed is None:
        recomputed = recomputed_values(gm, values)
    reads: list[dict[str, None]] = [{} for _ in range(num_stages)]
    cuts: dict[str, tuple[int, dict[int, None]]] = {}
    sizes: list[dict[str, None]] = [{} for _ in range(num_stages)]
    for n in gm.graph.nodes:
        if n.op not in CALL_OPS:
            continue
        s = _stage_of(node_stage, n, num_stages)
        for a in n.all_input_nodes:
            if a.op == "placeholder":
                reads[s].setdefault(a.name)
        for a in _local_reads(n, s, node_stage, recomputed, values):
            if values[a.name].kind in ("int", "ints"):
                sizes[s].setdefault(a.name)
        for a in n.all_input_nodes:
            if a.op not in CALL_OPS or a.name in recomputed:
                continue
            t = _stage_of(node_stage, a, num_stages)
            if t == s:
                continue
            if t > s:
                raise ValueError(
                    f"node {n.name!r} in stage {s} reads {a.name!r} from the later stage {t}; "
                    "stages must be contiguous ranges of the block chain, in order"
                )
            if values[a.name].kind != "tensor":
                raise ValueError(
                    f"value {a.name!r} (a {values[a.name].kind}, not a tensor) would cross from "
                    f"stage {t} to stage {s}; only tensors can be sent: group_pass keeps such "
                    "values in one block, so make the plan from its BlockGraph"
                )
            cuts.setdefault(a.name, (t, {}))[1].setdefault(s)
    by_name = {n.name: n for n in gm.graph.nodes}
    produced: list[dict[str, None]] = [{} for _ in range(num_stages)]
    for name in captured.output_names:
        node = by_name[name]
        s = _stage_of(node_stage, node, num_stages) if node.op in CALL_OPS else 0
        if node.op == "placeholder":
            reads[0].setdefault(name)
        produced[s].setdefault(name)
    order = [n.name for n in gm.graph.nodes]
    placeholders = [n for n in order if by_name[n].op == "placeholder"]
    cut_list = [n for n in order if n in cuts]
    out = []
    for s in range(num_stages):
        ins = [p for p in placeholders if p in reads[s]]
        ins += [c for c in cut_list if s in cuts[c][1]]
        outs = [c for c in cut_list if cuts[c][0] == s]
        outs += [o for o in produced[s] if o not in outs]
        if sizes[s] and _sample_source(ins, values) is None:
            name = next(iter(sizes[s]))
            raise ValueError(
                f"stage {s} recomputes the size {name!r} (coefficients "
                f"{values[name].int_coeffs} of the sample count) but none of its inputs "
                f"{ins} is a tensor with a batch dimension to count samples from; move the "
                "stage boundary so the stage receives an activation"
            )
        out.append(StageInterface(tuple(ins), tuple(outs), (), tuple(sizes[s])))
    cut_values = tuple(
        (c, cuts[c][0], tuple(sorted(cuts[c][1]))) for c in cut_list
    )
    return [StageInterface(i.inputs, i.outputs, cut_values, i.sizes) for i in out]


def dimension_source(inputs: Sequence[str], values: Mapping[str, ValueSpec],
                     name: str) -> tuple[str, int] | None:
    """The first input (and its dimension) whose size is the dynamic dimension ``name``
    itself: where a stage reads that size to rebuild an integer in it."""
    exact = ((1, (name,)),)
    for value in inputs:
        spec = values[value]
        for d, f in enumerate(spec.formulas if spec.kind == "tensor" else ()):
            if f == exact:
                return value, d
    return None


def _sample_source(inputs: list[str] | tuple[str, ...], values: dict[str, ValueSpec]) -> str | None:
    """The first input that is a tensor with a batch dimension (it counts the samples)."""
    for name in inputs:
        spec = values[name]
        if spec.kind == "tensor" and spec.batch_dim is not None:
            return name
    return None
