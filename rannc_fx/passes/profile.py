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

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import fx

from ..device import DeviceSpec
from ..progress import Progress
from ..values import ValueSpec
from .capture import CapturedGraph
from .noderun import NodeRunner, home_device, measure_device
from .opcache import CostCache
from .opcost import OpCost
from .profile_walk import Row, WalkStats, walk_formulas, walk_run
from .shapes_symbolic import SymbolicValues

__all__ = ["NodeCost", "Profile", "profile_pass"]

_FIELDS = ("fwd_s", "bwd_s", "saved_bytes", "workspace_bytes", "kept_bytes", "again_s",
           "rebuilt_bytes", "wheld_bytes")
# a NodeCost built without selective recomputation's costs (by hand): it keeps all, reruns
# all and rebuilds all; without a split backward's, its W reads all it saved
_STAND_IN = {"kept_bytes": "saved_bytes", "again_s": "fwd_s", "rebuilt_bytes": "saved_bytes",
             "wheld_bytes": "saved_bytes"}


class NodeCost(BaseModel):
    """One node's costs, one entry per ``Profile.batch_sizes`` (samples per replica)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]  # kept alive for backward, parameters excluded
    workspace_bytes: tuple[int, ...]  # transient peak while it runs (outputs included)
    # selective recomputation (``selective``): the outputs it keeps, the forward it runs again
    kept_bytes: tuple[int, ...] = ()
    again_s: tuple[float, ...] = ()
    rebuilt_bytes: tuple[int, ...] = ()  # of saved_bytes, what it rebuilds (no kept op's)
    # held between a split backward's B and W: what the weight GEMMs read and the gradients
    # kept for them (``opcost_split``)
    wheld_bytes: tuple[int, ...] = ()

    def series(self, field: str) -> tuple[float, ...]:
        """``field`` at each profiled size (a field this profile lacks: its stand-in)."""
        return getattr(self, field) or getattr(self, _STAND_IN.get(field, field))


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
            if any(len(getattr(c, f)) != len(b) for f in _FIELDS
                   if f not in _STAND_IN or getattr(c, f)):
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
        xs, ys = self.batch_sizes, self.nodes[node].series(field)
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
    stats = WalkStats(progress=Progress("profile", total=calls * len(sizes)))
    per_size = []
    with runner.session():
        if formulas is not None and runner.analytic:
            known: dict[tuple[str, int], OpCost] = {}
            per_size = [walk_formulas(gm, formulas, runner, cache, stats, s, known) for s in sizes]
        else:
            for s in sizes:
                inputs = runner.inputs(list(flat_inputs), batch, s, bdim)
                per_size.append(walk_run(gm, inputs, runner, cache, stats, s))
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



def _node_cost(rows: list[Row], spec: DeviceSpec | None) -> NodeCost:
    times = [c.times(spec) for c, _, _, _ in rows]
    return NodeCost(
        fwd_s=tuple(f for f, _ in times),
        bwd_s=tuple(b for _, b in times),
        saved_bytes=tuple(saved for _, saved, _, _ in rows),
        workspace_bytes=tuple(c.workspace for c, _, _, _ in rows),
        kept_bytes=tuple(c.kept_bytes for c, _, _, _ in rows),
        again_s=tuple(c.again(spec) for c, _, _, _ in rows),
        rebuilt_bytes=tuple(saved - both for _, saved, both, _ in rows),
        wheld_bytes=tuple(w for _, _, _, w in rows),
    )
