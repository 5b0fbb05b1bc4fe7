"""Per-node forward/backward time and memory, measured on the device or from an analytic model.

With the analytic model and the shape pass's formulas (``shapes_symbolic``), nothing runs per
node: each distinct op signature is counted once per profiled size on fake tensors built from
the formulas, and a walk over the nodes looks costs up and charges saved storages. Otherwise
(measured costs, or a graph whose sizes are no formulas) the pass runs the captured graph node
by node at every profiled micro-batch size, so each node sees its real inputs (real tensors on
the training device, or fake ones), and profiles each node alone (see ``opcost``). Either way
nodes with the same cost key (``opcache.op_key``) are profiled once, and costs persist on disk
across plans.

Saved bytes are charged per storage, once, to the node that made the storage: a ReLU output
that the ReLU and the next Linear both save counts once, at the ReLU. So summing
``saved_bytes`` over nodes gives what autograd keeps for one micro-batch (parameters and
buffers excluded). A graph input that some node saves is charged to that node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from ..device import DeviceSpec
from ..plan import ValueSpec
from ..progress import Progress
from .capture import CapturedGraph
from .noderun import NodeRunner, as_leaf, home_device, measure_device
from .opcache import CostCache, op_key
from .opcost import OpCost, storage_id, tensors
from .shapes_symbolic import Label, SymbolicValues

__all__ = ["NodeCost", "Profile", "profile_pass"]

_FIELDS = ("fwd_s", "bwd_s", "saved_bytes", "workspace_bytes")


class NodeCost(BaseModel):
    """One node's costs, one entry per ``Profile.batch_sizes`` (samples per replica)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]  # kept alive for backward, parameters excluded
    workspace_bytes: tuple[int, ...]  # transient peak while it runs (outputs included)


class Profile(BaseModel):
    """Costs of every call node at each profiled micro-batch size.

    ``measured`` ops were profiled in this run; ``from_cache`` node profiles were answered by
    the cache (same key earlier in the graph, at another node, or on disk); ``distinct`` is the
    number of different op keys over all sizes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_sizes: tuple[int, ...]
    cost_model: Literal["measured", "analytic"]
    device: str
    nodes: dict[str, NodeCost]  # by node name; placeholders, get_attr and output are absent
    measured: int = 0
    from_cache: int = 0
    distinct: int = 0

    @model_validator(mode="after")
    def _check(self) -> Profile:
        b = self.batch_sizes
        if not b or b[0] < 1 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"batch_sizes {list(b)} must be positive and strictly increasing")
        for name, c in self.nodes.items():
            if any(len(getattr(c, f)) != len(b) for f in _FIELDS):
                raise ValueError(f"node {name!r} has costs for other than {len(b)} sizes")
        return self

    def at(self, node: str, field: str, samples: int) -> float:
        """A node's cost for ``samples`` samples, interpolated (linearly) between profiled sizes.

        Beyond the profiled sizes the nearest two are extrapolated (clamped at 0); with a
        single profiled size the cost scales in proportion to ``samples``.
        """
        if field not in _FIELDS:
            raise ValueError(f"unknown cost field {field!r}; one of {', '.join(_FIELDS)}")
        if node not in self.nodes:
            raise KeyError(f"node {node!r} has no profile (only call nodes are profiled)")
        xs, ys = self.batch_sizes, getattr(self.nodes[node], field)
        if len(xs) == 1:
            return max(0.0, float(ys[0]) * samples / xs[0])
        i = 0
        while i < len(xs) - 2 and samples > xs[i + 1]:
            i += 1
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(0.0, float(ys[i] + slope * (samples - xs[i])))


def profile_pass(
    captured: CapturedGraph,
    flat_inputs: list[torch.Tensor],
    values: dict[str, ValueSpec],
    *,
    batch_sizes: tuple[int, ...],
    device_spec: DeviceSpec,
    cost_model: Literal["measured", "analytic"],
    device: torch.device | None = None,
    cache_dir: Path | None = None,
    repeats: int = 3,
    batch_dim: int = 0,
    formulas: SymbolicValues | None = None,
) -> Profile:
    """Profile every call node of ``captured.gm`` at each size in ``batch_sizes``.

    ``flat_inputs`` is one batch of the graph's inputs; the batch size and dimension come from
    the placeholders' ValueSpecs in ``values`` (else ``batch_dim`` and the first input's size).
    ``cost_model="measured"`` times each op on ``device`` (default: where the parameters are);
    ``"analytic"`` counts FLOPs and bytes on fake tensors and prices them with ``device_spec``,
    so a meta-device model works; with ``formulas`` (``shapes_pass``) it counts each distinct
    op signature once per size instead of running the graph. The graph and the model's state
    are left as they were.
    """
    gm = captured.gm
    sizes = tuple(sorted(set(batch_sizes)))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes={list(batch_sizes)}: give at least one size, all >= 1")
    batch, bdim = _input_batch(gm, flat_inputs, values, batch_dim)
    runner = NodeRunner(
        gm, cost_model, measure_device(gm, device, cost_model), max(1, repeats),
        home=home_device(gm, flat_inputs),
    )
    cache = CostCache(cache_dir, device=runner.device_name, cost_model=cost_model)
    calls = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
    stats = _Stats(progress=Progress("profile", total=calls * len(sizes)))
    per_size = []
    with runner.session():
        if formulas is not None and runner.analytic:
            known: dict[tuple[str, int], OpCost] = {}
            per_size = [_walk_formulas(gm, formulas, runner, cache, stats, s, known) for s in sizes]
        else:
            for s in sizes:
                inputs = runner.inputs(list(flat_inputs), batch, s, bdim)
                per_size.append(_walk(gm, inputs, runner, cache, stats, s))
    cache.save()
    spec = device_spec if runner.analytic else None
    nodes = {name: _node_cost([p[name] for p in per_size], spec) for name in per_size[0]}
    stats.progress.done(
        "profiled %d nodes at %d size(s) (%d measured, %d from cache, %d distinct ops; %s) "
        "in %.2f s", len(nodes), len(sizes), stats.measured, stats.hits, len(stats.keys),
        f"analytic costs for {device_spec.name}" if runner.analytic
        else f"measured on {runner.device_name}", stats.progress.seconds,
    )
    return Profile(
        batch_sizes=sizes, cost_model=cost_model,
        device=device_spec.name if runner.analytic else runner.device_name,
        nodes=nodes, measured=stats.measured, from_cache=stats.hits, distinct=len(stats.keys),
    )


# -- inputs and device -----------------------------------------------------------------------


def _input_batch(
    gm: fx.GraphModule, flat: list[torch.Tensor], values: dict[str, ValueSpec], batch_dim: int
) -> tuple[int, int]:
    """(batch size of ``flat``, its batch dimension), from the placeholders' ValueSpecs."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for name, t in zip(names, flat, strict=False):
        v = values.get(name)
        if v is not None and v.kind == "tensor" and v.batch_dim is not None:
            return int(t.shape[v.batch_dim]) // v.shape[v.batch_dim], v.batch_dim
    for t in flat:
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
            return int(t.shape[batch_dim]), batch_dim
    raise ValueError(
        f"no input tensor has a batch dimension {batch_dim}; pass values from infer_values_pass "
        "or the right batch_dim"
    )


# -- the walk --------------------------------------------------------------------------------


@dataclass
class _Stats:
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

    def made(self, node: str | None, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        in_ids = {storage_id(t) for t in ins}
        for t in outs:
            sid = storage_id(t)
            if sid not in in_ids and sid not in self.excluded:
                self.owner[sid] = (StorageWeakRef(t.untyped_storage()), node)

    def keep(self, t: torch.Tensor, saver: str) -> None:
        sid = storage_id(t)
        if sid in self.excluded or (sid in self.kept and not self.kept[sid].expired()):
            return
        st = t.untyped_storage()
        self.kept[sid] = StorageWeakRef(st)
        ref, node = self.owner.get(sid, (None, None))
        who = node if ref is not None and not ref.expired() and node is not None else saver
        self.charged[who] = self.charged.get(who, 0) + st.nbytes()


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


_Row = tuple[OpCost, int]  # the op's cost and the bytes of saved storages charged to the node


def _walk(
    gm: fx.GraphModule, inputs: list[Any], runner: NodeRunner, cache: CostCache, stats: _Stats,
    samples: int,
) -> dict[str, _Row]:
    """Run the graph node by node once, profiling (or looking up) every call node."""
    env: dict[fx.Node, Any] = {}
    ledger = _SavedLedger(runner.excluded)
    costs: dict[str, OpCost] = {}
    it = iter(inputs)
    frees = _last_uses(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
            ledger.made(None, tensors(env[node]), [])
        elif node.op == "get_attr":
            env[node] = runner.attr(str(node.target))
        elif node.op != "output":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            try:
                costs[node.name] = _profile_node(node, args, kwargs, env, runner, cache, stats, ledger)
            except Exception as e:
                raise RuntimeError(
                    f"profiling node {node.name!r} ({node.format_node()}) at {samples} sample(s) "
                    f"failed: {type(e).__name__}: {e}"
                ) from e
        for done in frees.get(node, ()):
            env.pop(done, None)
    return {name: (c, ledger.charged.get(name, 0)) for name, c in costs.items()}


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

    def of(self, ref: Label) -> Label:
        return ref if self.formulas.is_state(ref) else self.storage[ref]

    def made(self, node: str, count: int, ins: list[Label], views: tuple[int | None, ...],
             *, owned: bool = True) -> list[Label]:
        """Storages of ``node``'s ``count`` output tensors: an input's where the output views
        it, else a new one, charged to ``node`` when ``owned`` (a graph input's is not)."""
        outs = []
        for i in range(count):
            view = views[i] if i < len(views) else None
            storage = ins[view] if view is not None and view < len(ins) else (node, i)
            if storage == (node, i):
                self.owner[storage] = node if owned else None
            self.storage[(node, i)] = storage
            outs.append(storage)
        return outs

    def keep(self, storage: Label, saver: str) -> None:
        if self.formulas.is_state(storage) or storage in self.kept:
            return
        self.kept.add(storage)
        who = self.owner.get(storage) or saver
        self.charged[who] = self.charged.get(who, 0) + self.formulas.nbytes_at(storage, self.samples)


def _walk_formulas(
    gm: fx.GraphModule, formulas: SymbolicValues, runner: NodeRunner, cache: CostCache,
    stats: _Stats, samples: int, known: dict[tuple[str, int], OpCost],
) -> dict[str, _Row]:
    """Every call node's cost at ``samples`` samples, counting each distinct signature once."""
    ledger = _RefLedger(formulas, samples)
    costs: dict[str, OpCost] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ledger.made(node.name, len(formulas.requires_grad[node.name]), [], (), owned=False)
        elif node.op not in ("get_attr", "output"):
            sig = formulas.signatures[node.name]
            cost = known.get((sig, samples))
            if cost is None:
                try:
                    cost = _count_signature(node, formulas, runner, cache, stats, samples)
                except Exception as e:
                    raise RuntimeError(
                        f"profiling node {node.name!r} ({node.format_node()}) at {samples} "
                        f"sample(s) failed: {type(e).__name__}: {e}"
                    ) from e
                known[(sig, samples)] = cost
            else:
                stats.count(hit=True)
            costs[node.name] = cost
            ins = [ledger.of(r) for r in formulas.inputs_of(node)]
            outs = ledger.made(node.name, len(formulas.requires_grad[node.name]), ins, cost.views)
            for pos in cost.saved_outputs:
                ledger.keep(outs[pos], node.name)
            for pos in cost.saved_inputs:
                ledger.keep(ins[pos], node.name)
            ledger.charged[node.name] = ledger.charged.get(node.name, 0) + cost.saved_internal
    return {name: (c, ledger.charged.get(name, 0)) for name, c in costs.items()}


def _count_signature(node: fx.Node, formulas: SymbolicValues, runner: NodeRunner,
                     cache: CostCache, stats: _Stats, samples: int) -> OpCost:
    """The cost of ``node``'s signature at ``samples`` samples: the cache's, else counted."""
    args, kwargs = formulas.fake_args(node, samples, runner)
    key = op_key(node, runner.gm, args, kwargs, runner.module_memo)
    stats.keys.add(key)
    cost = cache.get(key)
    stats.count(hit=cost is not None)
    if cost is None:
        _, cost = runner.profile(runner.call(node, args, kwargs))
        cache.put(key, cost)
    return cost


def _profile_node(
    node: fx.Node, args: Any, kwargs: Any, env: dict[fx.Node, Any], runner: NodeRunner,
    cache: CostCache, stats: _Stats, ledger: _SavedLedger,
) -> OpCost:
    call = runner.call(node, args, kwargs)
    key = op_key(node, runner.gm, args, kwargs, runner.module_memo)
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
    ledger.made(node.name, outs, ins)
    for pos in cost.saved_outputs:
        ledger.keep(outs[pos], node.name)
    for pos in cost.saved_inputs:
        ledger.keep(ins[pos], node.name)
    ledger.charged[node.name] = ledger.charged.get(node.name, 0) + cost.saved_internal
    return cost


def _node_cost(rows: list[_Row], spec: DeviceSpec | None) -> NodeCost:
    times = [c.times(spec) for c, _ in rows]
    return NodeCost(
        fwd_s=tuple(f for f, _ in times),
        bwd_s=tuple(b for _, b in times),
        saved_bytes=tuple(saved for _, saved in rows),
        workspace_bytes=tuple(c.workspace for c, _ in rows),
    )
