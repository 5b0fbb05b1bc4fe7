"""``model.eval()`` and ``model.train()`` on a compiled model, under either tracer: eval runs
the eval-mode function of the current weights and running statistics (dropout off, batch norm
on its running statistics, a stochastic-depth branch not taken), leaves the running statistics
alone, and training afterwards runs as before."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import rannc_fx
from tests.captures import COUNTED, PASSES
from tests.dist_utils import run_ranks
from tests.harness import LINK, test_config

LOCAL = 8  # samples per rank
TOL = dict(rtol=1e-5, atol=1e-6)


class DropPath(nn.Module):
    """Stochastic depth as vision models write it: a Python branch on ``self.training``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)
        self.path = DropPath(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.path(self.drop(F.relu(self.bn(self.fc(x)))))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.blocks(self.inp(x))), y)


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return 1 + torch.randn(LOCAL * world, 6, generator=g), torch.randint(
        0, 3, (LOCAL * world,), generator=g)


def _gathered(cm: Any, like: nn.Module) -> nn.Module | None:
    """The whole model as the compiled one holds it now (rank 0; None elsewhere)."""
    full, _ = rannc_fx.get_state_dict(cm, full=True)
    if not full:
        return None
    ref = copy.deepcopy(like)
    ref.load_state_dict(full)
    return ref


def _run(rank: int, world: int, tracer: str, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    blank = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    x, y = _data(0, world)
    config = test_config(**LINK, timeout_s=60.0, tracer=tracer,
                         **cfg)
    cm = rannc_fx.compile(model, opt, config, example_args=(x[mine], y[mine]))
    assert cm.plan.tracer == tracer
    for step in range(2):
        x, y = _data(step + 1, world)
        cm(x[mine], y[mine]).backward()
        opt.step()
        opt.zero_grad()
    x, y = _data(99, world)
    torch.manual_seed(7)
    with torch.no_grad():  # training mode without gradients: dropout and drop path drawn
        trained_mode = float(cm(x[mine], y[mine]))
    before = _gathered(cm, blank)

    cm.eval()
    with torch.no_grad():
        first, second = float(cm(x[mine], y[mine])), float(cm(x[mine], y[mine]))
    after = _gathered(cm, blank)
    out: dict[str, Any] = {"first": first, "second": second}
    if before is not None and after is not None:
        before.eval()
        with torch.no_grad():
            out["one_process"] = float(before(x, y))
        for (n, b), a in zip(before.named_buffers(), after.buffers(), strict=True):
            assert torch.equal(b, a), f"eval moved {n}"

    cm.train()
    torch.manual_seed(7)
    loss = cm(x[mine], y[mine])  # with gradients now: the same draws, the same loss
    out["trained_mode"], out["again"] = trained_mode, float(loss)
    loss.backward()
    opt.step()
    return out


def _check(results: list[dict[str, Any]]) -> None:
    r0 = results[0]
    assert "one_process" in r0
    for r in results:
        assert r["first"] == r["second"], r  # eval draws nothing
        assert_close(r["first"], r0["one_process"], **TOL)
        assert r["trained_mode"] != r["first"]  # training mode still draws
        assert_close(r["again"], r["trained_mode"], **TOL)


CASES = {
    "1x2": dict(replicas=(2,), micro_batches=2),
    "2x1-1f1b": dict(replicas=(1, 1), micro_batches=2, schedule="1f1b"),
    "2x2-gpipe": dict(replicas=(2, 2), micro_batches=4, schedule="gpipe"),
    "2x2-1f1b": dict(replicas=(2, 2), micro_batches=4, schedule="1f1b"),
    "2x2-zbh1": dict(replicas=(2, 2), micro_batches=4, schedule="zbh1"),
    "2-lanes-zbv": dict(replicas=(1, 1), micro_batches=4, schedule="zbv"),
}


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("case", list(CASES))
def test_eval_runs_the_eval_function_of_the_trained_model(tracer: str, case: str) -> None:
    cfg = CASES[case]
    world = sum(cfg["replicas"])  # type: ignore[arg-type]
    _check(run_ranks(_run, world, tracer, cfg, timeout_s=60.0, wall_s=240.0))


def _passes(rank: int, world: int, tracer: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``_run`` and the capture and inference passes the rank ran in it."""
    return {**_run(rank, world, tracer, cfg), "passes": list(PASSES)}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_rank_0_alone_captures_the_eval_graph_and_every_rank_runs_it(tracer: str) -> None:
    """The eval graph's capture, its values' shapes and dtypes are found on rank 0 (at the
    first eval call, as the planned graph's at the first call) and sent with the graph: the
    others evaluate and train on what it sent, as one process does."""
    cfg = dict(replicas=(1, 2), micro_batches=2, schedule="gpipe")
    results = run_ranks(_passes, 3, tracer, cfg, timeout_s=60.0, wall_s=240.0, patches=COUNTED)
    _check(results)
    assert results[0]["passes"] == ["capture", "shapes", "dtypes"] * 2  # train, then eval
    assert all(r["passes"] == [] for r in results[1:]), [r["passes"] for r in results]


def _run_hf(rank: int, world: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    from tests import hf_models

    if name == "resnet":
        model, _, kw = hf_models.resnet_example(batch=LOCAL * world, image=16)
    else:  # BERT with its dropouts on: nn.Dropout and the attention's dropout probability
        model, args, kw = hf_models.bert_example(batch=LOCAL * world, dropout=0.2)
        kw = {"input_ids": args[0], **kw}
    blank = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mine = {k: v[rank * LOCAL:(rank + 1) * LOCAL] for k, v in kw.items()}
    config = test_config(**LINK, timeout_s=60.0, **cfg)
    cm = rannc_fx.compile(model, opt, config, example_kwargs=mine)
    assert cm.plan.tracer == "export"
    for _step in range(2):
        cm(**mine).loss.backward()
        opt.step()
        opt.zero_grad()
    cm.eval()
    with torch.no_grad():
        first, second = float(cm(**mine).loss), float(cm(**mine).loss)
    out: dict[str, Any] = {"first": first, "second": second}
    ref = _gathered(cm, blank)
    if ref is not None:
        ref.eval()
        with torch.no_grad():
            out["one_process"] = float(ref(**kw).loss)
    return out


@pytest.mark.parametrize("name,cfg,world", [
    ("resnet", dict(replicas=(2, 1), micro_batches=2, schedule="gpipe"), 3),
    ("bert", dict(replicas=(1, 1), micro_batches=2, schedule="1f1b"), 2),
])
def test_eval_of_a_transformers_model_that_only_torch_export_captures(name, cfg, world):
    pytest.importorskip("transformers")
    results = run_ranks(_run_hf, world, name, cfg, timeout_s=60.0, wall_s=300.0)
    for r in results:
        assert r["first"] == r["second"], r
        assert_close(r["first"], results[0]["one_process"], **TOL)


def _modes_differ(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Net(depth=0)  # no batch norm: one sample a replica plans too
    x, y = _data(0, world)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    cm = rannc_fx.compile(model, None, test_config(**LINK, timeout_s=30.0, replicas=(2,),
                                                   tracer="fx"))
    with torch.no_grad():
        cm(x[mine], y[mine])
        cm.train(rank == 0)
        with pytest.raises(ValueError, match="in different modes") as e:
            cm(x[mine], y[mine])
    return str(e.value)


def test_ranks_in_different_modes_are_refused_on_every_rank() -> None:
    said = run_ranks(_modes_differ, 2, timeout_s=30.0, wall_s=120.0)
    assert all("rank 0: training, rank 1: eval" in s for s in said), said


class EvalBranches(Net):
    """A forward whose eval mode branches on a tensor's value: it cannot be captured."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.training and float(x.sum()) > 0:
            x = -x
        return super().forward(x, y)


def _eval_fails(rank: int, world: int, tracer: str) -> tuple[str, float]:
    torch.manual_seed(0)
    model = EvalBranches(depth=1)
    x, y = _data(0, world)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    cm = rannc_fx.compile(model, None, test_config(**LINK, timeout_s=30.0, replicas=(1, 1),
                                                   micro_batches=2, tracer=tracer))
    cm(x[mine], y[mine]).backward()
    cm.eval()
    with torch.no_grad(), pytest.raises(Exception) as e:
        cm(x[mine], y[mine])
    cm.train()
    return f"{type(e.value).__name__}: {e.value}", float(cm(x[mine], y[mine]))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_an_eval_graph_rank_0_cannot_capture_fails_the_call_on_every_rank(tracer: str) -> None:
    """Rank 0's capture error, raised on rank 0 and named on the others, which wait for its
    graph; the model trains on after it."""
    said = run_ranks(_eval_fails, 2, tracer, timeout_s=30.0, wall_s=120.0)
    assert "rank 0 could not capture the eval graph: " in said[1][0], said
    assert "CaptureError" in said[0][0] and said[0][0].split(": ", 1)[1] in said[1][0], said
    assert said[0][1] == said[1][1]
