"""The model's tail: the part that mixes a batch's samples, run once a step on the whole batch.

A contrastive loss compares every sample with every other one (CLIP's text x image logits, a
bi-encoder's in-batch negatives): a value with two dimensions that grow with the sample count
(``ValueSpec.mixed``). No micro-batch or replica can compute its slice of such a value, so the
part of the graph from the first one to the outputs it feeds, the *tail*, runs once a step on
the whole batch; the rest (the *body*) is pipelined as usual:

    body    ... text_embeds (b, d)          image_embeds (b, d)
                     |                            |
    inputs      tail_in_text_embeds          tail_in_image_embeds     clones, in the last stage
                     \\                           /
    tail          matmul (b, b) -> mul(exp(logit_scale)) -> cross_entropy(logits, arange(b))

``find_tail`` finds it: the nodes whose value is mixed while none of their inputs' is (where
samples first mix), everything that reads them, and the values without a batch dimension that
only the tail reads (the temperature's ``exp``). ``insert_tail_inputs`` gives each batched
value the tail reads from the body a clone of its own (``tail_in_<name>``) and moves the clones
and the tail to the end of the graph, so the grouping makes them the last block: the clones run
in the last stage, per micro-batch, and are what the runtime gathers from every micro-batch
and replica for the tail (``runtime/tail.py``). Sizes and data-free values the tail reads
(``torch.arange(len(logits))``) are rebuilt inside it from its inputs, at the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from ..capture.graph import CapturedGraph, CaptureError, TailNodes
from ..capture.opaque import OPAQUE
from ..group.boundary import recomputed_values
from ..group.ops import CALL_OPS
from ..plan.values import ValueSpec, dtype_itemsize
from ..profile.profile import Profile

__all__ = ["TAIL", "TailCost", "TailNodes", "find_tail", "insert_tail_inputs", "tail_cost"]

TAIL = "rannc_tail"  # node.meta key: "input" on the clones, "node" on the tail's nodes


def find_tail(captured: CapturedGraph, values: dict[str, ValueSpec], *,
              loss_reduction: str = "mean") -> TailNodes | None:
    """The graph's tail, or None where no value mixes samples. Raises CaptureError where the
    tail cannot run on the whole batch, naming the node and why.

    A module run eagerly (``capture/opaque``) whose batch-free outputs are not a
    ``loss_reduction`` over the samples (a mean over the tokens a mask keeps) mixes them too."""
    gm = captured.gm
    nodes = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    mixed = {n.name for n in nodes
             if _mixed(values.get(n.name)) or _couples(captured, n, loss_reduction)}
    if not mixed:
        return None
    mixing = [n for n in nodes if n.name in mixed
              and not any(a.name in mixed for a in n.all_input_nodes)]
    tail: set[fx.Node] = set()
    for n in nodes:  # graph order: a reader comes after what it reads
        if n.name in mixed or any(a in tail for a in n.all_input_nodes):
            tail.add(n)
    free = recomputed_values(gm, values)
    # the values without a batch dimension that only the tail reads run in it (the whole
    # batch's statistics, a temperature's exp); sizes and data-free values are rebuilt there
    grew = True
    while grew:
        grew = False
        for n in reversed(nodes):
            if n in tail or n.name in free or not n.users:
                continue
            spec = values.get(n.name)
            if spec is not None and spec.kind == "tensor" and spec.batch_dim is not None:
                continue
            if all(u in tail for u in n.users):
                tail.add(n)
                grew = True
    reads: dict[str, None] = {}
    for n in nodes:
        if n not in tail:
            continue
        for a in n.all_input_nodes:
            if a in tail or a.op == "get_attr" or a.name in free:
                continue
            _check_read(a, n, values)
            reads[a.name] = None
    for n in tail:
        if (n.op == "call_module" and OPAQUE not in n.meta) or _writes(n):
            raise CaptureError(
                f"node {n.name} ({_what(n)}) comes after samples mix at "
                f"{mixing[0].name} but {'is a module call' if n.op == 'call_module' else 'writes its input in place'}; "
                "the part of the model that runs on the whole batch must be plain tensor "
                "functions: compute this before the samples mix"
            )
    return TailNodes(
        nodes=tuple(n.name for n in nodes if n in tail),
        mixing=tuple(n.name for n in mixing),
        reads=tuple(reads),
    )


def insert_tail_inputs(captured: CapturedGraph, tail: TailNodes) -> list[str]:
    """Give every value the tail reads from the body a clone of its own, read by the tail
    instead, and move the clones, then the tail, to the end of the graph (nothing else reads
    them). Marks them in ``node.meta[TAIL]``; returns the clones' names."""
    graph = captured.gm.graph
    by_name = {n.name: n for n in graph.nodes}
    out = graph.output_node()
    in_tail = {by_name[name] for name in tail.nodes}
    clones = []
    for name in tail.reads:
        src = by_name[name]
        with graph.inserting_before(out):
            c = graph.create_node("call_function", torch.ops.aten.clone.default, (src,),
                                  name=f"tail_in_{name}")
        c.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor_meta")})
        c.meta[TAIL] = "input"
        for u in list(src.users):
            if u in in_tail:
                u.replace_input_with(src, c)
        clones.append(c)
    for name in tail.nodes:
        n = by_name[name]
        n.meta[TAIL] = "node"
        out.prepend(n)
    graph.lint()
    captured.gm.recompile()
    return [c.name for c in clones]


@dataclass(frozen=True)
class TailCost:
    """The tail's once-a-step time and bytes at the whole batch. Its inputs (and their
    gradients), its saved activations and its outputs are held at once on every replica of
    the last stage while it runs, on top of every micro-batch's activations (GPipe)."""

    fwd_s: float
    bwd_s: float
    activation_bytes: int
    input_bytes: int  # the gathered inputs and their gradients
    output_bytes: int

    @property
    def held_bytes(self) -> int:
        return self.activation_bytes + self.input_bytes + self.output_bytes


def tail_cost(captured: CapturedGraph, profile: Profile, values: dict[str, ValueSpec],
              whole: int) -> TailCost | None:
    """The tail's costs for a batch of ``whole`` samples (profiled there: ``analyze``)."""
    tail = captured.tail
    if tail is None:
        return None
    inputs = [n.name for n in captured.gm.graph.nodes if n.meta.get(TAIL) == "input"]
    made = set(tail.nodes)
    outputs = dict.fromkeys(n for n in captured.output_names if n in made)
    return TailCost(
        fwd_s=sum(profile.at(n, "fwd_s", whole) for n in tail.nodes),
        bwd_s=sum(profile.at(n, "bwd_s", whole) for n in tail.nodes),
        activation_bytes=int(sum(profile.at(n, "saved_bytes", whole) for n in tail.nodes)),
        input_bytes=2 * sum(_nbytes(values[v], whole) for v in inputs),
        output_bytes=sum(_nbytes(values[v], whole) for v in outputs),
    )


def _nbytes(spec: ValueSpec, whole: int) -> int:
    if spec.kind != "tensor":
        return 0
    return math.prod(spec.shape_for(whole)) * dtype_itemsize(spec.dtype or "float32")


def _couples(captured: CapturedGraph, n: fx.Node, loss_reduction: str) -> bool:
    """An opaque call whose batch-free outputs do not reduce over the samples as the plan
    combines micro-batches (``loss_reduction``)."""
    where = n.meta.get(OPAQUE)
    if where is None:
        return False
    name, key = where
    reduces = captured.opaque[name][key].reduces
    return reduces is not None and reduces != loss_reduction


def _mixed(spec: ValueSpec | None) -> bool:
    return spec is not None and spec.kind == "tensor" and bool(spec.mixed)


def _check_read(a: fx.Node, reader: fx.Node, values: dict[str, ValueSpec]) -> None:
    spec = values.get(a.name)
    if spec is None or spec.kind != "tensor":
        raise CaptureError(
            f"node {reader.name} ({_what(reader)}) runs on the whole batch after samples mix, "
            f"and reads {a.name}, a {spec.kind if spec else 'value'} the rest of the model "
            "reads too; only tensors can pass into the part that runs on the whole batch"
        )
    if spec.batch_dim is None and a.op != "placeholder":
        raise CaptureError(
            f"node {reader.name} ({_what(reader)}) runs on the whole batch after samples mix, "
            f"and reads {a.name}, a tensor without a batch dimension that the part before "
            "also reads: compute it twice (once for each part) so that each has its own"
        )
    if spec.interleaved:
        raise CaptureError(
            f"node {reader.name} ({_what(reader)}) runs on the whole batch after samples mix, "
            f"and reads {a.name}, whose samples' rows interleave ({spec.shape}); give the "
            "samples a dimension of their own before they mix"
        )


def _writes(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _what(n: fx.Node) -> str:
    stack = n.meta.get("stack_trace")
    if stack:
        lines = [ln.strip() for ln in str(stack).strip().splitlines() if ln.strip()]
        if lines:
            return f"{getattr(n.target, '__name__', n.target)}, at `{lines[-1]}`"
    return str(getattr(n.target, "__name__", n.target))
