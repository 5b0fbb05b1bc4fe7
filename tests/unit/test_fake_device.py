"""Runs on fake tensors compute as the plan's kind of device: a model built on the meta device
is planned as the same model built on the CPU (autocast's dtypes, fused attention), and
attention's FLOPs and an op's compute dtype are counted as the kernels run them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from rannc_fx.planner.analyze import analyze
from rannc_fx.planner.driver import plan_model
from rannc_fx.profile.fakes import fake_device, fake_of, retarget
from rannc_fx.profile.flops import Flops, causal_fraction
from rannc_fx.profile.instruments import storage_id
from rannc_fx.profile.opcost import OpCall, count_op
from tests.harness import test_config

PRESET = "h100-80gb"


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CausalLM(nn.Module):
    """A small causal LM: positions made where the tokens are (a device the graph names)."""

    def __init__(self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 2,
                 seq: int = 256) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())


def _lm(device: str, seq: int = 64, batch: int = 4, layers: int = 2,
        d: int = 64) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(layers=layers, d=d)
    ids = torch.randint(0, 128, (batch, seq), device=device)
    return model, (ids, ids.roll(-1, 1))


def _config(tracer: str, amp: str | None, **kw: Any) -> Any:
    return test_config(tracer=tracer, autocast_dtype=amp, **kw)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_meta_model_is_planned_as_the_same_model_built_on_the_cpu(tracer):
    plans = {}
    for device in ("meta", "cpu"):
        for amp in (None, "bfloat16"):
            model, args = _lm(device, d=512)  # wide enough for its matmuls to set the pace
            plans[device, amp] = plan_model(model, args, {}, world_size=2, device=PRESET,
                                            config=_config(tracer, amp)).plan
    for amp in (None, "bfloat16"):
        meta, cpu = plans["meta", amp], plans["cpu", amp]
        assert [(st.first_block, st.end_block, st.replicas) for st in meta.stages] == [
            (st.first_block, st.end_block, st.replicas) for st in cpu.stages], amp
        assert meta.predicted_step_ms == pytest.approx(cpu.predicted_step_ms, rel=0.01), amp
        # the same up to the strides a meta capture's values have (torch.export's: a fused
        # attention's output interleaves its heads, the math path's on meta does not, so a
        # reshape after it copies there: 6 % of the activations here)
        for a, b in zip(meta.stages, cpu.stages, strict=True):
            assert a.memory.total == pytest.approx(b.memory.total, rel=0.1), amp
    # bfloat16 prices the matmuls at its rate (float32's was used for a meta model)
    assert plans["meta", "bfloat16"].predicted_step_ms <= 0.8 * plans["meta", None].predicted_step_ms
    assert {cv.spec.dtype for cv in plans["meta", "bfloat16"].cut_values} == {
        cv.spec.dtype for cv in plans["cpu", "bfloat16"].cut_values}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_meta_model_s_values_have_the_dtypes_autocast_gives_them(tracer):
    values = {}
    for device in ("meta", "cpu"):
        model, args = _lm(device)
        values[device] = analyze(model, args, {}, world_size=1, device=PRESET,
                                 config=_config(tracer, "bfloat16")).values
    assert values["meta"] == values["cpu"]
    assert {v.dtype for v in values["meta"].values()} >= {"bfloat16", "float32"}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_attention_s_saved_bytes_grow_with_the_length_not_its_square(tracer):
    """The fused kernel saves its output and a log-sum-exp row per head (the math path on
    meta saved each head's score matrix: 4x the length held 5.9x the bytes)."""
    saved = {}
    for seq in (64, 256):
        model, args = _lm("meta", seq=seq, batch=2, layers=1)
        profile = analyze(model, args, {}, world_size=1, device=PRESET,
                          config=_config(tracer, None)).profile
        i = profile.batch_sizes.index(1)
        saved[seq] = sum(c.saved_bytes[i] for c in profile.nodes.values())
    assert saved[256] <= 4.2 * saved[64], saved


def test_fused_attention_counts_the_math_it_replaces_and_a_causal_mask_s_unmasked_part():
    b, h, s, d = 2, 4, 96, 32
    mode = FakeTensorMode()
    q = fake_of(mode, torch.empty(b, h, s, d, device="meta"), fake_device("cpu"))
    with mode, Flops() as fused:
        F.scaled_dot_product_attention(q, q, q)
    with FlopCounterMode(display=False) as math, torch.device("meta"):
        x = torch.empty(b, h, s, d)
        torch.softmax(x @ x.transpose(-1, -2), -1) @ x
    assert fused.total == math.get_total_flops() == sdpa_flop_count(q.shape, q.shape, q.shape)
    with mode, Flops() as causal:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert causal.total == round(fused.total * causal_fraction(s, s))
    assert causal_fraction(s, s) == (s + 1) / (2 * s)
    assert causal_fraction(2, 3) == 3 / 6 and causal_fraction(3, 2) == 5 / 6


def test_an_op_s_compute_dtype_is_its_kernels_not_its_inputs():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = fake_device("cpu")
    x, w = (fake_of(mode, torch.empty(*s, device="meta", requires_grad=True), cpu)
            for s in ((8, 64), (32, 64)))
    with mode:
        _, plain = count_op(OpCall(F.linear, (x, w), {}))
        with torch.autocast("cpu", torch.bfloat16):
            _, amp = count_op(OpCall(F.linear, (x, w), {}))
    assert (plain.dtype, amp.dtype) == ("float32", "bfloat16")
    assert amp.fwd_flops == plain.fwd_flops == 2 * 8 * 32 * 64


def test_the_capture_s_device_in_a_node_s_arguments_becomes_the_fakes():
    meta, cpu = torch.device("meta"), torch.device("cpu")
    args, kwargs = retarget((3, meta, [meta]), {"device": "meta", "dtype": torch.int64}, meta, cpu)
    assert args == (3, cpu, [cpu]) and kwargs == {"device": cpu, "dtype": torch.int64}
    assert retarget((cpu,), {"device": "cpu"}, cpu, cpu) == ((cpu,), {"device": "cpu"})


@pytest.mark.parametrize("trains", [True, False])
def test_autocast_s_copy_of_a_weight_that_trains_is_counted_apart(trains):
    """Its cache makes one a step (every micro-batch's backward reads it): ``cast_bytes``,
    which the search holds once a stage; a frozen weight's copy is made per call."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = fake_device("cpu")
    x = fake_of(mode, torch.empty(8, 64, device="meta", requires_grad=True), cpu)
    w = fake_of(mode, torch.empty(32, 64, device="meta", requires_grad=trains), cpu)
    call = OpCall(F.linear, (x, w), {}, excluded=frozenset({storage_id(w)}))
    with mode:
        _, plain = count_op(call)
        with torch.autocast("cpu", torch.bfloat16):
            _, amp = count_op(call)
            _, again = count_op(call)  # the cache would hide a second call's cast
    assert plain.cast_bytes == 0
    assert amp.cast_bytes == again.cast_bytes == (32 * 64 * 2 if trains else 0)
    assert amp.saved_internal >= amp.cast_bytes
