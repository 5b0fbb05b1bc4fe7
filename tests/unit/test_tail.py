"""Models that mix a batch's samples (a contrastive loss with in-batch negatives), planned:
the part after the samples mix runs once a step on the whole batch (``Plan.tail``), costed
so, and refused where it cannot run. Training on ranks: ``distributed/test_tail.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import rannc_fx
from rannc_fx.capture.graph import CaptureError
from rannc_fx.planner.analyze import analyze
from rannc_fx.search import NoFeasiblePlan
from tests.harness import test_config

TOL = dict(rtol=1e-5, atol=1e-5)


class BiEncoder(nn.Module):
    """Queries against keys with in-batch negatives and a learned temperature, in plain
    PyTorch: every query's positive is its own key, every other key in the batch a negative."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                                   nn.Linear(32, 16))
        self.key = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16))
        self.log_temp = nn.Parameter(torch.tensor(0.5))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = F.normalize(self.query(q), dim=-1)
        b = F.normalize(self.key(k), dim=-1)
        logits = a @ b.T * self.log_temp.exp()
        labels = torch.arange(len(logits))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        return loss, logits


def _bi_batch(samples: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 12, generator=g), torch.randn(samples, 12, generator=g)


def _partition(model: nn.Module, *args: Any, world: int = 2, **cfg: Any) -> Any:
    config = test_config(**cfg)
    return rannc_fx.partition(model, args, world_size=world, config=config)


def test_the_tail_starts_where_samples_mix_and_runs_on_the_last_stage():
    batch = _bi_batch(8, 0)
    torch.manual_seed(0)
    model = BiEncoder()
    part = _partition(model, *batch, stages=2)
    plan, tail = part.plan, part.plan.tail
    assert tail is not None and plan.schedule == "gpipe"
    assert tail.mixing == ("matmul",)  # the first value with two sample dimensions: a @ b.T
    # what it reads: both encoders' normalized embeddings, cloned in the last stage
    assert len(tail.inputs) == 2
    assert all(v.name.startswith("tail_in_") and v.batch_dim is not None for v in tail.inputs)
    assert {v.name for v in tail.inputs} <= set(plan.stages[-1].outputs)
    assert tail.outputs == (0, 1)  # the loss and the logits
    # the tail holds none of the encoders, and the temperature's exp runs in it
    assert "exp" in tail.nodes and not any(n.startswith("linear") for n in tail.nodes)
    code = part.stages[-1].get_submodule("tail").code
    assert ".size(0)" in code  # arange(len(logits)): the size rebuilt from its input
    assert "log_temp" in dict(part.stages[-1].named_parameters())  # the stage owns it
    # in one process, the stages and then the tail are the model
    for got, want in zip(part(*batch), model(*batch), strict=True):
        assert_close(got, want, **TOL)
    assert rannc_fx.Plan.from_json(plan.to_json()) == plan
    assert "run once a step on the whole batch" in plan.summary()


def test_the_tail_costs_nothing_per_micro_batch_and_its_batch_is_held_at_the_last_block():
    batch = _bi_batch(8, 0)
    a = analyze(BiEncoder(), batch, world_size=2,
                config=test_config())
    tail = set(a.captured.tail.nodes)
    spec = a.values["matmul"]  # (b, b): one entry per pair of samples
    assert (spec.batch_dim, spec.mixed, spec.shape, spec.shape_for(3, 8)) == (0, (1,), (1, 1),
                                                                             (3, 8))
    assert 8 in a.profile.batch_sizes  # profiled at the whole batch
    last = a.blocks.blocks[-1]
    assert tail <= set(last)
    # the last block's per-micro-batch time is only its non-tail nodes'
    body = [n for n in last if n not in tail]
    for k, q in enumerate(a.table.sizes):
        want = sum(a.profile.at(n, "fwd_s", int(q)) for n in body)
        assert a.table.fwd[k, -1] == pytest.approx(want, rel=1e-6, abs=1e-12)
    from rannc_fx.shapes.tail import tail_cost

    cost = tail_cost(a.captured, a.profile, a.values, 8)
    assert cost is not None and cost.input_bytes == 2 * 2 * 8 * 16 * 4  # two (8, 16) and grads
    assert cost.output_bytes == 4 + 8 * 8 * 4  # the loss and the (8, 8) logits
    assert (a.table.workspace[:, -1] >= cost.held_bytes).all()


def test_1f1b_is_refused_for_a_model_with_a_tail():
    with pytest.raises(ValueError, match=r"schedule='1f1b' .* mixes its samples .* "
                                         r"use schedule='gpipe'"):
        _partition(BiEncoder(), *_bi_batch(8, 0), schedule="1f1b")


class _SharedScale(nn.Module):
    """A value without a batch dimension read both before and after samples mix."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = self.scale.exp()
        logits = (self.q(q) * s) @ self.k(k).T * s
        return F.cross_entropy(logits, torch.arange(len(logits)))


class _Scorer(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b.T


class _LeafScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.score = nn.Linear(8, 8), nn.Linear(8, 8), _Scorer()

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        logits = self.score(self.q(q), self.k(k))
        return F.cross_entropy(logits, torch.arange(logits.size(0)))


def test_a_tail_that_cannot_run_on_the_whole_batch_is_refused_naming_the_node():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(CaptureError, match=r"node mul_1 .* runs on the whole batch after "
                                           r"samples mix, and reads exp, a tensor without a "
                                           r"batch dimension that the part before also reads"):
        _partition(_SharedScale(), x, y)
    with pytest.raises(CaptureError, match=r"node score .* comes after samples mix at score but "
                                           r"is a module call"):
        _partition(_LeafScorer(), x, y, tracer="fx", leaf_modules=("_Scorer",))


def test_where_no_plan_fits_the_message_names_what_the_tail_holds():
    with pytest.raises(NoFeasiblePlan, match=r"mixes its samples at matmul: from there it runs "
                                             r"once a step on the whole batch of 8 samples, .* "
                                             r"holds 0.0 MiB"):
        _partition(BiEncoder(), *_bi_batch(8, 0), device_memory=4096, memory_margin=0.0)
