"""Selective recomputation (``rannc_fx.plan.selective``) on ranks: a stage that recomputes
selectively trains as one process does (dropout masks and BatchNorm statistics included).
In one process: ``unit/test_recompute_selective.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import rannc_fx
from rannc_fx.plan import selective
from rannc_fx.plan.config import Config
from rannc_fx.plan.plan import Plan
from tests.dist_utils import run_ranks
from tests.gpt_training import (
    GLOBAL,
    STEPS,
    TOL,
    adam,
    assert_bitwise_alike,
    from_bytes,
    local,
    step,
    to_bytes,
    train_gpt,
    train_like_one_process,
)
from tests.harness import test_config
from tests.unit.test_recompute_selective import _gpt_plan


def _without_recompute(plan: Plan) -> Plan:
    return plan.model_copy(update={"stages": tuple(
        st.model_copy(update={"selective": False, "again_ms": 0.0}) for st in plan.stages)})


def _counting_policy() -> list[int]:
    """Count the ops the selective policy is asked about (in the forwards it checkpoints; in
    this process: call it in the worker)."""
    calls: list[int] = []
    original = selective.policy

    def counted(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(ctx, func, *args, **kwargs)

    selective.policy = counted  # type: ignore[assignment]  # a forked worker's own copy
    return calls


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_selective_recomputation_trains_like_one_process(schedule):
    plan = _gpt_plan(schedule)
    assert all(st.selective for st in plan.stages) and len(plan.stages) == (
        4 if schedule == "interleaved" else 2), plan.summary()
    counted = train_like_one_process(plan, _counting_policy)
    assert all(calls > 0 for calls in counted)  # the forwards ran under the policy


def test_selective_recomputation_replays_the_dropout_masks():
    """Bitwise the training without recomputation: the rerun dropout draws F's masks."""
    plan = _gpt_plan("1f1b", dropout=0.1)
    got = run_ranks(train_gpt, 2, plan, 0.1, 100, _counting_policy, timeout_s=30.0,
                    wall_s=120.0)
    plain = run_ranks(train_gpt, 2, _without_recompute(plan), 0.1, 100,
                      _counting_policy, timeout_s=30.0, wall_s=120.0)
    assert_bitwise_alike(got, plain)


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1),
                                                    nn.BatchNorm2d(4), nn.ReLU())
                                      for _ in range(4)])
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.blocks(x).flatten(1)), y)


def _convnet() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _ConvNet(), (torch.randn(GLOBAL, 4, 8, 8, generator=g),
                        torch.randint(0, 3, (GLOBAL,), generator=g))


def _train_convnet(rank: int, world: int, plan: Plan) -> tuple[list[float], bytes]:
    model, args = _convnet()
    opt = adam(model)
    largs, _ = local(rank, args, {})
    cm = rannc_fx.compile(model, opt, Config(timeout_s=30.0, batch_norm=plan.batch_norm), plan=plan,
                          example_args=largs)
    losses = [step(cm, opt, largs, {}) for _ in range(STEPS)]
    state = {n: t.detach() for gm in cm.stages
             for n, t in [*gm.named_parameters(), *gm.named_buffers()]}
    return losses, to_bytes(state)


@pytest.mark.parametrize("batch_norm", ["step", "micro-batch"])
def test_batchnorm_statistics_are_counted_once(batch_norm):
    """The convolutions kept, BatchNorm rerun in the backward: the statistics are those of
    the same plan without recomputation (the rerun inside the stage's buffer scope)."""
    model, args = _convnet()
    cfg = test_config(recompute=True,
                      recompute_selective=True, replicas=(1, 1), micro_batches=2, schedule="gpipe",
                      batch_norm=batch_norm)
    plan = rannc_fx.partition(model, args, world_size=2, device="cpu", config=cfg).plan
    assert all(st.selective for st in plan.stages)
    got = run_ranks(_train_convnet, 2, plan, timeout_s=30.0, wall_s=120.0)
    want = run_ranks(_train_convnet, 2, _without_recompute(plan), timeout_s=30.0, wall_s=120.0)
    start = dict(_convnet()[0].named_buffers())
    moved = 0.0
    for (losses, data), (want_losses, want_data) in zip(got, want, strict=True):
        assert_close(torch.tensor(losses), torch.tensor(want_losses), **TOL)
        ref = from_bytes(want_data)
        for name, t in from_bytes(data).items():
            assert_close(t, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
            if name.endswith("running_var"):
                moved = max(moved, float((t - start[name]).abs().max()))
    assert moved > 100 * TOL["atol"]  # the statistics moved: counting them twice would show
