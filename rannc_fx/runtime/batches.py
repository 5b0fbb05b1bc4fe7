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

With more than one rank each call first all-gathers the ranks' local batch sizes, autocast
states, whether the call is under ``model.no_sync()``, dynamic sizes and the first input (if
any) whose shape is not the plan's for them:
every rank then picks the same executor, and unequal local batches or lengths, a length over
the plan's, or an input of another shape on any rank, are refused on every rank at once
instead of leaving the ranks that passed good shapes waiting for a peer that raised (a rank
that skipped the sum over ranks would leave the others in it). That
costs one collective's latency per call, before the first message (every message's size
depends on these sizes, so it cannot overlap them); ``Config(check_batches=False)`` skips it
for a job whose ranks always pass equal batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ..plan import ExcludedSize, Plan
from . import routing
from .accumulation import Accumulation
from .alone import AloneExecutor, build_executor
from .comm import CommError, abort_groups, build_groups
from .executor import StageExecutor
from .failures import PeerFailed, raised_everywhere
from .lane import LaneModules
from .trace import Recorder

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
    ) -> None:  # fmt: skip
        """``training``: the mode ``plan`` and ``module`` are for; ``other(mode)`` gives the
        plan, module and retype of the other mode (made at its first call)."""
        self.module, self.device, self.timeout_s = module, device, timeout_s
        self.training, self.other = training, other
        # one for every executor: the calls of one accumulation may run on several
        self.accumulation = accumulation if accumulation is not None else Accumulation()
        self.default: Executor = build_executor(plan, module, device=device, timeout_s=timeout_s,
                                                accumulation=self.accumulation)
        self.plan, self.state, self.retype, self.check = plan, state, retype, check
        self._planned_sizes = tuple(d.size for d in plan.dynamic_dims)
        self._planned_key: Key = (plan.global_batch, planned, self._planned_sizes, training)
        self._by_key: dict[Key, Executor] = {
            self._planned_key: self.default
        }
        self.trace: Recorder | None = None
        self._broken = False  # the agreement raised PeerFailed: recover at the next call
        self._by_sizes: dict[tuple[int, ...], Plan] = {self._planned_sizes: plan}
        # an input's shape travels in the agreement as (index, rank, dims): this many dims
        self._dims = max((len(s.shape) for s in plan.inputs if s.kind == "tensor"), default=0)

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
        messages, are aborted. The board's count is read between the new groups and a
        barrier on them, so it covers every failure of the ended call and none of the next."""
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
                                      accumulation=self.accumulation)
        if isinstance(self.default, StageExecutor):
            self.default.set_trace(self.trace)
        self._by_key = {self._planned_key: self.default}
        self._broken = False

    def _for_inputs(self, flat_inputs: Sequence[Any], training: bool, sync: bool) -> Executor:
        sizes, state = self._sizes(flat_inputs), self.state()
        plan = self._sized(sizes)
        local = self._local_size(plan, flat_inputs)
        world = self.plan.world_size
        agreed = world > 1 and self.check
        if agreed:
            rec = self.trace
            try:
                if rec is not None and rec.on:
                    with rec.span("agree", "collective", kind="agree", peers=rec.others,
                                  match="agree"):
                        self._agree(local, state, sync, training, sizes, plan, flat_inputs)
                else:
                    self._agree(local, state, sync, training, sizes, plan, flat_inputs)
            except ValueError as e:  # a refusal every rank makes from every rank's rows
                raised_everywhere(e)
                raise
        else:
            self._check_sizes([sizes])
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
            accumulation=self.accumulation,
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

    def _check_sizes(self, rows: list[tuple[int, ...]]) -> None:
        """Refuse dynamic sizes outside the plan's range, or unequal over the ranks (``rows``:
        each rank's sizes)."""
        dims = self.plan.dynamic_dims
        for j, d in enumerate(dims):
            seen = [r[j] for r in rows]
            by_rank = ", ".join(f"rank {i}: {n}" for i, n in enumerate(seen))
            where = f"input {d.input} ({self.plan.inputs[d.input].name!r}) dimension {d.dim}"
            if any(n > d.size or n < 2 for n in seen):
                said = (f"{seen[0]}" + (" on every rank" if len(seen) > 1 else "")
                        if all(n == seen[0] for n in seen) else f"({by_rank})")
                raise ValueError(
                    f"{where} ({d.name}) is {said}, outside the "
                    f"sizes 2..{d.size} the plan covers (it was made for {d.size}, its largest); "
                    f"plan with an example of the longest length you train with, or pad or "
                    f"truncate every batch to at most {d.size}"
                )
            if any(n != seen[0] for n in seen):
                raise ValueError(
                    f"the ranks passed {where} ({d.name}) of different sizes ({by_rank}); every "
                    "rank must pass the same length in one call: pad every rank's batch to one "
                    "length (e.g. the longest over the ranks, or bucket by length with the same "
                    "bucket on every rank)"
                )

    def _odd_input(self, plan: Plan, flat: Sequence[Any], local: int) -> list[int]:
        """(index, rank, dims...) of this rank's first input whose shape is not ``plan``'s for
        ``local`` samples (rank -1: not a tensor), or index -1: every input as planned."""
        for j, spec in enumerate(plan.inputs):
            if spec.kind != "tensor":
                continue
            t = flat[j] if j < len(flat) else None
            if not isinstance(t, torch.Tensor):
                return [j, -1] + [-1] * self._dims
            if tuple(t.shape) != spec.shape_for(local):
                dims = list(t.shape)[: self._dims]
                return [j, t.dim()] + dims + [-1] * (self._dims - len(dims))
        return [-1, -1] + [-1] * self._dims

    def _agree(self, local: int, state: str | None, sync: bool, training: bool,
               sizes: tuple[int, ...], plan: Plan, flat: Sequence[Any]) -> None:
        """One all-gather of (size, state, sync and mode, dynamic sizes, the odd input) per
        rank; every rank then sees every rank's.

        It is the cheapest collective that agrees (gloo, 2 ranks, 40-48 ms steps: +1.0 and
        +3.5 % against +2.8 and +5.0 % for an all-reduce of four integers, measured
        interleaved), and a mismatch needs no second exchange to say who passed what."""
        world = self.plan.world_size
        k = len(sizes)
        flags = int(sync) | int(training) << 1
        row = [local, _state_code(state), flags, *sizes, *self._odd_input(plan, flat, local)]
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        everyone = torch.empty(len(row) * world, dtype=torch.int64, device=self.device)
        groups = getattr(self.default, "groups", None)

        def failed(e: RuntimeError) -> CommError:
            return CommError(
                f"rank {dist.get_rank()}: all-gather of the local batch sizes at the start of a "
                f"call failed: {e}; a rank died or stopped calling the model (every rank calls "
                "it every step): check the other ranks' logs"
            )

        try:
            if groups is not None and groups.board is not None and mine.device.type == "cpu":
                work = dist.all_gather_single(everyone, mine, group=groups.world, async_op=True)
                groups.board.wait([work], lambda _: "agreeing on this call's batch",
                                  timeout_s=groups.timeout_s, on_error=lambda _, e: failed(e))
            else:
                dist.all_gather_single(everyone, mine,
                                       group=groups.world if groups is not None else None)
        except (CommError, PeerFailed):
            raise
        except RuntimeError as e:
            raise failed(e) from e
        rows = [tuple(r) for r in everyone.view(world, len(row)).tolist()]
        if all(r == rows[0] for r in rows) and rows[0][3 + k] == -1 and (
            not k or sizes == self._planned_sizes
        ):
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
        if any(r[2] >> 1 != rows[0][2] >> 1 for r in rows):
            shown = ", ".join(f"rank {i}: {'training' if r[2] >> 1 else 'eval'}"
                              for i, r in enumerate(rows))
            raise ValueError(
                f"the ranks call the model in different modes ({shown}); each mode runs a graph "
                "of its own: call model.train() or model.eval() on every rank alike"
            )
        if any(r[2] & 1 != rows[0][2] & 1 for r in rows):
            shown = ", ".join(f"rank {i}: {'outside' if r[2] & 1 else 'inside'}"
                              for i, r in enumerate(rows))
            raise ValueError(
                f"the ranks call the model inside and outside model.no_sync() ({shown}): the "
                "ranks outside would wait for the others in the gradients' sum over ranks; "
                "enter model.no_sync() for the same calls on every rank"
            )
        self._check_sizes([r[3 : 3 + k] for r in rows])
        if rows[0][3 + k] != -1 or any(r[3 + k] != -1 for r in rows):
            self._refuse_shapes([r[:2] + r[3 + k :] for r in rows], local, plan)

    def _refuse_shapes(self, rows: list[tuple[int, ...]], local: int, plan: Plan) -> None:
        """Every rank's odd input, named, with the plan's shapes and the ways out."""
        specs = plan.inputs

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
        dims = self.plan.dynamic_dims
        may = ("the batch dimension and " + ", ".join(d.name for d in dims) + " (up to the "
               "planned size)") if dims else "only the batch dimension"
        raise ValueError(
            f"the ranks' inputs do not all have the shapes the plan was made for ({shown}); "
            f"with {local} samples per rank it expects {want} on every rank: pad every rank's "
            f"batch to the planned shape ({may} may change between calls), or plan with an "
            "example of the shapes you train with"
        )


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


_STATES: list[str | None] = [None, "bfloat16", "float16"]


def _state_code(state: str | None) -> int:
    """An autocast state as an integer, equal on two ranks exactly when the states are."""
    if state is None:
        return 0
    return int(hashlib.sha256(state.encode()).hexdigest()[:15], 16)
