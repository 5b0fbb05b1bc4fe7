"""Recomputation layer by layer (``runtime/recompute.py``) on ranks: a stage with checkpoints
trains as one process does (dropout masks and BatchNorm statistics included), and compile
refuses a split backward on every rank. In one process: ``unit/test_recompute_layers.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import rannc_fx
from rannc_fx.plan.config import Config
from rannc_fx.plan.plan import Plan
from rannc_fx.runtime import recompute
from tests.dist_utils import run_ranks
from tests.gpt_training import (
    STEPS,
    TOL,
    adam,
    assert_bitwise_alike,
    from_bytes,
    gpt,
    local,
    step,
    to_bytes,
    train_gpt,
    train_like_one_process,
)
from tests.harness import test_config
from tests.unit.test_recompute_layers import (
    _gpt_plan,
    _with_checkpoints,
    _without_recompute,
    _zbh1,
)


def _counting_checkpoints() -> list[int]:
    """Count the checkpointed segment runs (in this process: call it in the worker)."""
    calls: list[int] = []
    original = recompute.checkpoint

    def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(fn, *args, **kwargs)

    recompute.checkpoint = counted  # type: ignore[assignment]  # a forked worker's own copy
    return calls


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_layered_recomputation_trains_like_one_process(schedule):
    plan = _gpt_plan(schedule)
    assert all(st.recompute and st.checkpoints for st in plan.stages), plan.stages
    for rank, calls in enumerate(train_like_one_process(plan, _counting_checkpoints)):
        st = plan.stage_of_rank(rank)
        # every segment but the last checkpointed, once per micro-batch's R
        assert calls == STEPS * plan.micro_batches * len(st.checkpoints), (rank, calls)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_layered_recomputation_replays_the_dropout_masks(schedule):
    """Bitwise the training without recomputation: R and each segment's recomputation in the
    backward draw the masks the forward drew."""
    layered = _gpt_plan(schedule, dropout=0.1)
    got = run_ranks(train_gpt, 2, layered, 0.1, 100, _counting_checkpoints, timeout_s=30.0,
                    wall_s=120.0)
    plain = run_ranks(train_gpt, 2, _without_recompute(layered), 0.1, 100,
                      _counting_checkpoints, timeout_s=30.0, wall_s=120.0)
    assert_bitwise_alike(got, plain)


class BNLayers(nn.Module):
    """Residual layers each starting with a BatchNorm (its running statistics move a lot: the
    inputs are far from zero mean and unit variance)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm1d(8, momentum=0.3), nn.Linear(8, 16), nn.Tanh(),
                          nn.Linear(16, 8))
            for _ in range(4)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x), y)


def _bn_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return 3 + 2 * torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _train_bn(rank: int, world: int, plan: Plan) -> tuple[list[float], bytes, int]:
    calls = _counting_checkpoints()
    torch.manual_seed(0)
    model = BNLayers()
    opt = adam(model)
    mine = slice(rank * 8, (rank + 1) * 8)
    x, y = _bn_data(0)
    cm = rannc_fx.compile(model, opt, Config(timeout_s=30.0, batch_norm=plan.batch_norm), plan=plan,
                          example_args=(x[mine], y[mine]))
    losses = []
    for k in range(STEPS):
        x, y = _bn_data(k + 1)
        losses.append(step(cm, opt, (x[mine], y[mine]), {}))
    state = {n: t.detach() for gm in cm.stages
             for n, t in (*gm.named_buffers(), *gm.named_parameters())}
    return losses, to_bytes(state), len(calls)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("batch_norm", ["step", "micro-batch"])
def test_batchnorm_in_a_segment_keeps_the_statistics(batch_norm, micro_batches):
    """The running statistics (and everything else) are those of the same pipeline without
    recomputation, though each checkpointed segment runs three times a step; with one
    micro-batch, those of one process."""
    x, y = _bn_data(0)
    cfg = test_config(recompute=True,
                      recompute_selective=False, replicas=(1, 1),
                      micro_batches=micro_batches, schedule="1f1b", batch_norm=batch_norm)
    parted = rannc_fx.partition(BNLayers(), (x, y), world_size=2, device="cpu", config=cfg)
    plan = _with_checkpoints(parted)
    assert all(st.checkpoints for st in plan.stages), plan.stages
    got = run_ranks(_train_bn, 2, plan, timeout_s=30.0, wall_s=120.0)
    plain = run_ranks(_train_bn, 2, _without_recompute(plan), timeout_s=30.0, wall_s=120.0)
    torch.manual_seed(0)
    ref = BNLayers()
    ref_opt = adam(ref)
    want = [step(ref, ref_opt, _bn_data(k + 1), {}) for k in range(STEPS)]
    ref_state = ref.state_dict()
    tracked = 0
    for (losses, state, calls), (plain_losses, plain_state, _) in zip(got, plain, strict=True):
        assert calls > 0
        assert_close(torch.tensor(losses), torch.tensor(plain_losses), **TOL)
        plain_tensors = from_bytes(plain_state)
        for n, t in from_bytes(state).items():
            assert_close(t, plain_tensors[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
            if micro_batches == 1:
                assert_close(t, ref_state[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
            if n.endswith("num_batches_tracked"):
                assert int(t) == STEPS, (n, int(t))
                tracked += 1
    assert tracked == 4
    if micro_batches == 1:
        assert_close(torch.tensor(got[0][0]), torch.tensor(want), **TOL)


def _compile_split(rank: int, world: int, plan: Plan) -> str:
    model, args, kwargs = gpt(0.0)
    largs, lkwargs = local(rank, args, kwargs)
    with pytest.raises(ValueError) as err:
        rannc_fx.compile(model, adam(model), Config(timeout_s=30.0), plan=plan,
                         example_args=largs, example_kwargs=lkwargs)
    return str(err.value)


def test_compile_refuses_it_on_every_rank():
    """Only stage 1 recomputes layer by layer; rank 0 refuses too instead of waiting for it."""
    plan = _zbh1(_gpt_plan("1f1b"))
    plan = plan.model_copy(update={"stages": (
        plan.stages[0].model_copy(update={"checkpoints": ()}), plan.stages[1])})
    got = run_ranks(_compile_split, 2, plan, timeout_s=30.0, wall_s=120.0)
    for msg in got:
        assert "stage 1 recomputes layer by layer" in msg and "'1f1b'" in msg, msg
