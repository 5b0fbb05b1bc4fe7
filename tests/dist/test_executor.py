"""StageExecutor on 1-4 forked gloo ranks against a deep-copied single-process reference.

Stage modules are made by hand (``symbolic_trace`` of small wrappers holding the model's own
submodules, under the model's attribute names) so the runtime is tested before the compiler
exists. Every rank checks the loss, its outputs, every local gradient and, after Adam steps,
every local parameter (rtol = atol = 1e-5).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.testing import assert_close

from rannc_fx.config import Config
from rannc_fx.plan import Plan
from rannc_fx.runtime import CommError, StageExecutor, init_distributed, routing
from rannc_fx.runtime import outputs as outputs_module
from rannc_fx.runtime.comm import all_reduce_flat
from rannc_fx.runtime.outputs import unbatched_peers
from rannc_fx.values import ValueSpec

from tests.dist_utils import make_plan, run_ranks, scalar, tensor

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 3  # samples per rank: odd, so micro-batches and replica slices come out uneven


# -- models, their hand-made stages, and their plans -------------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        return [F.cross_entropy(self.head(F.relu(self.b(F.relu(self.a(x))))), y)]


class _Whole(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.a, self.b, self.head = net.a, net.b, net.head

    def forward(self, x, y):
        return (F.cross_entropy(self.head(F.relu(self.b(F.relu(self.a(x))))), y),)


class _MlpBody(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.a, self.b = net.a, net.b

    def forward(self, x):
        return (F.relu(self.b(F.relu(self.a(x)))),)


class _MlpHead(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.head = net.head

    def forward(self, h, y):
        return (F.cross_entropy(self.head(h), y),)


class Skip(nn.Module):
    """A value from stage 0 read by stages 1 and 2 (a U-Net-style skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.head = (
            nn.Linear(6, 8),
            nn.Linear(8, 8),
            nn.Linear(8, 8),
            nn.Linear(8, 4),
        )

    def forward(self, x, y):
        skip = self.a(x)
        h0 = torch.tanh(self.b(skip))
        h1 = torch.tanh(self.c(h0 + skip))
        return [F.cross_entropy(self.head(h1 * skip), y)]


class _Skip0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a, self.b = net.a, net.b

    def forward(self, x):
        skip = self.a(x)
        return torch.tanh(self.b(skip)), skip


class _Skip1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.c = net.c

    def forward(self, h0, skip):
        return (torch.tanh(self.c(h0 + skip)),)


class _Skip2(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.head = net.head

    def forward(self, h1, skip, y):
        return (F.cross_entropy(self.head(h1 * skip), y),)


class TiedLM(nn.Module):
    """Embedding tied to the head, a position parameter crossing stages without a batch dim,
    and two outputs: the loss and the batched logits."""

    V, S, D = 11, 5, 8

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.V, self.D)
        self.pos = nn.Parameter(torch.randn(self.S, self.D) * 0.1)
        self.lin = nn.Linear(self.D, self.D)

    def forward(self, ids, labels):
        h = torch.tanh(self.lin(self.embed(ids) + self.pos))
        logits = F.linear(h, self.embed.weight)
        return [F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits]


class _Lm0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.embed, self.pos = net.embed, net.pos

    def forward(self, ids):
        return self.embed(ids), self.pos * 1.0


class _Lm1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.embed, self.lin = net.embed, net.lin

    def forward(self, e, p, labels):
        logits = F.linear(torch.tanh(self.lin(e + p)), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class _LmMid(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.lin = net.lin

    def forward(self, e, p):
        return (torch.tanh(self.lin(e + p)),)


class _LmHead(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.embed = net.embed

    def forward(self, h, labels):
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class Flat(nn.Module):
    """Cut values with S rows per sample (``flatten(0, 1)``), the batch on dim 1 (seq-first),
    and an integer (the sample count) that the consumer recomputes."""

    S = 4

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(3, 5), nn.Linear(self.S * 5, 4)

    def forward(self, x, y):
        h = F.relu(self.a(x))
        z = self.head(h.flatten(0, 1).view(x.shape[0], -1)) + h.transpose(0, 1).sum((0, 2))[:, None]
        return [F.cross_entropy(z, y)]


class _Flat0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a = net.a

    def forward(self, x):
        h = F.relu(self.a(x))
        return h.flatten(0, 1), h.transpose(0, 1), x.shape[0]


class _Flat1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.head = net.head

    def forward(self, rows, seq_first, n, y):
        z = self.head(rows.view(n, -1)) + seq_first.sum((0, 2))[:, None]
        return (F.cross_entropy(z, y),)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = (
            nn.Conv2d(2, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.Linear(4, 3),
        )

    def forward(self, x, y):
        h = F.relu(self.bn(self.conv(x)))
        return [F.cross_entropy(self.head(h.mean((2, 3))), y)]


class _Bn0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.conv, self.bn = net.conv, net.bn

    def forward(self, x):
        return (F.relu(self.bn(self.conv(x))),)


class _Bn1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.head = net.head

    def forward(self, h, y):
        return (F.cross_entropy(self.head(h.mean((2, 3))), y),)


class Aux(nn.Module):
    """Unbatched outputs on two stages: an auxiliary loss and an integer count (not averageable)
    from stage 0, the loss from stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        h = F.relu(self.a(x))
        loss = F.cross_entropy(self.head(F.relu(self.b(h))), y)
        return [loss, h.pow(2).mean(), (self.a.weight > 0).sum()]


class _Aux0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a = net.a

    def forward(self, x):
        h = F.relu(self.a(x))
        return h, h.pow(2).mean(), (self.a.weight > 0).sum()


class _Aux1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.b, self.head = net.b, net.head

    def forward(self, h, y):
        return (F.cross_entropy(self.head(F.relu(self.b(h))), y),)


@dataclass
class Case:
    net: Callable[[], nn.Module]
    stages: list[type[nn.Module]]
    values: dict[str, ValueSpec]
    inputs: list[str]
    io: list[tuple[list[str], list[str]]]
    outputs: list[str]
    data: Callable[[int, torch.Generator], list[torch.Tensor]]
    shared: list[tuple[str, list[int]]] = field(default_factory=list)
    # what the training loop calls backward on, from the model's outputs
    objective: Callable[[list[torch.Tensor]], torch.Tensor] = lambda out: out[0]

    def plan(
        self,
        global_batch: int,
        micro_batches: int,
        replicas: tuple[int, ...],
        *,
        schedule: str = "gpipe",
        recompute: tuple[bool, ...] | None = None,
    ) -> Plan:
        return make_plan(
            global_batch=global_batch,
            micro_batches=micro_batches,
            replicas=replicas,
            values=self.values,
            inputs=self.inputs,
            stage_io=self.io,
            outputs=self.outputs,
            shared=self.shared,
            schedule=schedule,
            recompute=recompute,
        )


def _xy(d_in, classes):
    def data(g: int, gen: torch.Generator) -> list[torch.Tensor]:
        return [
            torch.randn(g, *d_in, generator=gen),
            torch.randint(0, classes, (g,), generator=gen),
        ]

    return data


def _ids(g: int, gen: torch.Generator) -> list[torch.Tensor]:
    ids = torch.randint(0, TiedLM.V, (g, TiedLM.S), generator=gen)
    return [ids, torch.roll(ids, -1, dims=1)]


LM_VALUES = {
    "ids": tensor("ids", (1, TiedLM.S), dtype="int64"),
    "labels": tensor("labels", (1, TiedLM.S), dtype="int64"),
    "e": tensor("e", (1, TiedLM.S, TiedLM.D), requires_grad=True),
    "p": tensor("p", (TiedLM.S, TiedLM.D), batch_dim=None, requires_grad=True),
    "h": tensor("h", (1, TiedLM.S, TiedLM.D), requires_grad=True),
    "loss": scalar("loss"),
    "logits": tensor("logits", (1, TiedLM.S, TiedLM.V), requires_grad=True),
}

XY = {"x": tensor("x", (1, 6)), "y": tensor("y", (1,), dtype="int64"), "loss": scalar("loss")}
H8 = tensor("h", (1, 8), requires_grad=True)

CASES = {
    "mlp1": Case(MLP, [_Whole], XY, ["x", "y"], [(["x", "y"], ["loss"])], ["loss"], _xy((6,), 4)),
    "mlp2": Case(
        MLP,
        [_MlpBody, _MlpHead],
        {**XY, "h": H8},
        ["x", "y"],
        [(["x"], ["h"]), (["h", "y"], ["loss"])],
        ["loss"],
        _xy((6,), 4),
    ),
    "skip3": Case(
        Skip,
        [_Skip0, _Skip1, _Skip2],
        {
            **XY,
            "h0": H8.model_copy(update={"name": "h0"}),
            "h1": H8.model_copy(update={"name": "h1"}),
            "skip": H8.model_copy(update={"name": "skip"}),
        },
        ["x", "y"],
        [(["x"], ["h0", "skip"]), (["h0", "skip"], ["h1"]), (["h1", "skip", "y"], ["loss"])],
        ["loss"],
        _xy((6,), 4),
    ),
    "lm2": Case(
        TiedLM,
        [_Lm0, _Lm1],
        LM_VALUES,
        ["ids", "labels"],
        [(["ids"], ["e", "p"]), (["e", "p", "labels"], ["loss", "logits"])],
        ["loss", "logits"],
        _ids,
        shared=[("embed.weight", [0, 1])],
    ),
    "lm3": Case(
        TiedLM,
        [_Lm0, _LmMid, _LmHead],
        LM_VALUES,
        ["ids", "labels"],
        [(["ids"], ["e", "p"]), (["e", "p"], ["h"]), (["h", "labels"], ["loss", "logits"])],
        ["loss", "logits"],
        _ids,
        shared=[("embed.weight", [0, 2])],
    ),
    "flat2": Case(
        Flat,
        [_Flat0, _Flat1],
        {
            "x": tensor("x", (1, Flat.S, 3)),
            "y": tensor("y", (1,), dtype="int64"),
            "rows": tensor("rows", (Flat.S, 5), requires_grad=True),
            "seq_first": tensor("seq_first", (Flat.S, 1, 5), batch_dim=1, requires_grad=True),
            "n": ValueSpec(name="n", kind="int", int_coeffs=((1, 0),)),
            "loss": scalar("loss"),
        },
        ["x", "y"],
        [(["x"], ["rows", "seq_first", "n"]), (["rows", "seq_first", "n", "y"], ["loss"])],
        ["loss"],
        _xy((Flat.S, 3), 4),
    ),
    "aux2": Case(
        Aux,
        [_Aux0, _Aux1],
        {
            **XY,
            "h": H8,
            "aux": scalar("aux"),
            "n": tensor("n", (), dtype="int64", batch_dim=None),
        },
        ["x", "y"],
        [(["x"], ["h", "aux", "n"]), (["h", "y"], ["loss"])],
        ["loss", "aux", "n"],
        _xy((6,), 4),
        objective=lambda out: out[0] + 0.5 * out[1],
    ),
    "bn2": Case(
        BNNet,
        [_Bn0, _Bn1],
        {
            "x": tensor("x", (1, 2, 4, 4)),
            "y": tensor("y", (1,), dtype="int64"),
            "h": tensor("h", (1, 4, 4, 4), requires_grad=True),
            "loss": scalar("loss"),
        },
        ["x", "y"],
        [(["x"], ["h"]), (["h", "y"], ["loss"])],
        ["loss"],
        _xy((2, 4, 4), 3),
    ),
}


# -- the worker -----------------------------------------------------------------------------------


def _setup(
    rank: int, case: Case, plan: Plan, timeout_s: float = 10.0
) -> tuple[nn.Module, nn.Module, fx.GraphModule, StageExecutor]:
    torch.manual_seed(0)
    net = case.net()
    ref = copy.deepcopy(net)
    st = plan.stage_of_rank(rank)
    gm = fx.symbolic_trace(case.stages[st.index](net))
    for name, p in gm.named_parameters():
        assert p is net.get_parameter(name)  # the stage trains the model's own parameters
    return net, ref, gm, StageExecutor(plan, gm, timeout_s=timeout_s)


def _local(plan: Plan, rank: int, flat: list[torch.Tensor]) -> list[torch.Tensor]:
    lo, hi = routing.rank_span(plan, rank)
    return [
        t[lo:hi] if s.batch_dim is not None else t for t, s in zip(flat, plan.inputs, strict=True)
    ]


def _train(
    rank: int,
    world: int,
    name: str,
    replicas: tuple[int, ...],
    mbs: int,
    steps: int = 3,
    accumulate: int = 1,
    schedule: str = "gpipe",
    recompute: tuple[bool, ...] | None = None,
) -> list[list[Any]]:
    case = CASES[name]
    plan = case.plan(LOCAL * world, mbs, replicas, schedule=schedule, recompute=recompute)
    _, ref, gm, ex = _setup(rank, case, plan)
    params = list(gm.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    lo, hi = routing.rank_span(plan, rank)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            flat = case.data(plan.global_batch, torch.Generator().manual_seed(10 * step + micro))
            out = ex.forward(_local(plan, rank, flat))
            want = ref(*flat)
            assert len(out) == len(want)
            for j, (o, w) in enumerate(zip(out, want, strict=True)):
                spec = plan.outputs[j].spec
                assert_close(
                    o, w[lo:hi].detach() if spec.batch_dim is not None else w.detach(), **TOL
                )
            case.objective(out).backward()
            case.objective(want).backward()
            unbatched = [o for j, o in enumerate(out) if plan.outputs[j].spec.batch_dim is None]
            losses.append([o.tolist() for o in unbatched])
        for pname, p in gm.named_parameters():
            assert_close(
                p.grad,
                ref.get_parameter(pname).grad,
                **TOL,
                msg=lambda m, n=pname: f"grad {n}: {m}",
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for pname, p in gm.named_parameters():
            assert_close(
                p, ref.get_parameter(pname), **TOL, msg=lambda m, n=pname: f"param {n}: {m}"
            )
    return losses


def _same_everywhere(losses: list[list[list[Any]]]) -> None:
    """Every unbatched output (the loss) of every step is bitwise the same on every rank."""
    assert all(x == losses[0] for x in losses), losses


# -- tier 1: against the single-process reference ------------------------------------------------


@pytest.mark.parametrize("mbs", [1, 2, 3])
def test_one_rank(mbs):
    _same_everywhere(run_ranks(_train, 1, "mlp1", (1,), mbs))


@pytest.mark.parametrize(
    "replicas,mbs",
    [
        ((1, 1), 1),
        ((1, 1), 3),
        ((1, 1), 6),
        ((2, 1), 2),
        ((1, 2), 2),
        ((2, 1), 3),
        ((1, 2), 1),
        ((2, 2), 2),
        ((1, 3), 2),
        ((3, 1), 4),
    ],
)
def test_two_stages(replicas, mbs):
    _same_everywhere(run_ranks(_train, sum(replicas), "mlp2", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", [((2,), 1), ((2,), 3)])
def test_pure_data_parallel(replicas, mbs):
    _same_everywhere(run_ranks(_train, sum(replicas), "mlp1", replicas, mbs))


@pytest.mark.parametrize(
    "replicas,mbs", [((1, 1, 1), 2), ((1, 2, 1), 3), ((2, 1, 1), 2), ((1, 1, 2), 2)]
)
def test_skip_connection_to_two_later_stages(replicas, mbs):
    _same_everywhere(run_ranks(_train, sum(replicas), "skip3", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", [((1, 1), 2), ((2, 1), 2), ((1, 2), 3), ((2, 2), 3)])
def test_tied_embedding_and_batched_output(replicas, mbs):
    _same_everywhere(run_ranks(_train, sum(replicas), "lm2", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", [((1, 1, 1), 2), ((2, 1, 1), 3)])
def test_tied_embedding_in_first_and_last_of_three_stages(replicas, mbs):
    _same_everywhere(run_ranks(_train, sum(replicas), "lm3", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", [((1, 1), 2), ((2, 1), 3), ((1, 2), 2)])
def test_rows_per_sample_batch_dim_1_and_integer_cut(replicas, mbs):
    _same_everywhere(run_ranks(_train, sum(replicas), "flat2", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", [((2, 1), 2), ((1, 2), 3), ((2, 2), 3)])
def test_unbatched_outputs_of_two_stages(replicas, mbs):
    """Stage 0 returns an auxiliary loss and an integer count, stage 1 the loss: each stage's
    go to the other's ranks, so two ranks exchange them in both directions."""
    _same_everywhere(run_ranks(_train, sum(replicas), "aux2", replicas, mbs))


@pytest.mark.parametrize(
    "replicas,want",
    [
        ((1, 1), {0: ([], {1: 1}), 1: ([0], {})}),
        ((1, 2), {0: ([], {1: 1}), 1: ([0], {}), 2: ([], {})}),
        ((2, 2), {0: ([], {1: 2}), 1: ([], {1: 3}), 2: ([0], {}), 3: ([1], {})}),
        ((1, 3), {0: ([], {1: 1}), 1: ([0], {}), 2: ([], {}), 3: ([], {})}),
        ((3, 1), {0: ([], {1: 3}), 1: ([], {1: 3}), 2: ([], {1: 3}), 3: ([0, 1, 2], {})}),
        ((2,), {0: ([], {}), 1: ([], {})}),
    ],
)
def test_loss_goes_from_its_stage_to_every_other_rank_round_robin(replicas, want):
    plan = CASES["mlp2" if len(replicas) == 2 else "mlp1"].plan(12, 1, replicas)
    assert {r: unbatched_peers(plan, r) for r in range(plan.world_size)} == want


def test_unbatched_outputs_of_two_stages_go_both_ways():
    plan = CASES["aux2"].plan(12, 1, (2, 1))  # stage 0 (ranks 0, 1) owns aux and n
    got = {r: unbatched_peers(plan, r) for r in range(3)}
    assert got == {0: ([2], {1: 2}), 1: ([], {1: 2}), 2: ([0, 1], {0: 0})}


def _loss_collectives(rank: int, world: int, name: str, replicas: tuple[int, ...]) -> None:
    """No collective over every rank for the loss: only a stage with replicas all-reduces it,
    among them; its sends outlive the forward and are finished by the backward."""
    case = CASES[name]
    plan = case.plan(LOCAL * world, 2, replicas)
    _, ref, _, ex = _setup(rank, case, plan)
    calls: list[tuple[int, ...]] = []

    def spy(tensors, group, *, what, ranks=(), **kw):
        calls.append(tuple(ranks))
        return all_reduce_flat(tensors, group, what=what, ranks=ranks, **kw)

    outputs_module.all_reduce_flat = spy  # this forked worker's copy of the module
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(2))
    loss = ex.forward(_local(plan, rank, flat))[0]
    assert_close(loss, ref(*flat)[0], **TOL)
    st = plan.stage_of_rank(rank)
    owner = st.index == plan.outputs[0].stage
    assert calls == ([st.ranks] if owner and st.replicas > 1 else []), calls
    sends_loss = bool(unbatched_peers(plan, rank)[0])
    assert (ex.outputs.sent is not None) == sends_loss
    loss.backward()
    assert ex.outputs.sent is None


@pytest.mark.parametrize(
    "name,replicas", [("mlp2", (1, 1)), ("mlp2", (1, 2)), ("lm3", (1, 1, 2)), ("mlp1", (2,))]
)
def test_loss_needs_no_collective_over_every_rank(name, replicas):
    run_ranks(_loss_collectives, sum(replicas), name, replicas)


def test_gradient_accumulation_over_two_calls():
    _same_everywhere(run_ranks(_train, 3, "mlp2", (2, 1), 2, 2, 2))


def test_batchnorm_one_microbatch_is_exact():
    _same_everywhere(run_ranks(_train, 2, "bn2", (1, 1), 1))
    run_ranks(_bn_buffers, 2, (1, 1), 1)


@pytest.mark.parametrize("per_microbatch", [False, True])
@pytest.mark.parametrize("replicas,mbs", [((2, 1), 2), ((1, 1), 3)])
def test_batchnorm_buffers_with_microbatches(replicas, mbs, per_microbatch):
    run_ranks(_bn_buffers, sum(replicas), replicas, mbs, "gpipe", None, per_microbatch)


def _sliced_running_var(plan: Plan, ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What stage 0's running_var must be after one step: (1 - momentum) * 1 + momentum *
    sum over micro-batches and replicas of share * (the slice's unbiased variance)."""
    with torch.no_grad():
        h = ref.conv(x)
    acc = torch.zeros(h.shape[1])
    for i in range(plan.micro_batches):
        for k in range(plan.stages[0].replicas):
            a, b = routing.replica_span(plan, 0, k, i)
            acc += (b - a) / plan.global_batch * h[a:b].var(dim=(0, 2, 3), unbiased=True)
    m = ref.bn.momentum
    return (1 - m) * torch.ones_like(acc) + m * acc


def _bn_buffers(
    rank: int,
    world: int,
    replicas: tuple[int, ...],
    mbs: int,
    schedule: str = "gpipe",
    recompute: tuple[bool, ...] | None = None,
    per_microbatch: bool = False,
) -> None:
    """One update per step: from the whole mini-batch's mean and unbiased variance, as
    single-device training makes it (``batch_norm="step"``), or with the sample-weighted mean
    of the slices' statistics (``"micro-batch"``: running_mean is still exact); replicas hold
    equal buffers, and num_batches_tracked counts steps."""
    case = CASES["bn2"]
    plan = case.plan(LOCAL * world, mbs, replicas, schedule=schedule, recompute=recompute)
    if per_microbatch:
        plan = plan.model_copy(update={"batch_norm": "micro-batch"})
    net, ref, gm, ex = _setup(rank, case, plan)
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(0))
    ex.forward(_local(plan, rank, flat))[0].backward()
    ref(*flat)
    if plan.stage_of_rank(rank).index != 0:
        return
    assert net.bn.num_batches_tracked.item() == 1
    assert_close(net.bn.running_mean, ref.bn.running_mean, **TOL)
    exact = (mbs == 1 and replicas[0] == 1) or not per_microbatch
    if exact:
        assert_close(net.bn.running_var, ref.bn.running_var, **TOL)
    else:  # one update with the sample-weighted mean of the slices' unbiased variances
        assert_close(net.bn.running_var, _sliced_running_var(plan, ref, flat[0]), **TOL)
    group = ex.groups.stage[0]
    if group is not None:
        got = [torch.empty_like(net.bn.running_var) for _ in range(replicas[0])]
        torch.distributed.all_gather(got, net.bn.running_var, group=group)
        assert all(torch.equal(g, got[0]) for g in got)


# -- behaviour around the step ----------------------------------------------------------------------


def _protocol(rank: int, world: int) -> None:
    case = CASES["mlp2"]
    plan = case.plan(LOCAL * world, 2, (1, 1))
    _, ref, gm, ex = _setup(rank, case, plan)
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(1))
    local = _local(plan, rank, flat)
    with torch.no_grad():  # evaluation: the loss comes back, nothing is kept for backward
        loss = ex.forward(local)[0]
        assert_close(loss, ref(*flat)[0], **TOL)
    assert not loss.requires_grad and ex._saved is None
    stale = ex.forward(local)[0]
    fresh = ex.forward(local)[0]
    with pytest.raises(RuntimeError, match="once per forward"):
        stale.backward()
    fresh.backward()
    with pytest.raises(RuntimeError, match="once per forward"):
        fresh.backward()
    with pytest.raises(ValueError, match=r"expects \(3, 6\) on each rank"):
        ex.forward([flat[0], flat[1]])


def test_eval_and_misuse_errors():
    run_ranks(_protocol, 2)


def _silent_peer(rank: int, world: int) -> str:
    case = CASES["mlp2"]
    plan = case.plan(LOCAL * world, 1, (1, 1))
    _, _, _, ex = _setup(rank, case, plan, timeout_s=1.5)  # the runtime's own groups' timeout
    if rank == 0:
        time.sleep(3.0)  # never runs its stage: rank 1 waits for its cut value in vain
        return ""
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(1))
    with pytest.raises(CommError) as e:
        ex.forward(_local(plan, rank, flat))
    return str(e.value)


def test_timeout_names_the_peer_and_the_operation():
    msg = run_ranks(_silent_peer, 2, timeout_s=30)[1]
    # rank 1 waits first for the labels rank 0 holds, then for the cut value h
    assert "rank 1: recv of input 'y' of micro-batch 0 from rank 0 failed" in msg, msg
    assert "Timed out" in msg and "check its log" in msg


def test_plan_and_module_must_agree():
    plan = CASES["mlp1"].plan(LOCAL, 1, (1,))
    gm = fx.symbolic_trace(_MlpBody(MLP()))  # takes x only; the plan's stage takes x and y
    with pytest.raises(ValueError, match="takes 1 inputs but the plan lists 2"):
        StageExecutor(plan, gm)


def test_one_stage_runs_without_a_process_group():
    case = CASES["mlp1"]
    plan = case.plan(LOCAL, 2, (1,))
    torch.manual_seed(0)
    net = case.net()
    ex = StageExecutor(plan, fx.symbolic_trace(_Whole(net)))
    flat = case.data(LOCAL, torch.Generator().manual_seed(0))
    loss = ex.forward(flat)[0]
    assert_close(loss, net(*flat)[0], **TOL)
    loss.backward()
    assert net.a.weight.grad is not None


def _other_plan(rank: int, world: int) -> None:
    plan = CASES["mlp2"].plan(LOCAL * world, 1 + rank, (1, 1))  # micro-batches differ
    with pytest.raises(ValueError, match="holds a different plan"):
        _setup(rank, CASES["mlp2"], plan)


def test_ranks_must_hold_the_same_plan():
    run_ranks(_other_plan, 2)


def _from_torchrun_env(rank: int, world: int) -> list[float]:
    init_distributed(Config(timeout_s=5.0))
    assert torch.distributed.get_backend() == "gloo" and torch.distributed.get_rank() == rank
    a = torch.full((2,), float(rank + 1))
    b = torch.tensor([rank], dtype=torch.int64)
    ra, rb = all_reduce_flat([a, b], None, what="a test")
    assert rb.dtype == torch.int64 and int(rb) == sum(range(world))
    return ra.tolist()


def test_init_from_torchrun_environment_and_flat_all_reduce():
    assert run_ranks(_from_torchrun_env, 2, init=False) == [[3.0, 3.0]] * 2


def _alone(rank: int, world: int) -> int:
    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    init_distributed()
    return torch.distributed.get_world_size()


def test_init_without_torchrun_is_one_process():
    assert run_ranks(_alone, 1, init=False) == [1]
