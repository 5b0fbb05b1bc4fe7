"""Batches of another size than the plan's (the last smaller batch of an epoch, or a larger
one) train like one process on the global batch; unequal local batches fail on every rank.
In one process: ``unit/test_batch_sizes.py``."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

import rannc_fx
from examples.models import gpt_example, mlp_example
from tests.dist_utils import run_ranks
from tests.harness import LINK, Run, test_config, train_against_reference

PLANNED = 4  # samples per rank in the example batch the plan is made for
EXAMPLES = {"mlp": mlp_example, "gpt": gpt_example}


def _global(name: str, world: int, sizes: tuple[int, ...], step: int) -> tuple[Any, ...]:
    """Step ``step``'s global batch: ``sizes[step - 1]`` samples a rank."""
    torch.manual_seed(step)
    _, args, kwargs = EXAMPLES[name](batch=sizes[step - 1] * world)
    return args, kwargs


def _still_planned(run: Run) -> None:
    assert run.cm.plan.global_batch == PLANNED * run.world  # the plan shown is the planned one


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
    # planned for PLANNED samples a rank (the factory's batch), called with ``sizes``
    train_against_reference(functools.partial(EXAMPLES[name], batch=PLANNED * world), cfg,
                            world, len(sizes),
                            data=functools.partial(_global, name, world, tuple(sizes)),
                            check=_still_planned, timeout_s=30.0)


def _disagreeing(rank: int, world: int, what: str) -> str:
    torch.manual_seed(0)
    model, (x, y), _ = mlp_example(batch=PLANNED * world)
    cfg = test_config(**LINK, timeout_s=30.0, replicas=(1, 1), micro_batches=2)
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
