"""1F1B and recomputation on forked gloo ranks against the single-process reference, and what
a call and ``loss.backward()`` each do when the whole step runs inside the call."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.testing import assert_close

from rannc_fx.runtime.interpret import Mode
from rannc_fx.schedules import routing
from rannc_fx.schedules.generators import Kind
from tests.dist_utils import SharedRanks
from tests.distributed.test_executor import _bn_buffers, _local, _same_everywhere, _setup, _train
from tests.executor_cases import CASES, H8, LOCAL, TOL, XY, Case, _xy

# every case below runs on ranks shared with the others of its world size (one launch each:
# the cases are small, start-up is most of their time)
SHARED = SharedRanks()
SCHEDULES = ["gpipe", "1f1b", "zbh1"]
TRAINED = [
    ("mlp1", (1,), 3, (True,)),
    ("mlp1", (2,), 2, (True,)),
    ("mlp2", (1, 1), 4, (False, False)),
    ("mlp2", (1, 1), 1, (False, False)),  # fill-drain: ZB-H1's own list, deferred
    ("mlp2", (1, 1), 4, (True, True)),
    ("mlp2", (2, 1), 3, (True, False)),
    ("mlp2", (1, 3), 2, (False, True)),
    ("skip3", (1, 1, 1), 5, (False, True, False)),
    ("skip3", (1, 2, 1), 3, (True, False, True)),
    ("lm2", (1, 1), 3, (True, True)),
    ("lm3", (1, 1, 1), 4, (False, True, True)),
    ("lm3", (2, 1, 1), 3, (True, False, False)),
    ("flat2", (1, 2), 3, (True, True)),
    ("aux2", (2, 1), 2, (True, False)),  # two losses: the backward stays deferred
]
ACCUMULATED = [(schedule, recompute) for schedule in ("1f1b", "zbh1")
               for recompute in ((False, False), (True, True))]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name,replicas,mbs,recompute", TRAINED)
def test_schedules_and_recomputation_train_like_one_process(
    schedule, name, replicas, mbs, recompute
):
    _same_everywhere(
        SHARED.result(_train, sum(replicas), name, replicas, mbs, 3, 1, schedule, recompute)
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
@pytest.mark.parametrize("recompute", [(False, False), (True, True)])
def test_gradient_accumulation_over_two_calls_in_the_call(schedule, recompute):
    _same_everywhere(SHARED.result(_train, 3, "mlp2", (2, 1), 3, 2, 2, schedule, recompute))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_batchnorm_recomputed_counts_one_update(schedule):
    """The recomputation must not update running statistics again (checkpoint would)."""
    _same_everywhere(SHARED.result(_train, 2, "bn2", (1, 1), 1, 3, 1, schedule, (True, True)))
    SHARED.result(_bn_buffers, 2, (1, 1), 1, schedule, (True, False))
    SHARED.result(_bn_buffers, 3, (2, 1), 3, schedule, (True, True))


# -- dropout: recomputation draws what the forward drew ------------------------------------------


class DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, y):
        h = F.dropout(F.relu(self.a(x)), 0.5, self.training)
        h = F.dropout(F.relu(self.b(h)), 0.3, self.training)
        return [F.cross_entropy(self.head(h), y)]


class _Drop0(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a, self.b = net.a, net.b

    def forward(self, x):
        h = F.dropout(F.relu(self.a(x)), 0.5, self.training)
        return (F.dropout(F.relu(self.b(h)), 0.3, self.training),)


class _Drop1(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.head = net.head

    def forward(self, h, y):
        return (F.cross_entropy(self.head(h), y),)


DROP = Case(DropMLP, [_Drop0, _Drop1], {**XY, "h": H8}, ["x", "y"],
            [(["x"], ["h"]), (["h", "y"], ["loss"])], ["loss"], _xy((6,), 4))


def _dropout_run(rank: int, world: int, schedule: str, recompute: tuple[bool, ...]) -> list[Any]:
    """Losses, gradients and parameters of 3 Adam steps on the same random streams."""
    plan = DROP.plan(LOCAL * world, 3, (1, 1), schedule=schedule, recompute=recompute)
    torch.manual_seed(0)
    net = DROP.net()
    gm = fx.symbolic_trace(DROP.stages[plan.stage_of_rank(rank).index](net))
    from rannc_fx.runtime import StageExecutor

    ex = StageExecutor(plan, gm, timeout_s=10.0)
    opt = torch.optim.Adam(gm.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # each rank's dropout stream, the same in every run
    out: list[Any] = []
    for step in range(3):
        flat = DROP.data(plan.global_batch, torch.Generator().manual_seed(step))
        loss = ex.forward(_local(plan, rank, flat))[0]
        loss.backward()
        out.append(loss.item())
        out.append([p.grad.tolist() for p in gm.parameters()])
        opt.step()
        opt.zero_grad()
    out.append([p.tolist() for p in gm.parameters()])
    out.append(torch.rand(3).tolist())  # the stream after: recomputation leaves it as it was
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_recomputed_with_the_same_masks(schedule):
    plain = SHARED.result(_dropout_run, 2, schedule, (False, False))
    again = SHARED.result(_dropout_run, 2, schedule, (True, True))
    assert plain == again  # bitwise: the same masks, the same stream afterwards


# -- the whole step in the call ------------------------------------------------------------------


def _call_semantics(rank: int, world: int, recompute: tuple[bool, ...]) -> None:
    case = CASES["lm3"]
    plan = case.plan(LOCAL * world, 4, (1, 1, 1), schedule="1f1b", recompute=recompute)
    net, ref, gm, ex = _setup(rank, case, plan)
    assert ex.mode() is Mode.CALL
    lo, hi = routing.rank_span(plan, rank)

    def data(seed):
        flat = case.data(plan.global_batch, torch.Generator().manual_seed(seed))
        return flat, _local(plan, rank, flat)

    # a validation loss with grad enabled and no backward leaves .grad untouched
    flat, local = data(0)
    loss, logits = ex.forward(local)
    assert_close(loss, ref(*flat)[0], **TOL)
    assert all(p.grad is None for p in gm.parameters())
    assert ex.grads.held_bytes > 0 or not list(gm.parameters())
    # (loss / 4) ** 2 + 3 * loss: any function of the loss, by the chain rule
    flat, local = data(1)
    loss, logits = ex.forward(local)
    assert ex.grads.held_bytes > 0 or not list(gm.parameters())  # the last call's: replaced
    want, want_logits = ref(*flat)
    assert_close(logits, want_logits[lo:hi].detach(), **TOL)
    ((loss / 4) ** 2 + 3 * loss).backward()
    ((want / 4) ** 2 + 3 * want).backward()
    assert ex.grads.held_bytes == 0
    # accumulation: a second call adds to .grad
    flat, local = data(2)
    ex.forward(local)[0].mul(0.5).backward()
    ref(*flat)[0].mul(0.5).backward()
    for name, p in gm.named_parameters():
        assert_close(p.grad, ref.get_parameter(name).grad, **TOL, msg=name)
    with pytest.raises(RuntimeError, match="once per forward"):
        loss.backward()  # an older step's loss
    # no gradients: no backward work at all, nothing held
    before = {n: p.grad.clone() for n, p in gm.named_parameters()}
    with torch.no_grad():
        assert ex.mode() is Mode.EVAL
        loss = ex.forward(data(3)[1])[0]
    assert not loss.requires_grad and ex.grads.held_bytes == 0 and ex._saved is None
    for n, p in gm.named_parameters():
        assert torch.equal(p.grad, before[n])
    # eval mode with grad enabled: the forwards only, backward when loss.backward() asks
    gm.eval()
    ref.eval()
    assert ex.mode() is Mode.DEFERRED
    flat, local = data(4)
    loss = ex.forward(local)[0]
    assert ex.grads.held_bytes == 0
    for n, p in gm.named_parameters():
        assert torch.equal(p.grad, before[n])
    loss.backward()
    ref(*flat)[0].backward()
    for name, p in gm.named_parameters():
        assert_close(p.grad, ref.get_parameter(name).grad, **TOL, msg=name)


@pytest.mark.parametrize("recompute", [(False, False, False), (True, False, True)])
def test_whole_step_in_the_call(recompute):
    SHARED.result(_call_semantics, 3, recompute)


def _peak_in_flight(rank: int, world: int, schedule: str, mbs: int) -> int:
    """The most micro-batches whose saved activations a stage held at once (counted by
    saved-tensor hooks on the stage's parameters' users)."""
    case = CASES["mlp2"]
    plan = case.plan(LOCAL * world * mbs, mbs, (1,) * world, schedule=schedule)
    net, ref, gm, ex = _setup(rank, copy.copy(case), plan)
    live: set[int] = set()
    peak = 0
    current = {"mb": -1}
    runner = ex.runner
    forward = runner.forward

    def spy(step, i):
        current["mb"] = i
        return forward(step, i)

    runner.forward = spy  # type: ignore[method-assign]
    ex._dispatch[ex.stage.index][Kind.F] = spy

    def pack(t):
        nonlocal peak
        live.add(current["mb"])
        peak = max(peak, len(live))
        return (current["mb"], t)

    def unpack(x):
        return x[1]

    backward = runner.backward

    def spy_b(step, i):
        backward(step, i)
        live.discard(i)

    ex._dispatch[ex.stage.index][Kind.B] = spy_b
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ex.forward(_local(plan, rank, flat))[0].backward()
    return peak


@pytest.mark.parametrize("schedule,want", [("gpipe", [4, 4]), ("1f1b", [2, 1])])
def test_micro_batches_in_flight_follow_the_schedule(schedule, want):
    assert SHARED.result(_peak_in_flight, 2, schedule, 4) == want


# the shared ranks' cases, all known before the first test asks for one
for _schedule in SCHEDULES:
    for _name, _replicas, _mbs, _recompute in TRAINED:
        SHARED.add(_train, sum(_replicas), _name, _replicas, _mbs, 3, 1, _schedule, _recompute)
for _schedule, _recompute in ACCUMULATED:
    SHARED.add(_train, 3, "mlp2", (2, 1), 3, 2, 2, _schedule, _recompute)
for _schedule in ("gpipe", "1f1b"):
    SHARED.add(_train, 2, "bn2", (1, 1), 1, 3, 1, _schedule, (True, True))
    SHARED.add(_bn_buffers, 2, (1, 1), 1, _schedule, (True, False))
    SHARED.add(_bn_buffers, 3, (2, 1), 3, _schedule, (True, True))
    for _recompute in ((False, False), (True, True)):
        SHARED.add(_dropout_run, 2, _schedule, _recompute)
    SHARED.add(_peak_in_flight, 2, _schedule, 4)
for _recompute in ((False, False, False), (True, False, True)):
    SHARED.add(_call_semantics, 3, _recompute)
