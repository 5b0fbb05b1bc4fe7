"""BatchNorm's running statistics as one process tracks them, on ranks: one update a step
from the whole mini-batch (``runtime/batchnorm.py``), equal on every replica, however many
micro-batches. The arithmetic alone: ``unit/test_batchnorm.py``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from examples.models import ResCNN
from tests.harness import Run, optimizer, train_against_reference

TOL = dict(rtol=1e-6, atol=1e-7)  # the statistics: within 1e-6 of one process's
LOCAL = 16  # samples per rank
STEPS = 3
ADAM = optimizer(torch.optim.Adam, lr=0.01)


class BatchNormFirst(nn.Module):
    """Its first layer is a BatchNorm, so that layer's input is the data: equal to one
    process's at every step, and so must its running statistics be."""

    def __init__(self, momentum: float | None = 0.3) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6, momentum=momentum)
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(self.bn(x))), y)


def _data(name: str, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name in ("first", "average"):  # far from zero mean and unit variance: the statistics move a lot
        return 3 + 2 * torch.randn(samples, 6, generator=g), torch.randint(0, 4, (samples,),
                                                                            generator=g)
    return torch.randn(samples, 3, 16, 16, generator=g), torch.randint(0, 10, (samples,),
                                                                        generator=g)


def _buffers(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for m in modules for n, b in m.named_buffers()}


def _model(name: str) -> nn.Module:
    # "average": momentum=None, the cumulative average over the steps so far
    return (BatchNormFirst(None if name == "average" else 0.3) if name in ("first", "average")
            else ResCNN())


def _statistics(name: str, run: Run) -> float:
    """``STEPS`` Adam steps; after each, this rank's buffers: the step count, the first
    BatchNorm's statistics one process's, every replica's the same. The eval loss's ratio to
    one process's."""
    rank, world, cm, ref = run.rank, run.world, run.cm, run.ref
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    stage = cm.plan.stage_of_rank(rank)
    group = dist.new_group(list(stage.ranks)) if stage.replicas > 1 else None
    for step in range(1, STEPS + 1):
        out, want = run.forward(run.batch(step))
        run.backward(out, want)
        run.step()
        mine_now = _buffers(cm.stages)
        for n, b in mine_now.items():
            if n.endswith("num_batches_tracked"):
                assert int(b) == step, (n, int(b))
            if name in ("first", "average") and n.startswith("bn."):  # the data's statistics, exactly
                assert_close(b, ref.get_buffer(n), **TOL, msg=lambda m, n=n: f"{n}: {m}")
        if group is not None:  # every replica of the stage holds the same buffers
            for n, b in mine_now.items():
                got = [torch.empty_like(b) for _ in stage.ranks]
                dist.all_gather(got, b, group=group)
                assert all(torch.equal(g, got[0]) for g in got), n
    run.model.eval()
    ref.eval()
    x, y = _data(name, LOCAL * world, 99)
    with torch.no_grad():
        got, want = cm(x[mine], y[mine]), ref(x, y)
    return float(got / want)


def _train(name: str, tracer: str, cfg: dict[str, Any], wall_s: float) -> list[float]:
    """``_statistics`` on 3 ranks (the weights are not one process's: each micro-batch slice
    normalizes with its own statistics); each rank's eval-loss ratio."""
    world = 3
    got = train_against_reference(
        functools.partial(_model, name), dict(tracer=tracer, **cfg), world,
        data=functools.partial(_data, name, LOCAL * world), optimizer=ADAM, params=False,
        loop=functools.partial(_statistics, name), wall_s=wall_s)
    return [t.extra for t in got]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_statistics_of_a_first_batchnorm_equal_one_process_after_every_step(tracer):
    ratios = _train("first", tracer, dict(replicas=(2, 1), micro_batches=4, schedule="gpipe"),
                    wall_s=120.0)
    # the statistics are one process's; the weights are not quite (each micro-batch slice of 4
    # samples normalizes with its own statistics, as in GPipe): eval loss 0.990 (m = 2) and
    # 0.985 (m = 4) of one process's when measured
    assert all(abs(r - 1) < 0.03 for r in ratios), ratios


def test_a_cumulative_average_batchnorm_equals_one_process_after_every_step():
    """momentum=None: each step's statistics weigh 1 / num_batches_tracked."""
    ratios = _train("average", "fx", dict(replicas=(2, 1), micro_batches=2, schedule="gpipe"),
                    wall_s=120.0)
    assert all(abs(r - 1) < 0.03 for r in ratios), ratios


def test_a_deeper_batchnorm_model_keeps_its_replicas_equal_and_evaluates_like_one_process():
    ratios = _train("cnn", "fx", dict(replicas=(2, 1), micro_batches=4, schedule="1f1b"),
                    wall_s=180.0)
    # micro-batch statistics in the forward (as GPipe) move the trained weights a little:
    # eval loss 1.0002 of one process's when measured (GPipe, m = 2 and 4; 1F1B, m = 4)
    assert all(abs(r - 1) < 0.01 for r in ratios), ratios


# -- a 3-D U-Net on 3 stages, one micro-batch ----------------------------------------------------
def _block3d(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(c_in, c_out, 3, padding=1), nn.BatchNorm3d(c_out), nn.ReLU(),
                         nn.Conv3d(c_out, c_out, 3, padding=1), nn.BatchNorm3d(c_out),
                         nn.ReLU())


class UNet3d(nn.Module):
    """Conv3d + BatchNorm3d encoder and decoder with skip connections."""

    def __init__(self, c: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.enc1, self.enc2, self.mid = _block3d(1, c), _block3d(c, 2 * c), _block3d(2 * c, 4 * c)
        self.up2, self.dec2 = nn.ConvTranspose3d(4 * c, 2 * c, 2, stride=2), _block3d(4 * c, 2 * c)
        self.up1, self.dec1 = nn.ConvTranspose3d(2 * c, c, 2, stride=2), _block3d(2 * c, c)
        self.out = nn.Conv3d(c, classes, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.enc1(x)
        b = self.enc2(F.max_pool3d(a, 2))
        h = self.mid(F.max_pool3d(b, 2))
        h = self.dec2(torch.cat([self.up2(h), b], 1))
        h = self.dec1(torch.cat([self.up1(h), a], 1))
        return F.cross_entropy(self.out(h), y)


def _volumes(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # intensities far from zero mean, as scans are
    return (300 + 50 * torch.randn(samples, 1, 8, 8, 8, generator=g),
            torch.randint(0, 3, (samples, 8, 8, 8), generator=g))


def _unet(run: Run) -> dict[str, Any]:
    """``STEPS`` Adam steps; then which of this rank's buffers differ from one process's (bit
    for bit), and the eval losses."""
    for step in range(1, STEPS + 1):
        out, want = run.forward(run.batch(step))
        run.backward(out, want)
        run.step()
    cm, ref, local, world = run.cm, run.ref, 2, run.world
    mine = slice(run.rank * local, (run.rank + 1) * local)
    unequal = [n for m in cm.stages for n, b in m.named_buffers()
               if not torch.equal(b, ref.get_buffer(n))]
    run.model.eval()
    ref.eval()
    x, y = _volumes(local * world, 99)
    with torch.no_grad():
        got, want = float(cm(x[mine], y[mine])), float(ref(x, y))
    return {"unequal": unequal, "buffers": sum(1 for m in cm.stages for _ in m.buffers()),
            "eval": (got, want), "lanes": len(cm.plan.lanes), "m": cm.plan.micro_batches,
            "recompute": [st.recompute or st.selective for st in cm.plan.stages]}


@pytest.mark.parametrize(("tracer", "cfg"), [
    ("fx", {}), ("fx", dict(recompute=True)), ("export", {}),
])
def test_a_unet_on_stages_of_one_replica_and_one_micro_batch_has_one_process_statistics(
        tracer, cfg):
    got = [t.extra for t in train_against_reference(
        UNet3d, dict(tracer=tracer, replicas=(1, 1, 1), micro_batches=1, dynamic_dims="batch",
                     **cfg), 3, data=functools.partial(_volumes, 2 * 3), optimizer=ADAM,
        params=False, loop=_unet, wall_s=180.0)]
    # three lanes of one replica (three stages, or six under an interleaved schedule), m = 1
    assert all(r["lanes"] == 3 and r["m"] == 1 and all(r["recompute"]) == bool(cfg)
               for r in got), got
    assert sum(r["buffers"] for r in got) == len(list(UNet3d().buffers()))  # all compared
    for r in got:  # the running statistics and counts, bit for bit
        assert not r["unequal"], r["unequal"]
        # export: eval mode is not the model's yet (its graph keeps training mode)
        assert tracer == "export" or r["eval"][0] == pytest.approx(r["eval"][1], rel=1e-6)
