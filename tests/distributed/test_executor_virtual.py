"""Several stages a rank (interleaved 1F1B, ZBV) on forked gloo ranks against one process:
losses, every gradient every step and every parameter after Adam steps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.testing import assert_close

from rannc_fx.plan.plan import Plan, lane_layout
from rannc_fx.runtime import StageExecutor
from rannc_fx.runtime.lane import LaneModules
from rannc_fx.schedules import routing
from tests.dist_utils import SharedRanks, make_plan, scalar
from tests.distributed.test_executor import _same_everywhere
from tests.executor_cases import H8, LOCAL, TOL, XY, TiedLM, _ids, _Lm0, _LmHead, _xy
from tests.executor_cases import LM_VALUES as LM


class Deep(nn.Module):
    """Four stages' worth of layers; a skip from the first to the third stage (on one rank
    under interleaving: copied, not sent) and dropout (recomputation must redraw it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, y):
        h0 = torch.relu(self.a(x))
        h1 = torch.tanh(self.b(h0))
        h2 = torch.relu(self.c(h1) + h0)
        return [F.cross_entropy(self.head(h2), y)]


class _D0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a = net.a

    def forward(self, x):
        h0 = torch.relu(self.a(x))
        return h0, h0 * 1.0


class _D1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.b = net.b

    def forward(self, h0):
        return (torch.tanh(self.b(h0)),)


class _D2(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.c = net.c

    def forward(self, h1, skip):
        return (torch.relu(self.c(h1) + skip),)


class _D3(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.head = net.head

    def forward(self, h2, y):
        return (F.cross_entropy(self.head(h2), y),)


class TiedLM4(TiedLM):
    """``TiedLM`` with a second layer: four stages, the embedding tied to the head (stage 0
    and stage 3: one rank under ZBV, two under interleaving)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin2 = nn.Linear(self.D, self.D)

    def forward(self, ids, labels):
        h = torch.tanh(self.lin(self.embed(ids) + self.pos))
        h = torch.tanh(self.lin2(h))
        logits = F.linear(h, self.embed.weight)
        return [F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits]


class _L1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.lin = net.lin

    def forward(self, e, p):
        return (torch.tanh(self.lin(e + p)),)


class _L2(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.lin2 = net.lin2

    def forward(self, h):
        return (torch.tanh(self.lin2(h)),)


class Fan(nn.Module):
    """One value read by two stages of one lane and another by one of them (an encoder's
    output read by every decoder stage): the sender posts them stage by stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)
        self.c, self.d, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        enc, side = torch.tanh(self.a(x)), torch.relu(self.b(x))
        h = torch.tanh(self.c(enc + side))
        h = torch.relu(self.d(h))
        return [F.cross_entropy(self.head(h + enc), y)]


class _F0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a, self.b = net.a, net.b

    def forward(self, x):
        return torch.tanh(self.a(x)), torch.relu(self.b(x))


class _F1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.c = net.c

    def forward(self, enc, side):
        return (torch.tanh(self.c(enc + side)),)


class _F2(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.d = net.d

    def forward(self, h1):
        return (torch.relu(self.d(h1)),)


class _F3(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.head = net.head

    def forward(self, h2, enc, y):
        return (F.cross_entropy(self.head(h2 + enc), y),)


class Aux(Deep):
    """``Deep`` with an auxiliary loss from its second stage and a batched output (the
    features) from its third: three stages hold model outputs, two of them on one lane under
    interleaving; two losses keep the backward deferred (GPipe over the lanes)."""

    def forward(self, x, y):
        h0 = torch.relu(self.a(x))
        h1 = torch.tanh(self.b(h0))
        h2 = torch.relu(self.c(h1) + h0)
        return [F.cross_entropy(self.head(h2), y), h1.pow(2).mean(), h2]


class _A1(_D1):
    def forward(self, h0):
        h1 = torch.tanh(self.b(h0))
        return h1, h1.pow(2).mean()


class _A2(_D2):
    def forward(self, h1, skip):
        h2 = torch.relu(self.c(h1) + skip)
        return h2, h2.detach() * 1.0


H = {name: H8.model_copy(update={"name": name})
     for name in ("h0", "skip", "h1", "h2", "enc", "side", "feat")}
G = LM["h"]
CASES: dict[str, Any] = {
    "deep4": dict(
        net=Deep, stages=[_D0, _D1, _D2, _D3], values={**XY, **H}, inputs=["x", "y"],
        io=[(["x"], ["h0", "skip"]), (["h0"], ["h1"]), (["h1", "skip"], ["h2"]),
            (["h2", "y"], ["loss"])],
        outputs=["loss"], data=_xy((6,), 4), shared=[],
    ),
    "fan4": dict(
        net=Fan, stages=[_F0, _F1, _F2, _F3], values={**XY, **H}, inputs=["x", "y"],
        io=[(["x"], ["enc", "side"]), (["enc", "side"], ["h1"]), (["h1"], ["h2"]),
            (["h2", "enc", "y"], ["loss"])],
        outputs=["loss"], data=_xy((6,), 4), shared=[],
    ),
    "aux4": dict(
        net=Aux, stages=[_D0, _A1, _A2, _D3],
        values={**XY, **H, "aux": scalar("aux"),
                "feat": H8.model_copy(update={"name": "feat", "requires_grad": False})},
        inputs=["x", "y"],
        io=[(["x"], ["h0", "skip"]), (["h0"], ["h1", "aux"]), (["h1", "skip"], ["h2", "feat"]),
            (["h2", "y"], ["loss"])],
        outputs=["loss", "aux", "feat"], data=_xy((6,), 4), shared=[],
        objective=lambda out: out[0] + 0.5 * out[1],
    ),
    "lm4": dict(
        net=TiedLM4, stages=[_Lm0, _L1, _L2, _LmHead],
        values={**LM, "g": G.model_copy(update={"name": "g"})}, inputs=["ids", "labels"],
        io=[(["ids"], ["e", "p"]), (["e", "p"], ["g"]), (["g"], ["h"]),
            (["h", "labels"], ["loss", "logits"])],
        outputs=["loss", "logits"], data=_ids, shared=[("embed.weight", [0, 3])],
    ),
}


def _plan(name: str, world_batch: int, mbs: int, replicas: tuple[int, ...], schedule: str,
          virtual: int, recompute: tuple[bool, ...]) -> Plan:
    c = CASES[name]
    return make_plan(global_batch=world_batch, micro_batches=mbs, replicas=replicas,
                     values=c["values"], inputs=c["inputs"], stage_io=c["io"],
                     outputs=c["outputs"], shared=c["shared"], schedule=schedule,
                     recompute=recompute, virtual_stages=virtual)


def _train(rank: int, world: int, name: str, replicas: tuple[int, ...], mbs: int,
           schedule: str, virtual: int, recompute: tuple[bool, ...],
           steps: int = 3) -> list[list[Any]]:
    c = CASES[name]
    # LOCAL samples a rank, or as many as the micro-batches and replicas need
    per_rank = max(LOCAL, -(-mbs * max(replicas) // world))
    plan = _plan(name, per_rank * world, mbs, replicas, schedule, virtual, recompute)
    torch.manual_seed(0)
    net = c["net"]()
    ref = copy.deepcopy(net)
    mine = [st.index for st in plan.stages_of_rank(rank)]
    gms = {s: fx.symbolic_trace(c["stages"][s](net)) for s in mine}
    module = LaneModules(gms) if len(mine) > 1 else gms[mine[0]]
    ex = StageExecutor(plan, module, timeout_s=10.0)
    # the model's own parameters, once each, under their names in the model
    named = {n: p for gm in gms.values() for n, p in gm.named_parameters()}
    params = list({id(p): p for p in named.values()}.values())
    opt = torch.optim.Adam(params, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    lo, hi = routing.rank_span(plan, rank)
    losses = []
    for step in range(steps):
        flat = c["data"](plan.global_batch, torch.Generator().manual_seed(10 * step))
        local = [t[lo:hi] if s.batch_dim is not None else t
                 for t, s in zip(flat, plan.inputs, strict=True)]
        out = ex.forward(local)
        want = ref(*flat)
        for j, (o, w) in enumerate(zip(out, want, strict=True)):
            batched = plan.outputs[j].spec.batch_dim is not None
            assert_close(o, w[lo:hi].detach() if batched else w.detach(), **TOL)
        objective = c.get("objective", lambda o: o[0])
        objective(out).backward()
        objective(want).backward()
        losses.append([out[0].tolist()])
        for pname, p in named.items():
            assert_close(p.grad, ref.get_parameter(pname).grad, **TOL,
                         msg=lambda m, n=pname, k=step: f"step {k} grad {n}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for pname, p in named.items():
            assert_close(p, ref.get_parameter(pname), **TOL,
                         msg=lambda m, n=pname, k=step: f"step {k} param {n}: {m}")
    return losses


# every case runs on ranks shared with the others of its world size (one launch each: the
# cases are small, start-up is most of their time)
SHARED = SharedRanks()
SCHEDULES = [("interleaved", 2), ("zbv", 2)]
NAMES = ["deep4", "lm4", "fan4", "aux4"]
LANES = [
    ((1, 1), 2, (False,) * 4),
    ((1, 1), 4, (True, False, True, False)),
    ((1, 1), 1, (False,) * 4),
    ((2, 1), 4, (False, True, False, True)),
    ((2, 2), 3, (True, True, True, True)),
    ((1, 1), 6, (False, False, True, False)),  # every sample its own micro-batch
    ((2, 1), 8, (True, False, False, False)),
]


def _case(name: str, schedule: str, virtual: int, lanes: tuple[int, ...], mbs: int,
          recompute: tuple[bool, ...]) -> tuple[Any, ...]:
    """``_train``'s world size and arguments: each stage gets its lane's replica count."""
    layout = lane_layout(schedule, 4, virtual)
    replicas = tuple(lanes[next(k for k, held in enumerate(layout) if s in held)]
                     for s in range(4))
    return sum(lanes), name, replicas, mbs, schedule, virtual, recompute


@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lanes,mbs,recompute", LANES)
def test_several_stages_a_rank_train_like_one_process(name, schedule, virtual, lanes, mbs,
                                                      recompute):
    """``lanes``: the replica count of each lane's stages."""
    _same_everywhere(SHARED.result(_train, *_case(name, schedule, virtual, lanes, mbs,
                                                  recompute)))


# the shared ranks' cases, all known before the first test asks for one
for _schedule, _virtual in SCHEDULES:
    for _name in NAMES:
        for _lanes, _mbs, _recompute in LANES:
            SHARED.add(_train, *_case(_name, _schedule, _virtual, _lanes, _mbs, _recompute))
