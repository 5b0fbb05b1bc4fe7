"""The tail on the whole batch: its inputs gathered, one forward, one backward, rows back.

A plan with a tail (``Plan.tail``: the part of the model after its samples mix, such as a
contrastive loss) runs GPipe, and every replica of the last stage runs the tail once a step:

    F i (last stage)     the stage returns the tail's inputs too (``tail_in_*`` clones); this
                         replica keeps its rows of each micro-batch (``keep``)
    GATHER               the replicas swap their rows, so each holds every input for the
                         whole batch in sample order, and run the tail on it (``forward``);
                         losses join the stage's outputs (replica 0's value, the others add
                         zeros to the stage's sum); a batched output sends each rank the rows
                         of its samples (``send_rows``, every rank)
    loss.backward()      before the stage's first backward, the tail's backward with the
                         gradient that reaches each loss (``backward``); only replica 0 adds
                         the tail's parameter gradients (the stage's all-reduce sums over its
                         replicas, which all computed the same), and each replica keeps its
                         own micro-batches' rows of the inputs' gradients, which seed B i

So the step is the one-process step: the tail sees the batch one process would, and the body
gets the gradient of every sample's row. Between two ranks the tail's messages come before
``Outputs``' at GATHER on both sides, so they match in posting order (``p2p.post``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ..plan.plan import Plan, Stage
from ..plan.values import ValueSpec
from ..schedules import routing
from .comm import Groups
from .p2p import Message, post
from .pieces import dtype_of

__all__ = ["TailRunner", "tail_senders"]


class TailRunner:
    """This rank's part in running ``plan.tail`` (every rank has one; the last stage's run it)."""

    def __init__(self, plan: Plan, stage: Stage, module: fx.GraphModule | None, rank: int,
                 groups: Groups, device: torch.device) -> None:
        assert plan.tail is not None
        self.plan, self.tail, self.rank, self.groups, self.device = plan, plan.tail, rank, groups, device
        self.last = plan.stages[-1]
        self.runs = stage.index == self.last.index
        self.module = module.get_submodule("tail") if self.runs and module is not None else None
        self.replica = self.last.ranks.index(rank) if self.runs else -1
        self.pos = [stage.outputs.index(v.name) for v in self.tail.inputs] if self.runs else []
        self._params = list(self.module.parameters()) if self.module is not None else []
        self.local = routing.local_batch(plan)
        self.senders, self.receivers = tail_senders(plan, rank)
        # each replica of the last stage's samples of each micro-batch
        self.spans = [[routing.replica_span(plan, self.last.index, k, i)
                       for i in range(plan.micro_batches)] for k in range(len(self.last.ranks))]

    @property
    def params(self) -> list[nn.Parameter]:
        """The tail's parameters that require a gradient now (``trainable``)."""
        return [p for p in self._params if p.requires_grad]

    # -- the last stage ---------------------------------------------------------------------------
    def keep(self, step: Any, i: int, outs: tuple[Any, ...]) -> None:
        """Micro-batch ``i``'s rows of the tail's inputs, from the stage's outputs."""
        step.tail_in[i] = [outs[p].detach() for p in self.pos]

    def forward(self, step: Any) -> None:
        """Gather the whole batch's inputs and run the tail on it (GATHER, last stage)."""
        xs = self._gathered(step)
        step.tail_in = {}
        if step.grad:  # leaves: the backward reads their .grad
            xs = [x.detach().requires_grad_(True) if spec.requires_grad and _floating(x) else x
                  for x, spec in zip(xs, self.tail.inputs, strict=True)]
        with torch.enable_grad() if step.grad else torch.no_grad():
            outs = self.module(*xs) if self.module is not None else ()
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        for j, y in zip(self.tail.outputs, outs, strict=True):
            spec = self.plan.outputs[j].spec
            if spec.batch_dim is None and self.replica == 0:
                step.reduced[j] = y.detach()  # the others add zeros to the stage's sum
        if step.grad:
            step.tail = (xs, outs)
        step.tail_out = {j: y.detach() for j, y in zip(self.tail.outputs, outs, strict=True)}

    def _gathered(self, step: Any) -> list[torch.Tensor]:
        """Every input for the whole batch, in sample order: this replica's rows and the other
        replicas' (one message per input, micro-batch and peer, in that order)."""
        mine = self.spans[self.replica]
        peers = [k for k in range(len(self.last.ranks)) if k != self.replica]
        pieces: list[list[tuple[int, torch.Tensor]]] = []
        msgs: list[Message] = []
        for v, spec in enumerate(self.tail.inputs):
            have = [(mine[i][0], step.tail_in[i][v]) for i in range(self.plan.micro_batches)]
            pieces.append(have)
            if spec.batch_dim is None:
                continue  # a graph input without a batch dimension: every micro-batch's is it
            for i in range(self.plan.micro_batches):
                for k in peers:
                    a, b = self.spans[k][i]
                    peer = self.last.ranks[k]
                    label = f"tail input {spec.name!r} of micro-batch {i}"
                    msgs.append(Message("send", have[i][1].contiguous(), peer, label))
                    buf = torch.empty(spec.shape_for(b - a), dtype=dtype_of(spec),
                                      device=self.device)
                    msgs.append(Message("recv", buf, peer, label))
                    pieces[v].append((a, buf))
        post(msgs, self.groups).wait()
        out = []
        for spec, have in zip(self.tail.inputs, pieces, strict=True):
            if spec.batch_dim is None:
                out.append(have[0][1])
                continue
            parts = [t for _, t in sorted(have, key=lambda p: p[0])]
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, spec.batch_dim))
        return out

    def backward(self, step: Any, seeds: dict[int, torch.Tensor]) -> None:
        """The tail's backward from the gradients of its losses; this replica's rows of the
        inputs' gradients into ``step.tail_grads`` (micro-batch -> output position -> rows)."""
        xs, outs = step.tail
        step.tail = None
        tensors, grads = [], []
        for j, y in zip(self.tail.outputs, outs, strict=True):
            if j in seeds and isinstance(y, torch.Tensor) and y.requires_grad:
                tensors.append(y)
                grads.append(seeds[j])
        wanted = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        if self.replica == 0:
            wanted += self.params
        if tensors and wanted:
            torch.autograd.backward(tensors, grads, inputs=wanted)
        mine = self.spans[self.replica]
        for i, (a, b) in enumerate(mine):
            rows: dict[int, torch.Tensor] = {}
            for p, x, spec in zip(self.pos, xs, self.tail.inputs, strict=True):
                if spec.batch_dim is None or x.grad is None:
                    continue
                k = spec.shape[spec.batch_dim]
                rows[p] = x.grad.narrow(spec.batch_dim, a * k, (b - a) * k)
            step.tail_grads[i] = rows

    # -- every rank -------------------------------------------------------------------------------
    def send_rows(self, step: Any) -> None:
        """Each batched tail output's rows of a rank's samples to that rank; into
        ``step.results`` (GATHER, every rank, before ``Outputs.gather``)."""
        me = self.rank
        msgs: list[Message] = []
        for j in self.tail.outputs:
            spec = self.plan.outputs[j].spec
            if spec.batch_dim is None:
                continue
            label = f"model output {j} ({spec.name!r}, made on the whole batch)"
            if self.runs:
                y = step.tail_out[j]
                if self.replica in self.senders:
                    for dst in self.senders[self.replica]:
                        msgs.append(Message("send", self._rows(y, spec, dst), dst, label))
                step.results[j] = self._rows(y, spec, me).clone()
            else:
                whole = self.plan.global_batch
                buf = torch.empty(spec.shape_for(self.local, whole), dtype=dtype_of(spec),
                                  device=self.device)
                msgs.append(Message("recv", buf, self.receivers, label))
                step.results[j] = buf
        post(msgs, self.groups).wait()
        step.tail_out = {}

    def _rows(self, y: torch.Tensor, spec: ValueSpec, rank: int) -> torch.Tensor:
        a, b = routing.rank_span(self.plan, rank)
        k = spec.shape[spec.batch_dim or 0]
        return y.narrow(spec.batch_dim or 0, a * k, (b - a) * k).contiguous()


def tail_senders(plan: Plan, rank: int) -> tuple[dict[int, list[int]], int]:
    """Who sends the tail's batched outputs: ({replica of the last stage: the ranks outside
    the stage it sends to}, the replica's rank ``rank`` receives from (-1 inside the stage)).
    The j-th rank outside the stage gets them from replica j mod r, as the loss is sent."""
    last = plan.stages[-1]
    outside = [j for j in range(plan.world_size) if j not in last.ranks]
    senders: dict[int, list[int]] = {}
    source = -1
    for n, dst in enumerate(outside):
        k = n % len(last.ranks)
        senders.setdefault(k, []).append(dst)
        if dst == rank:
            source = last.ranks[k]
    return senders, source


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
