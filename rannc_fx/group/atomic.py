"""Atomic grouping: union-find over the call nodes, then the groups in a topological order.

Nodes that must never be cut apart (see ``group``'s docstring for the list) share a group;
the groups are ordered along the chain the search cuts, merging any that lie on a cycle of
the quotient graph, so that every group boundary is a valid cut.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from torch import fx

from ..plan.values import ValueSpec
from ..shapes.tail import TAIL
from .boundary import _kind, _tensors_of, recomputed_values
from .ops import (
    CALL_OPS,
    _alias_base,
    _module_writes,
    _mutated_args,
    _op_name,
    _state,
    is_view,
)

__all__ = ["atomic_groups"]


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        p = self.parent
        root = i
        while p[root] != root:
            root = p[root]
        while p[i] != root:
            p[i], i = root, p[i]
        return root

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def _interleaved(values: dict[str, ValueSpec], node: fx.Node) -> bool:
    spec = values.get(node.name)
    return spec is not None and spec.interleaved


def _param_only(nodes: Sequence[fx.Node], index: dict[fx.Node, int],
                values: dict[str, ValueSpec], free: frozenset[str]) -> list[bool]:
    """Per node: it reads only parameters, buffers, sizes and other such nodes (no data)."""
    out = [False] * len(nodes)
    for i, n in enumerate(nodes):
        if n.name in free or _kind(values, n) != "tensor":
            continue
        out[i] = all(
            a.op == "get_attr" or a.name in free or (a in index and out[index[a]])
            for a in n.all_input_nodes
        )
    return out


def _batch_bound(nodes: Sequence[fx.Node], index: dict[fx.Node, int],
                 values: dict[str, ValueSpec], free: frozenset[str]) -> list[bool]:
    """Per node: a tensor without a batch dimension computed from the batch (a partial loss such
    as BERT's masked-LM term before it is added to the next-sentence one, a batch statistic).
    Each replica of a stage computes its own from its own samples, but the runtime moves a cut
    value without a batch dimension whole, from one producer replica to each consumer replica
    (``routing.cut_transfers``): across stages with different replica counts the other
    replicas' parts would be dropped. So such a value never crosses a stage boundary."""
    def batched(a: fx.Node) -> bool:
        spec = values.get(a.name)
        return spec is not None and spec.kind == "tensor" and spec.batch_dim is not None

    dep = [False] * len(nodes)  # reads the batch, directly or through other nodes
    out = [False] * len(nodes)
    for i, n in enumerate(nodes):
        if n.name in free:
            continue
        dep[i] = any(batched(a) or (a in index and dep[index[a]]) for a in n.all_input_nodes)
        spec = values.get(n.name)
        out[i] = dep[i] and spec is not None and spec.kind == "tensor" and spec.batch_dim is None
    return out


def _anchors(nodes: list[fx.Node], index: dict[fx.Node, int],
             free: frozenset[str]) -> list[fx.Node | None]:
    """Per node, the first (in node order) non-recomputed node among its transitive readers."""
    out: list[fx.Node | None] = [None] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        best: fx.Node | None = None
        for u in nodes[i].users:
            j = index.get(u)
            if j is None:
                continue
            cand = u if u.name not in free else out[j]
            if cand is not None and (best is None or index[cand] < index[best]):
                best = cand
        out[i] = best
    return out


def atomic_groups(gm: fx.GraphModule, values: dict[str, ValueSpec], *,
                  free: frozenset[str] | None = None) -> list[list[str]]:
    """The atomic groups of the call nodes, in topological (chain) order, node order inside.

    ``free``: ``recomputed_values`` of the graph, if the caller has them already.
    """
    nodes = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    index = {n: i for i, n in enumerate(nodes)}
    uf = _UnionFind(len(nodes))
    if free is None:
        free = recomputed_values(gm, values)
    _union_atomic(gm, nodes, index, values, uf, free)
    groups = _ordered_groups(nodes, index, uf, {index[n] for n in nodes if n.name in free})
    # a group of recomputed values only (dead code: nothing reads it) would be an empty block:
    # it joins the next group (it orders nothing, so any place is valid)
    out: list[list[int]] = []
    pending: list[int] = []
    for g in groups:
        if all(nodes[i].name in free for i in g):
            pending.extend(g)
            continue
        out.append(sorted(pending + g))
        pending = []
    if pending:
        if out:
            out[-1] = sorted(out[-1] + pending)
        else:
            out.append(pending)
    return [[nodes[i].name for i in g] for g in out]


def _union_atomic(gm: fx.GraphModule, nodes: list[fx.Node], index: dict[fx.Node, int],
                  values: dict[str, ValueSpec], uf: _UnionFind, free: frozenset[str]) -> None:
    param_only = _param_only(nodes, index, values, free)
    batch_bound = _batch_bound(nodes, index, values, free)
    # readers of each alias class (keyed by its base value; a parameter, buffer or constant
    # by the tensor, whichever get_attr node or module reads it), in node order
    readers: dict[object, list[fx.Node]] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            readers.setdefault(_alias_key(a, gm), []).append(n)
        if n.op == "call_module":
            for _, t in _tensors_of(gm.get_submodule(str(n.target))):
                readers.setdefault(id(t), []).append(n)
    anchor = _anchors(nodes, index, free)
    for i, n in enumerate(nodes):
        users = [u for u in n.users if u in index]
        first_user = min(users, key=index.__getitem__) if users else None
        first_in = next((a for a in n.all_input_nodes if a in index), None)
        if n.name in free:
            # a size goes with the value it measures; a data-free value (or a size of a graph
            # input) with the first node that needs it, so no block holds only such values
            data = next((a for a in n.all_input_nodes if a in index and a.name not in free), None)
            target = data if data is not None else anchor[i] if anchor[i] is not None else (
                first_user if first_user is not None else first_in)
            if target is not None:
                uf.union(i, index[target])
            continue
        if _kind(values, n) == "constant" or _interleaved(values, n) or batch_bound[i]:
            for u in users:
                uf.union(i, index[u])
        if param_only[i] and first_user is not None:
            uf.union(i, index[first_user])
        if not n.users and first_in is not None:
            uf.union(i, index[first_in])
        src = n.args[0] if n.args else None
        if ((is_view(n) or _op_name(n) == "getitem") and isinstance(src, fx.Node)
                and src in index and src.name not in free):
            uf.union(i, index[src])
        for m in _mutated_args(n, gm):
            base = _alias_base(m)
            if m in index:
                uf.union(i, index[m])
            if base in index:
                uf.union(i, index[base])
            # a reader that ran before the write must stay with it: a later stage would see
            # the written value; a value from outside the chain (input, buffer) is read by
            # whichever stage holds each reader, so all of its readers stay with the write
            for r in readers.get(_alias_key(base, gm), ()):
                if base.op in ("placeholder", "get_attr") or index[r] < i:
                    uf.union(i, index[r])
        for _, t in _module_writes(n, gm):  # a normalization layer called in several places
            for r in readers.get(id(t), ()):
                uf.union(i, index[r])
    # the tail that runs on the whole batch, with the clones of what it reads: the last block
    tail = [i for i, n in enumerate(nodes) if n.meta.get(TAIL)]
    for i in tail[1:]:
        uf.union(tail[0], i)


def _alias_key(node: fx.Node, gm: fx.GraphModule) -> object:
    """What ``node`` aliases: the tensor's id for a parameter, buffer or constant (read by
    any number of get_attr nodes, under any of its names), else its base node."""
    t = _state(node, gm)
    return id(t) if t is not None else _alias_base(node)


def _ordered_groups(nodes: list[fx.Node], index: dict[fx.Node, int], uf: _UnionFind,
                    unordered: set[int]) -> list[list[int]]:
    """Groups in a topological order of the quotient graph, cycles merged, node order kept.

    Edges out of ``unordered`` nodes (recomputed values) do not order groups: a reader
    recomputes such a value wherever its producer ends up.
    """
    roots = [uf.find(i) for i in range(len(nodes))]
    edges: set[tuple[int, int]] = set()
    for i, n in enumerate(nodes):
        if i in unordered:
            continue
        for u in n.users:
            j = index.get(u)
            if j is not None and roots[i] != roots[j]:
                edges.add((roots[i], roots[j]))
    for comp in _sccs(sorted(set(roots)), edges):
        for r in comp[1:]:
            uf.union(comp[0], r)
    roots = [uf.find(i) for i in range(len(nodes))]
    succ: dict[int, set[int]] = {}
    indeg: dict[int, int] = {r: 0 for r in roots}
    for a, b in edges:
        ra, rb = uf.find(a), uf.find(b)
        if ra != rb and rb not in succ.setdefault(ra, set()):
            succ[ra].add(rb)
            indeg[rb] += 1
    members: dict[int, list[int]] = {}
    for i, r in enumerate(roots):
        members.setdefault(r, []).append(i)
    # a group's root is its smallest node index: the heap releases groups in node order
    ready = [r for r, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    order: list[list[int]] = []
    while ready:
        r = heapq.heappop(ready)
        order.append(members[r])
        for s in succ.get(r, ()):
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, s)
    assert len(order) == len(members), "cycle left in the quotient graph"
    return order


def _sccs(vertices: list[int], edges: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Strongly connected components with more than one vertex (iterative Tarjan)."""
    succ: dict[int, list[int]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
    num: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    out: list[list[int]] = []
    for v0 in vertices:
        if v0 in num:
            continue
        work = [(v0, 0)]
        while work:
            v, k = work.pop()
            if k == 0:
                num[v] = low[v] = len(num)
                stack.append(v)
                on_stack.add(v)
            nxt = succ.get(v, [])
            if k < len(nxt):
                work.append((v, k + 1))
                w = nxt[k]
                if w not in num:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], num[w])
                continue
            if low[v] == num[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out
