"""Gradients accumulated over calls without summing them over ranks: ``model.no_sync()``.

As DDP's ``no_sync()``: a call made inside it adds its gradients to ``.grad`` on this rank
only, with none of the sums over ranks (the replicas' all-reduce, a shared parameter's
all-reduce over its holders, ZeRO-2's reduce-scatter); the first call outside sums what
those calls left in ``.grad`` together with its own, in the collectives one call makes. The
sum over ranks is linear, so summing k calls' local sums once equals summing each call's:

    call            1 .. k-1, in no_sync()           k, outside              optimizer.step()
    .grad (rank i)  g_i(1) + ... + g_i(j)            Σ_i Σ_j g_i(j)          as one process
    collectives     none                             one per group           after k calls

A gradient already summed when a window opens (an earlier call outside ``no_sync()`` of the
same accumulation, or ``.grad`` left over from the last step) is equal on every rank of its
group, so the closing sum would count it once per rank: the window's first call keeps it on
the group's first rank only (a ZeRO-2 gradient is already only on its owner).

Where the closing call runs its backwards inside the call (1F1B; ``grads.GradSync.hold``),
its gradients wait for ``loss.backward()`` to scale them by the gradient that reaches the
loss, and the earlier calls' sums are already scaled: the one sum then runs in
``loss.backward()``, after the scaling.

The choice is the call's (as DDP's is its forward's), carried by its step to the ``REDUCE``
that runs in the call or in ``loss.backward()``. One ``Accumulation`` per compiled model is
shared by the executors of every batch size, autocast state and length (``batches``): the
calls of one accumulation may run on different executors. ``optimizer.step()`` and
``clip_grad_norm_`` are refused while ``.grad`` holds sums no call has summed over the ranks:
the replicas would step apart. Nothing changes where the plan sums nothing over ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from .grads import GradSync

__all__ = ["Accumulation"]


class Accumulation:
    """Whether ``.grad`` holds local sums that no call has summed over the ranks yet; the
    same on every rank (each runs the same calls' ``REDUCE``)."""

    def __init__(self) -> None:
        self.pending = False

    def reduce(self, grads: GradSync, *, sync: bool, held: bool) -> bool:
        """A step's ``REDUCE`` (``sync``: its call was made outside ``no_sync()``; ``held``:
        its gradients wait for ``loss.backward()``). Returns whether the sum over ranks
        waits for ``loss.backward()`` too (``apply(late=True)``)."""
        if not sync and grads.sums:
            if not self.pending:
                grads.keep_summed_once()
                self.pending = True
            grads.hold() if held else grads.merge()
            return False
        if self.pending and held:
            grads.hold()
            return True
        grads.reduce(earlier=self.pending)
        self.pending = False
        grads.hold() if held else grads.merge()
        return False

    def apply(self, grads: GradSync, scale: torch.Tensor | None, *, late: bool) -> None:
        """``loss.backward()`` of a step whose gradients were held: into ``.grad`` scaled,
        and, ``late``, the sum over ranks of all of ``.grad`` after."""
        if not late:
            grads.apply(scale)
            return
        grads.apply_and_reduce(scale)
        self.pending = False

    def check_summed(self, what: str) -> None:
        """Refuse ``what`` while ``.grad`` holds sums no call has summed over the ranks."""
        if self.pending:
            raise RuntimeError(
                f"{what} with gradients accumulated under model.no_sync() that no call has "
                "summed over the ranks yet: each rank holds only its own samples' gradients, "
                "so the replicas would step apart; make the last call of the accumulation "
                "outside no_sync() and call loss.backward() on it (that sums every call's "
                f"gradients once), then {what} (every rank raises this)"
            )

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse ``optimizer.step()`` while ``.grad`` holds unsummed sums; installed before
        any other step hook (ZeRO's), so nothing is set aside when it refuses."""
        def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.check_summed("optimizer.step()")

        optimizer.register_step_pre_hook(before)
