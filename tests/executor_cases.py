"""The executor tests' models, their stages made by hand and their plans (``Case``): the
model's own submodules in small wrappers under the model's attribute names, traced with
``symbolic_trace``, so that the runtime is tested apart from the compiler
(``unit/test_executor.py``, ``unit/test_executor_alone.py``, ``distributed/test_executor*.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from rannc_fx.plan.plan import Plan
from rannc_fx.plan.values import ValueSpec
from tests.dist_utils import make_plan, scalar, tensor

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
