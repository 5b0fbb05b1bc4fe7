"""Gradient all-reduce after a step's backwards: shared parameters over all their holders,
the rest among the stage's replicas (reduce-scattered to their owners where the stage's
gradients are sharded, ZeRO-2: ``grad_shards``); and where a step's gradients wait for
``loss.backward()``.

Each replica's gradient is the sum over its micro-batches of share-weighted slice gradients,
so the SUM over replicas is the global-batch gradient. A parameter that several stages use
(a tied embedding and LM head) gets a partial gradient on every rank of every such stage; one
SUM over all of them gives every holder the same full gradient, hence the same value after
the same optimizer step. Such a parameter is left out of its replica group's all-reduce, which
would count it twice.

A schedule that runs the backwards inside the call (1F1B) computes the gradient of the loss
itself; ``hold`` keeps it aside, and ``loss.backward()`` applies it scaled by the gradient that
reaches the loss (the chain rule: d f(loss)/dθ = f'(loss) · dloss/dθ). A call whose loss never
gets a backward leaves ``.grad`` as it was. Between the call and ``loss.backward()`` the held
gradients and any gradients of earlier calls (accumulation) exist side by side.

Calls under ``model.no_sync()`` skip the sums and leave local sums in ``.grad``
(``accumulation``); the closing call's ``reduce(earlier=True)`` adds them into what it sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..plan.plan import Plan
from . import comm
from .comm import Groups, all_reduce_flat, buckets
from .full_shard import sharded_ids
from .grad_shards import GradShards
from .lane import graph_modules
from .zero import Owners, sharded_params

__all__ = ["GradSync"]


class GradSync:
    """Which local parameters go through which group, and the all-reduces themselves."""

    def __init__(self, plan: Plan, stage: int | tuple[int, ...], module: nn.Module,
                 groups: Groups, owners: Owners | None = None):
        """``stage``: this rank's stage, or its stages where it runs several; ``module`` holds
        their parameters (a rank's stages share their ranks, hence one replica group). The
        parameters that require a gradient now are the ones summed: an executor makes its
        ``GradSync`` again where that changed (``trainable``). ``owners``: ZeRO's owners,
        the map the optimizer's share reads too (default: one of its own)."""
        stages = (stage,) if isinstance(stage, int) else stage
        self.plan, self.stage, self.groups = plan, stages[0], groups
        named = _named(module)
        unique = {id(p): p for p in named.values() if p.requires_grad}
        self.shared: list[tuple[int, list[nn.Parameter]]] = []  # (plan index, its objects here)
        taken: set[int] = set()
        for j, sp in enumerate(plan.shared_params):
            if not set(stages) & set(sp.stages):
                continue
            found = {id(named[n]): named[n] for n in (sp.name, *sp.aliases) if n in named}
            if not found:
                raise ValueError(
                    f"stage(s) {list(stages)} use shared parameter {sp.name!r} but no module "
                    f"here has a parameter under that name or its aliases {list(sp.aliases)}"
                )
            self.shared.append((j, [p for i, p in found.items() if i in unique and i not in taken]))
            taken.update(found)
        self.own = [p for i, p in unique.items() if i not in taken]
        self.shards = _grad_shards(plan, stages, module, taken, owners)
        sharded = {id(p) for p in self.shards.params} if self.shards is not None else set()
        # ZeRO-3's rows: reduce-scattered by each backward already (``full_shard``)
        rows = sharded_ids(plan, dict(zip(sorted(stages), graph_modules(module), strict=True)))
        self.rows = [p for p in self.own if id(p) in rows]
        self.whole = [p for p in self.own if id(p) not in sharded | rows]  # the all-reduce
        self._stash: dict[int, torch.Tensor] = {}
        self._held: dict[int, torch.Tensor] = {}
        self._begun = False  # a step's gradients are in .grad, the earlier ones aside

    def begin(self) -> None:
        """Before a step's backwards: set aside every parameter's gradient from earlier calls
        (accumulation), so only this step's are summed over ranks, and a step that fails
        leaves ``.grad`` as it found it (``abandon``)."""
        self._stash = {}
        self._held = {}
        self._begun = True
        for p in self.every:
            if p.grad is not None:
                self._stash[id(p)] = p.grad
                p.grad = None

    def abandon(self) -> None:
        """A step failed: its gradients go, ``.grad`` is what the step found."""
        if self._begun:
            for p in self.every:
                p.grad = self._stash.get(id(p))
        self._stash, self._held, self._begun = {}, {}, False

    @property
    def every(self) -> list[nn.Parameter]:
        return [p for _, group in self.shared for p in group] + self.own

    @property
    def sums(self) -> bool:
        """Whether the plan sums any gradient over ranks (read off the plan: every rank
        answers alike, whichever stage it runs)."""
        g = self.groups
        return any(len(r) > 1 for r in (*g.stage_ranks, *g.shared_ranks))

    def _jobs(self) -> list[tuple[dist.ProcessGroup, list[nn.Parameter], str, tuple[int, ...]]]:
        """The all-reduces of this rank: shared parameters first (plan order), then the
        stage's own; every rank walks the groups in that one global order."""
        todo: list[tuple[dist.ProcessGroup, list[nn.Parameter], str, tuple[int, ...]]] = []
        for j, ps in self.shared:
            g = self.groups.shared[j]
            if g is not None and ps:
                what = f"gradient of shared parameter {self.plan.shared_params[j].name!r}"
                todo.append((g, ps, what, self.groups.shared_ranks[j]))
        g = self.groups.stage[self.stage]
        if g is not None and self.whole:
            todo.append((g, self.whole, f"gradients of stage {self.stage}",
                         self.groups.stage_ranks[self.stage]))
        return todo

    def reduce(self, *, earlier: bool = False) -> None:
        """After the backwards: the SUM all-reduces (``_jobs``), then ZeRO-2's
        reduce-scatter. Leaves this step's reduced gradients in ``.grad`` (the set-aside ones
        stay aside). ``earlier``: the set-aside gradients are local sums of calls made under
        ``no_sync()``; each is added into what is summed and is no longer set aside once the
        sums have finished (until then ``abandon`` gives it back)."""
        jobs = self._jobs()
        stash = self._stash if earlier else {}
        for group, ps, what, ranks in jobs:
            # a bucket at a time: the flat copy is a bucket's, not the whole stage's gradients
            for bucket in buckets(ps, comm.BUCKET_BYTES):
                grads = [_plus(p, p.grad, stash.get(id(p))) for p in bucket]
                reduced = all_reduce_flat(grads, group, what=what, ranks=ranks,
                                          groups=self.groups)
                del grads
                for p, r in zip(bucket, reduced, strict=True):
                    p.grad = r
        if self.shards is not None:  # ZeRO-2: after every all-reduce, on every replica alike
            self.shards.reduce(self.groups, earlier=stash)
        if earlier:  # summed in: what stays aside is what no group sums
            for p in self._summed():
                stash.pop(id(p), None)

    def _summed(self) -> list[nn.Parameter]:
        """The parameters some group sums over ranks."""
        ps = [p for _, group, _, _ in self._jobs() for p in group]
        return ps + (self.shards.params if self.shards is not None else [])

    def keep_summed_once(self) -> None:
        """Before the first call under ``no_sync()`` adds to the set-aside gradients: one
        already summed over its group (equal on every rank of it) stays aside on one rank of
        the group only, the first (ZeRO-2: the owner), so the closing sum counts it once."""
        rank = dist.get_rank()
        for _, ps, _, ranks in self._jobs():
            if ranks[0] != rank:
                for p in ps:
                    self._stash.pop(id(p), None)
        if self.shards is not None:
            for p in self.shards.params:
                if not self.shards.owns(p):
                    self._stash.pop(id(p), None)

    def merge(self) -> None:
        """Add the set-aside gradients back: ``.grad`` = earlier calls' + this step's."""
        for p in self.every:
            old = self._stash.get(id(p))
            if old is not None:
                # in place into the earlier gradient: no third copy while the step's exists
                p.grad = old if p.grad is None else old.add_(p.grad)
        self._stash, self._begun = {}, False

    def hold(self) -> None:
        """Keep this step's gradients aside and give ``.grad`` back as the call found it, until
        ``apply`` (``loss.backward()``) or ``drop_held`` (the next call) decides their fate."""
        self._held = {}
        for p in self.every:
            if p.grad is not None:
                self._held[id(p)] = p.grad
            p.grad = self._stash.get(id(p))
        self._stash, self._begun = {}, False

    def apply(self, scale: torch.Tensor | None) -> None:
        """``.grad += scale * held`` (the chain rule through the loss), once."""
        for p in self.every:
            h = self._held.pop(id(p), None)
            if h is None:
                continue
            if scale is not None:
                h = h.mul_(scale.to(h.device, h.dtype))  # host gradients (host_params)
            p.grad = h if p.grad is None else p.grad.add_(h)
        self._held = {}

    def apply_and_reduce(self, scale: torch.Tensor | None) -> None:
        """``apply``, then the sum over ranks of all of ``.grad``: the local sums of earlier
        calls (``no_sync()``), set aside meanwhile (``abandon`` gives them back), and this
        call's held gradients, scaled."""
        held, self._held = self._held, {}
        self.begin()
        for p in self.every:
            h = held.get(id(p))
            if h is not None:
                p.grad = h if scale is None else h.mul_(scale.to(h.device, h.dtype))
        self.reduce(earlier=True)
        self.merge()

    def drop_held(self) -> None:
        self._held = {}

    @property
    def held_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self._held.values())


def _plus(p: nn.Parameter, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """``a + b`` for ``p``'s gradient, either of them None (zeros where both are)."""
    if a is None:
        return b if b is not None else torch.zeros_like(p)
    return a if b is None else a + b


def _grad_shards(plan: Plan, stages: tuple[int, ...], module: nn.Module, shared: set[int],
                 owners: Owners | None) -> GradShards | None:
    """The reduce-scatter of this rank's ZeRO-2 stages' own gradients (a shared parameter's
    is all-reduced over its holders instead), owned as ``zero.OptimizerShard`` owns them."""
    st = plan.stages[stages[0]]
    if st.replicas < 2 or not any(plan.stages[s].zero == 2 for s in stages):
        return None
    gms = dict(zip(sorted(stages), graph_modules(module), strict=True))
    every = sharded_params(plan, gms)
    owner = (owners if owners is not None else Owners(st.replicas)).assign(every)
    level2 = {id(p) for s in stages if plan.stages[s].zero == 2 for p in gms[s].parameters()}
    mine = [p for p in every if id(p) in level2 and id(p) not in shared]
    return GradShards(mine, owner, st.ranks.index(dist.get_rank()), st.replicas, st.index)


def _named(module: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by their name in a stage module (the plan's names): the module's own, or
    each stage's where it holds a lane's (``LaneModules``)."""
    return {n: p for gm in graph_modules(module)
            for n, p in gm.named_parameters(remove_duplicate=False)}
