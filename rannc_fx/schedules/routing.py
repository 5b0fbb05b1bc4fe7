"""Sample-range arithmetic: which samples every rank holds and every tensor piece that moves.

Everything here is a pure function of the Plan, so every rank computes the same routes and
no rank ever asks another for shapes or offsets.

Samples are numbered 0..G-1 over the global batch, the concatenation of the ranks' local
batches (rank j holds [j*L, (j+1)*L), L = G / world_size). Micro-batch i is the i-th of
``micro_batches`` contiguous, as-even-as-possible spans; replica k of a stage with r replicas
takes the k-th of r as-even spans of it. G = 12 on 3 ranks, 2 micro-batches, stage 0 on
ranks 0 and 1, stage 1 on rank 2:

    local batches  rank 0: [0, 4)   rank 1: [4, 8)   rank 2: [8, 12)
    micro-batches  0: [0, 6)                         1: [6, 12)
    stage 0        rank 0: [0, 3)   rank 1: [3, 6)   rank 0: [6, 9)   rank 1: [9, 12)
    stage 1        rank 2: [0, 6)                    rank 2: [6, 12)

    micro-batch 0  graph input x   rank 0 keeps [0, 3), sends [3, 4) to rank 1;
                                   rank 1 keeps [4, 6)
                   cut value h     rank 2 gets [0, 3) from rank 0 and [3, 6) from rank 1
                   batched output  rank 2 sends [0, 4) to rank 0 and [4, 6) to rank 1

A value moves by span overlap (RaNNC's scatter/gather): each piece is the overlap of the span
the source holds and the span the destination needs, so every sample moves once. A tensor
whose ``batch_dim`` has k rows per sample (``view(B * seq, h)``) moves rows [a*k, b*k).

Transfers come in a canonical order (``input_transfers``, then per micro-batch
``cut_transfers``, then ``output_transfers``; in backward, ``grad_transfers`` per micro-batch,
last first); sender and receiver both post them in that order, so p2p messages match without
tags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from ..plan.plan import Plan
from ..plan.values import ValueSpec, needs_grad

__all__ = [
    "RankRoutes",
    "Span",
    "Transfer",
    "cut_transfers",
    "even_split",
    "grad_transfers",
    "input_transfers",
    "local_batch",
    "microbatch_spans",
    "needs_grad",
    "output_transfers",
    "rank_routes",
    "rank_span",
    "replica_span",
    "rows_per_sample",
    "share",
    "spec_of",
]

Span = tuple[int, int]  # [start, stop) in global sample numbers


class Transfer(NamedTuple):
    """One piece of one value moving from rank ``src`` to rank ``dst`` for one micro-batch.

    ``kind`` says what moves: a graph input to a stage replica, a cut value to a consumer
    replica (``"grad"``: its gradient going back), or a model output to the rank whose local
    batch holds the samples. ``slot`` is the graph input's or model output's index (the
    value's index among ``plan.cut_values`` for cuts). The piece is samples [start, stop) of
    the global batch; the source tensor starts at sample ``src_base``, the destination tensor
    at ``dst_base``. ``batched=False``: the whole value moves (it has no batch dimension).
    """

    kind: Literal["input", "cut", "grad", "output"]
    value: str
    slot: int
    microbatch: int
    src: int
    dst: int
    start: int
    stop: int
    src_base: int
    dst_base: int
    batched: bool = True
    stage: int = -1

    @property
    def local(self) -> bool:
        """Source and destination are the same rank: copy, never send (gloo refuses)."""
        return self.src == self.dst

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def src_rows(self, spec: ValueSpec) -> tuple[int, int]:
        """(first row, row count) of the piece along ``spec.batch_dim`` in the source tensor."""
        k = rows_per_sample(spec)
        return (self.start - self.src_base) * k, self.samples * k

    def dst_rows(self, spec: ValueSpec) -> tuple[int, int]:
        """(first row, row count) of the piece along ``spec.batch_dim`` in the destination."""
        k = rows_per_sample(spec)
        return (self.start - self.dst_base) * k, self.samples * k

    def reversed(self) -> Transfer:
        """The gradient of a cut piece, going back from consumer to producer."""
        return self._replace(
            kind="grad", src=self.dst, dst=self.src, src_base=self.dst_base, dst_base=self.src_base
        )


# -- spans -----------------------------------------------------------------------------------


def even_split(start: int, stop: int, parts: int) -> list[Span]:
    """[start, stop) cut into ``parts`` contiguous spans whose sizes differ by at most one."""
    n = stop - start
    base, extra = divmod(n, parts)
    out, a = [], start
    for p in range(parts):
        b = a + base + (1 if p < extra else 0)
        out.append((a, b))
        a = b
    return out


def local_batch(plan: Plan) -> int:
    """Samples each rank passes per step: the global batch over the world size."""
    if plan.global_batch % plan.world_size:
        raise ValueError(
            f"the plan's global batch of {plan.global_batch} samples does not split evenly over "
            f"{plan.world_size} ranks; make the plan for a global batch that is a multiple of "
            "the world size (every rank passes the same local batch size)"
        )
    return plan.global_batch // plan.world_size


def rank_span(plan: Plan, rank: int) -> Span:
    """The global samples rank ``rank`` passes as its local batch."""
    n = local_batch(plan)
    return rank * n, (rank + 1) * n


def microbatch_spans(global_batch: int, micro_batches: int) -> list[Span]:
    return even_split(0, global_batch, micro_batches)


def replica_span(plan: Plan, stage: int, replica: int, microbatch: int) -> Span:
    """The samples replica ``replica`` of ``stage`` handles in micro-batch ``microbatch``."""
    mb = microbatch_spans(plan.global_batch, plan.micro_batches)[microbatch]
    r = plan.stages[stage].replicas
    if mb[1] - mb[0] < r:
        raise ValueError(
            f"micro-batch {microbatch} holds {mb[1] - mb[0]} samples but stage {stage} has {r} "
            f"replicas, so one would get none; with a global batch of {plan.global_batch} use at "
            f"most {plan.global_batch // r} micro-batches (or fewer replicas on that stage)"
        )
    return even_split(mb[0], mb[1], r)[replica]


def share(plan: Plan, stage: int, replica: int, microbatch: int) -> float:
    """The fraction of the global batch one replica's micro-batch holds: its loss weight."""
    a, b = replica_span(plan, stage, replica, microbatch)
    return (b - a) / plan.global_batch


def rows_per_sample(spec: ValueSpec) -> int:
    if spec.batch_dim is None:
        raise ValueError(f"value {spec.name!r} has no batch dimension")
    return spec.shape[spec.batch_dim]


def _overlap(a: Span, b: Span) -> Span | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


# -- transfers -------------------------------------------------------------------------------


def input_transfers(plan: Plan) -> list[Transfer]:
    """Batched graph inputs, from the rank whose local batch holds them to each replica using them.

    Order: micro-batch, input, consumer stage, consumer replica, owner rank. Inputs without a
    batch dimension move nowhere: every rank passes them.
    """
    out: list[Transfer] = []
    owners = [rank_span(plan, j) for j in range(plan.world_size)]
    for i in range(plan.micro_batches):
        for slot, spec in enumerate(plan.inputs):
            if spec.kind != "tensor" or spec.batch_dim is None:
                continue
            for st in plan.stages:
                if spec.name not in st.inputs:
                    continue
                for k, rank in enumerate(st.ranks):
                    need = replica_span(plan, st.index, k, i)
                    for j, have in enumerate(owners):
                        ov = _overlap(have, need)
                        if ov:
                            out.append(
                                Transfer(
                                    "input", spec.name, slot, i, j, rank, *ov, have[0], need[0],
                                    stage=st.index,
                                )
                            )
    return out


def cut_transfers(plan: Plan, microbatch: int) -> list[Transfer]:
    """Cut values of one micro-batch, from producer replicas to consumer replicas.

    Order: cut value (plan order), consumer stage, consumer replica, producer replica. A
    batched value moves by span overlap; a value without a batch dimension goes whole to
    consumer replica k from producer replica ``k % r_producer`` (the same on every replica:
    one computed from the batch, such as a partial loss, never crosses a cut, see
    ``group_atomic._batch_bound``); integers move nowhere (each consumer computes them from
    its own sample count).
    """
    out: list[Transfer] = []
    for slot, cv in enumerate(plan.cut_values):
        spec = cv.spec
        if spec.kind in ("int", "ints"):
            continue
        if spec.kind != "tensor":
            raise ValueError(
                f"cut value {cv.name!r} is a {spec.kind}; the runtime moves tensors and "
                "recomputes integers, so the split pass must keep constants inside each stage"
            )
        prod = plan.stages[cv.producer]
        have = [replica_span(plan, prod.index, k, microbatch) for k in range(prod.replicas)]
        for c in cv.consumers:
            cons = plan.stages[c]
            for k2, dst in enumerate(cons.ranks):
                need = replica_span(plan, c, k2, microbatch)
                if spec.batch_dim is None:
                    k1 = k2 % prod.replicas
                    out.append(
                        Transfer(
                            "cut",
                            cv.name,
                            slot,
                            microbatch,
                            prod.ranks[k1],
                            dst,
                            need[0],
                            need[1],
                            have[k1][0],
                            need[0],
                            batched=False,
                            stage=c,
                        )
                    )
                    continue
                for k1, src in enumerate(prod.ranks):
                    ov = _overlap(have[k1], need)
                    if ov:
                        out.append(
                            Transfer(
                                "cut",
                                cv.name,
                                slot,
                                microbatch,
                                src,
                                dst,
                                *ov,
                                have[k1][0],
                                need[0],
                                stage=c,
                            )
                        )
    return out


def grad_transfers(plan: Plan, microbatch: int) -> list[Transfer]:
    """Gradients of one micro-batch's cut values: ``cut_transfers`` reversed, where one flows."""
    grads = {cv.name for cv in plan.cut_values if needs_grad(cv.spec)}
    return [t.reversed() for t in cut_transfers(plan, microbatch) if t.value in grads]


def output_transfers(plan: Plan) -> list[Transfer]:
    """Batched model outputs, from the producer replicas to the ranks whose samples they hold.

    Order: micro-batch, output, producer replica, owner rank. Outputs without a batch
    dimension (a mean loss) are summed within their stage and sent on by the executor
    (``executor.unbatched_peers``).
    """
    out: list[Transfer] = []
    owners = [rank_span(plan, j) for j in range(plan.world_size)]
    for i in range(plan.micro_batches):
        for ref in plan.outputs:
            spec = ref.spec
            if spec.kind != "tensor" or spec.batch_dim is None or plan.tail_output(ref.index):
                continue  # the tail sends its own (runtime/tail.py)
            st = plan.stages[ref.stage]
            for k, src in enumerate(st.ranks):
                have = replica_span(plan, st.index, k, i)
                for j, need in enumerate(owners):
                    ov = _overlap(have, need)
                    if ov:
                        out.append(
                            Transfer(
                                "output", spec.name, ref.index, i, src, j, *ov, have[0], need[0],
                                stage=st.index,
                            )
                        )
    return out


def spec_of(plan: Plan, t: Transfer) -> ValueSpec:
    """The ValueSpec of the value a transfer moves."""
    if t.kind == "input":
        return plan.inputs[t.slot]
    if t.kind == "output":
        return plan.outputs[t.slot].spec
    return plan.cut_values[t.slot].spec


@dataclass(frozen=True)
class RankRoutes:
    """Every transfer one rank takes part in, by phase and micro-batch, in canonical order.

    ``args[i][p]`` lists the pieces stage argument ``p`` of micro-batch ``i`` is assembled
    from (graph-input and cut-value transfers whose destination is this rank).
    """

    rank: int
    inputs: list[list[Transfer]]  # per micro-batch
    cuts: list[list[Transfer]]  # per micro-batch
    grads: list[list[Transfer]]  # per micro-batch
    outputs: list[Transfer]
    args: list[list[list[Transfer]]]


def rank_routes(plan: Plan, rank: int, stage: int | None = None) -> RankRoutes:
    """The transfers ``rank`` sends or receives, filtered from the canonical lists; with
    ``stage`` (a rank running several), the cut values and gradients of that stage only (the
    graph inputs and model outputs stay the rank's: it posts them once for all its stages)."""
    m = plan.micro_batches
    st = plan.stage_of_rank(rank) if stage is None else plan.stages[stage]
    producer = [cv.producer for cv in plan.cut_values]

    def mine(ts: list[Transfer]) -> list[Transfer]:
        return [t for t in ts if rank in (t.src, t.dst)]

    def ours(ts: list[Transfer], reader_sends: bool) -> list[Transfer]:
        """Of a stage's: ``reader_sends`` (gradients) the reader sends, the producer gets."""
        if stage is None:
            return mine(ts)
        out = []
        for t in ts:
            here, there = (t.stage, producer[t.slot]) if not reader_sends else (
                producer[t.slot], t.stage)
            if (t.dst == rank and here == stage) or (t.src == rank and there == stage):
                out.append(t)
        return out

    inputs = mine(input_transfers(plan))
    per_mb = [[t for t in inputs if t.microbatch == i] for i in range(m)]
    cuts = [ours(cut_transfers(plan, i), False) for i in range(m)]
    args = []
    for i in range(m):
        incoming = [t for t in per_mb[i] + cuts[i] if t.dst == rank and t.stage == st.index]
        args.append([[t for t in incoming if t.value == name] for name in st.inputs])
    return RankRoutes(
        rank=rank,
        inputs=per_mb,
        cuts=cuts,
        grads=[ours(grad_transfers(plan, i), True) for i in range(m)],
        outputs=mine(output_transfers(plan)),
        args=args,
    )
