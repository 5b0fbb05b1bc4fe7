"""The one-rank, one-micro-batch fast path of StageExecutor, in this process (no group).

It must be indistinguishable from the general path (forced with the private ``_alone`` flag)
and from eager training: same outputs, gradients, parameters after Adam steps and BatchNorm
buffers, bitwise against eager; only ``loss.backward()`` is plain autograd (no bridge).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.testing import assert_close

from rannc_fx.runtime import AloneExecutor, StageExecutor, build_executor
from tests.dist_utils import tensor
from tests.executor_cases import CASES, LM_VALUES, TOL, XY, Aux, BNNet, Case, TiedLM, _ids, _xy

EXACT = dict(rtol=0.0, atol=0.0)


class _LmWhole(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.embed, self.pos, self.lin = net.embed, net.pos, net.lin

    def forward(self, ids, labels):
        logits = F.linear(torch.tanh(self.lin(self.embed(ids) + self.pos)), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class _BnWhole(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.conv, self.bn, self.head = net.conv, net.bn, net.head

    def forward(self, x, y):
        h = F.relu(self.bn(self.conv(x)))
        return (F.cross_entropy(self.head(h.mean((2, 3))), y),)


class _AuxWhole(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.a, self.b, self.head = net.a, net.b, net.head

    def forward(self, x, y):
        h = F.relu(self.a(x))
        loss = F.cross_entropy(self.head(F.relu(self.b(h))), y)
        return loss, h.pow(2).mean(), (self.a.weight > 0).sum()


ONE_STAGE = {
    "mlp1": CASES["mlp1"],
    "lm1": Case(
        TiedLM,
        [_LmWhole],
        LM_VALUES,
        ["ids", "labels"],
        [(["ids", "labels"], ["loss", "logits"])],
        ["loss", "logits"],
        _ids,
    ),
    "bn1": Case(
        BNNet,
        [_BnWhole],
        {**CASES["bn2"].values},
        ["x", "y"],
        [(["x", "y"], ["loss"])],
        ["loss"],
        _xy((2, 4, 4), 3),
    ),
    "aux1": Case(
        Aux,
        [_AuxWhole],
        {
            **XY,
            "aux": CASES["aux2"].values["aux"],
            "n": tensor("n", (), dtype="int64", batch_dim=None),
        },
        ["x", "y"],
        [(["x", "y"], ["loss", "aux", "n"])],
        ["loss", "aux", "n"],
        _xy((6,), 4),
        objective=CASES["aux2"].objective,
    ),
}
BATCH = 5


def _executor(case: Case, net: nn.Module, *, alone: bool) -> StageExecutor | AloneExecutor:
    plan, gm = case.plan(BATCH, 1, (1,)), fx.symbolic_trace(case.stages[0](net))
    # one rank, one micro-batch: the fast path is the default
    assert isinstance(build_executor(plan, gm), AloneExecutor)
    return AloneExecutor(plan, gm) if alone else StageExecutor(plan, gm)


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(net.named_parameters()), **dict(net.named_buffers())}


@pytest.mark.parametrize("name", sorted(ONE_STAGE))
def test_fast_path_equals_general_path_and_eager(name):
    case = ONE_STAGE[name]
    torch.manual_seed(0)
    eager = case.net()
    nets = {"fast": copy.deepcopy(eager), "general": copy.deepcopy(eager)}
    exs = {k: _executor(case, net, alone=k == "fast") for k, net in nets.items()}
    opts = {k: torch.optim.Adam(net.parameters(), lr=0.01) for k, net in nets.items()}
    eager_opt = torch.optim.Adam(eager.parameters(), lr=0.01)
    plan = exs["fast"].plan
    for step in range(3):
        flat = case.data(BATCH, torch.Generator().manual_seed(step))
        want = eager(*flat)
        case.objective(want).backward()
        for k, ex in exs.items():
            out = ex.forward(flat)
            bridged = type(out[0].grad_fn).__name__ == "BridgeBackward"
            assert bridged == (k == "general"), (k, out[0].grad_fn)
            for j, (o, w) in enumerate(zip(out, want, strict=True)):
                assert_close(o, w.detach(), **(EXACT if k == "fast" else TOL))
                if plan.outputs[j].spec.batch_dim is not None:
                    assert not o.requires_grad  # batched outputs come back detached, as always
            case.objective(out).backward()
        for k, net in nets.items():
            exact = EXACT if k == "fast" else TOL
            for pname, p in net.named_parameters():
                want_grad = eager.get_parameter(pname).grad
                assert_close(p.grad, want_grad, **exact, msg=f"{k} grad {pname} step {step}")
        for opt in (*opts.values(), eager_opt):
            opt.step()
            opt.zero_grad()
        for k, net in nets.items():
            exact = EXACT if k == "fast" else TOL
            for vname, v in _state(net).items():
                assert_close(v, _state(eager)[vname], **exact, msg=f"{k} {vname} step {step}")


def test_fast_path_in_eval_and_no_grad():
    case = ONE_STAGE["bn1"]
    torch.manual_seed(0)
    eager = case.net()
    net = copy.deepcopy(eager)
    ex = _executor(case, net, alone=True)
    flat = case.data(BATCH, torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = ex.forward(flat)[0]
        assert_close(loss, eager(*flat)[0], **EXACT)
    assert not loss.requires_grad
    assert_close(net.bn.running_mean, eager.bn.running_mean, **EXACT)  # train mode: updated
    net.eval(), eager.eval()
    before = net.bn.running_mean.clone()
    assert_close(ex.forward(flat)[0], eager(*flat)[0], **EXACT)
    assert torch.equal(net.bn.running_mean, before)


def test_fast_path_backward_twice_is_autograds_error():
    case = ONE_STAGE["mlp1"]
    torch.manual_seed(0)
    ex = _executor(case, case.net(), alone=True)
    loss = ex.forward(case.data(BATCH, torch.Generator().manual_seed(0)))[0]
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_fast_path_checks_the_inputs():
    case = ONE_STAGE["mlp1"]
    ex = _executor(case, case.net(), alone=True)
    x, y = case.data(BATCH, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"expects \(5, 6\)"):
        ex.forward([x[:4], y])
    with pytest.raises(ValueError, match="got 1 tensor inputs"):
        ex.forward([x])


def test_two_micro_batches_or_recomputation_take_the_general_path():
    case = ONE_STAGE["mlp1"]
    gm = fx.symbolic_trace(case.stages[0](case.net()))
    assert isinstance(build_executor(case.plan(BATCH, 2, (1,)), gm), StageExecutor)
    plan = case.plan(BATCH, 1, (1,), recompute=(True,))
    assert isinstance(build_executor(plan, gm), StageExecutor)
