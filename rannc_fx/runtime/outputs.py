"""Model outputs at ``GATHER``: batched ones home to the ranks whose samples they hold, the loss
(every output without a batch dimension) to every rank.

    batched output   the producing replicas send each owner rank its samples' rows
                     (``routing.output_transfers``), which it assembles for its local batch;
                     the rows a replica keeps (its own local batch's) go into that batch as
                     each micro-batch's forward ends (``home``): a micro-batch all of whose
                     rows stay is not held besides the local batch until ``GATHER``
    the loss         the stage that computes it sums its replicas' share-weighted parts (an
                     all-reduce among them, if several) and sends the sum to every rank
                     outside the stage, spread round robin over its replicas
                     (``unbatched_peers``); every other rank receives it

Between any two ranks the loss messages come after the batched outputs on both sides, so they
match in posting order like every other message (``p2p.post``). A sender returns without
waiting for its loss sends (the last stage's forward is the critical path); ``finish_sends``
completes them at the next forward or at the end of the backward. A one-stage plan all-reduces
the loss among its replicas, which are then every rank.

Loss arithmetic: replica k of the loss's stage sees n(i, k) samples of micro-batch i and
computes their loss l(i, k). With ``Plan.loss_reduction == "mean"`` (a mean over samples) the
step's loss is sum(n(i, k) / G * l(i, k)), the global-batch mean, and each slice's backward is
seeded with n(i, k) / G; with ``"sum"`` it is sum(l(i, k)), each backward seeded with 1: exact
for a sum, or for a loss the model already divides by a global count (transformers'
``num_items_in_batch``, a global token count). Every floating output without a batch
dimension combines that way.
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan.plan import OutputRef, Plan, Stage
from ..schedules.routing import RankRoutes, Transfer, spec_of
from .comm import Groups, all_reduce_flat
from .p2p import Message, Pending, post
from .pieces import assemble, dtype_of, interleave, ints_value, piece_shape, sample_major, take

__all__ = ["Outputs", "unbatched_peers"]


class Outputs:
    """This rank's part in returning the model's outputs (one object per executor)."""

    def __init__(
        self,
        plan: Plan,
        stage: Stage,
        rank: int,
        routes: RankRoutes,
        spans: list[tuple[int, int]],
        groups: Groups,
        device: torch.device,
        lane: tuple[int, ...] | None = None,
    ):
        """``lane``: every stage this rank runs (default ``stage`` alone); ``gather`` and
        ``share`` send all of theirs, ``accumulate`` and ``kept`` are ``stage``'s."""
        self.plan, self.stage, self.rank, self.routes = plan, stage, rank, routes
        self.lane = lane if lane is not None else (stage.index,)
        self.spans, self.groups, self.device = spans, groups, device
        self.local = plan.global_batch // plan.world_size
        self.out_pos = {name: p for p, name in enumerate(stage.outputs)}
        # the tail's outputs are the tail's to hand out (runtime/tail.py), but its losses are
        # summed over the stage's replicas and shared as the stage's own
        self.mine: list[OutputRef] = [
            r for r in plan.outputs if r.stage == stage.index and not plan.tail_output(r.index)
        ]
        self.ours = [r for r in plan.outputs if r.stage in self.lane and not plan.tail_output(r.index)]
        self.unbatched = [
            r for r in plan.outputs if r.spec.kind == "tensor" and r.spec.batch_dim is None
        ]
        # averaged over the batch: the floating ones (a loss); the others are micro-batch 0's
        self.averaged = {
            r.index
            for r in self.unbatched
            if dtype_of(r.spec).is_floating_point or dtype_of(r.spec).is_complex
        }
        self.dsts, self.srcs = unbatched_peers(plan, rank)
        # what each micro-batch slice's loss counts for: its share of the global batch, or 1
        self.weights = [
            1.0 if plan.loss_reduction == "sum" else (b - a) / plan.global_batch
            for a, b in spans
        ]
        self.sent: Pending | None = None  # sends of the last forward's loss, unfinished
        # this rank's rows of each (micro-batch, value) it keeps, and those it sends away
        self._kept_rows: dict[tuple[int, str], list[Transfer]] = {}
        self._sent_rows: set[tuple[int, str]] = set()
        for t in routes.outputs:
            if t.src == rank and t.local:
                self._kept_rows.setdefault((t.microbatch, t.value), []).append(t)
            elif t.src == rank:
                self._sent_rows.add((t.microbatch, t.value))

    @property
    def kept(self) -> set[int]:
        """Stage output positions that are model outputs (kept until ``GATHER``)."""
        return {self.out_pos[r.spec.name] for r in self.mine}

    def accumulate(self, i: int, outs: tuple[Any, ...], reduced: dict[int, torch.Tensor]) -> None:
        """Micro-batch ``i``'s outputs without a batch dimension into their share-weighted sums."""
        w = self.weights[i]
        for ref in self.mine:
            spec = ref.spec
            if spec.kind != "tensor" or spec.batch_dim is not None:
                continue
            v = outs[self.out_pos[spec.name]].detach()
            if ref.index in self.averaged:
                reduced[ref.index] = reduced[ref.index] + w * v if ref.index in reduced else w * v
            elif i == 0 and self.stage.ranks.index(self.rank) == 0:
                reduced[ref.index] = v.clone()  # not averageable: micro-batch 0's value

    def home(self, i: int, outs: dict[str, torch.Tensor], assembled: dict[int, torch.Tensor]
             ) -> dict[str, torch.Tensor]:
        """Micro-batch ``i``'s batched model outputs (detached, by name): the rows this rank
        keeps written into its local batch now (``assembled``: output index -> the local
        batch, sample-major where the output interleaves); what is left for ``gather``,
        the outputs some rows of which go to another rank."""
        left = {}
        for name, x in outs.items():
            homed = self._kept_rows.get((i, name))
            if homed is None:
                left[name] = x
                continue
            spec = spec_of(self.plan, homed[0])
            if spec.interleave is not None:
                a, b = self.spans[i]
                x = sample_major(x, spec, b - a)
            y = assembled.get(homed[0].slot)
            rows = homed[0].src_rows(spec)
            if y is None and len(homed) == 1 and homed[0].samples == self.local and (
                    rows == (0, x.shape[spec.batch_dim or 0])):
                assembled[homed[0].slot] = x  # the whole local batch as it is: no copy
                continue
            if y is None:
                y = assembled[homed[0].slot] = torch.empty(
                    spec.shape_for(self.local), dtype=dtype_of(spec), device=self.device)
            for t in homed:
                take(y, spec, t.dst_rows(spec)).copy_(take(x, spec, t.src_rows(spec)))
            if (i, name) in self._sent_rows:
                left[name] = outs[name]
        return left

    def gather(self, outputs: dict[int, dict[str, torch.Tensor]],
               assembled: dict[int, torch.Tensor]) -> dict[int, Any]:
        """Batched model outputs (``outputs[i][name]``, detached, of every stage this rank
        runs) to their owner ranks; the rows this rank kept are in ``assembled`` already
        (``home``).

        An interleaved output moves in sample-major order and is interleaved again for the
        local samples, as the model would have laid it out for the local batch alone.
        """
        me = self.rank
        layouts = {r.spec.name: r.spec for r in self.ours if r.spec.interleave is not None}
        regrouped: dict[tuple[int, str], torch.Tensor] = {}

        def source(t: Transfer) -> torch.Tensor:
            x = outputs[t.microbatch][t.value]
            if t.value not in layouts:
                return x
            key = (t.microbatch, t.value)
            if key not in regrouped:
                a, b = self.spans[t.microbatch]
                regrouped[key] = sample_major(x, layouts[t.value], b - a)
            return regrouped[key]

        msgs: list[Message] = []
        recv: dict[Transfer, torch.Tensor] = {}
        for t in self.routes.outputs:
            if t.local:
                continue
            spec = spec_of(self.plan, t)
            label = f"model output {t.value!r} of micro-batch {t.microbatch}"
            if t.src == me:
                piece = take(source(t), spec, t.src_rows(spec))
                msgs.append(Message("send", piece.contiguous(), t.dst, label))
            else:
                recv[t] = buf = torch.empty(
                    piece_shape(spec, t), dtype=dtype_of(spec), device=self.device
                )
                msgs.append(Message("recv", buf, t.src, label))
        post(msgs, self.groups).wait()
        results: dict[int, Any] = {}
        for ref in self.plan.outputs:
            spec = ref.spec
            if spec.kind != "tensor" or spec.batch_dim is None or self.plan.tail_output(ref.index):
                continue
            parts = [(t, recv[t]) for t in self.routes.outputs
                     if t.dst == me and t.slot == ref.index and not t.local]
            y = assembled.get(ref.index)
            if y is None:
                y = assemble(parts, spec, self.local, self.device)
            else:
                for t, piece in parts:
                    take(y, spec, t.dst_rows(spec)).copy_(piece)
            results[ref.index] = y if spec.interleave is None else interleave(y, spec, self.local)
        return results

    def share(self, reduced: dict[int, torch.Tensor], results: dict[int, Any]) -> Pending:
        """Every unbatched output to every rank; integer outputs computed here.

        This stage's own are summed over its replicas and sent to the ranks this rank serves;
        the sends are left running. The other stages' are received into ``results``: valid
        once the returned Pending is waited on. Posted after ``gather`` on every rank.
        """
        for ref in self.plan.outputs:
            spec = ref.spec
            if spec.kind in ("int", "ints"):
                results[ref.index] = ints_value(spec, self.local)
            elif spec.kind != "tensor":
                raise ValueError(f"model output {ref.index} is a {spec.kind}; return tensors")
        st = self.stage.index
        # stage by stage, in output order within each: as the receivers post them
        mine = sorted((r for r in self.unbatched if r.stage in self.lane),
                      key=lambda r: (r.stage, r.index))
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
                groups=self.groups,
            )
        results.update((r.index, v) for r, v in zip(mine, vals, strict=True))
        sends: list[Message] = []
        if self.dsts and vals:
            payload = [v.clone() for v in vals]  # the caller may change the returned ones
            for dst in self.dsts:
                for r, v in zip(mine, payload, strict=True):
                    sends.append(Message("send", v, dst, _unbatched_label(r)))
        recvs: list[Message] = []
        for s, src in self.srcs.items():
            for r in self.unbatched:
                if r.stage == s:
                    buf = torch.empty(r.spec.shape, dtype=dtype_of(r.spec), device=self.device)
                    results[r.index] = buf
                    recvs.append(Message("recv", buf, src, _unbatched_label(r)))
        if sends and recvs:
            # one batch, waited on before returning: NCCL could deadlock on two batches
            # that two ranks post in opposite order
            return post(sends + recvs, self.groups)
        self.sent = post(sends, self.groups) if sends else None
        return post(recvs, self.groups)

    def finish_sends(self) -> None:
        if self.sent is not None:
            sent, self.sent = self.sent, None
            sent.wait()


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
                if dst not in dsts:  # once: two stages of one lane may own some
                    dsts.append(dst)
            elif dst == rank:
                srcs[s] = src
    return dsts, srcs


def _unbatched_label(ref: OutputRef) -> str:
    return f"model output {ref.index} ({ref.spec.name!r}, without a batch dimension)"
