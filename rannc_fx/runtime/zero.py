"""ZeRO-1 inside a stage: each replica keeps the optimizer state of its share of the stage's
parameters, steps only those, and the replicas all-gather what they stepped.

The share is of whole tensors, largest first to the replica with the fewest bytes so far
(ties to the lower replica; the stage's parameters in one order on every replica), so no
tensor is split and a replica's share is at most total / r plus the largest tensor.

A step runs as without sharding up to ``optimizer.step()``: the gradients are all-reduced
over the replicas, so ``clip_grad_norm_``, ``GradScaler``'s unscale and inf check and any
read of ``.grad`` see exactly what they see unsharded. The step's pre-hook sets aside the
gradients of the parameters other replicas own (an optimizer skips a parameter without a
gradient: it neither makes state for it nor changes it); the post-hook gives them back and
all-gathers the stepped shares in buckets (``gather``). A step ``GradScaler`` skips (inf or NaN found) is skipped by every replica alike:
their gradients are the same. A shared parameter (a tied embedding and LM head) is sharded
among each holding stage's replicas like the others: its gradient is the same on every holder
after its all-reduce, so each stage's owner steps it alike.

Torch's ``ZeroRedundancyOptimizer`` is not used because it builds its own optimizer from a
class and keyword arguments: the optimizer the user made, the LR scheduler and
``GradScaler`` bound to it, would no longer be the one that steps. Here the user's optimizer
object steps, with its param groups unchanged (``zero_grad`` still clears every gradient).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Plan
from . import comm
from .comm import Groups, buckets, collective

__all__ = ["OptimizerShard", "owners", "paused", "shard_of", "shard_optimizer", "steps"]

_SHARDS: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerShard] = (
    weakref.WeakKeyDictionary())


def owners(numels: Sequence[int], replicas: int) -> list[int]:
    """The replica that owns each tensor: largest first to the least loaded (stable)."""
    load = [0] * replicas
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(replicas), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + numels[i]
    return out


class OptimizerShard:
    """This replica's share of a stage's parameters and the hooks that step only it."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 replica: int, replicas: int, stage: int, groups: Callable[[], Groups]):
        """``params``: the stage's sharded parameters, in the same order on every replica;
        ``groups``: the executor's current groups (they are made again after a failure)."""
        self.optimizer, self.replica, self.replicas, self.stage = optimizer, replica, replicas, stage
        self._groups = groups
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.params = [p for p in params if id(p) in held]
        owner = owners([p.numel() for p in self.params], replicas)
        self.owner = {id(p): o for p, o in zip(self.params, owner, strict=True)}
        self._aside: dict[int, torch.Tensor | None] = {}
        self._on = True
        self._handles = (optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after))
        _SHARDS[optimizer] = self

    def steps(self, p: torch.Tensor) -> bool:
        """Whether this replica steps ``p`` (and keeps its optimizer state)."""
        return self.owner.get(id(p), self.replica) == self.replica

    @property
    def others(self) -> list[nn.Parameter]:
        return [p for p in self.params if not self.steps(p)]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this replica holds for the stage's sharded parameters."""
        return sum(v.numel() * v.element_size() for p in self.params
                   for v in self.optimizer.state.get(p, {}).values()
                   if isinstance(v, torch.Tensor))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        _SHARDS.pop(self.optimizer, None)

    # -- the step ---------------------------------------------------------------------------
    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._on:
            return
        self._aside = {}
        for p in self.others:
            self._aside[id(p)], p.grad = p.grad, None

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._on:
            return
        for p in self.others:
            if id(p) in self._aside:
                p.grad = self._aside[id(p)]
        self._aside = {}
        self.gather()

    def gather(self) -> None:
        """Every replica's stepped share to every replica: all-gathers of buckets of whole
        tensors, one dtype at a time; round b gathers each replica's b-th bucket, padded to
        the largest, so the buffers stay within (r + 1) x ``comm.BUCKET_BYTES`` (or the
        largest tensor) whatever the stage's size."""
        groups = self._groups()
        group = groups.stage[self.stage]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for dtype, ps in by_dtype.items():
                cut = [buckets([p for p in ps if self.owner[id(p)] == r], comm.BUCKET_BYTES)
                       for r in range(self.replicas)]
                for b in range(max(len(x) for x in cut)):
                    self._gather_round([x[b] if b < len(x) else [] for x in cut], groups,
                                       group, dtype, ps[0].device)

    def _gather_round(self, shares: list[list[nn.Parameter]], groups: Groups,
                      group: dist.ProcessGroup | None, dtype: torch.dtype,
                      device: torch.device) -> None:
        sizes = [sum(p.numel() for p in s) for s in shares]
        chunk = max(sizes)
        mine = torch.zeros(chunk, dtype=dtype, device=device)
        if shares[self.replica]:
            torch.cat([p.reshape(-1) for p in shares[self.replica]],
                      out=mine[: sizes[self.replica]])
        out = torch.empty(chunk * self.replicas, dtype=dtype, device=device)

        def start(a: bool) -> Any:
            return dist.all_gather_into_tensor(out, mine, group=group, async_op=a)

        collective(start, f"all-gather of the stepped parameters of stage {self.stage}",
                   ranks=groups.stage_ranks[self.stage], groups=groups,
                   cpu=device.type == "cpu")
        for r, share in enumerate(shares):
            if r == self.replica or not share:
                continue
            pieces = out[r * chunk : r * chunk + sizes[r]].split([p.numel() for p in share])
            for p, piece in zip(share, pieces, strict=True):
                p.copy_(piece.view_as(p))


def shard_optimizer(optimizer: torch.optim.Optimizer | None, plan: Plan, rank: int,
                    modules: dict[int, nn.Module], groups: Callable[[], Groups]
                    ) -> OptimizerShard | None:
    """Shard ``optimizer`` over the replicas of this rank's stages whose plan says ``zero =
    1`` (``modules``: this rank's stage modules by index); None where none does. A lane's
    stages share their ranks, so one share and one group serve all of them."""
    zero = [s for s in modules if plan.stages[s].zero >= 1 and plan.stages[s].replicas > 1]
    if optimizer is None or not zero:
        return None
    params: dict[int, nn.Parameter] = {}
    for s in zero:
        for p in modules[s].parameters():
            if p.requires_grad:
                params.setdefault(id(p), p)
    st = plan.stages[zero[0]]
    return OptimizerShard(optimizer, list(params.values()), st.ranks.index(rank), st.replicas,
                          st.index, groups)


def shard_of(optimizer: torch.optim.Optimizer | None) -> OptimizerShard | None:
    """The shard installed on ``optimizer``, if any."""
    return _SHARDS.get(optimizer) if optimizer is not None else None


def steps(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], bool]:
    """Whether this rank steps (and keeps the state of) a parameter of ``optimizer``."""
    shard = shard_of(optimizer)
    return shard.steps if shard is not None else lambda p: True


@contextlib.contextmanager
def paused(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Steps taken inside run unsharded and gather nothing (a checkpoint's fresh state)."""
    shard = shard_of(optimizer)
    if shard is None:
        yield
        return
    shard._on = False
    try:
        yield
    finally:
        shard._on = True
