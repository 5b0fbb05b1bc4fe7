"""Group nodes into atomic blocks and coarsen them into the chain the search cuts.

Two steps, as in RaNNC:

1. *Atomic grouping* (union-find over nodes). Nodes that must never be cut apart share a
   group: a view or alias with the node producing its input, an in-place op with the value it
   mutates (and with that value's earlier readers, so none of them can run after the write),
   a ``getitem`` with its multi-output op, a parameter-only node (a weight transpose or cast
   that reads only parameters, buffers and sizes) with its first consumer, a node whose value
   is never read (an assert) with its producer, and a value that is neither a tensor nor an
   int with every reader (``ValueSpec.kind == "constant"``: dtypes, devices, tuples of
   tensors). Groups are then ordered topologically, in the original node order where the
   edges allow; groups on a cycle of the quotient graph are merged first.

   Some values never cross a stage boundary because the consumer stage recomputes them
   (``recomputed_values``): integers (sizes; from the stage's sample count) and *data-free*
   values (attention masks, position ids: deterministic values computed only from buffers,
   constants, sizes and other such values, never written in place, reading no trainable
   parameter and no tensor the forward writes; the consumer stage runs their chain again).
   They only join their first consumer's group and are not counted at boundaries.

   Every stage that reads a buffer or constant holds its own copy (the same values on every
   stage), so a tensor the forward writes (``written_state``: a BatchNorm's running
   statistics, a counter ``add_``-ed in place) has all its readers in the writer's group: a
   stage boundary between them would leave the other stages' copies stale.

2. *Coarsening*. While there are more than ``max_blocks`` blocks, the adjacent pair whose
   boundary carries the most bytes per second of compute on its smaller side is merged
   (communication-heavy cuts go first), using a heap.
"""

from __future__ import annotations

import heapq
import inspect
import operator
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import fx, nn

from ..plan import ValueSpec
from ..progress import note
from .capture import CapturedGraph
from .profile import Profile

__all__ = [
    "CALL_OPS",
    "BlockGraph",
    "atomic_groups",
    "block_params",
    "crossing_values",
    "group_pass",
    "is_inplace",
    "is_view",
    "recompute_chain",
    "recomputed_values",
    "written_state",
]

CALL_OPS = ("call_function", "call_method", "call_module")

# Python-level ops whose result aliases their first argument.
_VIEW_NAMES = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as",
    "t", "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "slice", "chunk",
    "split", "split_with_sizes", "tensor_split", "unbind", "contiguous", "detach", "alias",
    "as_strided", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "unfold", "real",
    "imag", "view_as_real", "view_as_complex", "to", "type_as", "getitem", "T", "mT", "H",
    "mH", "data",
})
_RANDOM_NAMES = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "poisson", "native_dropout",
})
# aten's batch-norm family updates its running statistics in place though the schemas do not
# say so (``_native_batch_norm_legit`` and ``_batch_norm_with_update`` do: ``Tensor(a!)``)
_RUNNING_STATS_OPS = frozenset({
    "batch_norm", "native_batch_norm", "instance_norm", "_batch_norm_impl_index",
    "cudnn_batch_norm",
})
_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
})


class BlockGraph(BaseModel):
    """The chain of blocks in topological order.

    A value is produced in a block no later than any block reading it, except a recomputed
    value (``recomputed_values``: sizes, data-free values such as masks), which a reader
    recomputes wherever its producer is.

    Every call node (call_function / call_method / call_module) is in exactly one block;
    placeholders, get_attr and output nodes are in none (a stage takes the graph inputs and
    parameters it uses directly). ``params[b]`` names the parameters and buffers block ``b``
    reads, each under its canonical name (a tied parameter under the name
    ``CapturedGraph.aliases`` maps its other names to). ``boundary[k]`` names the values that
    cross the cut before block ``k`` (produced by a node in a block < k, read by one in a
    block >= k), in node order; ``boundary[0]`` and ``boundary[B]`` are empty. Graph inputs
    never count as crossing: every stage reads them from the data. Integer values never count
    either: the split pass recomputes them where they are read.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: tuple[tuple[str, ...], ...]
    params: tuple[tuple[str, ...], ...]
    boundary: tuple[tuple[str, ...], ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_of(self) -> dict[str, int]:
        """Node name -> block index."""
        return {n: b for b, names in enumerate(self.blocks) for n in names}


# -- what an op is ---------------------------------------------------------------------------


def _op_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if t is getattr and len(node.args) > 1:
        return str(node.args[1])
    return getattr(t, "__name__", str(t))


def is_view(node: fx.Node) -> bool:
    """Whether the node's output may alias its first input (a view, a slice, a no-op cast)."""
    if node.op not in ("call_function", "call_method"):
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        rets = t._schema.returns
        return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write
    return _op_name(node) in _VIEW_NAMES


def _mutated_args(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """The inputs an in-place op writes to (empty for pure ops)."""
    t = node.target
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op == "call_module":
        mod = gm.get_submodule(str(t))
        return first if getattr(mod, "inplace", False) is True else []
    if node.op not in ("call_function", "call_method"):
        return []
    name = _op_name(node)
    if name in _RUNNING_STATS_OPS:
        return _running_stats(node)
    if isinstance(t, torch._ops.OpOverload):
        out = []
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                if isinstance(v, fx.Node):
                    out.append(v)
        return out
    if t in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return first
    if name.endswith("_") and not name.startswith("_"):
        return first
    return []


def _running_stats(node: fx.Node) -> list[fx.Node]:
    """The running statistics a batch-norm-family op updates: none with its training flag
    (``training``, ``use_input_stats``) false."""
    bound = _bound_args(node)
    if bound is None:
        return []
    if bound.get("training", bound.get("use_input_stats", True)) is False:
        return []
    return [v for k in ("running_mean", "running_var") if isinstance(v := bound.get(k), fx.Node)]


def _bound_args(node: fx.Node) -> dict[str, object] | None:
    """The node's arguments by parameter name (defaults filled in), when they can be known."""
    t = node.target
    schema = t._schema if isinstance(t, torch._ops.OpOverload) else None
    if schema is None:
        try:
            sig = inspect.signature(t)  # type: ignore[arg-type]  # F.batch_norm
        except (TypeError, ValueError):  # a builtin (torch.batch_norm): aten's schema
            packet = getattr(torch.ops.aten, _op_name(node), None)
            schema = getattr(getattr(packet, "default", None), "_schema", None)
        else:
            try:
                bound = sig.bind(*node.args, **node.kwargs)
            except TypeError:
                return None
            bound.apply_defaults()
            return dict(bound.arguments)
    if schema is None:
        return None
    out: dict[str, object] = {
        a.name: a.default_value for a in schema.arguments if a.has_default_value()
    }
    out.update(zip((a.name for a in schema.arguments), node.args, strict=False))
    out.update(node.kwargs)
    return out


def is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether the node writes to one of its inputs."""
    return bool(_mutated_args(node, gm))


def _state(node: fx.Node, gm: fx.GraphModule) -> torch.Tensor | None:
    """The parameter, buffer or constant that ``node`` (a get_attr, or a view of one) is."""
    base = _alias_base(node)
    if base.op != "get_attr":
        return None
    t = operator.attrgetter(str(base.target))(gm)
    return t if isinstance(t, torch.Tensor) else None


def _module_writes(node: fx.Node, gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """The buffers a ``call_module`` node's module updates itself: a normalization layer's
    running statistics (torch.fx leaves the training flag to run time, so whenever it tracks
    them)."""
    if node.op != "call_module":
        return []
    mod = gm.get_submodule(str(node.target))
    if not (isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats):
        return []
    return [
        (f"{node.target}.{attr}", t)
        for attr in ("running_mean", "running_var", "num_batches_tracked")
        if isinstance(t := getattr(mod, attr, None), torch.Tensor)
    ]


def written_state(gm: fx.GraphModule) -> dict[int, tuple[str, str]]:
    """Parameters, buffers and constants that the forward writes, by ``id``: (a name of the
    tensor, the first node that writes it). In-place ops on them or their views, the
    batch-norm family's running statistics, normalization modules that track them."""
    out: dict[int, tuple[str, str]] = {}
    for n in gm.graph.nodes:
        if n.op not in CALL_OPS:
            continue
        for name, t in _module_writes(n, gm):
            out.setdefault(id(t), (name, n.name))
        for m in _mutated_args(n, gm):
            state = _state(m, gm)
            if state is not None:
                out.setdefault(id(state), (str(_alias_base(m).target), n.name))
    return out


# -- atomic grouping -------------------------------------------------------------------------


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


def _kind(values: dict[str, ValueSpec], node: fx.Node) -> str:
    spec = values.get(node.name)
    return spec.kind if spec is not None else "constant"


def _interleaved(values: dict[str, ValueSpec], node: fx.Node) -> bool:
    spec = values.get(node.name)
    return spec is not None and spec.interleaved


def _is_random(node: fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in t.tags
    return _op_name(node) in _RANDOM_NAMES


def _alias_base(node: fx.Node) -> fx.Node:
    while node.op in CALL_OPS and is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _trainable(gm: fx.GraphModule, node: fx.Node) -> bool:
    t = operator.attrgetter(str(node.target))(gm)
    return isinstance(t, torch.nn.Parameter) and t.requires_grad


def recomputed_values(gm: fx.GraphModule, values: dict[str, ValueSpec]) -> frozenset[str]:
    """Values that never cross a stage boundary because a consumer stage recomputes them.

    Integers (kind ``int``/``ints``: from the sample count) and data-free values: call
    functions/methods (no modules) whose inputs are only buffers, constants, frozen
    parameters, integers and other data-free values, that are deterministic and that no
    in-place op writes (nor any alias of them), reading no tensor the forward writes (its
    value depends on where it is read, and another stage's copy is never written).
    """
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
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


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


def atomic_groups(gm: fx.GraphModule, values: dict[str, ValueSpec]) -> list[list[str]]:
    """The atomic groups of the call nodes, in topological (chain) order, node order inside."""
    nodes = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    index = {n: i for i, n in enumerate(nodes)}
    uf = _UnionFind(len(nodes))
    _union_atomic(gm, nodes, index, values, uf)
    free = recomputed_values(gm, values)
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
                  values: dict[str, ValueSpec], uf: _UnionFind) -> None:
    free = recomputed_values(gm, values)
    param_only = _param_only(nodes, index, values, free)
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
        if _kind(values, n) == "constant" or _interleaved(values, n):
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
                 values: dict[str, ValueSpec]) -> list[list[str]]:
    """Per block, the canonical names of the parameters, buffers and tensor constants it reads.

    A block that reads a recomputed value made in another block also reads what recomputing
    it reads.
    """
    gm = captured.gm
    canon = _canonical_names(captured)
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


# -- coarsening ------------------------------------------------------------------------------


def _representative(profile: Profile) -> int:
    """Index of the profiled size the grouping costs are read at (the middle one)."""
    return (len(profile.batch_sizes) - 1) // 2


def _group_compute(profile: Profile, groups: Sequence[Sequence[str]]) -> np.ndarray:
    k = _representative(profile)
    out = np.zeros(len(groups))
    for g, names in enumerate(groups):
        for n in names:
            c = profile.nodes.get(n)
            if c is not None:
                out[g] += c.fwd_s[k] + c.bwd_s[k]
    return out


def coarsen(compute: np.ndarray, cut: np.ndarray, max_blocks: int) -> list[int]:
    """Start positions of the merged blocks: at most ``max_blocks`` runs of the chain.

    ``compute[g]`` is group g's time and ``cut[k]`` the bytes crossing the cut before group
    k. The boundary with the highest ``cut / compute of its smaller side`` goes first; a
    boundary's bytes never change as others go, only the compute beside it. Of boundaries
    that score the same (identical layers), the one whose merged block is smallest goes first:
    otherwise the first block absorbs one identical layer after another.
    """
    n = len(compute)
    if n <= max_blocks:
        return list(range(n))
    comp = compute.astype(float).copy()  # by block start
    nxt = list(range(1, n + 1))  # start of the next block (n: none)
    prv = list(range(-1, n - 1))  # start of the previous block
    alive = [True] * n  # a start position still begins a block
    eps = max(float(compute.sum()) * 1e-9, 1e-15)

    def key(k: int) -> tuple[float, float]:
        score = (float(cut[k]) + 1.0) / (min(comp[prv[k]], comp[k]) + eps)
        return -score, comp[prv[k]] + comp[k]

    heap = [(*key(k), k, 0) for k in range(1, n)]
    heapq.heapify(heap)
    version = [0] * (n + 1)
    blocks = n
    while blocks > max_blocks:
        _, _, k, ver = heapq.heappop(heap)
        if not alive[k] or ver != version[k]:
            continue
        left = prv[k]
        comp[left] += comp[k]
        alive[k] = False
        nxt[left] = nxt[k]
        if nxt[k] < n:
            prv[nxt[k]] = left
        blocks -= 1
        for b in (left, nxt[left]):
            if 0 < b < n and alive[b]:
                version[b] += 1
                heapq.heappush(heap, (*key(b), b, version[b]))
    return [k for k in range(n) if alive[k]]


def group_pass(
    captured: CapturedGraph,
    profile: Profile,
    values: dict[str, ValueSpec],
    *,
    max_blocks: int,
) -> BlockGraph:
    """Atomic groups of ``captured.gm``'s call nodes, coarsened to at most ``max_blocks``."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks}: need at least one block")
    t0 = time.perf_counter()
    gm = captured.gm
    groups = atomic_groups(gm, values)
    if not groups:
        raise ValueError("the captured graph has no call nodes to group")
    position = {name: g for g, names in enumerate(groups) for name in names}
    samples = profile.batch_sizes[_representative(profile)]
    recomputed = recomputed_values(gm, values)
    cut = _cut_bytes(gm, position, len(groups), values, recomputed, samples)
    starts = coarsen(_group_compute(profile, groups), cut, max_blocks)
    ends = [*starts[1:], len(groups)]
    blocks = [tuple(n for g in groups[s:e] for n in g) for s, e in zip(starts, ends, strict=True)]
    block_of = {name: b for b, names in enumerate(blocks) for name in names}
    out = BlockGraph(
        blocks=tuple(blocks),
        params=tuple(tuple(p) for p in block_params(captured, blocks, values)),
        boundary=tuple(tuple(v) for v in crossing_values(gm, block_of, len(blocks), recomputed)),
    )
    note("grouped %d nodes into %d blocks in %.2f s", len(position), len(blocks),
         time.perf_counter() - t0)
    return out
