"""How nodes get their costs for the profile: a run of the graph, or a walk over formulas.

Both walks visit the call nodes of one graph at one micro-batch size and return, per node that
ran, its ``OpCost``, the bytes of saved storages charged to it, of those the bytes a kept op made
(``selective.kept``: what selective recomputation keeps instead of rebuilding), and the bytes
held between a split backward's ``B`` and ``W`` charged to it (``opcost_bw``: the storages
the weight GEMMs read, charged as saved ones are, and the gradients kept for them). Saved bytes are charged per storage,
once, to the node that made the storage (a ReLU output that the ReLU and the next Linear both
save counts once, at the ReLU), so summing them over nodes gives what autograd keeps for one
micro-batch, parameters and buffers excluded.

A node that raises at this size (a training-mode BatchNorm that sees one value per channel)
does not end the walk: the walk returns what it raised, by node, beside the rows, and the
nodes after it run on its stand-in (zeros shaped as its value at this size, from the shape
pass's formulas or spec). A node whose input has no value at all does not run either, and is
returned as raising (``NotRun``). The profile rules such sizes out for the nodes' blocks.

    walk_run        runs the graph node by node (real tensors, or fake ones), so each node sees
                    its real inputs; the ledger follows real storages
    walk_formulas   runs nothing per node: each distinct signature (``shapes/symbolic``) is
                    counted once per size on fake tensors built from the formulas, and the
                    ledger follows storages by which input each output views (``OpCost.views``)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from ..progress import Progress
from ..shapes.symbolic import Label, SymbolicValues
from .cache import CostCache, op_key
from .instruments import storage_id, tensors
from .noderun import NodeRunner, as_leaf
from .opcost import OpCost

__all__ = ["Failed", "NotRun", "Row", "StandIn", "WalkStats", "walk_formulas", "walk_run"]


@dataclass
class WalkStats:
    progress: Progress
    measured: int = 0
    hits: int = 0
    keys: set[str] = field(default_factory=set)

    def count(self, *, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.measured += 1
        self.progress.update(self.hits + self.measured, "ops (%d measured, %d from cache)",
                             self.measured, self.hits)


@dataclass
class _SavedLedger:
    """Which storages autograd keeps, charged once each to the node that made them."""

    excluded: frozenset[int]
    owner: dict[int, tuple[StorageWeakRef, str | None]] = field(default_factory=dict)
    kept: dict[int, StorageWeakRef] = field(default_factory=dict)
    charged: dict[str, int] = field(default_factory=dict)
    by_kept_ops: set[int] = field(default_factory=set)  # storages a kept op made
    both: dict[str, int] = field(default_factory=dict)  # of ``charged``, such storages
    w_kept: dict[int, StorageWeakRef] = field(default_factory=dict)  # read by a W
    w_charged: dict[str, int] = field(default_factory=dict)

    def made(self, node: str | None, outs: list[torch.Tensor], ins: list[torch.Tensor],
             kept_outputs: tuple[int, ...] = ()) -> None:
        in_ids = {storage_id(t) for t in ins}
        for i, t in enumerate(outs):
            sid = storage_id(t)
            if sid not in in_ids and sid not in self.excluded:
                self.owner[sid] = (StorageWeakRef(t.untyped_storage()), node)
                if i in kept_outputs:  # set or cleared: a freed storage's id comes back
                    self.by_kept_ops.add(sid)
                else:
                    self.by_kept_ops.discard(sid)

    def keep(self, t: torch.Tensor, saver: str, *, by_w: bool = False) -> None:
        """Charge ``t``'s storage, saved by ``saver`` (``by_w``: read by its split
        backward's W), once to the node that made it."""
        sid = storage_id(t)
        seen = self.w_kept if by_w else self.kept
        if sid in self.excluded or (sid in seen and not seen[sid].expired()):
            return
        st = t.untyped_storage()
        seen[sid] = StorageWeakRef(st)
        ref, node = self.owner.get(sid, (None, None))
        who = node if ref is not None and not ref.expired() and node is not None else saver
        charged = self.w_charged if by_w else self.charged
        charged[who] = charged.get(who, 0) + st.nbytes()
        if sid in self.by_kept_ops and not by_w:
            self.both[who] = self.both.get(who, 0) + st.nbytes()


def _last_uses(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Node -> the values no later node reads, to free after it runs."""
    seen: set[fx.Node] = set()
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in reversed(graph.nodes):
        for inp in node.all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                out.setdefault(node, []).append(inp)
    return out


# the op's cost, the bytes of saved storages charged to the node, of those a kept op's, and
# the bytes held between a split backward's B and W charged to it
Row = tuple[OpCost, int, int, int]


def _charge(ledger: _SavedLedger | _RefLedger, node: str, cost: OpCost, ins: list[Any],
            outs: list[Any]) -> None:
    """Charge what ``node``'s op saves, and what its split backward's W reads."""
    for pos in cost.saved_outputs:
        ledger.keep(outs[pos], node)
    for pos in cost.saved_inputs:
        ledger.keep(ins[pos], node)
    ledger.charged[node] = ledger.charged.get(node, 0) + cost.saved_internal
    ledger.both[node] = ledger.both.get(node, 0) + cost.kept_saved
    for pos in cost.w_outputs:
        ledger.keep(outs[pos], node, by_w=True)
    for pos in cost.w_inputs:
        ledger.keep(ins[pos], node, by_w=True)
    ledger.w_charged[node] = ledger.w_charged.get(node, 0) + cost.w_internal + cost.w_grads


def _rows(costs: dict[str, OpCost], ledger: _SavedLedger | _RefLedger) -> dict[str, Row]:
    return {name: (c, ledger.charged.get(name, 0), ledger.both.get(name, 0),
                   ledger.w_charged.get(name, 0)) for name, c in costs.items()}


# what each node that did not run at a size raised, by node name
Failed = dict[str, Exception]
# a node's value at a sample count, as zeros (None: not known, its readers do not run)
StandIn = Callable[[fx.Node, int], Any]


class NotRun(RuntimeError):
    """A node that did not run because one of its inputs has no value at this size."""


def walk_run(
    gm: fx.GraphModule, inputs: list[Any], runner: NodeRunner, cache: CostCache, stats: WalkStats,
    samples: int, stand_in: StandIn | None = None,
) -> tuple[dict[str, Row], Failed]:
    """Run the graph node by node once, profiling (or looking up) every call node; a node
    that raises gives way to ``stand_in``'s value for it."""
    env: dict[fx.Node, Any] = {}
    ledger = _SavedLedger(runner.excluded)
    costs: dict[str, OpCost] = {}
    failed: Failed = {}
    it = iter(inputs)
    frees = _last_uses(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
            ledger.made(None, tensors(env[node]), [])
        elif node.op == "get_attr":
            env[node] = runner.attr(str(node.target))
        elif node.op != "output":
            lost = [n.name for n in node.all_input_nodes if n not in env]
            if lost:
                failed[node.name] = NotRun(f"its input {lost[0]} has no value at {samples} "
                                           "sample(s)")
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            try:
                costs[node.name] = _profile_node(node, args, kwargs, env, runner, cache, stats, ledger)
            except Exception as e:
                failed[node.name] = e
                out = stand_in(node, samples) if stand_in is not None else None
                if out is not None:
                    env[node] = out
                    ledger.made(node.name, tensors(out), tensors((args, kwargs)))
        for done in frees.get(node, ()):
            env.pop(done, None)
    return _rows(costs, ledger), failed


@dataclass
class _RefLedger:
    """``_SavedLedger`` without tensors: a storage is the tensor (``Label``) that made it, an
    output that views an input (``OpCost.views``) lives in that input's storage, and bytes
    come from the formulas at this size."""

    formulas: SymbolicValues
    samples: int
    storage: dict[Label, Label] = field(default_factory=dict)  # tensor -> the one that made its storage
    owner: dict[Label, str | None] = field(default_factory=dict)
    kept: set[Label] = field(default_factory=set)
    charged: dict[str, int] = field(default_factory=dict)
    by_kept_ops: set[Label] = field(default_factory=set)  # storages a kept op made
    both: dict[str, int] = field(default_factory=dict)  # of ``charged``, such storages
    w_kept: set[Label] = field(default_factory=set)  # read by a W
    w_charged: dict[str, int] = field(default_factory=dict)

    def of(self, ref: Label) -> Label:
        return ref if self.formulas.is_state(ref) else self.storage[ref]

    def made(self, node: str, count: int, ins: list[Label], views: tuple[int | None, ...],
             *, owned: bool = True, kept_outputs: tuple[int, ...] = ()) -> list[Label]:
        """Storages of ``node``'s ``count`` output tensors: an input's where the output views
        it, else a new one, charged to ``node`` when ``owned`` (a graph input's is not)."""
        outs = []
        for i in range(count):
            view = views[i] if i < len(views) else None
            storage = ins[view] if view is not None and view < len(ins) else (node, i)
            if storage == (node, i):
                self.owner[storage] = node if owned else None
                if i in kept_outputs:
                    self.by_kept_ops.add(storage)
            self.storage[(node, i)] = storage
            outs.append(storage)
        return outs

    def keep(self, storage: Label, saver: str, *, by_w: bool = False) -> None:
        seen = self.w_kept if by_w else self.kept
        if self.formulas.is_state(storage) or storage in seen:
            return
        seen.add(storage)
        who = self.owner.get(storage) or saver
        nbytes = self.formulas.nbytes_at(storage, self.samples)
        charged = self.w_charged if by_w else self.charged
        charged[who] = charged.get(who, 0) + nbytes
        if storage in self.by_kept_ops and not by_w:
            self.both[who] = self.both.get(who, 0) + nbytes


def walk_formulas(
    gm: fx.GraphModule, formulas: SymbolicValues, runner: NodeRunner, cache: CostCache,
    stats: WalkStats, samples: int, known: dict[tuple[str, tuple[int, ...], int], OpCost | Exception],
) -> tuple[dict[str, Row], Failed]:
    """Every call node's cost at ``samples`` samples, counting each distinct signature once
    (``known``: the costs, or what the signature raised, of the sizes so far)."""
    ledger = _RefLedger(formulas, samples)
    costs: dict[str, OpCost] = {}
    failed: Failed = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ledger.made(node.name, len(formulas.requires_grad[node.name]), [], (), owned=False)
        elif node.op not in ("get_attr", "output"):
            sig = formulas.signatures[node.name]
            ins = [ledger.of(r) for r in formulas.inputs_of(node)]
            # inputs in the model's state, views of it included (a slice of a position table)
            state = tuple(i for i, r in enumerate(ins) if formulas.is_state(r))
            got = known.get((sig, state, samples))
            if got is None:
                try:
                    got = _count_signature(node, formulas, runner, cache, stats, samples, state)
                except Exception as e:  # every node of this signature raises it
                    got = e
                known[(sig, state, samples)] = got
            elif isinstance(got, OpCost):
                stats.count(hit=True)
            count = len(formulas.requires_grad[node.name])
            if isinstance(got, Exception):  # its outputs: storages of its own, as zeros
                failed[node.name] = got
                ledger.made(node.name, count, ins, ())
                continue
            costs[node.name] = got
            outs = ledger.made(node.name, count, ins, got.views, kept_outputs=got.kept_outputs)
            _charge(ledger, node.name, got, ins, outs)
    return _rows(costs, ledger), failed


def _count_signature(node: fx.Node, formulas: SymbolicValues, runner: NodeRunner,
                     cache: CostCache, stats: WalkStats, samples: int,
                     state: tuple[int, ...]) -> OpCost:
    """The cost of ``node``'s signature at ``samples`` samples, its inputs at ``state`` the
    model's state: the cache's, else profiled."""
    args, kwargs = formulas.fake_args(node, samples, runner)
    key = op_key(node, runner.gm, args, kwargs, runner.module_memo, state)
    stats.keys.add(key)
    cost = cache.get(key)
    stats.count(hit=cost is not None)
    if cost is None:
        ins = tensors((args, kwargs))
        _, cost = runner.profile(runner.call(node, args, kwargs,
                                             state=[ins[i] for i in state]))
        cache.put(key, cost)
    return cost


def _profile_node(
    node: fx.Node, args: Any, kwargs: Any, env: dict[fx.Node, Any], runner: NodeRunner,
    cache: CostCache, stats: WalkStats, ledger: _SavedLedger,
) -> OpCost:
    call = runner.call(node, args, kwargs)
    state = tuple(i for i, t in enumerate(call.inputs()) if storage_id(t) in call.excluded)
    key = op_key(node, runner.gm, args, kwargs, runner.module_memo, state)
    stats.keys.add(key)
    cost = cache.get(key)
    hit = cost is not None
    if cost is not None:
        out = runner.run(call)
    else:
        out, cost = runner.profile(call)
        cache.put(key, cost)
    stats.count(hit=hit)
    env[node] = pytree.tree_map_only(torch.Tensor, as_leaf, out)
    ins, outs = call.inputs(), tensors(out)
    ledger.made(node.name, outs, ins, cost.kept_outputs)
    _charge(ledger, node.name, cost, ins, outs)
    return cost
