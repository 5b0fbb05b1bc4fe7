"""Batch sizes other than the plan's: the plan re-split for the batch a call passes.

What runs where is a function of the global batch and the micro-batch count alone
(``routing``): the stages, their replica counts and the schedule stay. So a smaller last
batch of an epoch (``DataLoader(drop_last=False)``), or a larger batch, runs on a copy of the
plan with those two changed, its micro-batches capped so that every replica of every stage
gets at least one sample of each. One executor is made per size, the first time it is seen,
and kept (the plan's own stays the one ``model.plan`` shows).

With more than one rank each call first all-gathers the ranks' local batch sizes (one
integer each): every rank then picks the same executor, and unequal local batches are
refused on every rank at once instead of leaving the ranks that passed the plan's size
waiting for a peer that raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ..plan import Plan
from .alone import AloneExecutor, build_executor
from .executor import StageExecutor

__all__ = ["BatchSizes", "rebatched"]

Executor = StageExecutor | AloneExecutor


def rebatched(plan: Plan, global_batch: int) -> Plan:
    """``plan`` for a global batch of ``global_batch`` samples (the same stages and schedule)."""
    widest = max(st.replicas for st in plan.stages)
    if global_batch < widest:
        stage = next(st.index for st in plan.stages if st.replicas == widest)
        raise ValueError(
            f"a global batch of {global_batch} sample(s) cannot feed stage {stage}'s {widest} "
            "replicas (each needs at least one sample); drop the last smaller batch "
            "(DataLoader(drop_last=True)) or pass at least "
            f"{-(-widest // plan.world_size)} sample(s) per rank"
        )
    micro = min(plan.micro_batches, global_batch // widest)
    return plan.model_copy(update={"global_batch": global_batch, "micro_batches": micro})


class BatchSizes:
    """The executor for each global batch size this rank's calls pass."""

    def __init__(self, plan: Plan, module: fx.GraphModule, *, device: torch.device,
                 timeout_s: float | None) -> None:
        self.module, self.device, self.timeout_s = module, device, timeout_s
        self.default: Executor = build_executor(plan, module, device=device, timeout_s=timeout_s)
        self.plan = plan
        self._by_size: dict[int, Executor] = {plan.global_batch: self.default}
        self._batched = [
            (i, spec.batch_dim, spec.shape[spec.batch_dim])
            for i, spec in enumerate(plan.inputs)
            if spec.kind == "tensor" and spec.batch_dim is not None
        ]

    def for_inputs(self, flat_inputs: Sequence[Any]) -> Executor:
        """The executor for the batch ``flat_inputs`` holds (the same on every rank)."""
        local = self._local_size(flat_inputs)
        world = self.plan.world_size
        if world > 1:
            local = self._agreed(local)
        size = local * world
        found = self._by_size.get(size)
        if found is None:
            groups = getattr(self.default, "groups", None)
            found = build_executor(
                rebatched(self.plan, size), self.module, device=self.device,
                timeout_s=self.timeout_s, groups=groups,
            )  # fmt: skip
            self._by_size[size] = found
        return found

    def _local_size(self, flat: Sequence[Any]) -> int:
        """Samples in this call's local batch; the plan's when no input says otherwise (then
        the executor's input checks explain what is wrong)."""
        planned = self.plan.global_batch // self.plan.world_size
        for i, dim, rows in self._batched:
            t = flat[i] if i < len(flat) else None
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] % rows == 0:
                return int(t.shape[dim]) // rows
        return planned

    def _agreed(self, local: int) -> int:
        world = self.plan.world_size
        mine = torch.tensor([local], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(sizes, mine)
        found = [int(s.item()) for s in sizes]
        if len(set(found)) > 1:
            shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(found))
            raise ValueError(
                f"the ranks passed local batches of different sizes ({shown}); every rank must "
                "pass the same number of samples per call: a DistributedSampler gives every "
                "rank the same count (it pads), and DataLoader(drop_last=True) drops a "
                "smaller last batch"
            )
        return local
