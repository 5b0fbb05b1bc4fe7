"""ZeRO-3 inside a stage: each replica holds its rows of every parameter, their gradients and
their optimizer state; each use in the stage's graph all-gathers the parameter just before it
runs, and each backward reduce-scatters its gradient back to the rows (FSDP's scheme).

Rows: a parameter of r replicas with d rows along its first dimension is cut into r chunks of
ceil(d / r) rows, replica q holding rows [q c, (q + 1) c) clipped to d (the last chunks may
be shorter, or empty), the cut ``torch.chunk`` and torch.distributed.tensor's ``Shard(0)``
make. ``shard_stages`` cuts them once, after the replicas agreed on their values, by giving
each parameter object its rows as ``.data``: the user's optimizer, its LR scheduler and
``GradScaler`` keep the very objects they hold, and the optimizer makes its state at the
rows' shape, so it steps 1 / r of the stage on each replica. A parameter of no dimension, and
one several stages share (a tied embedding and LM head: its holders sum its gradient over
``grads.GradSync``'s shared group, whole), stays whole; the stage's ZeRO-1 share
(``zero.OptimizerShard``) shards the state of those.

The gathering is ``host_params``' fetching with another source: ``FullShard`` installs the
same rewrite of the stage's graph (a ``rannc_fetch`` before each use, a module that owns
parameters run on fetched copies), keeps the same saved-tensor tokens (the backward gathers a
parameter again where an op saved it; autocast's casts included) and the same window of
copies fetched ahead, in the first forward's order. A fetch here is an asynchronous
all-gather over the stage's replica group of each replica's rows padded to c; taking it
waits for it (reading the failure board, as every collective does). Its backward is the
reduce-scatter (SUM) of the whole gradient to the rows, which autograd accumulates into the
parameter's ``.grad``: every micro-batch's, so the sum over micro-batches and replicas is the
global batch's gradient, as ``grads`` keeps it unsharded. Over gloo the reduce-scatter is an
all-reduce of which each replica keeps its rows (``grad_shards`` measured gloo's own
reduce-scatter slower).

After the backwards nothing is left to reduce: ``grads.GradSync`` passes these parameters
over, ``clip.clip_grad_norm`` counts each replica's rows on that replica, the optimizer steps
the rows on every replica and nothing is gathered after the step.

Checkpoints (``state/checkpoint.py``) hold the rows as torch.distributed.tensor's
``DTensor`` sharded along the first dimension over the stage's replica group (``saved``):
torch.distributed.checkpoint writes each replica's rows and reads whatever rows a rank of
another plan asks for, so a checkpoint crosses between fully sharded and whole plans;
``full=True`` gathers each tensor whole first (``gather_whole``), and loading takes the rows
of a whole tensor (``rows_in``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import fx, nn

from ..plan.plan import Plan
from .comm import Groups, backend_of, collective
from .host_params import HostParams

__all__ = ["FullShard", "Rows", "gather_whole", "rows_in", "rows_of", "saved", "saved_whole",
           "shard_stages", "sharded_ids", "sharded_in"]


class Rows(NamedTuple):
    """Where a fully sharded parameter's rows lie: its whole shape, the chunk c every replica
    pads to, this replica and the group's size, the stage whose group gathers it."""

    shape: torch.Size
    chunk: int
    replica: int
    replicas: int
    stage: int

    @property
    def span(self) -> tuple[int, int]:
        """This replica's rows [a, b) of the whole parameter."""
        d = self.shape[0]
        a = min(self.replica * self.chunk, d)
        return a, min(a + self.chunk, d)


# by the parameter's id, while it lives (a tensor compares by value: no weak-keyed dict)
_ROWS: dict[int, Rows] = {}
# each stage's replica groups, the latest executor's (made again after a failure)
_GROUPS: dict[int, Groups] = {}
_MESHES: dict[int, tuple[Any, Any]] = {}  # by stage: its group and that group's mesh


def rows_of(p: torch.Tensor) -> Rows | None:
    """The rows ``p`` holds of its whole parameter; None where it is whole."""
    return _ROWS.get(id(p))


def sharded_in(plan: Plan, stage: int, module: nn.Module) -> list[nn.Parameter]:
    """The parameters of stage ``stage`` (its module ``module``) that ZeRO-3 shards: where
    the plan says ``zero = 3`` on several replicas, each with a dimension and used by no other
    stage; decided from the plan and the module alone, so every replica and every part of
    the runtime (the gradient sums, the clipping) agrees."""
    st = plan.stages[stage]
    if st.zero != 3 or st.replicas < 2:
        return []
    shared = {n for sp in plan.shared_params for n in (sp.name, *sp.aliases)}
    named = dict(module.named_parameters(remove_duplicate=False))
    skip = {id(p) for n, p in named.items() if n in shared}
    return list({id(p): p for p in named.values()
                 if id(p) not in skip and p.dim() >= 1}.values())


def shard_stages(plan: Plan, modules: Mapping[int, nn.Module], rank: int,
                 optimizer: torch.optim.Optimizer | None) -> None:
    """Give each parameter ``sharded_in`` this rank's stages its rows (and any gradient or
    optimizer state it has so far, cut the same way); once per parameter."""
    for s, module in sorted(modules.items()):
        st = plan.stages[s]
        for p in sharded_in(plan, s, module):
            if id(p) in _ROWS:
                continue
            r = st.replicas
            rows = Rows(p.shape, math.ceil(p.shape[0] / r), st.ranks.index(rank), r, s)
            a, b = rows.span
            with torch.no_grad():
                p.data = p.data[a:b].clone()
                if p.grad is not None:
                    p.grad = p.grad[a:b].clone()
                state = optimizer.state.get(p) if optimizer is not None else None
                if state:
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.shape == rows.shape:
                            state[k] = v[a:b].clone()
            _ROWS[id(p)] = rows
            weakref.finalize(p, _ROWS.pop, id(p), None)


def _padded(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``t`` (rows of the parameter) padded with zeros to the chunk."""
    if t.shape[0] == rows.chunk:
        return t.contiguous()
    out = t.new_zeros((rows.chunk, *rows.shape[1:]))
    out[: t.shape[0]].copy_(t)
    return out


def _settle(work: Any, rows: Rows, groups: Groups, what: str, device: torch.device) -> None:
    """Wait for a collective started before, as ``comm.collective`` waits for its own."""
    collective(lambda a: work if a else work.wait(),
               f"{what} of a parameter of stage {rows.stage}",
               ranks=groups.stage_ranks[rows.stage], groups=groups, cpu=device.type == "cpu")


def _gather(t: torch.Tensor, rows: Rows, groups: Groups, device: torch.device
            ) -> tuple[torch.Tensor, Any]:
    """Start the all-gather of every replica's rows of which ``t`` is this one's: the padded
    whole on ``device`` (its first ``rows.shape[0]`` rows the tensor), and the work."""
    out = torch.empty((rows.chunk * rows.replicas, *rows.shape[1:]), dtype=t.dtype,
                      device=device)
    with torch.no_grad():
        mine = _padded(t.detach(), rows)
        work = dist.all_gather_single(out, mine, group=groups.stage[rows.stage],
                                      async_op=True)
    return out, work


def gather_whole(t: torch.Tensor, rows: Rows, groups: Groups) -> torch.Tensor:
    """The whole tensor of which every replica holds ``t``, its rows (a parameter, or a
    tensor of its optimizer state), on every replica; synchronous."""
    out, work = _gather(t, rows, groups, t.device)
    _settle(work, rows, groups, "all-gather", t.device)
    return out[: rows.shape[0]]


def saved(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``t`` (a parameter's rows, or a tensor of its state of their shape) as the DTensor of
    its whole tensor, sharded along its first dimension over the stage's replicas; it shares
    ``t``'s memory (loading into it loads into ``t``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    group = _GROUPS[rows.stage].stage[rows.stage]
    assert group is not None  # a fully sharded stage has replicas
    cached = _MESHES.get(rows.stage)
    if cached is None or cached[0] is not group:  # the groups made again after a failure
        cached = _MESHES[rows.stage] = (group, DeviceMesh.from_group(group, t.device.type))
    mesh = cached[1]
    return DTensor.from_local(t, mesh, [Shard(0)], shape=rows.shape,
                              stride=torch.empty(rows.shape, device="meta").stride())


def saved_whole(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``t``'s whole tensor, gathered over the stage's replicas (every one calls this)."""
    return gather_whole(t, rows, _GROUPS[rows.stage])


def rows_in(src: Any, rows: Rows) -> Any:
    """What of a loaded ``src`` lands in a tensor holding ``rows``: the local rows of a
    DTensor (``saved``), the rows of a whole tensor; anything else as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(src, DTensor):
        return src.to_local()
    if isinstance(src, torch.Tensor) and tuple(src.shape) == tuple(rows.shape) and src.dim():
        a, b = rows.span
        return src[a:b]
    return src


class FullShard(HostParams):
    """The fully sharded parameters of one stage's GraphModule, all-gathered at each use."""

    def __init__(self, module: fx.GraphModule, device: torch.device, *, window: int,
                 groups: Groups, stage: int):
        super().__init__(module, device, window=window)
        self.groups = groups
        _GROUPS[stage] = groups
        self._stream = None  # the collectives run on their own streams

    def fetch(self, p: torch.Tensor) -> torch.Tensor:
        return super().fetch(p) if id(p) in _ROWS else p

    def whole_shape(self, p: torch.Tensor) -> torch.Size:
        return _ROWS[id(p)].shape

    def _copy(self, p: torch.Tensor, stream: Any) -> tuple[torch.Tensor, Any]:
        out, work = _gather(p, _ROWS[id(p)], self.groups, self.device)
        self.fetched_bytes += out.nbytes
        return out, work

    def _take(self, p: torch.Tensor) -> torch.Tensor:
        got = self._ahead.pop(id(p), None)
        out, work = got if got is not None else self._copy(p, None)
        rows = _ROWS[id(p)]
        _settle(work, rows, self.groups, "all-gather", self.device)
        return out[: rows.shape[0]]

    def returned(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter of ``grad`` (``p``'s whole gradient from this backward) over
        the replicas: the SUM of this replica's rows."""
        rows = _ROWS[id(p)]
        group = self.groups.stage[rows.stage]
        flat = grad.new_zeros((rows.chunk * rows.replicas, *rows.shape[1:]))
        flat[: rows.shape[0]].copy_(grad)
        gloo = backend_of(group) != "nccl"
        mine = flat if gloo else grad.new_empty((rows.chunk, *rows.shape[1:]))

        def start(a: bool) -> Any:
            if gloo:
                return dist.all_reduce(flat, group=group, async_op=a)
            return dist.reduce_scatter_single(mine, flat, group=group, async_op=a)

        collective(start, f"reduce-scatter of a gradient of stage {rows.stage}",
                   ranks=self.groups.stage_ranks[rows.stage], groups=self.groups,
                   cpu=grad.device.type == "cpu")
        a, b = rows.span
        at = rows.replica * rows.chunk if gloo else 0
        return mine[at : at + b - a].clone() if gloo else mine[: b - a]

    def release(self) -> None:
        for k, (_, work) in self._ahead.items():  # every replica started them: let them end
            _settle(work, _ROWS[k], self.groups, "all-gather", self.device)
        super().release()


def sharded_ids(plan: Plan, modules: Mapping[int, nn.Module]) -> set[int]:
    """The ids of every parameter ``sharded_in`` the stages among ``modules``."""
    return {id(p) for s, m in modules.items() for p in sharded_in(plan, s, m)}
