"""One rank's stage, one action at a time: the operations a schedule's actions name.

``StageRunner`` never decides ordering; ``executor`` calls its methods in the order of the
lowered schedule. What one step keeps between actions lives in a ``StepState`` (``step.py``):

    SCATTER     post every micro-batch's graph-input pieces (sends and receives)
    RECV_F i    post the receives of micro-batch i's cut values
    F i         wait for them, assemble the stage's arguments, run the stage; keep the
                arguments and (unless the stage recomputes) the outputs for the backward
    SEND_F i    send micro-batch i's cut values to the consumer replicas
    R i         run micro-batch i's forward again with gradients, on the random state and
                buffers its F saw (only stages that recompute; layer by layer, as checkpointed
                segments, where the stage has checkpoints: ``recompute.py``)
    RECV_B i    post the receives of the gradients of micro-batch i's cut values
    B i         wait for them, add the loss seed (its share of the global batch), backward
                (only to the stage's inputs where the schedule has a W i: ``backward_split``)
    W i         the parameters' gradients of micro-batch i, from what its B kept
    SEND_B i    send the gradients of micro-batch i's cut-value inputs to the producers

A stage that recomputes runs F keeping no activations (autograd's saved tensors are dropped as
they are made, as ``torch.utils.checkpoint`` does): a micro-batch in flight holds only the
stage's inputs (and its model outputs), and R rebuilds its activations right before B with
the same kernels, random state and buffers, so it recomputes the very values F made.

A stage that recomputes selectively (``Stage.selective``, ``rannc_fx.plan.selective``) has no R:
its F runs under non-reentrant ``torch.utils.checkpoint`` with the selective policy, keeping
the outputs of its matrix products, convolutions and fused attention, and B reruns the rest
of the forward from those, on F's random state and inside the stage's buffer scope.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx

from ..plan import selective
from ..plan.plan import Plan, Stage
from ..plan.values import ValueSpec
from ..schedules import routing
from ..schedules.routing import RankRoutes, Transfer
from .backward_split import SavedBoxes, backward_inputs, backward_weights, keeping_for_split
from .buffers import BufferSync
from .checks import check_stage_outputs
from .comm import Groups
from .full_shard import FullShard
from .host_params import HostParams, fetching, saving
from .outputs import Outputs
from .p2p import Message, Pending, post
from .pieces import assemble, dtype_of, ints_value, piece_shape, take
from .recompute import build_segmented, keeping_nothing, rng_restored, rng_state
from .step import StepState
from .tail import TailRunner
from .trace import Recorder

__all__ = ["StageRunner", "StepState"]

class StageRunner:
    """The per-action operations of ``module``, this rank's replica of ``stage``."""

    def __init__(
        self,
        plan: Plan,
        stage: Stage,
        module: fx.GraphModule,
        *,
        rank: int,
        routes: RankRoutes,
        spans: list[tuple[int, int]],
        in_specs: list[ValueSpec],
        outputs: Outputs,
        buffers: BufferSync,
        device: torch.device,
        groups: Groups | None = None,
        tail: TailRunner | None = None,
        mailbox: dict[Transfer, torch.Tensor] | None = None,
    ):
        self.plan, self.stage, self.module, self.rank = plan, stage, module, rank
        # pieces between two stages of this rank (a lane of several): copied, never sent
        self.mailbox = mailbox if mailbox is not None else {}
        self.groups = groups  # the messages travel on groups.world
        self.routes, self.in_specs, self.outputs = routes, in_specs, outputs
        self.buffers, self.device = buffers, device
        self.tail = tail if tail is not None and tail.runs else None
        self.recompute = stage.recompute
        self.selective = stage.selective
        self.graph_inputs = {spec.name: i for i, spec in enumerate(plan.inputs)}
        self.cuts = {cv.name: cv for cv in plan.cut_values}
        self.out_pos = {name: p for p, name in enumerate(stage.outputs)}
        self.spans = spans  # this replica's samples of each micro-batch
        self.shares = [(b - a) / plan.global_batch for a, b in self.spans]
        self.in_pos = {name: p for p, name in enumerate(stage.inputs)}
        self._producer = [cv.producer for cv in plan.cut_values]
        self._picked: dict[tuple[str, int, int | None], list[Transfer]] = {}
        self.sends_cuts = any(self._sends(t) for ts in routes.cuts for t in ts)
        self.sends_grads = any(self._sends(t) for ts in routes.grads for t in ts)
        self.kept = outputs.kept
        # model outputs alone: no other stage, no tail, no backward reads them (a batched
        # output is never seeded: the caller gets it detached)
        tail_pos = set(self.tail.pos) if self.tail is not None else set()
        batched = {r.spec.name for r in outputs.mine if r.spec.batch_dim is not None}
        self._model_only = {p for p in self.kept if stage.outputs[p] in batched
                            and stage.outputs[p] not in self.cuts and p not in tail_pos}
        self.trace: Recorder | None = None  # set by the executor when tracing
        # storages the step writes in place while sends may still be in flight: a buffer the
        # forward updates (BufferSync restores it before the next micro-batch)
        self._written = {b.untyped_storage().data_ptr() for b in module.buffers()}
        self._params = list(module.parameters())
        # parameters in host memory (or fully sharded): each use in the graph fetches its
        # parameter
        self.host = HostParams(module, device, window=stage.window_bytes) \
            if stage.host_params else None
        if stage.zero == 3 and stage.replicas > 1:  # fully sharded: gathered at each use
            assert groups is not None
            self.host = FullShard(module, device, window=stage.window_bytes, groups=groups,
                                  stage=stage.index)
        if self.host is not None:
            self.host.install()
        # recomputation layer by layer: what R runs (``recompute.py``); F runs ``module``
        self.segmented = build_segmented(
            module, stage.checkpoints, recompute_scope=buffers.recompute_scope,
            placed={n for b in plan.iter_stage_blocks(stage.index) for n in b.nodes},
            name=f"stage {stage.index}",
        ) if stage.checkpoints else None

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        """The stage's parameters that require a gradient now (``trainable``)."""
        return [p for p in self._params if p.requires_grad]

    # -- messages --------------------------------------------------------------------------------
    def _mine(self, which: str, i: int, peer: int | None = None) -> list[Transfer]:
        """The transfers of micro-batch i this replica of this stage posts (made once):
        ``"cut in"`` and ``"grad in"`` its receives (from stage ``peer`` only, if given),
        ``"cut out"`` and ``"grad out"`` its sends, by receiving stage (canonically within
        each), as the receivers post them: a rank running two receiving stages posts each
        one's receives in its own action."""
        key = (which, i, peer)
        got = self._picked.get(key)
        if got is None:
            cut = which.startswith("cut")
            ts = self.routes.cuts[i] if cut else self.routes.grads[i]
            if which.endswith("out"):
                got = sorted((t for t in ts if self._sends(t)),
                             key=lambda t: t.stage if cut else self._producer[t.slot])
            else:
                got = [t for t in ts if self._gets(t) and peer in (
                    None, self._producer[t.slot] if cut else t.stage)]
            self._picked[key] = got
        return got

    def messages_of(self, which: str, i: int) -> list[Transfer]:
        """Micro-batch i's transfers ``which`` ("cut out", "grad out", "cut in", "grad in")
        that travel between ranks (not copied within the rank)."""
        return [t for t in self._mine(which, i) if not t.local]

    def _sends(self, t: Transfer) -> bool:
        """This replica of this stage sends ``t`` (a cut value, or a cut value's gradient)."""
        stage = self._producer[t.slot] if t.kind == "cut" else t.stage
        return t.src == self.rank and stage == self.stage.index

    def _gets(self, t: Transfer) -> bool:
        """This replica of this stage receives ``t``."""
        stage = t.stage if t.kind == "cut" else self._producer[t.slot]
        return t.dst == self.rank and stage == self.stage.index

    def _messages(
        self, transfers: list[Transfer], source: Any, what: str
    ) -> tuple[list[Message], dict[Transfer, torch.Tensor]]:
        """This rank's sends (pieces of ``source(t)``) and receives (fresh buffers), in order."""
        me = self.rank
        msgs: list[Message] = []
        recv: dict[Transfer, torch.Tensor] = {}
        for t in transfers:
            if t.local:
                if t.kind in ("cut", "grad") and source is not None:  # to this rank's stage
                    spec = routing.spec_of(self.plan, t)
                    piece = take(source(t), spec, t.src_rows(spec) if t.batched else None)
                    # a copy, as a message would be: the reader may write its inputs
                    self.mailbox[t] = piece.clone(memory_format=torch.contiguous_format)
                continue
            spec = routing.spec_of(self.plan, t)
            label = f"{what} {t.value!r} of micro-batch {t.microbatch}"
            if t.src == me:
                piece = take(source(t), spec, t.src_rows(spec) if t.batched else None)
                msgs.append(Message("send", self._sendable(piece), t.dst, label))
            else:
                buf = torch.empty(piece_shape(spec, t), dtype=dtype_of(spec), device=self.device)
                recv[t] = buf
                msgs.append(Message("recv", buf, t.src, label))
        return msgs, recv

    def _sendable(self, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` as a send may hold it until the step ends: contiguous, and a copy when it
        shares storage with a buffer. An in-place op on a buffer returns the buffer itself
        (``add_ = aten.add_(count, 1)`` in an exported graph), so such a cut value would be
        sent from the buffer's storage while the next micro-batch's restore overwrites it,
        and the consumer would read either value."""
        if piece.untyped_storage().data_ptr() in self._written:
            return piece.clone(memory_format=torch.contiguous_format)
        return piece.contiguous()

    def scatter(self, step: StepState, _: int | None = None) -> None:
        """Every micro-batch's graph inputs at once, as one batch of messages each way (owners
        never wait on anything first): they leave together, so the first forward that reads
        them waits for all of them, once."""
        sends: list[Message] = []
        recvs: list[Message] = []
        received = []
        for i in range(self.plan.micro_batches):
            msgs, recv = self._messages(
                self.routes.inputs[i], lambda t: step.local[t.slot], "input"
            )
            sends += [x for x in msgs if x.op == "send"]
            recvs += [x for x in msgs if x.op == "recv"]
            received.append(recv)
        pending = post(recvs, self.groups)
        step.inputs.extend((pending, recv) for recv in received)
        step.sends.append(post(sends, self.groups))

    def recv_f(self, step: StepState, i: int, peer: int | None = None) -> None:
        """Post micro-batch i's receives of cut values (from stage ``peer`` only, if given)."""
        msgs, recv = self._messages(self._mine("cut in", i, peer), None, "cut value")
        step.cut_recv.setdefault(i, []).append((post(msgs, self.groups), recv))

    def send_f(self, step: StepState, i: int) -> None:
        if not self.sends_cuts:
            return  # another replica of this stage sends what this one would
        outs = step.outs[i]
        msgs, _ = self._messages(self._mine("cut out", i),
                                 lambda t: outs[self.out_pos[t.value]].detach(), "cut value")
        step.sends.append(post(msgs, self.groups))
        step.sent[("F", i)] = step.sends[-1]
        if self.recompute or not step.grad:
            del step.outs[i]  # sent: nothing else reads them

    def recv_b(self, step: StepState, i: int, peer: int | None = None) -> None:
        """Post micro-batch i's receives of gradients (from stage ``peer`` only, if given)."""
        msgs, recv = self._messages(self._mine("grad in", i, peer), None,
                                    "gradient of cut value")
        step.grad_recv.setdefault(i, []).append((post(msgs, self.groups), recv))

    def send_b(self, step: StepState, i: int) -> None:
        if not self.sends_grads:
            return  # B freed the arguments: this replica sends no gradient
        args = step.args.pop(i)

        def source(t: Transfer) -> torch.Tensor:
            x = args[self.in_pos[t.value]]
            return x.grad if x.grad is not None else torch.zeros_like(x)

        msgs, _ = self._messages(self._mine("grad out", i), source, "gradient of cut value")
        step.sends.append(post(msgs, self.groups))
        step.sent[("B", i)] = step.sends[-1]

    # -- compute ---------------------------------------------------------------------------------
    def _wait(self, pending: Pending, match: str, i: int) -> None:
        """Wait for received messages; traced, an event naming the ranks they come from."""
        rec = self.trace
        if rec is None or not rec.on or not pending.messages:
            pending.wait()
            return
        t0 = rec.now()
        pending.wait()
        peers = sorted({m.peer for m in pending.messages})
        rec.event(f"wait {match}{i}", "wait", t0, rec.now(), microbatch=i, peers=peers,
                  match=match)

    def _args(self, step: StepState, i: int) -> list[Any]:
        pending, recv = step.inputs[i]
        self._wait(pending, "SCATTER", i)
        for cut_pending, cut_recv in step.cut_recv.pop(i, ()):
            self._wait(cut_pending, "SEND_F", i)
            recv = {**recv, **cut_recv}
        step.inputs[i] = (pending, {})
        n = self.spans[i][1] - self.spans[i][0]
        args: list[Any] = []
        for name, spec, pieces in zip(
            self.stage.inputs, self.in_specs, self.routes.args[i], strict=True
        ):
            if spec.kind in ("int", "ints"):
                args.append(ints_value(spec, n))  # each stage's sizes for its own samples
                continue
            if name in self.graph_inputs and spec.batch_dim is None:
                args.append(step.local[self.graph_inputs[name]])
                continue
            parts = [
                (t, recv[t] if not t.local else self.mailbox.pop(t) if t.kind == "cut"
                 else take(step.local[t.slot], spec, t.src_rows(spec)))
                for t in pieces
            ]
            x = assemble(parts, spec, n, self.device)
            if step.grad and name in self.cuts and routing.needs_grad(spec):
                x = x.detach().requires_grad_(True)  # a leaf: backward reads its .grad
            args.append(x)
        return args

    def forward(self, step: StepState, i: int) -> None:
        with fetching(self.host):
            self._forward(step, i)

    def _forward(self, step: StepState, i: int) -> None:
        args = self._args(step, i)
        self.buffers.before_microbatch(i)
        if step.grad and self.recompute:
            step.rng[i] = rng_state(self.device)
            with keeping_nothing():
                outs = self._run(args)
            outs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
        elif step.grad and self.selective:
            outs = self._run_selective(args)
        else:
            with saving(self.host), self._keeping(step, i, args):
                outs = self._run(args)
        self.buffers.after_microbatch(i, self.shares[i])
        check_stage_outputs(self.stage, self.cuts, self.spans[i][1] - self.spans[i][0], outs)
        self.outputs.accumulate(i, outs, step.reduced)
        if self.tail is not None:
            self.tail.keep(step, i, outs)
        model = {self.stage.outputs[p]: outs[p].detach() for p in self.kept
                 if _is_tensor(outs[p])}
        step.model_outs[i] = left = self.outputs.home(i, model, step.assembled)
        if step.grad:
            step.args[i] = args
        if self.sends_cuts or (step.grad and not self.recompute):
            # an output all of whose rows went into this rank's local batch, and that no
            # other stage, the tail or a backward reads, is not held until the backward
            step.outs[i] = tuple(None if p in self._model_only and name not in left else o
                                 for p, (name, o) in enumerate(zip(self.stage.outputs, outs,
                                                                   strict=True)))

    def recompute_one(self, step: StepState, i: int) -> None:
        """R: micro-batch i's forward again, with gradients, as its F ran it."""
        # enable_grad: a deferred backward runs inside autograd's backward, where it is off
        with (
            fetching(self.host),
            torch.enable_grad(),
            rng_restored(step.rng.pop(i), self.device),
            self.buffers.recompute_scope(),
            saving(self.host),
            self._keeping(step, i, step.args[i]),
        ):
            step.outs[i] = self._run(step.args[i], self.segmented)

    def _keeping(self, step: StepState, i: int,
                 args: list[Any]) -> contextlib.AbstractContextManager[Any]:
        """Micro-batch i's saved tensors in boxes where its backward is split, so that its
        B can drop what its W does not read (``backward_split``; where no input needs a
        gradient, W runs the whole backward and B drops nothing)."""
        if not (step.grad and i in step.split) or self.host is not None or not any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in args):
            return contextlib.nullcontext()
        return keeping_for_split(step.saved.setdefault(i, SavedBoxes()))

    def backward(self, step: StepState, i: int) -> None:
        with fetching(self.host):
            self._backward(step, i)

    def _backward(self, step: StepState, i: int) -> None:
        recv: dict[Transfer, torch.Tensor] = {}
        for pending, got in step.grad_recv.pop(i, ()):
            self._wait(pending, "SEND_B", i)
            recv = {**recv, **got}
        if self.mailbox:  # gradients from a stage of this rank
            recv = {**recv, **{t: self.mailbox.pop(t) for t in self._mine("grad in", i)
                               if t.local}}
        outs = step.outs.pop(i)
        grads: dict[int, torch.Tensor] = {}
        for t, piece in recv.items():
            pos = self.out_pos[t.value]
            spec = routing.spec_of(self.plan, t)
            g = grads.get(pos)
            if g is None:
                g = grads[pos] = torch.zeros_like(outs[pos])
            take(g, spec, t.dst_rows(spec) if t.batched else None).add_(piece)
        for pos, s in step.seeds.items():
            g = self.outputs.weights[i] * s
            grads[pos] = grads[pos] + g if pos in grads else g
        for pos, g in step.tail_grads.pop(i, {}).items():  # its rows of the tail's gradients
            grads[pos] = grads[pos] + g if pos in grads else g
        tensors, gs = [], []
        for pos, g in grads.items():
            o = outs[pos]
            if isinstance(o, torch.Tensor) and o.requires_grad:
                tensors.append(o)
                gs.append(g)
        if tensors and i in step.split:
            inputs = [x for x in step.args.get(i, ()) if isinstance(x, torch.Tensor)]
            step.weight_work[i] = backward_inputs(tensors, gs, inputs, self.trainable,
                                                  step.saved.pop(i, None))
        elif tensors:
            torch.autograd.backward(tensors, gs)
        step.backwards += 1
        if not self.sends_grads:
            step.args.pop(i, None)

    def weights(self, step: StepState, i: int) -> None:
        """W: micro-batch i's parameter gradients, into ``.grad``."""
        work = step.weight_work.pop(i, None)
        if work is not None:
            with fetching(self.host):
                backward_weights(work)

    def _run(self, args: list[Any], module: fx.GraphModule | None = None) -> tuple[Any, ...]:
        outs = (self.module if module is None else module)(*args)
        return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)

    def _run_selective(self, args: list[Any]) -> tuple[Any, ...]:
        outs = selective.checkpointed(self.module, args, self.buffers.recompute_scope)
        return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)
