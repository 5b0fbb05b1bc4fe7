"""A stage's backward in two parts: its inputs' gradients (``B``), then its parameters' (``W``).

The previous stage waits for ``B``; nobody waits for ``W``, so a zero-bubble schedule runs it
in the bubbles. Together they do one backward's work, each node's once (tied parameters
aside, below):

    B   autograd from the outputs to the stage's inputs only (``inputs=``), keeping the graph.
        Autograd then skips every edge that leads only to parameters: a matmul's node computes
        its input's gradient, not its weight's. On the way, the gradient that reaches each
        *frontier* node is kept: a node ``B`` runs that also has an edge, skipped, towards a
        parameter.
    W   per group of parameters that share frontier nodes, autograd from those nodes with the
        kept gradients to the group's parameters only: each frontier node now computes its
        parameter side, and the nodes between it and a parameter (a transpose, a sum over a
        broadcast) run for the first time. Gradients accumulate into ``.grad``.

``W`` is for the weight matrices and kernels (parameters of two or more dimensions), whose
gradient is a GEMM or convolution of its own, as in the zero-bubble paper. A vector's
gradient (a bias, a normalization's scale) comes out of the kernel ``B`` runs anyway (a layer
norm's backward makes all three at once), so ``B`` computes it: deferring it would run that
kernel twice (4 GPT layers on the CPU: B + W 13-15 % over one backward with every parameter
in W, 1.5-5 % with vectors in B).

Where no input of the stage needs a gradient (a first stage, fed the ids), nobody waits for
its ``B``: ``B`` does nothing and ``W`` runs the one whole backward, every parameter's gradient
included, as torch.distributed.pipelining runs a first stage (split, the embeddings and first two
layers of the benchmarks' GPT took 37-40 % longer than one backward on the CPU, their ``W``
running the first layer's attention backward again); between ``B`` and ``W`` such a
micro-batch is held whole.

Where no path from an output to an input passes by a parameter's nodes (a bias added after the
last matmul), that parameter's frontier is the output's own node, with the output's gradient.
A parameter whose frontier nodes lie one below another (a weight read at two depths of the
stage, as layers that share their weights read it) is computed in ``B`` with the vectors:
``W`` from both nodes would run every node between them again, where ``B``, which runs them
anyway, only adds the parameter's own side.

Between ``B`` and ``W`` a micro-batch holds only what ``W`` reads: the forward of a micro-batch
whose backward is split runs under ``keeping_for_split`` (saved-tensor hooks that put each
saved tensor in a ``Held`` box), and ``B`` empties each box it unpacks for a node that ``W``
will not run, so that the tensor goes as soon as that node is done, as in a backward that
keeps no graph. The saved tensors of normalizations, activations and attention go; the
inputs of the weight GEMMs stay (on a BERT-large layer ``W`` reads 16 % of the forward's saved
bytes, and the gradients kept for its frontier nodes are 22 % more:
``benchmarks/split_backward_memory.py``). The rest of the graph lives until ``W`` has run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

# what torch.autograd.backward calls once it has checked its arguments (None: the public call)
_ENGINE: Callable[..., Any] | None = getattr(torch.autograd.graph, "_engine_run_backward", None)

__all__ = ["Held", "SavedBoxes", "WeightWork", "backward_inputs", "backward_weights",
           "keeping_for_split"]


class Held:
    """A saved tensor of a forward whose backward is split; ``B`` empties the box where no
    node of ``W`` reads it. It holds no node (the node holds it: a cycle would keep the
    graph alive)."""

    __slots__ = ("tensor", "drop", "name")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.drop: bool | None = None  # set by the first unpack during B
        self.name = ""


class SavedBoxes(list[Held]):
    """A forward's boxes; while ``B`` runs, ``w_nodes`` holds the nodes ``W`` will run."""

    w_nodes: set[Node] | None = None


def keeping_for_split(boxes: SavedBoxes) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks for a forward whose backward ``backward_inputs`` will split: every
    saved tensor goes into a ``Held`` appended to ``boxes`` (hand them to
    ``backward_inputs``)."""

    def pack(t: torch.Tensor) -> Held:
        # its data only: a node's saved output holds that node as its grad_fn, and the node
        # holds the box, a cycle no collector sees through (the backward needs no grad_fn)
        box = Held(t.detach())
        boxes.append(box)
        return box

    def unpack(box: Held) -> torch.Tensor:
        if box.drop is None and boxes.w_nodes is not None:
            node = torch._C._current_autograd_node()
            box.drop = node is not None and node not in boxes.w_nodes
            box.name = node.name() if node is not None else ""
        t = box.tensor
        if t is None:
            raise RuntimeError(
                f"rannc_fx: {box.name or 'a node'} read a tensor that the split backward's B "
                "dropped as one its W does not read")
        if box.drop:  # its node has it now and runs no more: gone when it is done, as a
            box.tensor = None  # backward that keeps no graph frees it
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@dataclass
class _Group:
    params: list[torch.Tensor] = field(default_factory=list)
    frontier: list[Node] = field(default_factory=list)  # kept gradients: captured in B
    seeded: list[tuple[Node, int, torch.Tensor]] = field(default_factory=list)  # outputs'
    nodes: set[Node] = field(default_factory=set)  # from its frontier to its parameters


@dataclass
class WeightWork:
    """What ``backward_weights`` needs from ``backward_inputs``: per parameter group, its
    frontier nodes and the gradients kept for them. Holding it holds the graph."""

    groups: list[_Group]
    kept: dict[Node, tuple[torch.Tensor | None, ...]]


def backward_inputs(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    saved: SavedBoxes | None = None,
) -> WeightWork:
    """``B``: the gradients of ``inputs`` and of ``params`` of fewer than two dimensions
    (and of those ``W`` would reach twice), accumulated into their ``.grad``, from
    ``outputs`` seeded with ``grads``; returns what ``backward_weights`` needs for the other
    ``params``' (those that require a gradient; the others are left alone). Where no input
    needs a gradient, nothing: ``W`` runs the whole backward. ``saved``: the forward's boxes
    (``keeping_for_split``), emptied where no node of ``W`` reads them."""
    roots = [get_gradient_edge(o) for o in outputs]
    trainable = [p for p in params if p.requires_grad]
    if not any(x.requires_grad for x in inputs):
        # nobody waits for this B (a first stage): W runs the one whole backward
        whole = _Group(params=trainable, seeded=[
            (e.node, e.output_nr, g) for e, g in zip(roots, grads, strict=True)])
        return WeightWork([whole] if trainable else [], {})
    parents = _parents([e.node for e in roots])
    matrices = [p for p in trainable if p.dim() >= 2]
    wanted = [x for x in inputs if x.requires_grad] + [p for p in trainable if p.dim() < 2]
    while True:
        on_path = _above({get_gradient_edge(x).node for x in wanted}, parents)
        groups = _groups(roots, grads, matrices, parents, on_path)
        # a group whose W would run nodes again (one of its starts below another) is
        # computed in B: its nodes run once there, and B's path to it runs anyway
        again = [p for g in groups if _runs_again(g) for p in g.params]
        if not again:
            break
        wanted += again
        matrices = [p for p in matrices if all(p is not q for q in again)]
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    if saved is not None:
        saved.w_nodes = _run_by_w(groups)
    hooks = []
    for g in groups:
        for node in g.frontier:
            def keep(grad_outputs: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
                kept[node] = grad_outputs
            hooks.append(node.register_prehook(keep))
    try:
        if wanted:
            _backward(outputs, grads, wanted)
    finally:
        for h in hooks:
            h.remove()
        if saved is not None:
            saved.w_nodes = None
    return WeightWork(groups, kept)


def _run_by_w(groups: list[_Group]) -> set[Node]:
    """The nodes ``W`` runs: each group's nodes from its parameters up to its frontier (no
    start of a group lies below another: ``_runs_again``)."""
    out: set[Node] = set()
    for g in groups:
        out |= g.nodes
    return out


def _runs_again(g: _Group) -> bool:
    """Whether one of the group's start nodes lies below another: ``W`` from both would run
    the nodes between them a second time (one walk down from all of them)."""
    starts = set(g.frontier) | {node for node, _, _ in g.seeded}
    if len(starts) < 2:
        return False
    seen: set[Node] = set()
    queue = deque(c for s in starts for c, _ in s.next_functions if c is not None)
    while queue:
        node = queue.popleft()
        if node in starts:
            return True
        if node not in seen:
            seen.add(node)
            queue.extend(c for c, _ in node.next_functions if c is not None)
    return False


def backward_weights(work: WeightWork) -> None:
    """``W``: the parameters' gradients, accumulated into their ``.grad``. Frees the graph
    (once nothing else holds its outputs)."""
    for g in work.groups:
        edges: list[GradientEdge] = []
        seeds: list[torch.Tensor] = []
        for node in g.frontier:
            for i, grad in enumerate(work.kept.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(grad)
        for node, i, grad in g.seeded:
            edges.append(GradientEdge(node, i))
            seeds.append(grad)
        if not edges:
            continue
        # no start lies below another (``_runs_again``): each gets its seed, nothing more
        _backward(edges, seeds, g.params)
    work.groups, work.kept = [], {}


def _backward(roots: Sequence[torch.Tensor] | Sequence[GradientEdge],
              seeds: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(roots, seeds, inputs=inputs, retain_graph=True)`` without
    its checks of the seeds against the roots (which read every root node's input metadata:
    about 45 us a call on the CPU, 11-17 % of a 2-layer GPT stage's ``W`` at 64 tokens a
    micro-batch, whose 8 weight groups make 8 calls): the seeds are the gradients autograd
    made for those very nodes, or the outputs' gradients, made in their shapes and types."""
    if _ENGINE is None:
        torch.autograd.backward(roots, list(seeds), inputs=list(inputs), retain_graph=True)
        return
    _ENGINE(tuple(roots), tuple(seeds), True, False, tuple(inputs), allow_unreachable=True,
            accumulate_grad=True)


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node below ``roots`` -> the nodes whose backward feeds it."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    queue = deque(dict.fromkeys(roots))
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _above(nodes: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node with a path down to one of them."""
    out = {n for n in nodes if n in parents}
    queue = deque(out)
    while queue:
        for p in parents[queue.popleft()]:
            if p not in out:
                out.add(p)
                queue.append(p)
    return out


def _groups(roots: list[GradientEdge], grads: Sequence[torch.Tensor],
            params: Sequence[torch.Tensor], parents: dict[Node, list[Node]],
            on_path: set[Node]) -> list[_Group]:
    """Parameters grouped by the frontier nodes they share (union-find over the nodes found
    walking up from each parameter until the path to the inputs, or an output, is met)."""
    seeds: dict[Node, list[tuple[int, torch.Tensor]]] = {}
    for e, seed in zip(roots, grads, strict=True):
        seeds.setdefault(e.node, []).append((e.output_nr, seed))
    owner: dict[Node, int] = {}  # frontier or seeded node -> group index (union-find root)
    link: list[int] = []

    def find(i: int) -> int:
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i

    members: list[tuple[torch.Tensor, set[Node], int, set[Node]]] = []
    for p in params:
        if not p.requires_grad:
            continue
        acc = get_gradient_edge(p).node
        if acc not in parents:
            continue  # no output depends on it here
        found: set[Node] = set()
        seen = {acc}
        queue = deque([acc])
        while queue:
            node = queue.popleft()
            if node in on_path:
                found.add(node)
                continue
            if node in seeds:
                found.add(node)  # an output's node: its seed reaches the parameter
            for q in parents[node]:
                if q not in seen:
                    seen.add(q)
                    queue.append(q)
        gid = len(link)
        link.append(gid)
        members.append((p, found, gid, seen))
        for node in found:
            if node in owner:
                link[find(owner[node])] = find(gid)
            owner[node] = gid
    groups: dict[int, _Group] = {}
    done: set[Node] = set()
    for p, found, gid, seen in members:
        group = groups.setdefault(find(gid) if found else -1, _Group())
        group.params.append(p)
        group.nodes |= seen
        for node in found:
            if node in done:
                continue
            done.add(node)
            if node in on_path:
                group.frontier.append(node)
            else:
                group.seeded.extend((node, i, grad) for i, grad in seeds[node])
    groups.pop(-1, None)
    return list(groups.values())
