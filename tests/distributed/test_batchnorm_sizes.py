"""Models whose nodes cannot run every micro-batch size plan and train on ranks like one
process (a training-mode BatchNorm that sees one value per channel at one sample rules that
size out), and a batch that would give each replica one sample is refused. The planning:
``unit/test_batchnorm_sizes.py``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.models import ResCNN
from rannc_fx.plan.plan import Plan
from tests.harness import Run, optimizer, train_against_reference
from tests.unit.test_batchnorm_sizes import BatchNormMLP, _check_plan_keeps_off, _data

STEPS = 2


def _cifar_resnet() -> ResCNN:
    """A CIFAR-size ResNet: 32x32 images down to a 1x1 map in its last block."""
    return ResCNN(channels=(4, 4, 4, 4, 4, 4))


def _model(name: str) -> nn.Module:
    return BatchNormMLP() if name == "mlp" else _cifar_resnet()


# -- training ---------------------------------------------------------------------------------
def _steps(name: str, local: int, run: Run) -> dict[str, Any]:
    """``STEPS`` Adam steps, each training loss's ratio to one process's; then every replica's
    buffers alike, the eval loss's ratio, and what a call of one sample a rank raises."""
    rank, world, cm, ref = run.rank, run.world, run.cm, run.ref
    ratios = []
    for step in range(1, STEPS + 1):
        loss, want = run.forward(run.batch(step))
        run.backward(loss, want)
        run.step()
        ratios.append(float(loss) / float(want))
    stage = cm.plan.stages_of_rank(rank)[0]
    group = dist.new_group(list(stage.ranks)) if stage.replicas > 1 else None
    if group is not None:  # every replica of the stage holds the same buffers
        for st in cm.stages:
            for n, b in st.named_buffers():
                got = [torch.empty_like(b) for _ in stage.ranks]
                dist.all_gather(got, b, group=group)
                assert all(torch.equal(g, got[0]) for g in got), n
    run.model.eval()
    ref.eval()
    x, y = _data(name, local * world, 99)
    mine = slice(rank * local, (rank + 1) * local)
    with torch.no_grad():
        ratios.append(float(cm(x[mine], y[mine])) / float(ref(x, y)))
    run.model.train()
    refused = ""
    try:  # one sample a rank: every replica's micro-batch would hold one
        cm(x[rank : rank + 1], y[rank : rank + 1])
    except ValueError as e:
        refused = str(e)
    return {"plan": cm.plan.to_json(), "ratios": ratios, "refused": refused}


# under torch.export a BatchNorm is an ATen op, which the profile checks as F.batch_norm
# does (the MLP's); both cost models
@pytest.mark.parametrize(("name", "world", "local", "tracer", "cost_model"), [
    ("mlp", 2, 32, "fx", "measured"), ("mlp", 2, 32, "export", "analytic"),
    ("resnet", 3, 8, "fx", "measured"),
])
def test_batchnorm_models_plan_and_train_like_one_process(name, world, local, tracer,
                                                          cost_model):
    got = [t.extra for t in train_against_reference(
        functools.partial(_model, name), dict(tracer=tracer, cost_model=cost_model,
                                              dynamic_dims="batch"), world,
        data=functools.partial(_data, name, local * world),
        optimizer=optimizer(torch.optim.Adam, lr=0.01), params=False,
        loop=functools.partial(_steps, name, local), wall_s=240.0)]
    plan = Plan.from_json(got[0]["plan"])
    assert any(e.samples == 1 for e in plan.excluded_sizes), plan.summary()
    assert "never runs 1 sample(s)" in plan.summary()
    _check_plan_keeps_off(plan)
    for r in got:
        # each replica normalizes its own samples (README, "What a step computes"): the
        # training losses within 3 % of one process's when measured, the eval loss within
        # 1 % (export: eval mode is not the model's yet, the graph keeps training mode)
        *train, evaluated = r["ratios"]
        assert all(abs(q - 1) < 0.05 for q in train), r["ratios"]
        assert tracer == "export" or abs(evaluated - 1) < 0.03, r["ratios"]
        if any(st.replicas == world for st in plan.stages):  # else some stage has 1 replica
            assert "drop the last smaller batch" in r["refused"], r["refused"]
