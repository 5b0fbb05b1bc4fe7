"""ZeRO in one process: how owners share the tensors and buckets cut them, and an offloaded
optimizer state (the alone path offloads too) stepping like one process, fused Adam and
GradScaler included, and keeping the gradients when its step fails. On ranks:
``distributed/test_zero.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import rannc_fx
from examples.models import mlp_example
from rannc_fx.plan.config import Config
from rannc_fx.runtime.comm import buckets
from rannc_fx.runtime.zero import owners, shard_of
from tests.dist_utils import assert_like_reference

TOL = dict(rtol=1e-5, atol=1e-5)


def test_owners_share_whole_tensors_largest_first_to_the_least_loaded() -> None:
    sizes = [10, 3, 7, 7, 1, 2, 9]
    got = owners(sizes, 3)
    assert got == owners(sizes, 3)  # the same on every replica
    load = [sum(n for n, o in zip(sizes, got, strict=True) if o == r) for r in range(3)]
    # LPT: no replica holds more than an equal share plus its largest tensor
    assert max(load) <= sum(sizes) / 3 + max(sizes)
    assert sorted(load) == [12, 13, 14]
    assert owners([5, 5], 4) == [0, 1]  # more replicas than tensors: some own nothing
    assert owners([], 2) == []


def test_buckets_cut_whole_tensors_in_order() -> None:
    ps = [torch.zeros(n) for n in (3, 5, 2, 10, 1, 1)]  # 4 bytes an element
    assert [[p.numel() for p in b] for b in buckets(ps, 24)] == [[3], [5], [2], [10], [1, 1]]
    assert [[p.numel() for p in b] for b in buckets(ps, 400)] == [[3, 5, 2, 10, 1, 1]]
    assert [len(b) for b in buckets([torch.zeros(12, dtype=torch.float16)] * 3, 24)] == [1, 1, 1]
    assert buckets([], 24) == []


def test_offloaded_fused_adam_with_the_grad_scaler_steps_like_one_process():
    """A fused optimizer unscales inside its step (GradScaler's grad_scale and found_inf, set
    on the optimizer): every bucket's step unscales and skips alike (one process: the alone
    path offloads too)."""
    model, (x, y), _ = mlp_example(batch=8)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)
    cm = rannc_fx.compile(model, opt, Config(offload=True, profile_cache_dir=None,
                                             profile_repeats=1), example_args=(x, y))
    assert shard_of(opt) is not None and cm.plan.stages[0].offload
    scaler, ref_scaler = (rannc_fx.GradScaler("cpu", init_scale=2.0**10),
                          torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for step in range(3):
        for m, o, sc in ((cm, opt, scaler), (ref, ref_opt, ref_scaler)):
            sc.scale(m(x, y)).backward()
            if step == 1:  # an overflow: the step is skipped and the scale halves
                next(iter(m.parameters())).grad.view(-1)[0] = float("inf")
            sc.step(o)
            sc.update()
            o.zero_grad()
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**9
    assert_like_reference(cm.stages, ref, **TOL)


def test_an_offloaded_step_that_fails_keeps_the_gradients(monkeypatch):
    """A closure is refused, and a bucket's step that raises leaves .grad as it was: the
    step can be retried (one process: the alone path offloads too)."""
    model, (x, y), _ = mlp_example(batch=8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cm = rannc_fx.compile(model, opt, Config(offload=True, profile_cache_dir=None,
                                             profile_repeats=1), example_args=(x, y))
    cm(x, y).backward()
    grads = {n: p.grad.clone() for n, p in cm.stages[0].named_parameters()}

    def kept() -> None:
        for n, p in cm.stages[0].named_parameters():
            assert p.grad is not None and torch.equal(p.grad, grads[n]), n

    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    kept()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(type(opt).step, "__wrapped__", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        opt.step()
    kept()
    monkeypatch.undo()
    before = {n: p.detach().clone() for n, p in cm.stages[0].named_parameters()}
    opt.step()  # the retry steps
    assert any(not torch.equal(p, before[n]) for n, p in cm.stages[0].named_parameters())
