"""Run this rank's stage of a plan: GPipe forwards on call, backwards on ``loss.backward()``.

One step on a rank (every rank runs the same code; what it sends and receives comes from
``routing``, computed from the plan alone):

    forward(flat_local_inputs)
      A  post the local batch's pieces to the replicas that need them, and receive ours
      for each micro-batch i (schedule: sF0, sF1, ...):
      B    wait for micro-batch i's inputs (graph inputs, cut values), run the stage,
           send its cut values on to the consumer replicas
      C  send batched model outputs to the ranks whose samples they hold; receive ours
         outputs without a batch dimension (the loss): the stage that computes them sums
         its replicas' parts (an all-reduce among them, if several) and sends the sum to
         every rank outside the stage, spread round robin over its replicas
         (``unbatched_peers``); every other rank receives it
         finish updated buffers (BatchNorm, see ``buffers``) among the stage's replicas
      -> flat outputs; the loss is tied to the autograd bridge

Between any two ranks the loss messages come after the batched outputs on both sides,
before the backward's gradients, so they match in posting order like every other message
(``comm.post``). A sender returns without waiting for its loss sends (the last stage's
forward is the critical path); it finishes them at its next forward or end of backward. A
one-stage plan all-reduces the loss among its replicas, which are then every rank.

    loss.backward()  (on every rank)
      for each micro-batch i, last first (schedule: sB(m-1) ... sB0):
           receive the gradients of this stage's cut values from the consumer replicas,
           add the loss seed (share of the global batch), backward through the stage,
           send the gradients of the stage's cut-value inputs to the producer replicas
      all-reduce (SUM) gradients: each shared parameter over every rank that holds it,
      then the rest among the stage's replicas

One rank and one micro-batch (``world_size == 1``, ``micro_batches == 1``): the stage is the
whole model on the whole batch, so forward calls it directly and ``loss.backward()`` is plain
autograd through it; nothing moves, nothing is reduced, no bridge. Its outputs are those of the
general path (batched ones detached), and so are gradients and buffers.

Loss arithmetic: replica k of the loss's stage sees n(i, k) samples of micro-batch i and
computes their mean loss l(i, k); the step's loss is sum(n(i, k) / G * l(i, k)), which is the
global-batch mean, and each backward is seeded with n(i, k) / G, so the summed gradients are
the global-batch gradient. Outputs without a batch dimension are assumed mean-reduced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from ..config import Config
from ..plan import OutputRef, Plan, ValueSpec
from . import routing
from .buffers import BufferSync
from .comm import Groups, Message, Pending, all_reduce_flat, build_groups, check_same_plan, post
from .grads import GradSync
from .pieces import assemble, dtype_of, interleave, piece_shape, sample_major, take
from .routing import Transfer
from .schedule import Action, gpipe_schedule

__all__ = ["StageExecutor", "check_outputs_routable", "unbatched_peers"]


@dataclass
class _Step:
    """What one step keeps between forward and backward."""

    index: int
    inputs: list[list[Any]] = field(default_factory=list)  # per micro-batch, stage arguments
    outputs: list[tuple[Any, ...]] = field(default_factory=list)  # per micro-batch
    done: bool = False


class StageExecutor:
    """Runs ``module`` (the stage GraphModule of this rank) as part of ``plan``.

    ``module`` takes ``plan.stages[s].inputs`` as positional arguments and returns a flat
    tuple in the order of ``plan.stages[s].outputs``. Its parameters are the model's own, so
    an optimizer over them trains the model. ``groups`` defaults to ``build_groups(plan)``
    with ``timeout_s`` (default ``Config().timeout_s``); that, and a check that every rank
    holds the same plan, are collectives: every rank builds its executor at the same point.
    A one-rank plan needs no process group.
    """

    def __init__(
        self,
        plan: Plan,
        module: fx.GraphModule,
        *,
        rank: int | None = None,
        groups: Groups | None = None,
        device: torch.device | str | None = None,
        timeout_s: float | None = None,
    ):
        self.plan = plan
        self.module = module
        if plan.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"the plan is for {plan.world_size} ranks but no process group is running; "
                "launch with torchrun and call rannc_fx.runtime.init_distributed() first"
            )
        if dist.is_initialized() and dist.get_world_size() != plan.world_size:
            raise ValueError(
                f"the plan is for {plan.world_size} ranks but the process group has "
                f"{dist.get_world_size()}; launch with --nproc-per-node {plan.world_size} or "
                "make a plan for this world size"
            )
        check_outputs_routable(plan)  # before any collective: every rank refuses alike
        self.rank = rank if rank is not None else dist.get_rank() if dist.is_initialized() else 0
        self.stage = plan.stage_of_rank(self.rank)
        self.replica = self.stage.ranks.index(self.rank)
        self.device = torch.device(device) if device is not None else _device_of(module)
        if plan.world_size > 1:
            check_same_plan(plan, self.device)
        timeout = timeout_s if timeout_s is not None else Config().timeout_s
        self.groups = groups if groups is not None else build_groups(plan, timeout_s=timeout)
        self.actions: list[Action] = gpipe_schedule(len(plan.stages), plan.micro_batches)[
            self.stage.index
        ]
        self._local = routing.local_batch(plan)
        self._spans = [
            routing.replica_span(plan, self.stage.index, self.replica, i)
            for i in range(plan.micro_batches)
        ]
        self._shares = [(b - a) / plan.global_batch for a, b in self._spans]
        self._build_routes()
        self.grads = GradSync(plan, self.stage.index, module, self.groups)
        # Unbatched floating outputs (the loss): averaged over the batch, tied to the bridge.
        self._diff = [
            r.index
            for r in plan.outputs
            if r.spec.kind == "tensor"
            and r.spec.batch_dim is None
            and (dtype_of(r.spec).is_floating_point or dtype_of(r.spec).is_complex)
        ]
        self.buffers = BufferSync(
            module,
            micro_batches=plan.micro_batches,
            group=self.groups.stage[self.stage.index],
            ranks=self.stage.ranks,
        )
        self._step = 0
        self._saved: _Step | None = None
        self._anchor = torch.zeros((), requires_grad=True)
        self._in_shapes = [
            spec.shape_for(self._local) if spec.kind == "tensor" else None for spec in plan.inputs
        ]
        # Unbatched outputs: whom this rank sends its stage's to, whom it gets each other's from.
        self._unbatched = [
            r for r in plan.outputs if r.spec.kind == "tensor" and r.spec.batch_dim is None
        ]
        self._loss_dsts, self._loss_srcs = unbatched_peers(plan, self.rank)
        self._loss_sent: Pending | None = None  # sends of the last forward's loss, unfinished
        # one rank, one micro-batch: call the stage, plain autograd (tests set it False)
        self._alone = plan.world_size == 1 and plan.micro_batches == 1 and self._build_alone()

    # -- static routes --------------------------------------------------------------------------
    def _build_routes(self) -> None:
        plan, st = self.plan, self.stage
        self._graph_inputs = {spec.name: (i, spec) for i, spec in enumerate(plan.inputs)}
        self._cuts = {cv.name: cv for cv in plan.cut_values}
        n_placeholders = sum(1 for n in _graph(self.module).nodes if n.op == "placeholder")
        if n_placeholders != len(st.inputs):
            raise ValueError(
                f"stage {st.index}'s module takes {n_placeholders} inputs but the plan lists "
                f"{len(st.inputs)} ({list(st.inputs)}); the module and plan do not match"
            )
        self._in_specs: list[ValueSpec] = []
        for name in st.inputs:
            if name in self._graph_inputs:
                self._in_specs.append(self._graph_inputs[name][1])
            elif name in self._cuts and st.index in self._cuts[name].consumers:
                self._in_specs.append(self._cuts[name].spec)
            else:
                raise ValueError(
                    f"stage {st.index} input {name!r} is neither a graph input nor a cut value "
                    "the plan sends to this stage"
                )
        self._out_pos = {name: p for p, name in enumerate(st.outputs)}
        self._my_outputs: list[OutputRef] = [r for r in plan.outputs if r.stage == st.index]
        for ref in self._my_outputs:
            if ref.spec.name not in self._out_pos:
                raise ValueError(
                    f"model output {ref.index} ({ref.spec.name!r}) is assigned to stage "
                    f"{st.index}, which does not return it"
                )
        for name in st.outputs:
            if name in self._cuts and self._cuts[name].producer != st.index:
                raise ValueError(f"stage {st.index} returns {name!r}, produced by another stage")

        self.routes = routing.rank_routes(plan, self.rank)

    def _build_alone(self) -> bool:
        """The one-rank, one-micro-batch fast path: where each stage argument and each model
        output comes from. False where it cannot apply (an output the general path refuses)."""
        kinds = {r.spec.kind for r in self.plan.outputs}
        if not kinds <= {"tensor", "int", "ints"}:
            return False
        self._alone_args: list[tuple[int, Any]] = []  # (graph input slot, or -1 and the value)
        for name, spec in zip(self.stage.inputs, self._in_specs, strict=True):
            if spec.kind in ("int", "ints"):
                self._alone_args.append((-1, _ints_value(spec, self._local)))
            else:
                self._alone_args.append((self._graph_inputs[name][0], None))
        # (stage output position, how it comes back, or -1 and the value): as the general path
        # returns it, detached where that one detaches
        self._alone_outs: list[tuple[int, str, Any]] = []
        for ref in self.plan.outputs:
            spec = ref.spec
            if spec.kind != "tensor":
                self._alone_outs.append((-1, "value", _ints_value(spec, self._local)))
            elif spec.batch_dim is not None:
                self._alone_outs.append((self._out_pos[spec.name], "detach", None))
            elif ref.index in self._diff:
                self._alone_outs.append((self._out_pos[spec.name], "as is", None))
            else:
                self._alone_outs.append((self._out_pos[spec.name], "copy", None))
        return True

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, flat_inputs: Sequence[Any]) -> list[Any]:
        """Run every micro-batch's forward; returns the model's flat outputs for this rank.

        ``flat_inputs`` is this rank's local batch, one entry per ``plan.inputs``. Batched
        outputs come back for the local samples (detached); outputs without a batch
        dimension are equal on every rank, and with grad enabled ``.backward()`` on one of
        them (on every rank) runs the pipeline's backward.
        """
        if self._alone:
            return self._forward_alone(flat_inputs)
        self._finish_loss_sends()
        local = self._check_inputs(flat_inputs)
        self._step += 1
        self._saved = None  # a new step frees the last one's activations
        training = torch.is_grad_enabled()
        m = self.plan.micro_batches
        keep = (
            set(range(len(self.stage.outputs)))
            if training
            else {self._out_pos[r.spec.name] for r in self._my_outputs}
        )

        # A: every micro-batch's graph inputs at once; owners never wait on anything first.
        sends: list[Pending] = []
        in_recv: list[dict[Transfer, torch.Tensor]] = []
        in_pending: list[Pending] = []
        for i in range(m):
            msgs, recv = self._messages(self.routes.inputs[i], lambda t: local[t.slot], "input")
            in_recv.append(recv)
            in_pending.append(post([x for x in msgs if x.op == "recv"]))
            sends.append(post([x for x in msgs if x.op == "send"]))

        # B: per micro-batch, receive (one ahead), run, send cut values on.
        step = _Step(self._step)
        reduced: dict[int, torch.Tensor] = {}
        cut_recv = {0: self._post_cut_recvs(0)}
        self.buffers.begin()
        for action in self.actions:
            if action.kind != "F":
                continue
            i = action.microbatch
            in_pending[i].wait()
            pending, recv = cut_recv.pop(i)
            pending.wait()
            if i + 1 < m:
                cut_recv[i + 1] = self._post_cut_recvs(i + 1)
            args = self._stage_args(i, local, {**in_recv[i], **recv}, training)
            in_recv[i] = {}
            self.buffers.before_microbatch(i)
            outs = self.module(*args)
            outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            self.buffers.after_microbatch(i, self._shares[i])
            self._check_outputs(i, outs)
            sends.append(self._send_cuts(i, outs))
            self._reduce_outputs(i, outs, reduced)
            step.inputs.append(args if training else [])
            step.outputs.append(tuple(o if p in keep else None for p, o in enumerate(outs)))

        # C: batched outputs home, the loss to every rank, buffers made equal.
        results = self._gather_outputs(step.outputs)
        received = self._share_unbatched(reduced, results)
        for p in sends:
            p.wait()
        self.buffers.finish()
        received.wait()
        flat = [results[r.index] for r in self.plan.outputs]
        return self._attach(step, flat) if training else flat

    def _forward_alone(self, flat_inputs: Sequence[Any]) -> list[Any]:
        """One rank, one micro-batch: the stage on the whole batch, its autograd graph kept."""
        local = self._check_inputs(flat_inputs)
        self._step += 1
        self._saved = None
        outs = self.module(*[local[j] if j >= 0 else v for j, v in self._alone_args])
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        if len(outs) != len(self.stage.outputs):
            self._check_outputs(0, tuple(outs))  # raises, naming the outputs
        flat: list[Any] = []
        for pos, how, v in self._alone_outs:
            if how == "as is":
                flat.append(outs[pos])
            elif how == "detach":
                flat.append(outs[pos].detach())
            elif how == "copy":
                flat.append(outs[pos].detach().clone())
            else:
                flat.append(v)
        return flat

    def _check_inputs(self, flat: Sequence[Any]) -> list[Any]:
        specs = self.plan.inputs
        if len(flat) != len(specs):
            raise ValueError(
                f"the model got {len(flat)} tensor inputs but the plan was made for "
                f"{len(specs)} ({[s.name for s in specs]}); call it as when it was planned"
            )
        out = []
        for j, (t, spec, want) in enumerate(zip(flat, specs, self._in_shapes, strict=True)):
            if want is not None:
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"input {j} ({spec.name!r}) must be a tensor, got {type(t)}")
                if t.shape != want:
                    raise ValueError(
                        f"input {j} ({spec.name!r}) has shape {tuple(t.shape)} but the plan "
                        f"expects {want} on each rank (global batch {self.plan.global_batch} "
                        f"over {self.plan.world_size} ranks: {self._local} samples per rank)"
                    )
                if t.device != self.device:
                    t = t.to(self.device)
            out.append(t)
        return out

    def _check_outputs(self, i: int, outs: tuple[Any, ...]) -> None:
        """A cut value whose shape, dtype or need for a gradient differs from the plan would
        garble the p2p stream or lose gradients silently: stop with the value's name."""
        st = self.stage
        if len(outs) != len(st.outputs):
            raise ValueError(
                f"stage {st.index} returned {len(outs)} values; the plan lists "
                f"{len(st.outputs)} ({list(st.outputs)})"
            )
        n = self._spans[i][1] - self._spans[i][0]
        for name, o in zip(st.outputs, outs, strict=True):
            cv = self._cuts.get(name)
            if cv is None or cv.spec.kind != "tensor":
                continue
            want = (cv.spec.shape_for(n), dtype_of(cv.spec))
            if not isinstance(o, torch.Tensor) or (tuple(o.shape), o.dtype) != want:
                got = (tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else type(o)
                raise ValueError(
                    f"stage {st.index} made cut value {name!r} as {got} for {n} samples but the "
                    f"plan says {want}; the plan does not describe this model (make it again)"
                )
            if o.requires_grad and not routing.needs_grad(cv.spec) and torch.is_grad_enabled():
                raise ValueError(
                    f"cut value {name!r} needs a gradient but the plan says it does not "
                    "(requires_grad=False), so its gradient would be lost; make the plan again"
                )

    def _messages(
        self, transfers: list[Transfer], source: Any, what: str
    ) -> tuple[list[Message], dict[Transfer, torch.Tensor]]:
        """This rank's sends (pieces of ``source(t)``) and receives (fresh buffers), in order.

        The order is the canonical one among the messages of one direction between two ranks,
        which is all that p2p matching needs; sends and receives may be posted separately.
        """
        me = self.rank
        msgs: list[Message] = []
        recv: dict[Transfer, torch.Tensor] = {}
        for t in transfers:
            if t.local:
                continue
            spec = routing.spec_of(self.plan, t)
            label = f"{what} {t.value!r} of micro-batch {t.microbatch}"
            if t.src == me:
                piece = take(source(t), spec, t.src_rows(spec) if t.batched else None)
                msgs.append(Message("send", piece.contiguous(), t.dst, label))
            else:
                buf = torch.empty(piece_shape(spec, t), dtype=dtype_of(spec), device=self.device)
                recv[t] = buf
                msgs.append(Message("recv", buf, t.src, label))
        return msgs, recv

    def _post_cut_recvs(self, i: int) -> tuple[Pending, dict[Transfer, torch.Tensor]]:
        mine = [t for t in self.routes.cuts[i] if t.dst == self.rank]
        msgs, recv = self._messages(mine, None, "cut value")
        return post(msgs), recv

    def _send_cuts(self, i: int, outs: tuple[Any, ...]) -> Pending:
        mine = [t for t in self.routes.cuts[i] if t.src == self.rank]
        msgs, _ = self._messages(mine, lambda t: outs[self._out_pos[t.value]].detach(), "cut value")
        return post(msgs)

    def _stage_args(
        self, i: int, local: list[Any], recv: dict[Transfer, torch.Tensor], training: bool
    ) -> list[Any]:
        n = self._spans[i][1] - self._spans[i][0]
        args: list[Any] = []
        for name, spec, pieces in zip(
            self.stage.inputs, self._in_specs, self.routes.args[i], strict=True
        ):
            if spec.kind in ("int", "ints"):
                args.append(_ints_value(spec, n))  # each stage's sizes for its own samples
                continue
            if name in self._graph_inputs and spec.batch_dim is None:
                args.append(local[self._graph_inputs[name][0]])
                continue
            parts = [
                (t, recv[t] if not t.local else take(local[t.slot], spec, t.src_rows(spec)))
                for t in pieces
            ]
            x = assemble(parts, spec, n, self.device)
            if training and name in self._cuts and routing.needs_grad(spec):
                x = x.detach().requires_grad_(True)  # a leaf: backward reads its .grad
            args.append(x)
        return args

    def _reduce_outputs(
        self, i: int, outs: tuple[Any, ...], reduced: dict[int, torch.Tensor]
    ) -> None:
        """Outputs without a batch dimension: share-weighted sum (mean-reduced losses)."""
        for ref in self._my_outputs:
            spec = ref.spec
            if spec.kind != "tensor" or spec.batch_dim is not None:
                continue
            v = outs[self._out_pos[spec.name]].detach()
            if ref.index in self._diff:
                w = self._shares[i]
                reduced[ref.index] = reduced[ref.index] + w * v if ref.index in reduced else w * v
            elif i == 0 and self.replica == 0:
                reduced[ref.index] = v.clone()  # not averageable: micro-batch 0's value

    def _share_unbatched(
        self, reduced: dict[int, torch.Tensor], results: dict[int, Any]
    ) -> Pending:
        """Every unbatched output to every rank; integer outputs computed here.

        This stage's own are summed over its replicas (an all-reduce among them) and sent to
        the ranks this rank serves (``unbatched_peers``); the sends are left running. The
        other stages' are received into ``results``: valid once the returned Pending is waited
        on. Posted after ``_gather_outputs`` on every rank, so between any two ranks they
        follow the batched outputs on both sides.
        """
        for ref in self.plan.outputs:
            spec = ref.spec
            if spec.kind in ("int", "ints"):
                results[ref.index] = _ints_value(spec, self._local)
            elif spec.kind != "tensor":
                raise ValueError(f"model output {ref.index} is a {spec.kind}; return tensors")
        st = self.stage.index
        mine = [r for r in self._unbatched if r.stage == st]
        vals = [
            reduced[r.index]
            if r.index in reduced
            else torch.zeros(r.spec.shape, dtype=dtype_of(r.spec), device=self.device)
            for r in mine
        ]
        group = self.groups.stage[st]
        if vals and group is not None:
            vals = all_reduce_flat(
                vals,
                group,
                what=f"the outputs without a batch dimension (the loss) of stage {st}",
                ranks=self.stage.ranks,
            )
        results.update((r.index, v) for r, v in zip(mine, vals, strict=True))
        sends: list[Message] = []
        if self._loss_dsts and vals:
            payload = [v.clone() for v in vals]  # the caller may change the returned ones
            for dst in self._loss_dsts:
                for r, v in zip(mine, payload, strict=True):
                    sends.append(Message("send", v, dst, _unbatched_label(r)))
        recvs: list[Message] = []
        for s, src in self._loss_srcs.items():
            for r in self._unbatched:
                if r.stage == s:
                    buf = torch.empty(r.spec.shape, dtype=dtype_of(r.spec), device=self.device)
                    results[r.index] = buf
                    recvs.append(Message("recv", buf, src, _unbatched_label(r)))
        if sends and recvs:
            # one batch, waited on before returning: NCCL could deadlock on two batches
            # that two ranks post in opposite order
            return post(sends + recvs)
        self._loss_sent = post(sends) if sends else None
        return post(recvs)

    def _finish_loss_sends(self) -> None:
        if self._loss_sent is not None:
            sent, self._loss_sent = self._loss_sent, None
            sent.wait()

    def _gather_outputs(self, outputs: list[tuple[Any, ...]]) -> dict[int, Any]:
        """C: batched model outputs to the ranks whose local samples they are.

        An interleaved output moves in sample-major order and is interleaved again for the
        local samples, as the model would have laid it out for the local batch alone.
        """
        me = self.rank
        mine = {r.spec.name: r.spec for r in self._my_outputs if r.spec.interleave is not None}
        regrouped: dict[tuple[int, str], torch.Tensor] = {}

        def source(t: Transfer) -> torch.Tensor:
            x = outputs[t.microbatch][self._out_pos[t.value]].detach()
            if t.value not in mine:
                return x
            key = (t.microbatch, t.value)
            if key not in regrouped:
                a, b = self._spans[t.microbatch]
                regrouped[key] = sample_major(x, mine[t.value], b - a)
            return regrouped[key]

        msgs, recv = self._messages(self.routes.outputs, source, "model output")
        pending = post(msgs)
        pending.wait()
        results: dict[int, Any] = {}
        for ref in self.plan.outputs:
            spec = ref.spec
            if spec.kind != "tensor" or spec.batch_dim is None:
                continue
            parts = [
                (t, recv[t] if not t.local else take(source(t), spec, t.src_rows(spec)))
                for t in self.routes.outputs
                if t.dst == me and t.slot == ref.index
            ]
            y = assemble(parts, spec, self._local, self.device)
            results[ref.index] = y if spec.interleave is None else interleave(y, spec, self._local)
        return results

    # -- backward --------------------------------------------------------------------------------
    def _attach(self, step: _Step, flat: list[Any]) -> list[Any]:
        """Route the unbatched floating outputs through the bridge whose backward is ours."""
        if not self._diff:
            return flat  # nothing to differentiate: keep no activations
        self._saved = step
        tied = _Bridge.apply(self, step.index, self._anchor, *(flat[j] for j in self._diff))
        out = list(flat)
        for j, v in zip(self._diff, tied, strict=True):
            out[j] = v
        return out

    def backward(self, step_index: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Every micro-batch's backward, then the gradient all-reduces (called by the bridge).

        ``grads`` are the gradients of the unbatched floating outputs, in output order.
        """
        step = self._saved
        if step is None or step.index != step_index or step.done:
            raise RuntimeError(
                f"backward for step {step_index} but the pipeline holds "
                + ("no step" if step is None else f"step {step.index}")
                + "; call loss.backward() once per forward, before the next forward"
            )
        step.done = True
        seeds = self._seeds(grads)
        self.grads.begin()
        sends: list[Pending] = []
        last = self.plan.micro_batches - 1
        grad_recv = {last: self._post_grad_recvs(last)}
        for action in self.actions:
            if action.kind != "B":
                continue
            i = action.microbatch
            pending, recv = grad_recv.pop(i)
            pending.wait()
            if i > 0:
                grad_recv[i - 1] = self._post_grad_recvs(i - 1)
            self._backward_one(i, step, recv, seeds)
            sends.append(self._send_grads(i, step.inputs[i]))
            step.inputs[i], step.outputs[i] = [], ()
        for sent in sends:
            sent.wait()
        self._finish_loss_sends()
        self.grads.finish()
        self._saved = None

    def _seeds(self, grads: Sequence[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """Output position -> the user's gradient for it (to be scaled by each share)."""
        seeds: dict[int, torch.Tensor] = {}
        for j, g in zip(self._diff, grads, strict=True):
            ref = self.plan.outputs[j]
            if ref.stage != self.stage.index or g is None:
                continue
            pos = self._out_pos[ref.spec.name]
            seeds[pos] = seeds[pos] + g if pos in seeds else g
        return seeds

    def _post_grad_recvs(self, i: int) -> tuple[Pending, dict[Transfer, torch.Tensor]]:
        mine = [t for t in self.routes.grads[i] if t.dst == self.rank]
        msgs, recv = self._messages(mine, None, "gradient of cut value")
        return post(msgs), recv

    def _backward_one(
        self,
        i: int,
        step: _Step,
        recv: dict[Transfer, torch.Tensor],
        seeds: dict[int, torch.Tensor],
    ) -> None:
        outs = step.outputs[i]
        grads: dict[int, torch.Tensor] = {}
        for t, piece in recv.items():
            pos = self._out_pos[t.value]
            spec = routing.spec_of(self.plan, t)
            g = grads.get(pos)
            if g is None:
                g = grads[pos] = torch.zeros_like(outs[pos])
            take(g, spec, t.dst_rows(spec) if t.batched else None).add_(piece)
        for pos, s in seeds.items():
            g = self._shares[i] * s
            grads[pos] = grads[pos] + g if pos in grads else g
        tensors, gs = [], []
        for pos, g in grads.items():
            o = outs[pos]
            if isinstance(o, torch.Tensor) and o.requires_grad:
                tensors.append(o)
                gs.append(g)
        if tensors:
            torch.autograd.backward(tensors, gs)

    def _send_grads(self, i: int, args: list[Any]) -> Pending:
        pos = {name: p for p, name in enumerate(self.stage.inputs)}

        def source(t: Transfer) -> torch.Tensor:
            x = args[pos[t.value]]
            return x.grad if x.grad is not None else torch.zeros_like(x)

        mine = [t for t in self.routes.grads[i] if t.src == self.rank]
        msgs, _ = self._messages(mine, source, "gradient of cut value")
        return post(msgs)


def unbatched_peers(plan: Plan, rank: int) -> tuple[list[int], dict[int, int]]:
    """Where the outputs without a batch dimension go: (the ranks ``rank`` sends its stage's
    to, {stage: the rank ``rank`` receives that stage's from}).

    A stage with such outputs sends them to every rank outside it, the j-th of those (in rank
    order) from its replica j mod r, so each replica sends about (world - r) / r messages:

        stage 1 on ranks 2, 3 owns the loss    rank 0 <- rank 2, rank 1 <- rank 3
    """
    owners = sorted(
        {r.stage for r in plan.outputs if r.spec.kind == "tensor" and r.spec.batch_dim is None}
    )
    dsts: list[int] = []
    srcs: dict[int, int] = {}
    for s in owners:
        ranks = plan.stages[s].ranks
        outside = [j for j in range(plan.world_size) if j not in ranks]
        for k, dst in enumerate(outside):
            src = ranks[k % len(ranks)]
            if src == rank:
                dsts.append(dst)
            elif dst == rank:
                srcs[s] = src
    return dsts, srcs


def check_outputs_routable(plan: Plan) -> None:
    """Refuse a plan with a model output whose interleaved layout is unknown, when the plan
    splits the batch: its rows could not be handed back to the ranks by sample."""
    if plan.world_size == 1 and plan.micro_batches == 1:
        return  # the one rank computes the whole batch at once: nothing is cut
    for ref in plan.outputs:
        spec = ref.spec
        if spec.interleaved and spec.interleave is None:
            raise ValueError(
                f"model output {ref.index} ({spec.name!r}, {spec.shape} per sample) has rows "
                f"of different samples interleaved along dimension {spec.batch_dim} in a way "
                f"rannc_fx cannot undo, and this plan splits the batch ({plan.micro_batches} "
                f"micro-batch(es) on {plan.world_size} rank(s)), so each rank would get other "
                "samples' rows; return it with the batch as a dimension of its own (e.g. "
                "out.view(seq, batch, -1) rather than out.view(-1, n)), or compute the loss "
                "inside the model and return that"
            )


class _Bridge(torch.autograd.Function):
    """Joins the user's autograd graph to the pipeline: its backward runs ``backward``."""

    @staticmethod
    def forward(
        ctx: Any, executor: StageExecutor, step: int, anchor: torch.Tensor, *values: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.executor, ctx.step = executor, step
        return tuple(v.clone() for v in values)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.executor.backward(ctx.step, grads)
        return (None,) * (3 + len(grads))


def _ints_value(spec: ValueSpec, samples: int) -> int | torch.Size:
    ints = spec.ints_for(samples)
    return ints[0] if spec.kind == "int" else torch.Size(ints)


def _unbatched_label(ref: OutputRef) -> str:
    return f"model output {ref.index} ({ref.spec.name!r}, without a batch dimension)"


def _graph(module: nn.Module) -> fx.Graph:
    g = getattr(module, "graph", None)
    if not isinstance(g, fx.Graph):
        raise TypeError(f"the stage module must be an fx.GraphModule, got {type(module).__name__}")
    return g


def _device_of(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")
