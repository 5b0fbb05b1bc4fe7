"""Where a stage that recomputes layer by layer starts its segments: the model's layers.

A recomputing stage runs its forward again (R) right before each backward. Layer by layer,
R keeps only the values entering each *segment* of the stage, and the backward runs each
segment's forward a third time just before that segment's backward (``runtime/recompute``),
so one segment's activations exist at a time rather than the whole stage's. The segments
are the model's layers, as every framework's activation checkpointing takes them (a
transformer block, a residual block): a node belongs to the innermost submodule on its
``nn_module_stack`` that is an indexed child of a container of alike children (an
``nn.ModuleList`` or ``nn.Sequential`` of one class: ``encoder.layer.3``, a ResNet stage's
``layers.1``; not the children of ``nn.Sequential(BatchNorm1d, Linear, Tanh)``, nor T5's
self-attention and feed-forward sub-layers, ``block.3`` being the layer there), or to none; a
run of nodes of none between two nodes of one layer (a mask made where it is read) belongs
to that layer. A segment starts wherever that changes, moved to the atomic group
start before or after it that fewer bytes cross (``group_atomic``: no in-place write of one
segment reaches another's input), and past any value recomputed where it is read (a mask:
the stage holds a copy under another name).

``layer_segments`` returns the segments' costs for the search (``search.Segments``): each
segment's activations and, for each value that crosses a segment start, its bytes at the
first start it crosses (graph inputs and recomputed values never cross, as for a stage
boundary). None where the graph has no layers to cut at.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch import fx

from ..plan.values import ValueSpec
from ..search import Segments
from .boundary import recomputed_values
from .group import BlockGraph

__all__ = ["layer_segments", "node_layers"]


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(path, class) of each module on the node's module stack, outermost first."""
    return [(str(path), str(cls)) for path, cls in (node.meta.get("nn_module_stack") or {})
            .values()]


def node_layers(nodes: list[fx.Node]) -> list[str | None]:
    """Each node's layer: the innermost module on its stack that is an indexed child of a
    container whose indexed children (as the graph calls them) are all of one class, or
    None; a run of layerless nodes between two of one layer belongs to it."""
    kinds: dict[str, set[str]] = {}
    for n in nodes:
        for path, cls in _stack(n):
            parent, _, index = path.rpartition(".")
            if index.isdigit():
                kinds.setdefault(parent, set()).add(cls)
    lists = {p for p, k in kinds.items() if len(k) == 1}
    layers: list[str | None] = []
    for n in nodes:
        inside = [path for path, _ in _stack(n)
                  if path.rpartition(".")[2].isdigit() and path.rpartition(".")[0] in lists]
        layers.append(inside[-1] if inside else None)
    last: tuple[int, str] | None = None  # the previous node with a layer
    for x, lay in enumerate(layers):
        if lay is None:
            continue
        if last is not None and last[1] == lay and last[0] < x - 1:
            layers[last[0] + 1:x] = [lay] * (x - last[0] - 1)
        last = (x, lay)
    return layers


def _cut(crossing: list[tuple[int, int, np.ndarray]], n: int) -> np.ndarray:
    """Bytes (at the largest size) crossing the place before each of n + 1 positions."""
    diff = np.zeros(n + 2)
    for p, last, nbytes in crossing:
        diff[p + 1] += nbytes[-1]
        diff[last + 1] -= nbytes[-1]
    return np.cumsum(diff)[: n + 1]


def _starts(layers: list[str | None], allowed: list[int], cut: np.ndarray) -> np.ndarray:
    """Segment starts: 0 and each place the layer changes, moved to the group start before
    or after it that fewer bytes cross."""
    allowed = allowed or list(range(len(layers)))
    out = [0]
    for x in range(1, len(layers)):
        if layers[x] == layers[x - 1]:
            continue
        a = int(np.searchsorted(allowed, x, side="right")) - 1
        near = [allowed[c] for c in (a, a + 1) if 0 <= c < len(allowed)]
        if near:
            out.append(min(near, key=lambda y: (cut[y], abs(y - x))))
    return np.unique(np.asarray(out))


def layer_segments(gm: fx.GraphModule, blocks: BlockGraph, values: dict[str, ValueSpec],
                   act: np.ndarray, fwd: np.ndarray,
                   bytes_at: Callable[[ValueSpec], np.ndarray]) -> Segments | None:
    """The segments of the chain ``blocks`` of ``gm``; ``act`` and ``fwd`` (N, Q) are each
    node's saved bytes and forward seconds at each size, the nodes in block order;
    ``bytes_at(spec)`` a value's bytes at each size (as the cost table counts a cut's)."""
    names = [n for b in blocks.blocks for n in b]
    pos = {n: x for x, n in enumerate(names)}
    by_name = {n.name: n for n in gm.graph.nodes}
    layers = node_layers([by_name[n] for n in names])
    N = len(names)
    recomputed = recomputed_values(gm, values)
    crossing: list[tuple[int, int, np.ndarray]] = []  # producer, last reader, bytes by size
    for name in names:
        spec = values.get(name)
        if spec is None or spec.kind != "tensor" or name in recomputed:
            continue
        p = pos[name]
        last = max((pos[u.name] for u in by_name[name].users if u.name in pos), default=p)
        if last > p:
            crossing.append((p, last, bytes_at(spec)))
    xs = _starts(layers, sorted(pos[g] for g in blocks.group_starts if g in pos),
                 _cut(crossing, N))
    # a recomputed value is rebuilt where it is read, under another name: a segment starts
    # at the first node after it that the stage keeps as it is
    xs = np.unique([next((y for y in range(x, N) if names[y] not in recomputed), N) if x else 0
                    for x in xs])
    xs = xs[xs < N]
    if len(xs) < 2:
        return None
    S = len(xs)
    cum = np.concatenate((np.zeros((1, act.shape[1])), np.cumsum(act, axis=0))).T  # (Q, N+1)
    ends = np.append(xs, N)
    seg_act = cum[:, ends[1:]] - cum[:, ends[:-1]]
    kept = np.zeros((act.shape[1], S))
    for p, last, nbytes in crossing:
        t = int(np.searchsorted(xs, p, side="right"))  # the first start after its producer
        if t < S and xs[t] <= last:
            kept[:, t] += nbytes
    posb = np.array([pos[b[0]] for b in blocks.blocks] + [N])
    first = np.searchsorted(xs, posb, side="right") - 1  # as a stage's start
    last_ = np.maximum(np.searchsorted(xs, posb, side="left") - 1, 0)  # as a stage's end
    head = cum[:, ends[np.minimum(first + 1, S)]] - cum[:, posb]
    tail = cum[:, posb] - cum[:, xs[last_]]
    f = np.concatenate((np.zeros((1, fwd.shape[1])), np.cumsum(fwd, axis=0))).T
    return Segments(starts=tuple(names[x] for x in xs), act=seg_act, kept=kept,
                    first=first, last=last_, head=head, tail=tail,
                    tail_fwd=f[:, posb] - f[:, xs[last_]])
