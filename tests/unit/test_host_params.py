"""Parameters in host memory (``runtime/host_params.py``) in one process: each use fetches
its parameter, the forward keeps no copy of one, the device holds the windows the plan
counts, and the planner and the simulator cost it per stage. Training on ranks:
``distributed/test_host_params.py``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing import assert_close

import rannc_fx
from examples.models import TransformerLM
from rannc_fx.plan.config import Config
from rannc_fx.plan.device import DeviceSpec
from rannc_fx.plan.plan import Plan
from rannc_fx.runtime import host_params as hp
from rannc_fx.runtime.host_params import HostParams, fetching, saving
from rannc_fx.schedules.program import simulate_plan
from tests.gpt_training import (
    LiveBytes,
    gpt,
)
from tests.harness import test_config


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))) * self.scale + x


def _graphs() -> list[tuple[str, fx.GraphModule]]:
    """The block as torch.fx captures it (Linear leaves: call_module) and as torch.export
    does (every parameter a get_attr)."""
    torch.manual_seed(0)
    block = nn.Sequential(_Block(), _Block())
    x = torch.randn(8, 64)
    exported = torch.export.export(block, (x,), strict=False).module()
    assert isinstance(exported, fx.GraphModule)
    return [("fx", fx.symbolic_trace(block)), ("export", exported)]


def _forward_backward(gm: fx.GraphModule, host: HostParams | None, amp: bool = False
                      ) -> tuple[int, dict[str, torch.Tensor | None]]:
    """Live bytes the forward leaves (parameter storages known: not new) and the gradients
    (``amp``: the forward under CPU bfloat16 autocast)."""
    torch.manual_seed(1)
    x = torch.randn(8, 64, requires_grad=True)
    known = {p.untyped_storage()._cdata for p in gm.parameters()}
    with LiveBytes(known) as live:
        with fetching(host), saving(host), torch.autocast("cpu", torch.bfloat16, enabled=amp):
            y = gm(x)
        left = live.now
    with fetching(host):
        y.float().square().sum().backward()
    return left, {n: p.grad for n, p in gm.named_parameters()}


@pytest.mark.parametrize("kind", ["fx", "export"])
def test_the_forward_keeps_no_parameter_copy_and_the_gradients_are_exact(kind):
    gm = dict(_graphs())[kind]
    plain_left, plain_grads = _forward_backward(gm, None)
    gm.zero_grad(set_to_none=True)
    host = HostParams(gm, torch.device("cpu"), window=1 << 20)
    host.install()
    code = gm.code
    assert hp.FETCH in code  # every use goes through a fetch, printed in the stage's code
    left, grads = _forward_backward(gm, host)
    # what the forward leaves is what it leaves without fetching (activations), not the
    # copies ops saved of the parameters (fc1's and fc2's weights: 2 x 2 x 64 KiB)
    assert left <= plain_left, (left, plain_left)
    assert host.saved_tokens >= 4  # each Linear saved its weight: a token instead
    assert host.fetched_bytes >= 2 * sum(p.nbytes for p in gm.parameters())  # F and B
    for name, g in grads.items():  # bit for bit the gradients of the stage as it was
        want = plain_grads[name]
        assert g is not None and want is not None and torch.equal(g, want), name


@pytest.mark.parametrize("kind", ["fx", "export"])
def test_under_autocast_the_forward_keeps_no_cast_of_a_parameter(kind):
    """Autocast casts each fetched weight before its product, which saves the cast (a new
    tensor, no view of the copy): it becomes a token too, cast again in the backward."""
    gm = dict(_graphs())[kind]
    plain_left, plain_grads = _forward_backward(gm, None, amp=True)
    gm.zero_grad(set_to_none=True)
    host = HostParams(gm, torch.device("cpu"), window=1 << 20)
    host.install()
    left, grads = _forward_backward(gm, host, amp=True)
    # without parameters on the host the forward keeps the four Linears' bfloat16 weights
    assert left <= plain_left - 4 * 64 * 256 * 2, (left, plain_left)
    assert host.saved_tokens >= 4
    for name, g in grads.items():
        want = plain_grads[name]
        assert g is not None and want is not None and torch.equal(g, want), name


def test_without_tokens_the_forward_would_keep_the_copies():
    """The check above can fail: saving the copies themselves leaves them alive."""
    gm = dict(_graphs())["export"]
    plain_left, _ = _forward_backward(gm, None)
    gm.zero_grad(set_to_none=True)
    host = HostParams(gm, torch.device("cpu"), window=1 << 20)
    host.install()
    host._pack = lambda t: t  # type: ignore[method-assign]
    left, _ = _forward_backward(gm, host)
    assert left >= plain_left + 2 * 2 * 64 * 256 * 4


def test_fetching_ahead_stays_within_the_window():
    gm = dict(_graphs())["export"]
    window = 64 * 256 * 4  # one fc weight
    host = HostParams(gm, torch.device("cpu"), window=window)
    host.install()
    peak = 0
    original = host._ahead_of

    def watched(p: torch.Tensor, forward: bool) -> None:
        nonlocal peak
        original(p, forward)
        peak = max(peak, sum(c.nbytes for c, _ in host._ahead.values()))

    host._ahead_of = watched  # type: ignore[method-assign]
    for _ in range(2):  # the first forward records the order, the second fetches ahead
        _forward_backward(gm, host)
    assert 0 < peak <= window


@functools.cache
def _gpt_plan(schedule: Any, recompute: bool | None = False, selective: bool | None = False,
              replicas: tuple[int, ...] = (1, 1), layers: bool | None = False) -> Plan:
    model, args, kwargs = gpt(0.0)
    cfg = test_config(cost_model="analytic",
                      host_params=True, recompute=recompute, recompute_selective=selective,
                      recompute_layers=layers, replicas=replicas, micro_batches=2,
                      schedule=schedule)
    return rannc_fx.partition(model, args, kwargs, world_size=2, device="cpu", config=cfg).plan


def _one_stage() -> rannc_fx.Partitioned:
    model, args, kwargs = gpt(0.0)
    cfg = test_config(cost_model="analytic",
                      host_params=True, replicas=(2,), micro_batches=1)
    return rannc_fx.partition(model, args, kwargs, world_size=2, device="cpu", config=cfg)


def test_a_forced_plan_keeps_every_stage_on_the_host_and_says_so():
    plan = _gpt_plan("1f1b")
    assert all(st.host_params and st.window_bytes > 0 for st in plan.stages)
    for st in plan.stages:
        # the device holds two windows of parameters and one of gradients, no state
        assert st.memory.params == 2 * st.window_bytes and st.memory.grads == st.window_bytes
        assert st.memory.optimizer_state == 0 and st.host_bytes > st.window_bytes
    assert "params " in plan.summary()


def test_the_search_keeps_parameters_on_the_host_only_where_nothing_else_fits():
    """A 16-layer GPT of width 1024 (about 200 M parameters, 0.8 GB; 13 GB with gradients
    and Adam's state) on 2 V100s: with their 32 GB nothing moves to the host; with 1 GiB each
    no recomputation or offloaded state makes a stage fit, parameters on the host do."""
    with torch.device("meta"):
        model = TransformerLM(vocab=32000, d_model=1024, heads=16, layers=16, seq=128)
    ids = torch.randint(0, 32000, (8, 128))
    spec = DeviceSpec.preset("v100-32gb")

    def plan(memory: int) -> Plan:
        return rannc_fx.partition(model, (ids,), {"labels": ids}, world_size=2, device=spec,
                                  config=test_config(device_memory=memory,
                                                     replicas=(1, 1))).plan

    roomy = plan(32 * 2**30)
    assert not any(st.host_params for st in roomy.stages), roomy.summary()
    tight = plan(2**30)  # 0.9 GiB usable: a stage's parameters and gradients are 1 GiB
    assert all(st.host_params for st in tight.stages), tight.summary()
    assert all(st.memory.total <= tight.memory_budget for st in tight.stages)
    assert all(st.fetch_ms > 0 and st.host_bytes > 2**30 for st in tight.stages)


def test_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="host_params=True with zero"):
        Config(host_params=True, zero=1)
    with pytest.raises(ValueError, match="schedule='zbv'"):
        Config(host_params=True, schedule="zbv")
    plan = _gpt_plan("1f1b")
    bad = plan.model_dump()
    bad["stages"][0]["offload"] = True
    with pytest.raises(ValueError, match="stage 0 keeps its parameters in host memory"):
        Plan.model_validate(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_device_holds_a_window_of_parameters():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    gm = fx.symbolic_trace(layers)
    want = [p.detach().clone() for p in gm.parameters()]
    window = 2 * 1024 * 1024 * 4
    host = HostParams(gm, dev, window=window)
    host.install()
    x = torch.randn(64, 1024, device=dev, requires_grad=True)
    ref = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)]).to(dev)
    ref.load_state_dict({k: v.to(dev) for k, v in layers.state_dict().items()})
    for _ in range(2):
        ref(x).sum().backward()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    for _ in range(2):
        with fetching(host), saving(host):
            y = gm(x)
        with fetching(host):
            y.sum().backward()
    peak = torch.cuda.max_memory_allocated(dev) - base
    params = sum(p.nbytes for p in gm.parameters())
    assert peak < params / 2, (peak, params)  # 16 x 4 MiB never on the device at once
    for p, w, r in zip(gm.parameters(), want, ref.parameters(), strict=True):
        assert p.device.type == "cpu" and torch.equal(p, w)
        assert p.grad is not None and p.grad.device.type == "cpu"
        assert r.grad is not None
        assert_close(p.grad, r.grad.cpu())


def test_the_device_holds_the_parameters_the_plan_counts():
    """The GPT as one stage (the forced plan on 2 replicas), run in this process as the
    runtime runs it: the fetched copies alive at once -- what of the parameters is on the
    device -- reach the plan's two windows (those fetched ahead, those in use) within 10 %,
    never more, and a fraction of the stage's parameters."""
    part = _one_stage()
    gm, st = part.stages[0], part.plan.stages[0]
    host = HostParams(gm, torch.device("cpu"), window=st.window_bytes)
    host.install()
    live: list[tuple[StorageWeakRef, int]] = []
    peak = 0
    made = host._copy

    def tracked(p: torch.Tensor, stream: Any) -> Any:
        nonlocal peak
        out = made(p, stream)
        live.append((StorageWeakRef(out[0].untyped_storage()), out[0].nbytes))
        peak = max(peak, sum(n for ref, n in live if not ref.expired()))
        return out

    host._copy = tracked  # type: ignore[method-assign]
    model, args, kwargs = gpt(0.0)
    for _ in range(2):  # the first forward records the order, the second fetches ahead
        with fetching(host), saving(host):
            out = part(*args, **kwargs)
        with fetching(host):
            out["loss"].backward()
    assert 0.9 * st.memory.params <= peak <= st.memory.params, (peak, st.memory.params)
    assert peak < sum(p.nbytes for p in gm.parameters()) / 4


def test_the_simulator_stretches_a_host_stage_by_its_transfers():
    """On the CPU (no copy engine) a host stage's F, R and B take their compute plus their
    share of the transfers: stage 0 given transfers of 10 times its compute runs each of its
    micro-batches 11 times as long, and the step holds all of them one after another."""
    plan = _gpt_plan("1f1b")
    st = plan.stages[0]
    compute = st.fwd_ms + st.bwd_ms + st.again_ms
    slow = plan.model_copy(update={"stages": (
        st.model_copy(update={"fetch_ms": 10 * compute}), *plan.stages[1:])})
    base, stretched = simulate_plan(plan).makespan, simulate_plan(slow).makespan
    assert stretched >= plan.micro_batches * 11 * compute * 1e-3 * (1 - 1e-9) > 2 * base
    same = plan.model_copy(update={"stages": (
        st.model_copy(update={"fetch_ms": 0.0}), *plan.stages[1:])})
    assert st.fetch_ms > 0 and simulate_plan(same).makespan < base  # the plan's own, added
