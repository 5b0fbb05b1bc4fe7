"""Batch sizes (and autocast states) other than the plan's: the plan re-split for the call.

What runs where is a function of the global batch and the micro-batch count alone
(``routing``): the stages, their replica counts and the schedule stay. So a smaller last
batch of an epoch (``DataLoader(drop_last=False)``), or a larger batch, runs on a copy of the
plan with those two changed, its micro-batches capped so that every replica of every stage
gets at least one sample of each, and fewer where a replica's micro-batch would hold a size
its stage never runs (``Plan.excluded_sizes``: one sample for a training-mode BatchNorm
that normalizes one value per channel). One executor is made per size, the first time it is seen,
and kept (the plan's own stays the one ``model.plan`` shows).

The same goes for the autocast state a call runs under: ``retype`` (given by
``rannc_fx.compile``, see ``rannc_fx/startup/amp.py``) gives the plan with its cut values and outputs
in that state's dtypes, and the executor for (size, state) is kept likewise.

The same goes for the mode: a call in the mode the model was not planned in (``model.eval()``
after training, ``startup/modes.py``) runs that mode's graph on its own plan (``other``),
with an executor per (size, state, lengths) likewise.

The same goes for the sizes of the plan's dynamic dimensions (``Plan.dynamic_dims``: a
sequence length under dynamic padding): a call of another length up to the planned one runs
on ``plan.at_sizes(...)``, every message sized for it, with its own executor (the most
recent ``KEPT`` kept).

With more than one rank each call first agrees with the others on all of these, and on its
mode, ``model.no_sync()`` state and the parameters that train (``agreement.py``: one
all-gather; ``trainable.py``), so every rank picks
the same executor and a mismatch is refused on every rank at once;
``Config(check_batches=False)`` skips it for a job whose ranks always pass equal batches.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ..plan.plan import ExcludedSize, Plan
from ..schedules import routing
from .accumulation import Accumulation
from .agreement import Agreement
from .comm import abort_groups, build_groups
from .executor import StageExecutor
from .failures import raised_everywhere
from .lane import LaneModules, graph_modules
from .single_rank import AloneExecutor, build_executor
from .trace import Recorder
from .trainable import Trainable

__all__ = ["KEPT", "BatchSizes", "rebatched"]

Executor = StageExecutor | AloneExecutor
Key = tuple[int, str | None, tuple[int, ...], bool]  # global batch, state, lengths, training
KEPT = 32  # executors kept for sizes other than the plan's (dynamic padding makes many)


def rebatched(plan: Plan, global_batch: int) -> Plan:
    """``plan`` for a global batch of ``global_batch`` samples (the same stages and schedule),
    with the most micro-batches (up to the plan's) that give no stage a size it never runs
    (``Plan.excluded_sizes``: a node of it raised there when profiled)."""
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
    hit = None
    for m in range(micro, 0, -1):  # the most micro-batches that keep off excluded sizes
        got = plan.model_copy(update={"global_batch": global_batch, "micro_batches": m})
        hit = _runs_excluded(got)
        if hit is None:
            return got
    assert hit is not None
    raise ValueError(
        f"a global batch of {global_batch} sample(s) gives stage {hit.stage}'s "
        f"{plan.stages[hit.stage].replicas} replica(s) micro-batches of {hit.samples} "
        f"sample(s) with any count of them up to {micro}, and node {hit.nodes[0]} of that "
        f"stage cannot run {hit.samples} ({hit.error}); drop the last smaller batch "
        "(DataLoader(drop_last=True)) or pass a batch that gives each of its replicas more "
        "samples"
    )


def _runs_excluded(plan: Plan) -> ExcludedSize | None:
    """A size a stage of ``plan`` never runs (``Plan.excluded_sizes``) that one of its
    replicas' micro-batches would hold; None if none does."""
    for x in plan.excluded_sizes:
        r = plan.stages[x.stage].replicas
        for i in range(plan.micro_batches):
            for replica in range(r):
                a, b = routing.replica_span(plan, x.stage, replica, i)
                if b - a == x.samples:
                    return x
    return None


class BatchSizes:
    """The executor for each global batch size this rank's calls pass."""

    def __init__(
        self, plan: Plan, module: fx.GraphModule | LaneModules, *, device: torch.device,
        timeout_s: float | None,
        planned: str | None = None,
        state: Callable[[], str | None] = lambda: None,
        retype: Callable[[Plan, str | None], Plan] = lambda plan, _: plan,
        check: bool = True,
        training: bool = True,
        other: Callable[[bool], tuple[Plan, fx.GraphModule | LaneModules,
                                      Callable[[Plan, str | None], Plan]]] | None = None,
        accumulation: Accumulation | None = None,
        trainable: Trainable | None = None,
    ) -> None:  # fmt: skip
        """``training``: the mode ``plan`` and ``module`` are for; ``other(mode)`` gives the
        plan, module and retype of the other mode (made at its first call); ``trainable``:
        which of this rank's parameters train, as the calls saw it (default: its own)."""
        self.module, self.device, self.timeout_s = module, device, timeout_s
        self.training, self.other = training, other
        # one for every executor: the calls of one accumulation may run on several
        self.accumulation = accumulation if accumulation is not None else Accumulation()
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.trainable = trainable if trainable is not None else Trainable(
            plan, dict(zip([st.index for st in plan.stages_of_rank(rank)],
                           graph_modules(module), strict=True)), rank=rank)
        self.default: Executor = build_executor(plan, module, device=device, timeout_s=timeout_s,
                                                accumulation=self.accumulation,
                                                trainable=self.trainable)
        self.plan, self.state, self.retype, self.check = plan, state, retype, check
        self._planned_sizes = tuple(d.size for d in plan.dynamic_dims)
        self._planned_key: Key = (plan.global_batch, planned, self._planned_sizes, training)
        self._by_key: dict[Key, Executor] = {
            self._planned_key: self.default
        }
        self.trace: Recorder | None = None
        self._broken = False  # the agreement raised PeerFailed: recover at the next call
        self._by_sizes: dict[tuple[int, ...], Plan] = {self._planned_sizes: plan}
        self.agreement = Agreement(plan, device)

    def for_inputs(self, flat_inputs: Sequence[Any], training: bool | None = None, *,
                   sync: bool = True) -> Executor:
        """The executor for the batch ``flat_inputs`` holds (the same on every rank), in
        mode ``training`` (default: the planned one); ``sync``: the call is outside
        ``model.no_sync()``, checked alike on every rank."""
        self._recover()
        return self._for_inputs(flat_inputs, self.training if training is None else training,
                                sync)

    def failed(self, e: Exception, during: str) -> None:
        """A call raised outside the executor (its inputs' structure, the agreement, its
        outputs): tell the other ranks unless every rank raised it, and start over next call."""
        self._broken = True
        groups = getattr(self.default, "groups", None)
        if groups is not None and groups.board is not None:
            ex = self.default
            held = tuple(st.index for st in getattr(ex, "stages", (ex.stage,)))
            groups.board.post(ex.rank, held, e, during)

    def _recover(self) -> None:
        """After a call that raised here, fresh groups and executors for every rank.

        Every rank raised in the call a failure ended (its own error, or ``PeerFailed``), so
        every rank comes here once, at its next call, and makes the groups again with the
        others (``new_group`` is collective); the old groups, which may hold that step's
        messages, are aborted and let go of at once, which closes their connections: a peer's
        wait the ended step left blocked on one of them (its abandoned receive from this rank)
        ends with an error then, not at its group's timeout, so no thread of the failed step
        is left waiting when the job exits. The board's count is read between the new groups
        and a barrier on them, so it covers every failure of the ended call and none of the
        next."""
        old = self.default
        groups = getattr(old, "groups", None)
        failed = self._broken or any(getattr(ex, "failed", False) for ex in self._by_key.values())
        if not failed or groups is None or groups.board is None:
            return
        fresh = build_groups(self.plan, timeout_s=self.timeout_s or groups.timeout_s)
        assert fresh.board is not None and fresh.world is not None
        fresh.board.seen = fresh.board.count()
        dist.barrier(group=fresh.world)
        abort_groups(groups)
        self.default = build_executor(self.plan, self.module, device=self.device,
                                      timeout_s=self.timeout_s, groups=fresh,
                                      accumulation=self.accumulation, trainable=self.trainable)
        if isinstance(self.default, StageExecutor):
            self.default.set_trace(self.trace)
        self._by_key = {self._planned_key: self.default}
        self._broken = False
        del old, groups
        gc.collect()  # the failed executors hold cycles: their groups must go now

    def _for_inputs(self, flat_inputs: Sequence[Any], training: bool, sync: bool) -> Executor:
        sizes, state = self._sizes(flat_inputs), self.state()
        plan = self._sized(sizes)
        local = self._local_size(plan, flat_inputs)
        world = self.plan.world_size
        agreed = world > 1 and self.check
        trainable, pending = self.trainable, self.accumulation.pending
        if agreed:
            groups = getattr(self.default, "groups", None)
            rec = self.trace
            span = rec.span("agree", "collective", kind="agree", peers=rec.others,
                            match="agree") if rec is not None and rec.on else nullcontext()
            try:
                with span:
                    rows = self.agreement.agree(local, state, sync, training, sizes, plan,
                                                flat_inputs, groups, extra=trainable.row())
                trainable.check(dict(enumerate(rows)), pending=pending)
            except ValueError as e:  # a refusal every rank makes from every rank's rows
                raised_everywhere(e)
                raise
        else:
            self.agreement.check_sizes([sizes])
            trainable.check({trainable.rank: trainable.row()}, pending=pending)
        trainable.commit()  # the executors follow at their next step
        key = (local * world, state, sizes, training)
        return _recent(self._by_key, key, self._planned_key,
                       lambda: self._build(key, plan, state, agreed))

    def _build(self, key: Key, plan: Plan, state: str | None, agreed: bool) -> Executor:
        """The executor for a batch size, state, lengths and mode not seen lately."""
        groups = getattr(self.default, "groups", None)
        module, retype = self.module, self.retype
        if key[3] != self.training:
            if self.other is None:
                raise RuntimeError("this model was compiled for one mode only")
            plan, module, retype = self.other(key[3])
            if key[2] != self._planned_sizes:
                plan = plan.at_sizes({d.name: n for d, n in zip(plan.dynamic_dims, key[2],
                                                                 strict=True)})
        plan = retype(plan, state)
        if key[0] != plan.global_batch:
            try:
                plan = rebatched(plan, key[0])
            except ValueError as e:
                if agreed:
                    raised_everywhere(e)
                raise
        found = build_executor(
            plan, module, device=self.device, timeout_s=self.timeout_s, groups=groups,
            accumulation=self.accumulation, trainable=self.trainable,
        )
        if isinstance(found, StageExecutor):
            found.set_trace(self.trace)
        return found

    def set_trace(self, rec: Recorder) -> None:
        """Every executor, made or to be made, records into ``rec``."""
        self.trace = rec
        for ex in self._by_key.values():
            if isinstance(ex, StageExecutor):
                ex.set_trace(rec)

    def _sizes(self, flat: Sequence[Any]) -> tuple[int, ...]:
        """This call's size of each dynamic dimension; the plan's where no input has it (then
        the input checks explain what is wrong)."""
        out = []
        for d in self.plan.dynamic_dims:
            t = flat[d.input] if d.input < len(flat) else None
            ok = isinstance(t, torch.Tensor) and t.dim() > d.dim
            out.append(int(t.shape[d.dim]) if ok else d.size)  # type: ignore[union-attr]
        return tuple(out)

    def _sized(self, sizes: tuple[int, ...]) -> Plan:
        """The plan at these dynamic sizes, made once per size (the most recent ``KEPT``):
        dynamic padding calls at a handful of lengths, each many times."""
        dims = self.plan.dynamic_dims
        return _recent(self._by_sizes, sizes, self._planned_sizes, lambda: self.plan.at_sizes(
            {d.name: n for d, n in zip(dims, sizes, strict=True)}))

    def _local_size(self, plan: Plan, flat: Sequence[Any]) -> int:
        """Samples in this call's local batch; the plan's when no input says otherwise (then
        the executor's input checks explain what is wrong)."""
        for i, spec in enumerate(plan.inputs):
            dim = spec.batch_dim
            if spec.kind != "tensor" or dim is None:
                continue
            rows = spec.shape[dim]
            t = flat[i] if i < len(flat) else None
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] % rows == 0:
                return int(t.shape[dim]) // rows
        return self.plan.global_batch // self.plan.world_size

def _recent(cache: dict[Any, Any], key: Any, pinned: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` when missing; the ``KEPT`` most recently used stay
    besides ``pinned`` (dicts keep insertion order: the first key is the least recent)."""
    found = cache.pop(key, None)
    if found is None:
        found = make()
        others = [k for k in cache if k != pinned]
        if len(others) >= KEPT:
            del cache[others[0]]
    cache[key] = found  # last: most recently used
    return found
