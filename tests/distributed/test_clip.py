"""``CompiledModel.clip_grad_norm_`` on forked gloo ranks: the norm of the whole model's
gradient on every rank (replicas and a tied embedding counted once) and parameters after
clipped Adam steps equal to a single-process reference clipped by torch's own function;
a non-finite norm raises on every rank; a call before ``loss.backward()`` is refused."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from examples.models import gpt_example, mlp_example
from rannc_fx.compile import compile as rannc_compile
from tests.dist_utils import local_part, run_ranks
from tests.harness import Run, example, optimizer, test_config, train_against_reference

INF = math.inf


class TanhMLP(torch.nn.Module):
    """Smooth layers: no gradient entry is exactly zero (ReLU's dead units give zeros), so the
    norm of type -inf, the smallest entry, is not 0 on every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.cross_entropy(self.head(x), y)


def tanh_example(batch: int) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return TanhMLP(), (torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)), {}


FACTORY = {"mlp": mlp_example, "gpt": functools.partial(gpt_example, layers=1),
           "tanh": tanh_example}  # fmt: skip  (gpt: one layer, export is slow)
# at init the mlp's gradient norms are 0.70 (p=2) and 0.40 (inf); the gpt's 9.5 and 1.24
MAX_NORM = {"mlp": 0.1, "gpt": 0.5, "tanh": 0.1}


LOCAL = 2  # samples per rank
# forced plans without the link probe or per-op profiling (they cost seconds a case)
ANALYTIC = dict(cost_model="analytic", link_bandwidth=1e9, link_latency=1e-5,
                allreduce_bandwidth=1e9)
# eps well above a clipped gradient's entries: Adam then sees the clipping factor
# (with a tiny eps its step is nearly invariant to the gradient's scale)
ADAM = optimizer(torch.optim.Adam, lr=0.01, eps=1e-3)


def _foreach_reached_torch(run: Run) -> None:
    """The option reached torch's norm (where the rank counts any gradient) and scaling on
    this rank."""
    seen = run.installed
    assert "clip_grads_with_norm_" in {f for f, _ in seen}
    assert all(v is run.spec.clip_kw["foreach"] for _, v in seen), seen


def _train_clipped(name: str, world: int, cfg: dict[str, Any], norm_type: float,
                   foreach: bool | None = None) -> list[list[float]]:
    """3 clipped Adam steps against one process clipped by torch's own function: the norms
    (each rank's), the losses and every parameter."""
    got = train_against_reference(
        functools.partial(FACTORY[name], batch=LOCAL * world), {**ANALYTIC, **cfg}, world,
        optimizer=ADAM, example=False, clip=(MAX_NORM[name], norm_type),
        clip_kw=dict(foreach=foreach),
        # -inf's smallest entry is a near-cancelling sum: micro-batches round it by ~1e-4
        clip_tol=dict(rtol=1e-3 if norm_type == -INF else 1e-5, atol=0),
        clipped=norm_type != -INF,  # the smallest entry is below any max_norm: no clipping
        setup=_record_foreach if foreach is not None else None,
        check=_foreach_reached_torch if foreach is not None else None)
    return [t.norms for t in got]


def _record_foreach() -> list[tuple[str, Any]]:
    """(function, foreach) of each call of torch's norm and scaling in this (forked) process."""
    seen: list[tuple[str, Any]] = []
    for fname in ("get_total_norm", "clip_grads_with_norm_"):
        real = getattr(torch.nn.utils, fname)

        def spy(*args: Any, _real: Any = real, _name: str = fname, **kwargs: Any) -> Any:
            foreach = kwargs["foreach"] if "foreach" in kwargs else args[-1]
            seen.append((_name, foreach))
            return _real(*args, **kwargs)

        setattr(torch.nn.utils, fname, spy)
    return seen


@pytest.mark.parametrize(
    "name,world,cfg,norm_type",
    [
        ("mlp", 1, dict(micro_batches=1), 2.0),  # the one-rank fast path
        ("mlp", 2, dict(replicas=(1, 1), micro_batches=2, schedule="gpipe"), INF),
        ("mlp", 3, dict(replicas=(2, 1), micro_batches=2, schedule="1f1b"), 2.0),
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b"), INF),
        ("gpt", 3, dict(replicas=(1, 2), micro_batches=1, schedule="gpipe"), 2.0),
        ("gpt", 4, dict(replicas=(2, 1, 1), micro_batches=2, schedule="1f1b"), 3.0),
        # two stages a rank: the tied embedding on one rank (ZBV) or two (interleaved)
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=2, schedule="zbv"), 1.0),
        ("gpt", 3, dict(replicas=(2, 1), micro_batches=2, schedule="interleaved"), 2.0),
    ],
)
def test_clips_like_one_process(name, world, cfg, norm_type):
    norms = _train_clipped(name, world, cfg, norm_type)
    assert all(n == norms[0] for n in norms)  # bit for bit the same norm on every rank


@pytest.mark.parametrize(
    "name,world,cfg,norm_type,foreach",
    [
        # the tied embedding on both stages: counted once in a sum of absolute values
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b"), 1.0, True),
        # 0 counts the tensors with a non-zero entry (torch's vector_norm of the counts)
        ("mlp", 3, dict(replicas=(2, 1), micro_batches=2, schedule="gpipe"), 0.0, False),
        # -inf: the smallest entry of any stage (the largest of the negated norms)
        ("tanh", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b"), -INF, True),
    ],
)
def test_other_norm_types_and_foreach_clip_like_one_process(name, world, cfg, norm_type, foreach):
    norms = _train_clipped(name, world, cfg, norm_type, foreach)
    assert all(n == norms[0] for n in norms)
    assert min(norms[0]) > 0  # (a norm of 0 would hide the sign of -inf's reduction)


def _refusals(rank: int, world: int, schedule: str) -> None:
    model, args, _ = example("mlp", LOCAL * world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cm = rannc_compile(model, opt, test_config(**ANALYTIC, replicas=(1, 1), micro_batches=2,
                                               schedule=schedule))
    with pytest.raises(RuntimeError, match="before the first call"):
        cm.clip_grad_norm_(1.0)
    loss = cm(*local_part(args, rank, LOCAL * world, LOCAL))
    with pytest.raises(RuntimeError, match=r"before loss\.backward\(\) of step 1"):
        cm.clip_grad_norm_(1.0)
    loss.backward()
    # a NaN in one rank's gradient: every rank raises, and nothing is scaled
    if rank == 1:
        next(cm.stages[0].parameters()).grad[0].fill_(math.nan)
    before = [p.grad.clone() for p in cm.stages[0].parameters()]
    with pytest.raises(RuntimeError, match=r"is nan \(ranks \[1\] hold non-finite gradients\)"):
        cm.clip_grad_norm_(1.0, error_if_nonfinite=True)
    for p, b in zip(cm.stages[0].parameters(), before, strict=True):
        assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    for norm_type in (2.0, INF):  # without the check: NaN everywhere, as torch returns it
        assert cm.clip_grad_norm_(1.0, norm_type).isnan()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_refuses_before_backward_and_raises_on_every_rank_when_nonfinite(schedule):
    run_ranks(_refusals, 2, schedule, timeout_s=60.0)
