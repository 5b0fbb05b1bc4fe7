"""What crosses a block boundary: values (a recomputed one never does) and the state a block reads.

The coarsening weighs each cut by the bytes crossing it, ``BlockGraph`` names the values
crossing each cut and the parameters and buffers each block reads, and the split rebuilds a
recomputed value (a size, a mask made from buffers) inside every stage that reads it instead of
sending it.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Hashable, Sequence

import numpy as np
import torch
from torch import fx

from ..capture.capture import CapturedGraph
from ..plan.values import ValueSpec
from .ops import CALL_OPS, _alias_base, _is_random, _mutated_args, _state, written_state

__all__ = [
    "block_params",
    "crossing_values",
    "recompute_chain",
    "recomputed_values",
]


# -- recomputed values -----------------------------------------------------------------------


def _kind(values: dict[str, ValueSpec], node: fx.Node) -> str:
    spec = values.get(node.name)
    return spec.kind if spec is not None else "constant"


def _trainable(gm: fx.GraphModule, node: fx.Node) -> bool:
    t = operator.attrgetter(str(node.target))(gm)
    return isinstance(t, torch.nn.Parameter) and t.requires_grad


# per graph module, its answers by what they depend on (``_depends``): planning asks again for
# the same graph with every candidate plan it builds
_ANSWERS: weakref.WeakKeyDictionary[fx.GraphModule, dict[Hashable, frozenset[str]]] = (
    weakref.WeakKeyDictionary())


def _depends(gm: fx.GraphModule, values: dict[str, ValueSpec]) -> Hashable:
    """What ``recomputed_values`` reads besides the graph's ops: the nodes in order, which
    call nodes' values are integers, and the state each ``get_attr`` reads (which tensor,
    whether it trains)."""
    nodes = list(gm.graph.nodes)
    return (tuple(n.name for n in nodes),
            tuple(_kind(values, n) in ("int", "ints") for n in nodes if n.op in CALL_OPS),
            tuple((id(_state(n, gm)), _trainable(gm, n)) for n in nodes if n.op == "get_attr"))


def recomputed_values(gm: fx.GraphModule, values: dict[str, ValueSpec]) -> frozenset[str]:
    """Values that never cross a stage boundary because a consumer stage recomputes them.

    Integers (kind ``int``/``ints``: from the sample count) and data-free values: call
    functions/methods (no modules) whose inputs are only buffers, constants, frozen
    parameters, integers and other data-free values, that are deterministic and that no
    in-place op writes (nor any alias of them), reading no tensor the forward writes (its
    value depends on where it is read, and another stage's copy is never written).
    """
    answers = _ANSWERS.setdefault(gm, {})
    key = _depends(gm, values)
    if key not in answers:
        answers[key] = _recomputed(gm, values)
    return answers[key]


def _recomputed(gm: fx.GraphModule, values: dict[str, ValueSpec]) -> frozenset[str]:
    nodes = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    written = {_alias_base(m) for n in nodes for m in _mutated_args(n, gm)}
    written_ids = set(written_state(gm))
    out: set[str] = set()
    for n in nodes:
        kind = _kind(values, n)
        if kind in ("int", "ints"):
            out.add(n.name)
            continue
        if (n.op == "call_module" or _is_random(n) or _mutated_args(n, gm)
                or _alias_base(n) in written or n in written
                or any(id(_state(a, gm)) in written_ids for a in n.all_input_nodes
                       if a.op == "get_attr")):
            continue
        if all(
            (a.op == "get_attr" and not _trainable(gm, a)) or a.name in out
            for a in n.all_input_nodes
        ):
            out.add(n.name)
    return frozenset(out)


def recompute_chain(node: fx.Node, recomputed: frozenset[str] | set[str],
                    values: dict[str, ValueSpec]) -> list[fx.Node]:
    """The data-free nodes a stage runs to recompute ``node``, in node order (ints excluded)."""
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n.name not in recomputed or _kind(values, n) in ("int", "ints"):
            continue
        seen[n] = None
        stack.extend(n.all_input_nodes)
    return sorted(seen)  # fx nodes compare by their place in the graph (O(chain), not O(graph))


# -- what crosses a cut ----------------------------------------------------------------------


def crossing_values(
    gm: fx.GraphModule, position: dict[str, int], num: int, recomputed: frozenset[str]
) -> list[list[str]]:
    """``out[k]``: the values crossing the cut before position ``k`` (0..num), in node order.

    ``position`` maps each call node to its block (or group) index. Recomputed values are
    left out; graph inputs and parameters are not produced by a block.
    """
    out: list[list[str]] = [[] for _ in range(num + 1)]
    for n in gm.graph.nodes:
        p = position.get(n.name)
        if p is None or n.name in recomputed:
            continue
        last = max((position[u.name] for u in n.users if u.name in position), default=p)
        for k in range(p + 1, last + 1):
            out[k].append(n.name)
    return out


def _cut_bytes(gm: fx.GraphModule, position: dict[str, int], num: int,
               values: dict[str, ValueSpec], recomputed: frozenset[str],
               samples: int) -> np.ndarray:
    """Bytes crossing the cut before each position, by a difference array (O(nodes))."""
    diff = np.zeros(num + 2)
    for n in gm.graph.nodes:
        p = position.get(n.name)
        spec = values.get(n.name)
        if p is None or spec is None or spec.kind != "tensor" or n.name in recomputed:
            continue
        last = max((position[u.name] for u in n.users if u.name in position), default=p)
        if last > p:
            nbytes = spec.nbytes_for(samples)
            diff[p + 1] += nbytes
            diff[last + 1] -= nbytes
    return np.cumsum(diff)[: num + 1]


def block_params(captured: CapturedGraph, blocks: Sequence[Sequence[str]],
                 values: dict[str, ValueSpec], *, recomputed: frozenset[str] | None = None
                 ) -> list[list[str]]:
    """Per block, the canonical names of the parameters, buffers and tensor constants it reads.

    A block that reads a recomputed value made in another block also reads what recomputing
    it reads. ``recomputed``: ``recomputed_values`` of the graph, if the caller has them.
    """
    gm = captured.gm
    canon = _canonical_names(captured)
    if recomputed is None:
        recomputed = recomputed_values(gm, values)
    by_name = {n.name: n for n in gm.graph.nodes}
    block_of = {name: b for b, names in enumerate(blocks) for name in names}
    out: list[list[str]] = []
    for b, names in enumerate(blocks):
        seen: dict[str, None] = {}
        reads: list[fx.Node] = []
        for name in names:
            node = by_name[name]
            reads.append(node)
            for a in node.all_input_nodes:
                if a.name in recomputed and block_of.get(a.name) != b:
                    reads.extend(recompute_chain(a, recomputed, values))
        for node in reads:
            for a in node.all_input_nodes:
                if a.op == "get_attr":
                    target = str(a.target)
                    if isinstance(operator.attrgetter(target)(gm), torch.Tensor):
                        seen.setdefault(canon.get(target, target))
            if node.op == "call_module":
                mod = gm.get_submodule(str(node.target))
                prefix = f"{node.target}."
                for pname, _ in _tensors_of(mod):
                    full = prefix + pname
                    seen.setdefault(canon.get(full, full))
        out.append(list(seen))
    return out


def _tensors_of(mod: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *mod.named_parameters(remove_duplicate=False),
        *mod.named_buffers(remove_duplicate=False),
    ]


def _canonical_names(captured: CapturedGraph) -> dict[str, str]:
    """Every parameter/buffer name -> the one name its tensor goes by (first seen, or aliases)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in _tensors_of(captured.gm):
        out[name] = captured.aliases.get(name) or first.setdefault(id(t), name)
    return out
