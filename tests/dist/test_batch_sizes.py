"""Batches of another size than the plan's (the last smaller batch of an epoch, or a larger
one) train like one process on the global batch; unequal local batches fail on every rank.
In one process: ``unit/test_batch_sizes.py``."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import rannc_fx
from rannc_fx.config import Config
from rannc_fx.models import gpt_example, mlp_example
from tests.dist_utils import run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)
PLANNED = 4  # samples per rank in the example batch the plan is made for
EXAMPLES = {"mlp": mlp_example, "gpt": gpt_example}


def _global(name: str, samples: int, seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    _, args, kwargs = EXAMPLES[name](batch=samples)
    return args, kwargs


def _loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out


def _train(rank: int, world: int, name: str, cfg: dict[str, Any], sizes: list[int]) -> list[float]:
    torch.manual_seed(0)
    model, args, kwargs = EXAMPLES[name](batch=PLANNED * world)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-4)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, eps=1e-4)
    config = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=30.0, **cfg)
    cut = lambda t, n: t[rank * n : (rank + 1) * n]  # noqa: E731
    cm = rannc_fx.compile(model, opt, config, example_args=tuple(cut(a, PLANNED) for a in args),
                          example_kwargs={k: cut(v, PLANNED) for k, v in kwargs.items()})
    losses = []
    for step, n in enumerate(sizes):
        gargs, gkwargs = _global(name, n * world, seed=step + 1)
        out = cm(*(cut(a, n) for a in gargs), **{k: cut(v, n) for k, v in gkwargs.items()})
        want = ref(*gargs, **gkwargs)
        assert_close(_loss(out), _loss(want), **TOL)
        for loss, o in ((_loss(out), opt), (_loss(want), ref_opt)):
            loss.backward()
            o.step()
            o.zero_grad()
        losses.append(_loss(out).item())
    for pname, p in cm.stages[0].named_parameters():
        assert_close(p, ref.get_parameter(pname), **TOL, msg=lambda m, n=pname: f"{n}: {m}")
    assert cm.plan.global_batch == PLANNED * world  # the plan shown is still the planned one
    return losses


@pytest.mark.parametrize(
    "name,world,cfg,sizes",
    [
        ("mlp", 3, dict(replicas=(2, 1), micro_batches=2), [4, 3, 1, 4, 6]),
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=4, schedule="1f1b"), [4, 3, 1, 4]),
        ("gpt", 2, dict(replicas=(1, 1), micro_batches=2, schedule="gpipe"), [4, 2, 4]),
        # equal batches need no agreement: each rank picks the executor of its own size
        ("mlp", 2, dict(replicas=(1, 1), micro_batches=2, check_batches=False), [4, 1, 4]),
        ("mlp", 1, dict(micro_batches=1), [4, 3, 4]),  # the one-rank fast path
    ],
)
def test_other_batch_sizes_train_like_one_process(name, world, cfg, sizes):
    losses = run_ranks(_train, world, name, cfg, sizes, timeout_s=30.0, wall_s=120.0)
    assert all(run == losses[0] for run in losses)


def _disagreeing(rank: int, world: int, what: str) -> str:
    torch.manual_seed(0)
    model, (x, y), _ = mlp_example(batch=PLANNED * world)
    cfg = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=30.0, replicas=(1, 1),
                 micro_batches=2)
    cm = rannc_fx.compile(model, None, cfg, example_args=(x[:PLANNED], y[:PLANNED]))
    # rank 1's last batch is smaller, or rank 1 alone runs under autocast
    n = 3 if what == "size" and rank == 1 else PLANNED
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=what == "autocast" and rank == 1):
            cm(x[:n], y[:n])
    except ValueError as e:
        return str(e)
    return "ran"


@pytest.mark.parametrize(
    "what,expected",
    [
        ("size", r"local batches of different sizes \(rank 0: 4, rank 1: 3\)"),
        ("autocast", r"different autocast states \(rank 0: None, rank 1: bfloat16\)"),
    ],
)
def test_ranks_that_disagree_fail_on_every_rank_at_once(what, expected):
    # wall_s below the 30 s timeout: no rank may wait for the one that failed
    for message in run_ranks(_disagreeing, 2, what, timeout_s=30.0, wall_s=20.0):
        assert re.search(expected, message), message
