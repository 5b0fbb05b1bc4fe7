"""The costs outside the model's graph, in one process: the optimizer step (timed with the
user's own optimizer, or estimated) and the link the plan is given. Measured between ranks:
``distributed/test_links_and_optimizer.py``."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from examples.models import mlp_example
from rannc_fx import Config, DeviceSpec
from rannc_fx.planner.analyze import analyze
from rannc_fx.planner.build import build_plan
from rannc_fx.profile.optimizer import SizeCurve, accumulate_curve, measure, optimizer_curve
from rannc_fx.search import search_pass
from rannc_fx.split.split import split_pass

CPU = torch.device("cpu")


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(4))]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),  # records a key its constructor refuses
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
)
def test_an_optimizer_is_timed_with_its_own_class_and_settings(make):
    opt = make(_params())
    state_before = copy.deepcopy(opt.state_dict())
    curve = measure(opt, CPU, repeats=1)
    assert curve is not None and type(opt).__name__ in curve.source
    assert len(curve.nbytes) == 3 and list(curve.nbytes) == sorted(curve.nbytes)
    assert all(math.isfinite(s) and s > 0 for s in curve.seconds)
    assert list(curve.seconds) == sorted(curve.seconds)  # a larger tensor never costs less
    assert opt.state_dict() == state_before  # the user's optimizer is not stepped


def test_a_size_curve_interpolates_and_extends_its_last_slope():
    curve = SizeCurve((100.0, 1100.0, 2100.0), (1.0, 2.0, 5.0), "test")
    assert curve(10.0) == 1.0  # a tiny tensor still pays the fixed cost
    assert curve(600.0) == pytest.approx(1.5)
    assert curve(3100.0) == pytest.approx(8.0)  # beyond: 3 s per 1000 bytes
    assert list(curve(np.array([100.0, 2100.0]))) == [1.0, 5.0]


def test_an_optimizer_that_cannot_be_rebuilt_falls_back_to_the_estimate():
    opt = torch.optim.LBFGS(_params())  # its step needs a closure
    spec = DeviceSpec.preset("cpu")
    assert measure(opt, CPU) is None
    curve = optimizer_curve(opt, CPU, spec, 2.0)
    # Adam streams param, grad, two states in and param, two states out: 7 bytes per byte
    assert curve(1e6) == pytest.approx(7e6 / (spec.memory_bandwidth * spec.efficiency))
    assert optimizer_curve(None, CPU, spec, 0.0)(1e6) == pytest.approx(
        3e6 / (spec.memory_bandwidth * spec.efficiency)
    )


def test_gradient_accumulation_is_timed_on_the_device_or_estimated():
    spec = DeviceSpec.preset("cpu")
    # read .grad and the new gradient, write .grad: 3 bytes per gradient byte
    assert accumulate_curve(None, spec)(1e6) == pytest.approx(
        3e6 / (spec.memory_bandwidth * spec.efficiency)
    )
    measured = accumulate_curve(CPU, spec, repeats=1)
    assert all(math.isfinite(s) and s > 0 for s in measured.seconds)


def test_the_plan_charges_each_stage_its_optimizer_step_and_the_given_link():
    model, args, _ = mlp_example(batch=8)
    cfg = Config(
        replicas=(1, 1), micro_batches=2, profile_cache_dir=None, profile_repeats=1,
        link_bandwidth=123e6, link_latency=0.25e-3,
    )  # fmt: skip
    a = analyze(model, args, world_size=2, config=cfg, optimizer=torch.optim.Adam(model.parameters()))
    assert a.table.optimizer_s is not None and a.table.accumulate_s is not None
    plan = build_plan(a, search_pass(a.table, a.space))
    dev = plan.device
    assert (dev.interconnect_bandwidth, dev.interconnect_latency) == (123e6, 0.25e-3)
    for st, gm in zip(plan.stages, split_pass(a.captured, plan, values=a.values), strict=True):
        ps = list(gm.parameters())
        assert st.memory.grads == sum(q.numel() * q.element_size() for q in ps)
        # the range's figures are its parameters' own, each tensor once
        i, j = st.first_block, st.end_block
        assert st.optimizer_ms == pytest.approx(1e3 * a.table.optimizer_s[i, j])
        assert st.accumulate_ms == pytest.approx(1e3 * a.table.accumulate_s[i, j])
        # a stage with parameters has a step to cost (the measured boundaries may leave the
        # last stage the loss alone: then none)
        assert (st.optimizer_ms > 0) == (st.accumulate_ms > 0) == bool(ps)
    assert any(st.optimizer_ms > 0 for st in plan.stages)
    # the cut crosses once each way per micro-batch: bytes over 123 MB/s plus 2 x 0.25 ms
    cut = plan.cut_values[0].spec.nbytes_for(plan.stages[0].samples)
    assert plan.stages[0].comm_ms == pytest.approx(1e3 * (2 * cut / 123e6 + 2 * 0.25e-3))
    assert "optim ms" in plan.summary()
