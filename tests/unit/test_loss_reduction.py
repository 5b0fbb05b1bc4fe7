"""``Config(loss_reduction="sum")`` reaches the plan and reads from the environment. Training
with it on ranks: ``distributed/test_loss_reduction.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import rannc_fx
from rannc_fx.plan.config import Config

VOCAB, SEQ = 50, 10


class SummedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.layers(x)), y, reduction="sum")


def _batch(name: str, samples: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if name == "sum":
        return torch.randn(samples, 8, generator=g), torch.randint(0, 5, (samples,), generator=g)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    # every sample its own padding: the slices' counts differ, so share weights would be wrong
    pad = torch.randint(0, SEQ - 1, (samples,), generator=g)
    labels[torch.arange(SEQ)[None, :] >= (SEQ - pad)[:, None]] = -100
    return ids, labels


def test_the_option_reaches_the_plan_and_reads_from_the_environment():
    assert Config().loss_reduction == "mean"
    cfg = Config.from_env(environ={"RANNC_FX_LOSS_REDUCTION": "sum"})
    assert cfg.loss_reduction == "sum"
    x, y = _batch("sum", 8, 0)
    part = rannc_fx.partition(SummedMLP(), (x, y), world_size=2,
                              config=Config(profile_cache_dir=None, stages=2,
                                            loss_reduction="sum"))
    assert part.plan.loss_reduction == "sum"
    assert rannc_fx.Plan.from_json(part.plan.to_json()).loss_reduction == "sum"
