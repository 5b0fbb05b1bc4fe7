"""On one CUDA device (tier 2, skipped without CUDA): the stage placed on ``cuda:LOCAL_RANK``,
costs measured on the device, float16 autocast with ``rannc_fx.GradScaler``.

Each test runs in one forked process with torchrun's variables (``compile()`` starts its
own NCCL group), so that this process never initializes CUDA and the forked tests after
it still can. NCCL cannot run two ranks on one GPU: multi-rank runs need as many GPUs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

import rannc_fx
from examples.models import mlp_example
from rannc_fx.plan.config import Config
from tests.dist_utils import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CFG = dict(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0)
FP32 = dict(rtol=1e-4, atol=1e-5)  # cuBLAS sums in another order than the CPU


def _placed(rank: int, world: int) -> list[float]:
    torch.backends.cuda.matmul.allow_tf32 = False
    model, (x, y), _ = mlp_example(batch=8)
    ref = copy.deepcopy(model)  # stays on the CPU
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cm = rannc_fx.compile(model, opt, Config(**CFG), example_args=(x, y))  # device: None
    assert cm.device == torch.device("cuda", 0)  # cuda:LOCAL_RANK
    tensors = [*cm.stages[0].parameters(), *cm.stages[0].buffers()]
    assert tensors and all(t.device == cm.device for t in tensors)
    assert all(p.device == cm.device for g in opt.param_groups for p in g["params"])
    losses = []
    for _ in range(2):
        loss = cm(x.cuda(), y.cuda())
        want = ref(x, y)
        assert_close(loss.cpu(), want, **FP32)
        for lo, o in ((loss, opt), (want, ref_opt)):
            lo.backward()
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    for name, p in cm.stages[0].named_parameters():
        assert_close(p.cpu(), ref.get_parameter(name), **FP32)
    # a model built on the CPU is planned for the GPU it will run on, costed analytically
    # (timing its ops on the CPU would price the wrong hardware)
    assert cm.plan.cost_model == "analytic"
    assert cm.plan.device.name == torch.cuda.get_device_name(0)
    return losses


def test_the_stage_is_placed_on_the_local_rank_device_and_trains_like_the_cpu_model():
    losses = run_ranks(_placed, 1, timeout_s=60.0, wall_s=180.0, init=False)[0]
    assert losses[1] < losses[0]


def _measured(rank: int, world: int) -> tuple[str, bool, list[float], int]:
    model, (x, y), _ = mlp_example(batch=8)
    model = model.cuda()
    parted = rannc_fx.partition(model, (x.cuda(), y.cuda()), world_size=2,
                                config=Config(**CFG, replicas=(1, 1), micro_batches=2))
    plan = parted.plan
    named = plan.device.name == torch.cuda.get_device_name(0)
    return plan.cost_model, named, [b.fwd_ms for b in plan.blocks], plan.device.memory_bytes


def test_costs_are_measured_on_the_device_the_model_is_on():
    cost_model, named, fwd_ms, memory = run_ranks(_measured, 1, timeout_s=60.0, wall_s=180.0,
                                                  init=False)[0]
    assert cost_model == "measured"
    assert named and memory > 2**30  # the device's own name and memory size
    assert all(t >= 0 for t in fwd_ms) and sum(fwd_ms) > 0


def _fp16(rank: int, world: int) -> list[float]:
    model, (x, y), _ = mlp_example(batch=8)
    model = model.cuda()
    x, y = x.cuda(), y.cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cm = rannc_fx.compile(model, opt, Config(**CFG, autocast_dtype="float16"),
                          example_args=(x, y))
    scaler = rannc_fx.GradScaler(init_scale=2.0**10)  # "cuda" by default where it is
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    scales = []
    for step in range(3):
        for m, s, o in ((cm, scaler, opt), (ref, ref_scaler, ref_opt)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = m(x, y)
            s.scale(loss).backward()
            if step == 1:  # an overflow: the step is skipped and the scale halves
                next(iter(m.parameters())).grad.view(-1)[0] = float("inf")
            s.step(o)
            s.update()
            o.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        scales.append(scaler.get_scale())
    for name, p in cm.stages[0].named_parameters():
        assert_close(p, ref.get_parameter(name), rtol=1e-3, atol=1e-3)
    return scales


def test_float16_with_the_grad_scaler_follows_torchs_scaler():
    scales = run_ranks(_fp16, 1, timeout_s=60.0, wall_s=180.0, init=False)[0]
    assert scales == [2.0**10, 2.0**9, 2.0**9]


def _offloaded(rank: int, world: int) -> list[int]:
    """Adam's state in host memory on one GPU: it trains like the CPU model, the moments are
    on the host between steps (pinned), and the device holds no more than a bucket of them."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, (x, y), _ = mlp_example(batch=8)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    cm = rannc_fx.compile(model, opt, Config(offload=True, **CFG), example_args=(x, y))
    assert cm.plan.stages[0].offload
    for _ in range(3):
        for m, o, args in ((cm, opt, (x.cuda(), y.cuda())), (ref, ref_opt, (x, y))):
            m(*args).backward()
            o.step()
            o.zero_grad()
    moments = [v for p in cm.stages[0].parameters() for v in opt.state[p].values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert moments and all(v.device.type == "cpu" and v.is_pinned() for v in moments)
    for name, p in cm.stages[0].named_parameters():
        assert_close(p.cpu(), ref.get_parameter(name), **FP32)
    return [cm.plan.stages[0].memory.optimizer_state]


def test_offloaded_optimizer_state_lives_on_the_host_and_trains_like_the_cpu_model():
    state = run_ranks(_offloaded, 1, timeout_s=60.0, wall_s=180.0, init=False)[0]
    assert state == [0]  # the plan keeps none of it on the device
