"""Clip the whole model's gradient norm: each parameter counted once, one all-reduce, one
factor on every rank.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on a rank sees only its stage:
each rank clips by its own stage's norm, so the stages are scaled by different factors and
two holders of a shared parameter (a tied embedding) stop being equal. Here each rank adds up
what it counts, one all-reduce over the world makes the whole model's norm, and every rank
scales all its gradients by the factor torch's function would use on the single-process model.

After ``loss.backward()`` the replicas of a stage hold the same gradient, and so does every
rank of every stage that uses a shared parameter (``grads.GradSync``). Each parameter is
counted by the lowest rank that holds it, decided from the plan alone so that every rank
agrees: replica 0 of its stage, and for a shared parameter replica 0 of the first stage that
uses it; a parameter whose gradient is sharded (ZeRO-2, ``grad_shards``) by its owner, the one
replica that holds it; a fully sharded one (ZeRO-3, ``full_shard``) by every replica, each
holding its own rows. Here with replicas (2, 1, 1) and an embedding E tied between stages 0 and 2:

    rank                 0        1        2        3
    stage (replica)      0 (0)    0 (1)    1 (0)    2 (0)
    own parameters       count    -        count    count
    E                    count    -                 -
    gradients scaled     all      all      all      all    by max_norm / (norm + 1e-6), <= 1

Norm types: a finite p ≠ 0 sums the p-th powers of the ranks' norms; 0 (the count of
non-zeros) sums the counts; inf takes the largest, -inf the smallest (as the largest of the
negated norms), so one SUM or MAX all-reduce serves every type.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..plan.plan import Plan
from .comm import all_reduce_flat
from .executor import StageExecutor
from .single_rank import AloneExecutor

__all__ = ["Counted", "clip_grad_norm", "counted_by"]


class Counted(NamedTuple):
    """What one rank counts in the whole model's norm."""

    own: bool  # its stage's parameters that no other stage uses
    shared: frozenset[int]  # indices into plan.shared_params


def counted_by(plan: Plan, rank: int) -> Counted:
    """The parameters ``rank`` counts: those of which it is the lowest rank holding a copy
    (a rank running a lane's several stages counts them all, a weight they share once)."""
    held = plan.stages_of_rank(rank)
    first = held[0].ranks[0] == rank
    mine = {st.index for st in held}
    shared = frozenset(
        j for j, sp in enumerate(plan.shared_params) if first and min(sp.stages) in mine
    )
    return Counted(first, shared)


def clip_grad_norm(
    executor: StageExecutor | AloneExecutor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model that ``executor`` runs a stage
    of; every rank calls it after ``loss.backward()`` and gets the same norm."""
    every, counted = _parameters(executor)
    p = float(norm_type)
    grads = [q.grad for q in counted if q.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, p, foreach=foreach) if grads else None
    dtype = local.dtype if local is not None else torch.get_default_dtype()
    world = executor.plan.world_size
    # [this rank's contribution, then per rank: 2 if its norm is NaN, 1 if infinite]
    buf = torch.zeros(1 + world, dtype=torch.float64, device=executor.device)
    if local is not None:
        norm = local.to(buf.device, torch.float64)
        buf[0] = _contribution(norm, p)
        buf[1 + executor.rank] = torch.where(norm.isnan(), 2.0, (~norm.isfinite()).double())
    elif p == -math.inf:
        buf[0] = -math.inf  # the identity of the MAX over negated norms
    if world > 1:
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        # each flag has one writer, so SUM and MAX both keep it
        what = "the gradient norm (every rank calls clip_grad_norm_)"
        (buf,) = all_reduce_flat([buf], None, what=what, op=op)
    total, flags = _norm_of(buf[0], p), buf[1:]
    total = torch.where((flags == 2).any(), math.nan, total)  # MAX may drop a NaN
    total = total.to(dtype)
    if error_if_nonfinite and not bool(total.isfinite()):
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        why = (
            f"ranks {bad} hold non-finite gradients"
            if bad
            else "every rank's part is finite, their sum overflows"
        )
        raise RuntimeError(
            f"the total norm of order {p} of the model's gradients is {total.item()} ({why}), "
            "so it cannot be clipped; every rank raises this. To scale the gradients by the "
            "non-finite norm anyway, set error_if_nonfinite=False"
        )
    torch.nn.utils.clip_grads_with_norm_(every, max_norm, total, foreach)
    return total


def _contribution(norm: torch.Tensor, p: float) -> torch.Tensor:
    """What a rank with local norm ``norm`` adds (SUM) or offers (MAX) to the reduction."""
    if p == -math.inf:
        return -norm
    if p in (0.0, math.inf):
        return norm
    return norm.pow(p)


def _norm_of(reduced: torch.Tensor, p: float) -> torch.Tensor:
    """The whole model's norm from the reduced contributions."""
    if p == -math.inf:
        return -reduced
    if p in (0.0, math.inf):
        return reduced
    return reduced.pow(1 / p)


def _parameters(
    executor: StageExecutor | AloneExecutor,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(every parameter of this rank's stage that takes a gradient, those this rank counts);
    refuses a step whose gradients are not in ``.grad`` yet."""
    if isinstance(executor, AloneExecutor):  # one rank, plain autograd: .grad is final
        every = [q for q in executor.module.parameters() if q.requires_grad]
        return every, every
    step = executor.pending
    if step is not None:
        why = (
            "1F1B holds them until loss.backward() applies them"
            if step.held
            else "the backwards run when loss.backward() reaches the loss"
        )
        raise RuntimeError(
            f"clip_grad_norm_ called before loss.backward() of step {step.index}: this step's "
            f"gradients are not in .grad yet ({why}); call it after loss.backward() on every "
            "rank, before optimizer.step() (a call whose loss gets no backward: run it under "
            "torch.no_grad())"
        )
    grads, counts = executor.grads, counted_by(executor.plan, executor.rank)
    mine = [q for j, group in grads.shared if j in counts.shared for q in group]
    shards = grads.shards
    sharded = {id(q) for q in shards.params} if shards is not None else set()
    rows = {id(q) for q in grads.rows}  # ZeRO-3: each replica's rows its own
    mine.extend(q for q in grads.own
                if (shards.owns(q) if shards is not None and id(q) in sharded else
                    id(q) in rows or counts.own))
    return grads.every, mine
