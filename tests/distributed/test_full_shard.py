"""ZeRO-3 inside a stage (``runtime/full_shard.py``): each replica holds its rows of every
parameter, of their gradients and of their optimizer state, gathers each parameter at each
use and reduce-scatters its gradient in each backward; the training is the one process's
(loss and every parameter after several Adam steps), one stage on every rank (plain FSDP)
and pipelines with sharded replicas, under GPipe and 1F1B, recomputing, clipped, with a tied
embedding; each rank's parameter, gradient and state bytes are the plan's."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from examples.models import gpt_example, mlp_example
from rannc_fx.runtime import comm, full_shard
from rannc_fx.runtime.full_shard import rows_of
from tests.distributed.test_zero import _inf_on_a_replica, _nccl
from tests.harness import Run, optimizer, train_against_reference
from tests.unit.test_checkpoint import _data  # the tied-embedding LM, a batch for 2 or 3 ranks

STEPS = 3


def _data4() -> Any:
    """The tied-embedding LM with a batch 4 ranks divide."""
    torch.manual_seed(0)
    return gpt_example(batch=8)


def _config(replicas: tuple[int, ...], schedule: str, recompute: bool | None,
            layers: bool | None = None) -> dict[str, Any]:
    # the link given and the costs counted, not timed, as the ZeRO-1 tests do
    return dict(replicas=replicas, micro_batches=2, schedule=schedule, recompute=recompute,
                recompute_layers=layers, zero=3, link_bandwidth=1e9, link_latency=2e-5,
                cost_model="analytic")


def _bytes(run: Run) -> dict[str, Any]:
    """What this rank holds of its stage's parameters, gradients and Adam state (after the
    last step's backward and step: the gradients are this step's), and what the plan says."""
    cm, opt = run.cm, run.opt
    me = cm.plan.stages_of_rank(run.rank)[0]
    ps = list(dict.fromkeys(p for gm in cm.stages for p in gm.parameters()))
    run.backward(*run.call(run.batch(STEPS + 1)))  # gradients to count
    sharded = [p for p in ps if rows_of(p) is not None]
    return {
        "stage": me.index, "replicas": me.replicas, "zero": me.zero,
        "sharded": len(sharded), "params": len(ps),
        "param_bytes": sum(p.nbytes for p in ps),
        "grad_bytes": sum(p.grad.nbytes for p in ps if p.grad is not None),
        "state_bytes": sum(v.nbytes for p in opt.state for v in opt.state[p].values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0),
        # the plan's: the rows and the two windows it counts beside them
        "plan_params": me.memory.params - 2 * me.window_bytes,
        "plan_grads": me.memory.grads - me.window_bytes,
        "plan_state": me.memory.optimizer_state,
        "whole_params": me.param_bytes,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "replicas,schedule,recompute,layers,clip,tracer",
    [((2,), "gpipe", False, None, 0.5, "export"),
     ((2,), "1f1b", True, None, 0.5, "export"), ((2, 1), "gpipe", False, None, 0.5, "fx"),
     ((1, 2), "1f1b", True, True, None, "export"), ((2, 2), "1f1b", False, None, 0.5, "fx")],
    ids=["fsdp-two-ranks-gpipe-clip-export",
         "fsdp-1f1b-recompute-clip-export", "first-stage-sharded-gpipe-clip-fx",
         "last-stage-sharded-1f1b-layer-by-layer-export", "two-stages-of-two-1f1b-clip-fx"],
)
def test_fully_sharded_training_is_the_one_process_training(replicas, schedule, recompute,
                                                           layers, clip, tracer):
    patches = [(comm.__name__, "BUCKET_BYTES", 4096)]  # several rounds of the ZeRO-1 share
    got = [t.extra for t in train_against_reference(
        _data4 if sum(replicas) == 4 else _data,
        {**_config(replicas, schedule, recompute, layers), "tracer": tracer}, sum(replicas), STEPS,
        clip=clip, check=_bytes, timeout_s=30.0, wall_s=240.0, patches=patches)]
    for info in got:
        r = info["replicas"]
        assert info["zero"] == (3 if r > 1 else 0), info
        if r == 1:
            assert info["sharded"] == 0, info
            continue
        # the tied embedding, held by two stages, stays whole; the rest is rows
        assert 0 < info["sharded"] <= info["params"], info
        for held, planned in (("param_bytes", "plan_params"), ("grad_bytes", "plan_grads"),
                              ("state_bytes", "plan_state")):
            assert abs(info[held] - info[planned]) <= 0.1 * info[planned], (held, info)
        assert info["param_bytes"] < 0.75 * info["whole_params"], info


@pytest.mark.slow
def test_the_reduce_scatter_nccl_runs_trains_like_one_process():
    """Over gloo a gradient's rows come from an all-reduce (faster there); NCCL's path, the
    reduce-scatter itself, run here on gloo."""
    got = [t.extra for t in train_against_reference(
        _data, _config((2, 1), "1f1b", False), 3, STEPS, clip=0.5, check=_bytes,
        timeout_s=30.0, wall_s=240.0, patches=[(full_shard.__name__, "backend_of", _nccl)])]
    assert [i["zero"] for i in got] == [3, 3, 0]


@pytest.mark.slow
@pytest.mark.parametrize("inf_on", [None, 1])
def test_grad_scaler_over_a_fully_sharded_stage_steps_like_one_process(inf_on):
    """An inf in one replica's rows skips the step on every rank, as in one process."""
    scales = [t.extra for t in train_against_reference(
        functools.partial(mlp_example, batch=4 * 3),
        dict(replicas=(2, 1), micro_batches=2, zero=3, cost_model="analytic"), 3,
        optimizer=optimizer(torch.optim.Adam, lr=0.01), scaler=2.0**10,
        loop=functools.partial(_inf_on_a_replica, inf_on), timeout_s=30.0)]
    assert set(scales) == {2.0**10 if inf_on is None else 2.0**9}
