"""Batches of another size than the plan's, in one process: how many micro-batches a smaller
batch runs (``runtime/batches.rebatched``), and a batch too small for the replicas refused.
On ranks: ``distributed/test_batch_sizes.py``."""

from __future__ import annotations

import pytest

from rannc_fx.runtime import rebatched
from tests.dist_utils import make_plan, scalar, tensor


def test_a_batch_too_small_for_the_replicas_is_refused_with_the_way_out():
    values = {"x": tensor("x", (1, 4)), "h": tensor("h", (1, 4), requires_grad=True),
              "y": tensor("y", (1,)), "loss": scalar("loss")}
    plan = make_plan(global_batch=8, micro_batches=4, replicas=(3, 1), values=values,
                     inputs=["x", "y"], stage_io=[(["x"], ["h"]), (["h", "y"], ["loss"])],
                     outputs=["loss"])
    assert rebatched(plan, 5).micro_batches == 1  # each micro-batch needs 3 samples
    assert rebatched(plan, 6).micro_batches == 2
    assert rebatched(plan, 6).stages == plan.stages
    assert rebatched(plan, 16).micro_batches == 4  # larger: the plan's count
    with pytest.raises(ValueError, match=r"2 sample\(s\) cannot feed stage 0's 3 replicas"):
        rebatched(plan, 2)
