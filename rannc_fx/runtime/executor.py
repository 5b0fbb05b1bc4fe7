"""Run this rank's stage of a plan by interpreting the plan's lowered schedule.

The schedule is the single source of ordering: ``schedule`` makes the compute actions of the
plan's schedule, ``lowering`` adds messages and once-a-step actions, and ``StageExecutor``
dispatches each action to ``StageRunner`` (or to its own ``GATHER`` and ``REDUCE``) by table.
Which part of the list a call runs (``Mode``: no gradients, the whole step in the call, or
the backward deferred to ``loss.backward()``), and the loop that runs it, are ``interpret``'s.

Every rank runs its list the same way; what it sends and receives comes from ``routing``,
computed from the plan alone, and ``simulate`` checks at start-up that the lowered schedule
matches every message and cannot hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ..plan.config import Config
from ..plan.device import device_of
from ..plan.plan import Plan
from ..schedules import routing
from ..schedules.generators import Action, Kind
from ..schedules.kinds import GPIPE
from ..schedules.program import Program, program_of
from ..schedules.release import rank_release
from .accumulation import Accumulation
from .autograd_link import Bridge
from .checks import (
    check_inputs,
    check_outputs_routable,
    check_stage_interface,
    check_world,
    input_shapes,
    rank_stages,
    stage_modules,
)
from .comm import Groups, build_groups, check_same_plan
from .grads import GradSync
from .interpret import Dispatch, Mode, action_lists, run_actions, run_traced
from .lane import LaneModules
from .lane_runners import LaneRunners, action_peers
from .recompute import check_reruns_unsplit
from .step import StepState
from .trace import Recorder
from .trainable import Trainable

__all__ = ["StageExecutor"]


class StageExecutor:
    """Runs ``module`` (the stage GraphModule of this rank) as part of ``plan``.

    ``module`` takes ``plan.stages[s].inputs`` as positional arguments and returns a flat
    tuple in the order of ``plan.stages[s].outputs``. Its parameters are the model's own, so
    an optimizer over them trains the model. ``groups`` defaults to ``build_groups(plan)``
    with ``timeout_s`` (default ``Config().timeout_s``); that, and a check that every rank
    holds the same plan, are collectives: every rank builds its executor at the same point.
    A one-rank plan needs no process group. ``accumulation``: whether ``.grad`` holds sums
    of calls under ``no_sync()`` not yet summed over ranks, shared by every executor of the
    model (default: this executor's own); ``trainable``: which of this rank's parameters
    train, followed call by call (default: this executor's own); ``program``: the plan's
    lowered schedule (default: ``program_of(plan)``, built once for a plan).
    """

    def __init__(
        self,
        plan: Plan,
        module: fx.GraphModule | LaneModules,
        *,
        rank: int | None = None,
        groups: Groups | None = None,
        device: torch.device | str | None = None,
        timeout_s: float | None = None,
        accumulation: Accumulation | None = None,
        trainable: Trainable | None = None,
        program: Program | None = None,
    ):
        self.plan, self.module = plan, module
        check_world(plan)
        check_outputs_routable(plan)  # before any collective: every rank refuses alike
        self.rank = rank if rank is not None else dist.get_rank() if dist.is_initialized() else 0
        # the stages this rank runs (a lane's several, or one) and the main one
        self.stages, self.stage = rank_stages(plan, self.rank)
        self.replica = self.stage.ranks.index(self.rank)
        self.device = torch.device(device) if device is not None else device_of(module)
        self.modules = stage_modules(plan, self.rank, self.stages, module)
        in_specs = {st.index: check_stage_interface(plan, st, self.modules[st.index])
                    for st in self.stages}
        # lowered and simulated once (a schedule that could hang never starts); every rank
        # checks every stage: one that went on would wait for the refusing one
        self.program = program if program is not None else program_of(plan)
        check_reruns_unsplit(plan, self.program.lowered)
        self._lists, self._deferred, self._split = action_lists(self.program, self.stage.index,
                                                                 self.stages)
        if plan.world_size > 1:
            check_same_plan(plan, self.device)
        timeout = timeout_s if timeout_s is not None else Config().timeout_s
        self.groups = groups if groups is not None else build_groups(plan, timeout_s=timeout)
        self._local = routing.local_batch(plan)
        self._in_shapes = input_shapes(plan, self._local)
        self._build_runners(in_specs)
        self._build_gradients(trainable, accumulation)
        self._dispatch = self._dispatch_table()
        self._step = 0
        self.trace: Recorder | None = None
        self._peers: dict[tuple[int, Kind, int | None], list[int]] = {}
        self._saved: StepState | None = None  # the step a loss.backward() may still reach
        self.failed = False  # a call or backward raised: the groups may hold stale messages
        self._anchor = torch.zeros((), requires_grad=True)

    @property
    def actions(self) -> list[Action]:
        """This rank's lowered list (its lane's)."""
        return self._lists[Mode.CALL]

    def _build_runners(self, in_specs: dict[int, Any]) -> None:
        """The lane's runners (one a stage), their routes and buffers, the outputs and the
        sends this rank may wait for mid-step (``schedules/release.py``)."""
        plan = self.plan
        self.lane = LaneRunners.build(plan, self.stages, self.modules, in_specs,
                                      rank=self.rank, replica=self.replica,
                                      groups=self.groups, device=self.device)
        self.runners, self._routes = self.lane.runners, self.lane.routes
        self._buffers = self.lane.buffers
        self.runner = self.runners[self.stage.index]
        self.routes = self._routes[self.stage.index]
        self.outputs, self.buffers = self.runner.outputs, self.runner.buffers
        self.tail = self.lane.tails[self.stage.index]
        # the outputs tied to autograd: the averaged ones (losses); which one is the loss
        self._diff = [r.index for r in plan.outputs if r.index in self.outputs.averaged]
        self._loss = plan.loss_output
        self._in_call = (self.program.in_call[self.program.lane_of(self.stage.index)]
                         and self._loss is not None)
        self._release = rank_release(self.program.lowered, self.program.topology,
                                     self.program.lane_of(self.stage.index), self.runners,
                                     plan.micro_batches, [cv.producer for cv in plan.cut_values])

    def _build_gradients(self, trainable: Trainable | None,
                         accumulation: Accumulation | None) -> None:
        """Which parameters train (the model's ``trainable``, whose calls commit a change of
        ``requires_grad``, or this executor's own), their all-reduce, and the accumulation
        under ``no_sync()`` (the model's, or this executor's own)."""
        self._commits = trainable is None
        self.trainable = trainable if trainable is not None else Trainable(
            self.plan, self.modules, rank=self.rank)
        self._trained = self.trainable.version  # the trainable parameters self.grads sums
        self.grads = GradSync(self.plan, tuple(self.runners), self.module, self.groups,
                              self.trainable.owners)
        self.accumulation = accumulation if accumulation is not None else Accumulation()

    def _dispatch_table(self) -> Dispatch:
        """By stage and kind, what runs an action; the once-a-step kinds are the rank's, for
        all its stages."""
        once: dict[Kind, Callable[..., None]] = {
            Kind.SCATTER: self._scatter,
            Kind.GATHER: self._gather,
            Kind.REDUCE: self._reduce,
        }
        return {
            s: {
                **once,
                Kind.RECV_F: r.recv_f,
                Kind.F: r.forward,
                Kind.SEND_F: r.send_f,
                Kind.R: r.recompute_one,
                Kind.RECV_B: r.recv_b,
                Kind.B: r.backward,
                Kind.W: r.weights,
                Kind.SEND_B: r.send_b,
            }
            for s, r in self.runners.items()
        }

    # -- a step ------------------------------------------------------------------------------------
    def mode(self) -> Mode:
        """What a call made now would run (``interpret``'s docstring)."""
        if not torch.is_grad_enabled():
            return Mode.EVAL
        if self._in_call and self.module.training:
            return Mode.CALL
        return Mode.DEFERRED

    @property
    def pending(self) -> StepState | None:
        """The step whose ``loss.backward()`` has not run yet: its gradients are not in
        ``.grad`` (1F1B holds them aside, GPipe has not computed them)."""
        return self._saved

    def forward(self, flat_inputs: Sequence[Any], *, sync: bool = True) -> list[Any]:
        """Run this call's part of the step; returns the model's flat outputs for this rank.

        ``flat_inputs`` is this rank's local batch, one entry per ``plan.inputs``; ``sync``
        False (``model.no_sync()``): its gradients stay local sums (``accumulation``). Batched
        outputs come back for the local samples (detached); outputs without a batch
        dimension are equal on every rank, and with grad enabled ``.backward()`` on the loss
        (on every rank) finishes the step. Whatever raises here is posted on the failure
        board for the other ranks (``failures``), and this executor is ``failed``.
        """
        try:
            return self._forward(flat_inputs, sync)
        except Exception as e:
            self._fail(e, "in its forward")
            raise

    def _fail(self, e: Exception, during: str) -> None:
        """Give up the step: its gradients never reach ``.grad``; tell the other ranks."""
        self.failed = True
        self._saved = None
        self.grads.abandon()
        board = self.groups.board
        if board is not None:
            board.post(self.rank, tuple(self.runners), e, during)

    def _forward(self, flat_inputs: Sequence[Any], sync: bool) -> list[Any]:
        self.outputs.finish_sends()
        local = check_inputs(self.plan, flat_inputs, self._in_shapes, self._local, self.device)
        self._step += 1
        self._saved = None  # a new step frees the last one's activations and held gradients
        self.grads.drop_held()
        if self._commits:
            self.trainable.commit()
        if self._trained != self.trainable.version:
            self._trained = self.trainable.version  # requires_grad changed: sum what trains now
            self.grads = GradSync(self.plan, tuple(self.runners), self.module, self.groups,
                                  self.trainable.owners)
        mode = self.mode()
        step = StepState(self._step, grad=mode is not Mode.EVAL, local=local,
                         held=mode is Mode.CALL, sync=sync)
        # one state per stage this rank runs; the main stage's is ``step`` itself
        step.parts = {s: step if s == self.stage.index else
                      StepState(self._step, grad=step.grad, local=local, held=step.held)
                      for s in self.runners}
        if mode is Mode.CALL:
            assert self._loss is not None
            for stage, seeds in self.lane.unit_seeds(self._loss, self.device).items():
                step.parts[stage].seeds = seeds
            self.grads.begin()
        for b in self._buffers:
            b.begin()
        if self.trace is not None:
            self.trace.ran(self.plan, self.plan.schedule if mode is Mode.CALL else GPIPE.name)
        self._run(step, self._lists[mode])
        flat = [step.results[r.index] for r in self.plan.outputs]
        step.results, step.reduced = {}, {}  # the caller holds them now, as long as it wants
        if mode is Mode.EVAL:
            # no backward follows to finish them: a process that ends after evaluating must
            # not leave the loss it sends to the other ranks in flight
            self.outputs.finish_sends()
            return flat
        tied = [self._loss] if step.held and self._loss is not None else self._diff
        if not tied:
            return flat  # nothing to differentiate: keep no activations
        self._saved = step
        out = Bridge.apply(self, step.index, self._anchor, *(flat[j] for j in tied))
        for j, v in zip(tied, out, strict=True):
            flat[j] = v
        return flat

    def backward(self, step_index: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Called by the bridge with the gradients of the tied outputs: run the deferred
        backwards, or apply the gradients the call held (failures as in ``forward``)."""
        step = self._saved
        if step is None or step.index != step_index:  # a misuse: nothing ran, nothing to tell
            raise RuntimeError(
                f"backward for step {step_index} but the pipeline holds "
                + ("no step" if step is None else f"step {step.index}")
                + "; call loss.backward() once per forward, before the next forward"
            )
        try:
            self._backward(step, grads)
        except Exception as e:
            self._fail(e, "in its backward")
            raise

    def _backward(self, step: StepState, grads: Sequence[torch.Tensor | None]) -> None:
        self._saved = None
        if step.held:
            g = grads[0]
            if step.late:  # a sum over ranks follows: this rank's sends first
                self.outputs.finish_sends()
            self.accumulation.apply(self.grads, None if g is None or _is_one(g) else g,
                                    late=step.late)
            self.outputs.finish_sends()
            return
        seeds, tail_seeds = self.lane.seeds(self._diff, grads)
        for stage, part in step.parts.items():
            part.seeds = seeds.get(stage, {})
        self.grads.begin()
        if self.tail is not None and self.tail.runs:
            self.tail.backward(step, tail_seeds)
        self._run(step, self._deferred[1])
        self.outputs.finish_sends()

    def _run(self, step: StepState, actions: list[Action]) -> None:
        split = self._split[id(actions)]
        for s, part in step.parts.items():
            part.split = split[s]
        release = self._release if actions is self.actions else {}
        rec = self.trace
        if rec is not None and rec.on:
            run_traced(rec, step, actions, self._dispatch, release, self._peers)
            return
        run_actions(step, actions, self._dispatch, release)

    # -- tracing -----------------------------------------------------------------------------------
    def set_trace(self, rec: Recorder | None) -> None:
        """Record the traced steps' actions in ``rec`` (``runtime/trace.py``)."""
        self.trace = rec
        for r in self.runners.values():
            r.trace = rec
        if rec is not None:
            self._peers = {}
            for s, routes in self._routes.items():
                self._peers.update(action_peers(self.plan, self.rank, s, routes, self.groups))

    # -- once a step -------------------------------------------------------------------------------
    def _scatter(self, step: StepState, _: int | None = None) -> None:
        """Every micro-batch's graph-input pieces, once for all of this rank's stages (they
        match the other ranks' in canonical order); each stage reads its own."""
        self.runner.scatter(step)
        for part in step.parts.values():
            if part is not step:
                part.inputs = list(step.inputs)

    def _finish_sends(self, step: StepState) -> None:
        for part in step.parts.values():
            part.finish_sends()

    def _gather(self, step: StepState, _: int | None = None) -> None:
        """The tail on the whole batch, batched outputs home, the loss to every rank, buffers
        made equal."""
        if self.tail is not None:
            if self.tail.runs:
                self.tail.forward(step)
            self.tail.send_rows(step)
        for part in step.parts.values():  # every stage of this rank's, by name
            if part is not step:
                for i, outs in part.model_outs.items():
                    step.model_outs.setdefault(i, {}).update(outs)
                step.reduced.update(part.reduced)
                step.assembled.update(part.assembled)
                part.model_outs, part.reduced, part.assembled = {}, {}, {}
        step.results = {**step.results, **self.outputs.gather(step.model_outs, step.assembled)}
        step.model_outs, step.assembled = {}, {}
        received = self.outputs.share(step.reduced, step.results)
        self._finish_sends(step)
        for b in self._buffers:
            b.finish()
        received.wait()

    def _reduce(self, step: StepState, _: int | None = None) -> None:
        self._finish_sends(step)
        step.late = self.accumulation.reduce(self.grads, sync=step.sync, held=step.held)


def _is_one(g: torch.Tensor) -> bool:
    return g.numel() == 1 and bool(g.item() == 1)
