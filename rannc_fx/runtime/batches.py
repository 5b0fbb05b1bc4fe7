"""Batch sizes (and autocast states) other than the plan's: the plan re-split for the call.

What runs where is a function of the global batch and the micro-batch count alone
(``routing``): the stages, their replica counts and the schedule stay. So a smaller last
batch of an epoch (``DataLoader(drop_last=False)``), or a larger batch, runs on a copy of the
plan with those two changed, its micro-batches capped so that every replica of every stage
gets at least one sample of each. One executor is made per size, the first time it is seen,
and kept (the plan's own stays the one ``model.plan`` shows).

The same goes for the autocast state a call runs under: ``retype`` (given by
``rannc_fx.compile``, see ``rannc_fx/startup/amp.py``) gives the plan with its cut values and outputs
in that state's dtypes, and the executor for (size, state) is kept likewise.

With more than one rank each call first all-gathers the ranks' local batch sizes, autocast
states and the first input (if any) whose shape is not the plan's for that size: every rank
then picks the same executor, and unequal local batches, or an input of another sequence
length on any rank, are refused on every rank at once instead of leaving the ranks that
passed the plan's shapes waiting for a peer that raised. That costs one collective's latency per call, before the
first message (every message's size depends on the batch size, so it cannot overlap them);
``Config(check_batches=False)`` skips it for a job whose ranks always pass equal batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ..plan import Plan
from .alone import AloneExecutor, build_executor
from .comm import CommError
from .executor import StageExecutor
from .trace import Recorder

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

    def __init__(
        self, plan: Plan, module: fx.GraphModule, *, device: torch.device,
        timeout_s: float | None,
        planned: str | None = None,
        state: Callable[[], str | None] = lambda: None,
        retype: Callable[[Plan, str | None], Plan] = lambda plan, _: plan,
        check: bool = True,
    ) -> None:  # fmt: skip
        self.module, self.device, self.timeout_s = module, device, timeout_s
        self.default: Executor = build_executor(plan, module, device=device, timeout_s=timeout_s)
        self.plan, self.state, self.retype, self.check = plan, state, retype, check
        self._by_key: dict[tuple[int, str | None], Executor] = {
            (plan.global_batch, planned): self.default
        }
        self.trace: Recorder | None = None
        self._batched = [
            (i, spec.batch_dim, spec.shape[spec.batch_dim])
            for i, spec in enumerate(plan.inputs)
            if spec.kind == "tensor" and spec.batch_dim is not None
        ]
        # an input's shape travels in the agreement as (index, rank, dims): this many dims
        self._dims = max((len(s.shape) for s in plan.inputs if s.kind == "tensor"), default=0)

    def for_inputs(self, flat_inputs: Sequence[Any]) -> Executor:
        """The executor for the batch ``flat_inputs`` holds (the same on every rank)."""
        local, state = self._local_size(flat_inputs), self.state()
        world = self.plan.world_size
        if world > 1 and self.check:
            rec = self.trace
            if rec is not None and rec.on:
                with rec.span("agree", "collective", kind="agree", peers=rec.others,
                              match="agree"):
                    self._agree(local, state, flat_inputs)
            else:
                self._agree(local, state, flat_inputs)
        key = (local * world, state)
        found = self._by_key.get(key)
        if found is None:
            groups = getattr(self.default, "groups", None)
            plan = self.retype(self.plan, key[1])
            if key[0] != plan.global_batch:
                plan = rebatched(plan, key[0])
            found = build_executor(
                plan, self.module, device=self.device, timeout_s=self.timeout_s, groups=groups
            )
            if isinstance(found, StageExecutor):
                found.set_trace(self.trace)
            self._by_key[key] = found
        return found

    def set_trace(self, rec: Recorder) -> None:
        """Every executor, made or to be made, records into ``rec``."""
        self.trace = rec
        for ex in self._by_key.values():
            if isinstance(ex, StageExecutor):
                ex.set_trace(rec)

    def _local_size(self, flat: Sequence[Any]) -> int:
        """Samples in this call's local batch; the plan's when no input says otherwise (then
        the executor's input checks explain what is wrong)."""
        planned = self.plan.global_batch // self.plan.world_size
        for i, dim, rows in self._batched:
            t = flat[i] if i < len(flat) else None
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] % rows == 0:
                return int(t.shape[dim]) // rows
        return planned

    def _odd_input(self, flat: Sequence[Any], local: int) -> list[int]:
        """(index, rank, dims...) of this rank's first input whose shape is not the plan's for
        ``local`` samples (rank -1: not a tensor), or index -1: every input as planned."""
        for j, spec in enumerate(self.plan.inputs):
            if spec.kind != "tensor":
                continue
            t = flat[j] if j < len(flat) else None
            if not isinstance(t, torch.Tensor):
                return [j, -1] + [-1] * self._dims
            if tuple(t.shape) != spec.shape_for(local):
                dims = list(t.shape)[: self._dims]
                return [j, t.dim()] + dims + [-1] * (self._dims - len(dims))
        return [-1, -1] + [-1] * self._dims

    def _agree(self, local: int, state: str | None, flat: Sequence[Any]) -> None:
        """One all-gather of (size, state, the odd input) per rank; every rank then sees
        every rank's.

        It is the cheapest collective that agrees (gloo, 2 ranks, 40-48 ms steps: +1.0 and
        +3.5 % against +2.8 and +5.0 % for an all-reduce of four integers, measured
        interleaved), and a mismatch needs no second exchange to say who passed what."""
        world = self.plan.world_size
        row = [local, _state_code(state), *self._odd_input(flat, local)]
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        everyone = torch.empty(len(row) * world, dtype=torch.int64, device=self.device)
        try:
            dist.all_gather_single(everyone, mine)
        except RuntimeError as e:
            raise CommError(
                f"rank {dist.get_rank()}: all-gather of the local batch sizes at the start of a "
                f"call failed: {e}; a rank died or stopped calling the model (every rank calls "
                "it every step): check the other ranks' logs"
            ) from e
        rows = [tuple(r) for r in everyone.view(world, len(row)).tolist()]
        if all(r == rows[0] for r in rows) and rows[0][2] == -1:
            return
        if any(r[0] != rows[0][0] for r in rows):
            shown = ", ".join(f"rank {i}: {r[0]}" for i, r in enumerate(rows))
            raise ValueError(
                f"the ranks passed local batches of different sizes ({shown}); every rank must "
                "pass the same number of samples per call: a DistributedSampler gives every "
                "rank the same count (it pads), and DataLoader(drop_last=True) drops a "
                "smaller last batch"
            )
        if any(r[1] != rows[0][1] for r in rows):
            names = {_state_code(state): state, **{_state_code(s): s for s in _STATES}}
            shown = ", ".join(f"rank {i}: {names.get(r[1], 'another dtype')}"
                              for i, r in enumerate(rows))
            raise ValueError(
                f"the ranks call the model under different autocast states ({shown}); enter "
                "the same torch.autocast(...) on every rank"
            )
        self._refuse_shapes(rows, local)

    def _refuse_shapes(self, rows: list[tuple[int, ...]], local: int) -> None:
        """Every rank's odd input, named, with the plan's shapes and the ways out."""
        specs = self.plan.inputs

        def said(r: tuple[int, ...]) -> str:
            j, rank, dims = r[2], r[3], r[4:]
            if j == -1:
                return "as planned"
            if rank == -1:
                return f"input {j} ({specs[j].name!r}) is missing or not a tensor"
            shape = tuple(dims[: min(rank, self._dims)]) + (("...",) if rank > self._dims else ())
            return f"input {j} ({specs[j].name!r}) has shape {shape}"

        shown = "; ".join(f"rank {i}: {said(r)}" for i, r in enumerate(rows))
        odd = {r[2] for r in rows if r[2] != -1}
        want = ", ".join(f"{specs[j].name!r} {specs[j].shape_for(local)}" for j in sorted(odd))
        raise ValueError(
            f"the ranks' inputs do not all have the shapes the plan was made for ({shown}); "
            f"with {local} samples per rank it expects {want} on every rank: pad every rank's "
            "batch to the planned length (only the batch dimension may change between calls), "
            "or plan with an example of the length you train with"
        )


_STATES: list[str | None] = [None, "bfloat16", "float16"]


def _state_code(state: str | None) -> int:
    """An autocast state as an integer, equal on two ranks exactly when the states are."""
    if state is None:
        return 0
    return int(hashlib.sha256(state.encode()).hexdigest()[:15], 16)
