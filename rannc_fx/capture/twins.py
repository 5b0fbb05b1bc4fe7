"""Pair the nodes of two captures of one model op by op: its graph in training mode and in
eval mode (``split/restage.py`` gives the second the first's stages).

The two graphs run the same code with ``module.training`` flipped, so they differ only where
that code branches on the mode: a dropout's or batch norm's baked flag (same op, other
arguments), the counters batch norm bumps in training only, a stochastic-depth mask that only
training draws. The nodes that both have are paired by the longest common subsequence of
their signatures, in graph order (``difflib``): op, target, and the module the op was called
from where the capture records it (torch.export's ``nn_module_stack``), so that the twelfth
layer's ``linear`` pairs with the twelfth layer's. A node without a twin exists in one mode
only.

    training   x ─ linear ─ batch_norm(True) ─ add_ ─ new_empty ─ bernoulli_ ─ mul ─ add
    eval       x ─ linear ─ batch_norm(False) ──────────────────────────────────────── add
               (twins: x, linear, batch_norm, add)
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable

from torch import fx
from torch.fx.node import _get_qualified_name

__all__ = ["node_signature", "twins_pass"]


def node_signature(node: fx.Node) -> Hashable:
    """What a node's twin in the other mode's graph has in common with it."""
    if node.op in ("placeholder", "get_attr", "call_module"):
        return node.op, str(node.target)
    if node.op == "output":
        return ("output",)
    target = node.target
    name = _get_qualified_name(target) if callable(target) else str(target)
    stack = node.meta.get("nn_module_stack")
    owner = ""
    if stack:
        last = list(stack.values())[-1]
        owner = str(last[0] if isinstance(last, tuple) else last)
    return node.op, name, owner


def twins_pass(planned: fx.Graph, other: fx.Graph) -> dict[str, str]:
    """``other``'s node name -> the name of its twin in ``planned``, for every node that has
    one (an analysis pass: neither graph changes)."""
    mine, theirs = list(planned.nodes), list(other.nodes)
    matcher = difflib.SequenceMatcher(
        None, [node_signature(n) for n in mine], [node_signature(n) for n in theirs],
        autojunk=False,
    )  # fmt: skip
    out: dict[str, str] = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            out[theirs[block.b + k].name] = mine[block.a + k].name
    return out
