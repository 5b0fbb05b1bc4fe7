"""ZeRO-1 inside a stage: each replica keeps the optimizer state of its share of the stage's
parameters, steps only those, and the replicas all-gather what they stepped.

The share is of whole tensors, largest first to the replica with the fewest bytes so far
(ties to the lower replica; the stage's parameters in one order on every replica), so no
tensor is split and a replica's share is at most total / r plus the largest tensor. A share
is kept for good (``Owners``): a parameter that starts training after compile
(``trainable``) goes to the replica with the fewest bytes then, and one that stops keeps its
owner, so no optimizer state ever has to move between replicas.

A step runs as without sharding up to ``optimizer.step()``: the gradients are all-reduced
over the replicas, so ``clip_grad_norm_``, ``GradScaler``'s unscale and inf check and any
read of ``.grad`` see exactly what they see unsharded. The step's pre-hook sets aside the
gradients of the parameters other replicas own (an optimizer skips a parameter without a
gradient: it neither makes state for it nor changes it); the post-hook gives them back and
all-gathers the stepped shares in buckets (``gather``). A step ``GradScaler`` skips (inf or NaN found) is skipped by every replica alike:
their gradients are the same. A shared parameter (a tied embedding and LM head) is sharded
among each holding stage's replicas like the others: its gradient is the same on every holder
after its all-reduce, so each stage's owner steps it alike.

A stage whose plan offloads its optimizer state (``offload.py``) keeps this replica's share
of it in host memory: the pre-hook steps those parameters there, a bucket at a time.

Torch's ``ZeroRedundancyOptimizer`` is not used because it builds its own optimizer from a
class and keyword arguments: the optimizer the user made, the LR scheduler and
``GradScaler`` bound to it, would no longer be the one that steps. Here the user's optimizer
object steps, with its param groups unchanged (``zero_grad`` still clears every gradient).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan.plan import Plan
from . import comm
from .comm import Groups, collective
from .grad_shards import Round, rounds
from .offload import HostState

__all__ = ["OptimizerShard", "Owners", "offloaded_params", "owned_by", "owners", "paused",
           "shard_of", "shard_optimizer", "sharded_params", "steps"]

_SHARDS: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerShard] = (
    weakref.WeakKeyDictionary())


def owned_by(params: Sequence[nn.Parameter], replicas: int) -> dict[int, int]:
    """The owner of each of ``params`` (by ``id``; ``owners`` over their sizes, in order)."""
    got = owners([p.numel() for p in params], replicas)
    return {id(p): o for p, o in zip(params, got, strict=True)}


def sharded_params(plan: Plan, modules: Mapping[int, nn.Module]) -> list[nn.Parameter]:
    """The trained parameters of the stages among ``modules`` (this rank's, by index) that
    the plan shards over more than one replica, each once, in stage order: the one order
    every replica of them shares. ZeRO-3's stages are not among them: each replica steps
    its rows, and the tensors it keeps whole (``full_shard``) on every replica alike."""
    return list({id(p): p for s in sorted(modules) for p in modules[s].parameters()
                 if p.requires_grad and plan.stages[s].zero in (1, 2)
                 and plan.stages[s].replicas > 1}.values())


def offloaded_params(plan: Plan, modules: Mapping[int, nn.Module]) -> list[nn.Parameter]:
    """The trained parameters of the stages among ``modules`` whose plan offloads their
    optimizer state, each once."""
    return list({id(p): p for s in sorted(modules) for p in modules[s].parameters()
                 if p.requires_grad and plan.stages[s].offload}.values())


def owners(numels: Sequence[int], replicas: int) -> list[int]:
    """The replica that owns each tensor: largest first to the least loaded (stable)."""
    return _least_loaded(numels, [0] * replicas)


def _least_loaded(numels: Sequence[int], load: list[int]) -> list[int]:
    """``owners`` from the replicas' ``load`` so far (updated in place)."""
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + numels[i]
    return out


class Owners:
    """The owner of every sharded parameter this rank's stages have trained, by ``id``.

    The first ``assign`` is ``owned_by``; each later one gives the parameters not seen yet
    to the least loaded replicas, largest first, and never moves one already owned: its
    optimizer state lives on its owner. Every replica makes the same calls with the same
    parameters in the same order (a change of ``requires_grad`` is agreed at a call), so
    every replica holds the same map. ``of`` is the one dict that the optimizer's share and
    the gradient shards both read."""

    def __init__(self, replicas: int) -> None:
        self.of: dict[int, int] = {}
        self._load = [0] * replicas

    def assign(self, params: Sequence[nn.Parameter]) -> dict[int, int]:
        new = list({id(p): p for p in params if id(p) not in self.of}.values())
        for p, o in zip(new, _least_loaded([p.numel() for p in new], self._load), strict=True):
            self.of[id(p)] = o
        return self.of


class OptimizerShard:
    """This replica's share of a stage's parameters and the hooks that step only it; where
    the state is offloaded (``offload.HostState``), the hooks step it a bucket at a time."""

    def __init__(self, optimizer: torch.optim.Optimizer, sharded: Sequence[nn.Parameter],
                 replica: int, replicas: int, stage: int, groups: Callable[[], Groups],
                 offloaded: Sequence[nn.Parameter] = (), owners: Owners | None = None):
        """``sharded``: the parameters sharded over the replicas, in the same order on every
        replica; ``offloaded``: those whose state (this replica's share of it) lives in host
        memory; ``groups``: the executor's current groups (made again after a failure);
        ``owners``: the map the gradient shards read too (default: one of its own)."""
        self.optimizer, self.replica, self.replicas, self.stage = optimizer, replica, replicas, stage
        self._groups = groups
        self.owners = owners if owners is not None else Owners(replicas)
        self.host: HostState | None = None
        self.follow(sharded, offloaded)
        self._aside: dict[int, torch.Tensor | None] = {}
        self._on = True
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)
        optimizer.register_load_state_dict_post_hook(
            lambda _: self.host.settle() if self.host is not None else None)
        _SHARDS[optimizer] = self

    def follow(self, sharded: Sequence[nn.Parameter],
               offloaded: Sequence[nn.Parameter] = ()) -> None:
        """Shard the parameters that train now (``sharded``, ``offloaded`` as at
        construction) among those the optimizer's groups hold now: at construction, and
        again where ``requires_grad`` or the groups changed (``trainable``)."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        # owners over every sharded tensor, the optimizer's or not: the gradient shards
        # (``grad_shards``, built without the optimizer) own by the same map
        self.owner = self.owners.assign(sharded)
        self.sharded = [p for p in sharded if id(p) in held]
        self.params = list({id(p): p for p in (*self.sharded, *offloaded) if id(p) in held}
                           .values())
        self.others = [p for p in self.sharded if not self.steps(p)]
        # the all-gather's rounds: per dtype, round b holds each replica's b-th bucket
        self._rounds = rounds(self.sharded, self.owner, self.replicas, comm.BUCKET_BYTES)
        mine = [p for p in offloaded if id(p) in held and self.steps(p)]
        if not mine:
            self.host = None  # the state of one that stopped training stays where it is
        elif self.host is None:
            self.host = HostState(self.optimizer, mine)
        else:
            self.host.params = mine

    def steps(self, p: torch.Tensor) -> bool:
        """Whether this replica steps ``p`` (and keeps its optimizer state)."""
        return self.owner.get(id(p), self.replica) == self.replica

    # -- the step ---------------------------------------------------------------------------
    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._on:
            return
        if self.host is not None:
            self.host.check(args, kwargs)  # before any gradient is set aside
        self._aside = {}
        for p in self.others:
            self._aside[id(p)], p.grad = p.grad, None
        if self.host is None:
            return
        mine = {id(p): p.grad for p in self.host.params}  # they step here, in buckets
        for p in self.host.params:
            p.grad = None
        self._aside.update(mine)
        try:
            self.host.step_in_buckets(mine, kwargs)
        except BaseException:  # the step failed: .grad as the step found it
            self._after(optimizer, args, kwargs, gather=False)
            raise

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any,
               gather: bool = True) -> None:
        if not self._on:
            return
        for p in self.params:
            if id(p) in self._aside:
                p.grad = self._aside[id(p)]
        self._aside = {}
        if gather and self.replicas > 1 and self.sharded:
            self.gather()

    def gather(self) -> None:
        """Every replica's stepped share to every replica: all-gathers of buckets of whole
        tensors, one dtype at a time; round b gathers each replica's b-th bucket, padded to
        the largest, so the buffers stay within (r + 1) x ``comm.BUCKET_BYTES`` (or the
        largest tensor) whatever the stage's size."""
        groups = self._groups()
        group = groups.stage[self.stage]
        with torch.no_grad():
            for rd in self._rounds:
                self._gather_round(rd, groups, group)

    def _gather_round(self, rd: Round, groups: Groups, group: dist.ProcessGroup | None
                      ) -> None:
        shares, sizes, chunk, dtype, device = rd.shares, rd.sizes, rd.chunk, rd.dtype, rd.device
        mine = torch.zeros(chunk, dtype=dtype, device=device)
        if shares[self.replica]:
            torch.cat([p.reshape(-1) for p in shares[self.replica]],
                      out=mine[: sizes[self.replica]])
        out = torch.empty(chunk * self.replicas, dtype=dtype, device=device)

        def start(a: bool) -> Any:
            return dist.all_gather_single(out, mine, group=group, async_op=a)

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
                    modules: dict[int, nn.Module], groups: Callable[[], Groups],
                    owners: Owners | None = None) -> OptimizerShard | None:
    """Shard ``optimizer`` over the replicas of this rank's stages whose plan says ``zero =
    1``, and offload the state of those that say ``offload`` (``modules``: this rank's stage
    modules by index); None where none does either. A lane's stages share their ranks, so
    one share and one group serve all of them (``owners``: the map the gradient shards
    read)."""
    zero = [s for s in modules if plan.stages[s].zero in (1, 2) and plan.stages[s].replicas > 1]
    off = [s for s in modules if plan.stages[s].offload]
    if optimizer is None or not (zero or off):
        return None
    st = plan.stages[(zero or off)[0]]
    return OptimizerShard(optimizer, sharded_params(plan, modules), st.ranks.index(rank),
                          st.replicas, st.index, groups,
                          offloaded=offloaded_params(plan, modules), owners=owners)


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
