"""Models whose nodes cannot run every micro-batch size plan around it: a training-mode
BatchNorm that sees one value per channel at one sample rules that size out for its stage
(``Profile.failures``, ``CostTable.excluded``, ``Plan.excluded_sizes`` and its notes), in the
search and at run time (``runtime/batches.rebatched``). Training such models on ranks:
``distributed/test_batchnorm_sizes.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import rannc_fx
from rannc_fx.plan.config import Config
from rannc_fx.plan.plan import ExcludedSize, Plan
from rannc_fx.planner.analyze import analyze
from rannc_fx.planner.driver import choose, run_search
from rannc_fx.runtime.batches import rebatched
from rannc_fx.search import NoFeasiblePlan
from rannc_fx.search.cost_model import sizes_run
from tests.dist_utils import make_plan, scalar, tensor
from tests.harness import test_config


class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d, ReLU layers: every BatchNorm sees one value per channel at one
    sample."""

    def __init__(self, d: int = 8, hidden: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        dims = [d] + [hidden] * depth
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.BatchNorm1d(b), nn.ReLU())
            for a, b in zip(dims, dims[1:], strict=False))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x), y)


def _data(name: str, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(samples, 8, generator=g), torch.randint(0, 4, (samples,), generator=g)
    return (torch.randn(samples, 3, 32, 32, generator=g),
            torch.randint(0, 10, (samples,), generator=g))


def _config(tracer: str, **kw: Any) -> Config:
    return test_config(timeout_s=60.0, tracer=tracer, **kw)


def _check_plan_keeps_off(plan: Plan) -> None:
    """No replica's micro-batch of a stage holds a size the stage never runs."""
    for x in plan.excluded_sizes:
        r = plan.stages[x.stage].replicas
        assert x.samples not in sizes_run(plan.global_batch, plan.micro_batches, r), (x, plan)


# -- planning (no processes) ----------------------------------------------------------------
@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("device", [None, "cpu"])  # measured (a run), analytic (formulas)
def test_a_batchnorm_mlp_plans_around_one_sample(tracer, device):
    torch.manual_seed(0)
    x, y = _data("mlp", 64, 0)
    a = analyze(BatchNormMLP(), (x, y), world_size=2, device=device, config=_config(tracer))
    assert a.cost_model == ("measured" if device is None else "analytic")
    failed = {(f.node, f.samples) for f in a.profile.failures}
    assert failed and {q for _, q in failed} == {1}, failed  # every BatchNorm, at 1 only
    assert all("Expected more than 1 value per channel" in f.error for f in a.profile.failures)
    assert 2 in a.profile.batch_sizes  # next to the failure: profiled, not interpolated
    where = a.blocks.block_of()
    assert set(a.table.excluded[1]) == {where[n] for n, _ in failed}

    plan = choose(a, run_search(a.table, a.space))
    assert plan.excluded_sizes and {e.samples for e in plan.excluded_sizes} == {1}
    assert all(n in {f for f, _ in failed} for e in plan.excluded_sizes for n in e.nodes)
    _check_plan_keeps_off(plan)
    assert plan.notes and "never runs 1 sample(s)" in plan.summary()
    assert Plan.from_json(plan.to_json()) == plan


def test_forced_micro_batches_keep_every_stage_off_the_size_it_cannot_run():
    torch.manual_seed(0)
    x, y = _data("mlp", 32, 0)
    # 16 micro-batches: one sample a replica on 2 replicas, two on one; only the latter run
    plan = rannc_fx.partition(BatchNormMLP(), (x, y), world_size=2,
                              config=_config("fx", micro_batches=16)).plan
    assert all(st.replicas == 1 for st in plan.stages) and plan.micro_batches == 16
    _check_plan_keeps_off(plan)
    # 3 samples on 2 replicas: 2 and 1, whatever the micro-batch count; no plan is left
    x, y = _data("mlp", 3, 0)
    with pytest.raises(NoFeasiblePlan, match=r"(?s)cannot run.*raised at 1 sample\(s\): "
                                             r"ValueError: Expected more than 1 value"):
        rannc_fx.partition(BatchNormMLP(), (x, y), world_size=2,
                           config=_config("fx", replicas=(2,)))
    # 32 micro-batches of 32 samples: one sample whatever the plan, the only size profiled
    x, y = _data("mlp", 32, 0)
    with pytest.raises(RuntimeError, match=r"failed at every size profiled \(1 sample\(s\)\)"
                                           r".*Expected more than 1 value per channel"):
        rannc_fx.partition(BatchNormMLP(), (x, y), world_size=2,
                           config=_config("fx", micro_batches=32))


class _Picky(nn.Module):
    """Runs on the shape pass's fake tensors, raises on real ones below 64 samples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, FakeTensor) and x.shape[0] < 64:
            raise RuntimeError("needs 64 samples or more")
        return 2 * x


class _PickyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.picky, self.b = nn.Linear(8, 8), _Picky(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(self.picky(self.a(x))), y)


def test_a_node_that_raises_at_every_size_fails_planning_with_its_error():
    x, y = _data("mlp", 16, 0)
    with pytest.raises(RuntimeError, match=r"node 'picky' .*failed at every size profiled .*"
                                           r"needs 64 samples or more"):
        rannc_fx.partition(_PickyModel(), (x, y), world_size=2,
                           config=_config("fx", leaf_modules=("_Picky",)))


# -- a smaller batch at run time ------------------------------------------------------------
def _one_stage(replicas: int, micro_batches: int, excluded: int | None) -> Plan:
    values = {"x": tensor("x", (4,)), "loss": scalar("loss")}
    plan = make_plan(global_batch=64, micro_batches=micro_batches, replicas=[replicas],
                     values=values, inputs=["x"], stage_io=[(["x"], ["loss"])],
                     outputs=["loss"])
    if excluded is None:
        return plan
    return plan.model_copy(update={"excluded_sizes": (ExcludedSize(
        stage=0, samples=excluded, nodes=("bn",), error="ValueError: Expected more than 1 "
        "value per channel when training"),)})


def test_a_smaller_batch_runs_fewer_micro_batches_rather_than_a_size_its_stage_cannot_run():
    # 10 samples on 2 replicas: 5 micro-batches of 2 would give each replica 1
    assert rebatched(_one_stage(2, 8, None), 10).micro_batches == 5
    got = rebatched(_one_stage(2, 8, 1), 10)
    assert got.micro_batches == 2  # 4: 3, 3, 2, 2 samples, 1 on a replica; 3: 4, 3, 3
    _check_plan_keeps_off(got)
    assert rebatched(_one_stage(2, 8, 1), 32).micro_batches == 8  # 2 a replica: as planned
    assert rebatched(_one_stage(2, 8, 1), 16).micro_batches == 4  # 8 would give them 1
    with pytest.raises(ValueError, match=r"micro-batches of 1 sample\(s\).*node bn.*drop_last"):
        rebatched(_one_stage(2, 8, 1), 3)  # 2 and 1 on the replicas, whatever m
