"""Per-node forward/backward time and memory, measured on the device or from an analytic model.

With the analytic model, or measuring a model whose tensors are elsewhere (``materialize``),
and the shape pass's formulas (``shapes/symbolic``), the graph does not run: each distinct op
signature is profiled once per size on fake tensors built from the formulas (counted, or made
real on the device and timed), and a walk over the nodes looks costs up and charges saved
storages. Otherwise (a model on the device it is measured on, or a graph whose sizes are no
formulas) the pass runs the captured graph node by node at every profiled micro-batch size,
so each node sees its real inputs (real tensors on the training device, or fake ones), and
profiles each node alone (see ``opcost``). Either way
nodes with the same cost key (``opcache.op_key``) are profiled once, and costs persist on disk
across plans.

Saved bytes are charged per storage, once, to the node that made the storage: a ReLU output
that the ReLU and the next Linear both save counts once, at the ReLU. So summing
``saved_bytes`` over nodes gives what autograd keeps for one micro-batch (parameters and
buffers excluded). A graph input that some node saves is charged to that node.

A node that raises at a profiled size (a training-mode BatchNorm that sees one value per
channel at one sample) is an ``OpFailure`` of the profile, not an error: the stages holding it
must not run that size (``costs`` rules it out for its block). So that no size the search may
use is read off a line through such a size, the sizes next to it among ``candidates`` are
profiled too. Its costs there are its nearest profiled size's, never read at that size. Only a
node that raises at every profiled size is an error: there is no size left to plan with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import fx
from torch.utils import _pytree as pytree

from ..capture.capture import CapturedGraph
from ..plan.device import DeviceSpec
from ..plan.values import ValueSpec
from ..progress import Progress
from ..shapes.symbolic import Leaf, SymbolicValues
from .cache import CostCache
from .fakes import fake_device
from .noderun import NodeRunner, home_device, measure_device
from .opcost import OpCost
from .walk import Failed, Row, WalkStats, walk_formulas, walk_run

__all__ = ["NodeCost", "OpFailure", "Profile", "first_line", "profile_pass"]

_FIELDS = ("fwd_s", "bwd_s", "saved_bytes", "workspace_bytes", "kept_bytes", "again_s",
           "rebuilt_bytes", "wheld_bytes", "cast_bytes")
# a NodeCost built without selective recomputation's costs (by hand): it keeps all, reruns
# all and rebuilds all; without a split backward's, its W reads all it saved
_STAND_IN = {"kept_bytes": "saved_bytes", "again_s": "fwd_s", "rebuilt_bytes": "saved_bytes",
             "wheld_bytes": "saved_bytes", "cast_bytes": None}


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
    # kept for them (``opcost_bw``)
    wheld_bytes: tuple[int, ...] = ()
    # of saved_bytes, autocast's copies of weights that need a gradient: its cache makes one a
    # step, which every micro-batch's backward reads (empty: none)
    cast_bytes: tuple[int, ...] = ()

    def series(self, field: str) -> tuple[float, ...]:
        """``field`` at each profiled size (a field this profile lacks: its stand-in)."""
        stand_in = _STAND_IN.get(field, field)
        return getattr(self, field) or (getattr(self, stand_in) if stand_in is not None
                                        else (0,) * len(self.fwd_s))


class OpFailure(BaseModel):
    """A node that raised when profiled at ``samples`` samples (per replica, per micro-batch):
    the first line of what it raised."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str
    samples: int
    error: str


def first_line(e: BaseException) -> str:
    """``ValueError: Expected more than 1 value per channel ...``: the type and first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class Profile(BaseModel):
    """Costs of every call node at each profiled micro-batch size.

    ``measured`` ops were profiled in this run; ``from_cache`` node profiles were answered by
    the cache (same key earlier in the graph, at another node, or on disk); ``distinct`` is the
    number of different op keys over all sizes. ``failures`` are the nodes that raised at a
    profiled size: their costs there are stand-ins (``costs`` rules the size out for them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_sizes: tuple[int, ...]
    cost_model: Literal["measured", "analytic"]
    device: str
    nodes: dict[str, NodeCost]  # by node name; placeholders, get_attr and output are absent
    measured: int = 0
    from_cache: int = 0
    distinct: int = 0
    failures: tuple[OpFailure, ...] = ()

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
    candidates: tuple[int, ...] = (),
) -> Profile:
    """Profile every call node of ``captured.gm`` at each size in ``batch_sizes``, and where
    a node raises at one, at the nearest sizes of ``candidates`` (the sizes the plan may run)
    on either side of it too.

    ``flat_inputs`` is one batch of the graph's inputs; the batch size and dimension come from
    the placeholders' ValueSpecs in ``values`` (else ``batch_dim`` and the first input's size).
    ``cost_model="measured"`` times each op on ``device`` (default: where the parameters are;
    a model whose tensors are elsewhere, on the meta device included, runs on fakes and each
    op it profiles is made real on ``device``: ``materialize``); ``"analytic"`` counts FLOPs
    and bytes on fake tensors and prices them with ``device_spec``, on fakes of
    ``device_spec``'s kind of device (``fakes``). On fakes, with ``formulas``
    (``shapes_pass``), each distinct op signature is profiled once per size instead of
    running the graph. The graph and the model's state are left as they were.
    """
    gm = captured.gm
    sizes = tuple(sorted(set(batch_sizes)))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes={list(batch_sizes)}: give at least one size, all >= 1")
    batch, bdim = _input_batch(gm, flat_inputs, values, batch_dim)
    runner = NodeRunner(
        gm, cost_model, measure_device(gm, device, cost_model), max(1, repeats),
        home=fake_device(device_spec.device_type) if cost_model == "analytic" else None,
        source=home_device(gm, flat_inputs), spec=device_spec,
    )
    cache = CostCache(cache_dir, device=runner.device_name, cost_model=cost_model)
    calls = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
    stats = WalkStats(progress=Progress("profile", total=calls * len(sizes)))
    walked: dict[int, tuple[dict[str, Row], Failed]] = {}
    known: dict[tuple[str, tuple[int, ...], int], OpCost | Exception] = {}

    def stand_in(node: fx.Node, samples: int) -> Any:
        return _zeros(node, samples, values, formulas, runner)

    with runner.session():
        todo = list(sizes)
        while todo:
            for s in todo:
                if formulas is not None and runner.fakes:
                    walked[s] = walk_formulas(gm, formulas, runner, cache, stats, s, known)
                else:
                    inputs = runner.inputs(list(flat_inputs), batch, s, bdim)
                    walked[s] = walk_run(gm, inputs, runner, cache, stats, s, stand_in)
            todo = _next_to_failures(walked, candidates)
            if stats.progress.total is not None:
                stats.progress.total += calls * len(todo)
    cache.save()
    sizes = tuple(sorted(walked))
    failures = _failures(gm, walked)
    spec = device_spec if runner.analytic else None
    nodes = {name: _node_cost(_rows_of(name, walked), spec) for name in _called(gm)}
    stats.progress.done(
        "profiled %d nodes at %d size(s) (%d measured, %d from cache, %d distinct ops; %s)%s "
        "in %.2f s", len(nodes), len(sizes), stats.measured, stats.hits, len(stats.keys),
        f"analytic costs for {device_spec.name}" if runner.analytic
        else f"measured on {runner.device_name}" + (
            ", each op made real there" if runner.materializer is not None else ""),
        "".join(f"; node {f.node} raised at {f.samples} sample(s): {f.error}"
                for f in failures[:3]) + (f" (and {len(failures) - 3} more)"
                                          if len(failures) > 3 else ""),
        stats.progress.seconds,
    )
    return Profile(
        batch_sizes=sizes, cost_model=cost_model,
        device=device_spec.name if runner.analytic else runner.device_name,
        nodes=nodes, measured=stats.measured, from_cache=stats.hits, distinct=len(stats.keys),
        failures=failures,
    )


# -- nodes that raise ------------------------------------------------------------------------


def _called(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def _next_to_failures(walked: dict[int, tuple[dict[str, Row], Failed]],
                      candidates: tuple[int, ...]) -> list[int]:
    """The nearest candidate sizes on either side of each size where a node raised, that
    are not profiled yet: a candidate between two profiled sizes is read off the line
    through them, so both must be sizes where every node ran."""
    out: set[int] = set()
    for s, (_, failed) in walked.items():
        if failed:
            below = [c for c in candidates if c < s]
            above = [c for c in candidates if c > s]
            out.update(x for x in (max(below, default=None), min(above, default=None))
                       if x is not None and x not in walked)
    return sorted(out)


def _failures(gm: fx.GraphModule, walked: dict[int, tuple[dict[str, Row], Failed]]
              ) -> tuple[OpFailure, ...]:
    """Every (node, size) that raised, in graph order; a RuntimeError for the first node that
    raised at every size (nothing is left to plan it with)."""
    out = []
    for node in gm.graph.nodes:
        raised = {s: failed[node.name] for s, (_, failed) in sorted(walked.items())
                  if node.name in failed}
        if len(raised) == len(walked):
            s, e = next(iter(raised.items()))
            raise RuntimeError(
                f"profiling node {node.name!r} ({node.format_node()}) failed at every size "
                f"profiled ({', '.join(map(str, sorted(walked)))} sample(s)); at {s}: "
                f"{type(e).__name__}: {e}"
            ) from e
        out += [OpFailure(node=node.name, samples=s, error=first_line(e))
                for s, e in raised.items()]
    return tuple(sorted(out, key=lambda f: f.samples))


def _rows_of(name: str, walked: dict[int, tuple[dict[str, Row], Failed]]) -> list[Row]:
    """A node's rows at every profiled size: where it raised, its nearest size's (never read
    at that size, which ``costs`` rules out for it)."""
    ran = [s for s, (rows, _) in walked.items() if name in rows]
    return [walked[s][0][name] if name in walked[s][0]
            else walked[min(ran, key=lambda r: (abs(r - s), r))][0][name]
            for s in sorted(walked)]


def _zeros(node: fx.Node, samples: int, values: dict[str, ValueSpec],
           formulas: SymbolicValues | None, runner: NodeRunner) -> Any:
    """Zeros in the shape of ``node``'s value at ``samples`` samples (for the nodes after
    one that raised): from the formulas, else from its spec where that is a tensor; None
    where neither says."""
    device = runner.home if runner.fakes else runner.device

    def zeros(leaf: Any) -> Any:
        if not isinstance(leaf, Leaf):
            return leaf
        t = torch.zeros(leaf.shape, dtype=leaf.dtype, device=device)
        return t.requires_grad_(True) if leaf.requires_grad and t.is_floating_point() else t

    if formulas is not None:
        return pytree.tree_map(zeros, formulas.value_at(node.name, samples))
    spec = values.get(node.name)
    if spec is None or spec.kind != "tensor" or spec.dtype is None:
        return None
    return zeros(Leaf(spec.shape_for(samples), getattr(torch, spec.dtype), spec.requires_grad))


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
        cast_bytes=casts if any(casts := tuple(c.cast_bytes for c, _, _, _ in rows)) else (),
    )
