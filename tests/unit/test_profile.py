"""The profile pass: measured and analytic per-node costs, the op cache, saved bytes."""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.models import MLP, TransformerLM, cnn_example, gpt_example
from rannc_fx.capture.capture import CapturedGraph, capture_pass
from rannc_fx.plan.device import DeviceSpec
from rannc_fx.profile.cache import arg_sig, qualname
from rannc_fx.profile.noderun import home_device
from rannc_fx.profile.profile import NodeCost, Profile, profile_pass
from rannc_fx.shapes.infer import infer_values_pass

CPU = DeviceSpec.preset("cpu")
A100 = DeviceSpec.preset("a100-80gb")


# -- graphs ------------------------------------------------------------------------------------


def captured(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[CapturedGraph, list[torch.Tensor]]:
    cap = capture_pass(model, args, kwargs)
    return cap, cap.flatten_inputs(args, kwargs)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Timing tests on one thread: on a shared 2-core host, OpenMP waits swamp small ops."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _profile(cap: CapturedGraph, flat: list[torch.Tensor], sizes: tuple[int, ...],
             cost_model: str = "measured", **kw: Any) -> Profile:
    spec = kw.pop("device_spec", CPU)
    return profile_pass(cap, flat, {}, batch_sizes=sizes, device_spec=spec,
                        cost_model=cost_model, **kw)  # type: ignore[arg-type]


# -- measured ----------------------------------------------------------------------------------


def test_measured_costs_positive(one_thread: None) -> None:
    torch.manual_seed(0)
    model = MLP(d_in=32, hidden=64, depth=3)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    cap, flat = captured(model, x, y)
    prof = _profile(cap, flat, (4, 8))
    calls = [n.name for n in cap.gm.graph.nodes if n.op in ("call_module", "call_function")]
    assert sorted(prof.nodes) == sorted(calls)
    for name, c in prof.nodes.items():
        assert all(t > 0 for t in c.fwd_s), name
        assert all(t > 0 for t in c.bwd_s), name  # everything here is on the loss's grad path
        assert all(w > 0 for w in c.workspace_bytes), name
    # A Linear's workspace is at least its output: samples x 64 floats.
    assert prof.nodes["layers_1"].workspace_bytes == (4 * 64 * 4, 8 * 64 * 4)


def test_matmul_time_grows_with_batch(one_thread: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    cap, flat = captured(model, torch.randn(16, 256))
    prof = _profile(cap, flat, (4, 1024))
    lin = prof.nodes["_2"]  # the second Linear: its input needs grad, so bwd has two matmuls
    assert lin.fwd_s[1] > 4 * lin.fwd_s[0], lin  # 256x the work
    assert lin.bwd_s[1] > 4 * lin.bwd_s[0], lin
    assert prof.at("_2", "fwd_s", 512) < lin.fwd_s[1]


def test_no_grad_path_has_no_backward(one_thread: None) -> None:
    class Head(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.argmax(-1), x * 2  # integer output; x needs no grad

    cap, flat = captured(Head(), torch.randn(8, 16))
    prof = _profile(cap, flat, (8,))
    assert all(c.bwd_s == (0.0,) for c in prof.nodes.values())
    assert all(c.saved_bytes == (0,) for c in prof.nodes.values())
    with pytest.raises(ValueError, match="at least one size"):
        _profile(cap, flat, ())


def _autograd_saved_bytes(model: nn.Module, *args: Any) -> int:
    """What autograd keeps after the forward: saved storages, parameters excluded."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(seen.values())


def _split_held_bytes(model: nn.Module, *args: Any) -> int:
    """What the runtime's split backward holds between B and W for the whole model (its
    input needing a gradient, as a later stage's: a first stage's B makes nothing and
    leaves it all): the saved storages B leaves for W, and the gradients kept for W's
    first nodes, parameters excluded."""
    from rannc_fx.runtime.backward_split import SavedBoxes, backward_inputs, keeping_for_split

    params = {p.untyped_storage()._cdata for p in model.parameters()}
    boxes = SavedBoxes()
    args = (args[0].detach().requires_grad_(True), *args[1:])
    with keeping_for_split(boxes):
        out = model(*args)
    work = backward_inputs([out], [torch.ones_like(out)], [args[0]], list(model.parameters()),
                           boxes)
    held = {b.tensor.untyped_storage()._cdata: b.tensor.untyped_storage().nbytes()
            for b in boxes if b.tensor is not None}
    grads = [g for gs in work.kept.values() for g in gs if g is not None] + [
        g for group in work.groups for _, _, g in group.seeded]
    held.update({g.untyped_storage()._cdata: g.untyped_storage().nbytes() for g in grads})
    return sum(n for k, n in held.items() if k not in params)


@pytest.mark.parametrize("samples", [3, 8])
def test_saved_and_weight_held_bytes_match_autograd(samples: int) -> None:
    torch.manual_seed(0)
    model = MLP(d_in=32, hidden=64, depth=3, classes=10)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    cap, flat = captured(model, x, y)
    prof = _profile(cap, flat, (samples,), repeats=1)
    saved = {n: c.saved_bytes[0] for n, c in prof.nodes.items()}
    # Each ReLU keeps its output (B x 64 floats), charged once though the next Linear keeps
    # it too; the first Linear keeps the input x for its weight gradient.
    f32 = 4
    assert saved["layers_0"] == samples * 32 * f32
    assert saved["relu"] == saved["relu_1"] == saved["relu_2"] == samples * 64 * f32
    assert saved["layers_1"] == saved["layers_2"] == saved["head"] == 0
    xs, ys = x[:samples].clone(), y[:samples].clone()
    assert sum(saved.values()) == _autograd_saved_bytes(model, xs, ys)
    # Per node, what a micro-batch holds between its split backward's B and W (the Linear
    # layers' inputs and their outputs' gradients, not the ReLUs' saved outputs beyond
    # those): summed over the nodes, what the runtime's split holds for the whole model.
    held = {n: c.wheld_bytes[0] for n, c in prof.nodes.items()}
    # the first Linear, whose input needs no gradient: its input x (W runs its whole backward
    # from a gradient it does not own); each ReLU: its output, which the next Linear's W
    # reads (charged to the ReLU that made it); each later Linear and the head: their
    # outputs' gradients; the loss: nothing
    assert held["layers_0"] == samples * 32 * f32
    assert held["relu"] == held["relu_1"] == held["relu_2"] == samples * 64 * f32
    assert held["layers_1"] == held["layers_2"] == samples * 64 * f32
    assert held["head"] == samples * 10 * f32
    # the model split as a later stage (x needing a gradient) keeps the first Linear's
    # output gradient too
    assert sum(held.values()) + samples * 64 * f32 == _split_held_bytes(model, xs, ys)


def test_inplace_ops_profile_on_clones(one_thread: None) -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.lin(x))
            h.mul_(2.0)
            return F.relu(h, inplace=True).sum()

    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(4, 16)
    want = model(x)
    cap, flat = captured(model, x)
    prof = _profile(cap, flat, (4,), repeats=1)
    assert prof.nodes["mul_"].fwd_s[0] > 0 and prof.nodes["mul_"].bwd_s[0] > 0
    assert torch.equal(cap.gm(x)[0], want) and torch.equal(x, flat[0])


def test_batchnorm_state_and_rng_untouched(one_thread: None) -> None:
    model, args, _ = cnn_example(batch=4, image=8)
    model.train()
    before = copy.deepcopy(model.state_dict())
    cap, flat = captured(model, *args)
    code = cap.gm.code
    rng = torch.random.get_rng_state()
    prof = _profile(cap, flat, (2, 4), repeats=1)
    assert prof.nodes["stem_1"].fwd_s[0] > 0  # a BatchNorm2d, in training mode
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert cap.gm.code == code  # an analysis pass


# -- the cache ---------------------------------------------------------------------------------


def _gpt(layers: int) -> tuple[CapturedGraph, list[torch.Tensor]]:
    model, args, kwargs = gpt_example(batch=4, layers=layers, seq=16)
    cap, flat = captured(model, *args, **kwargs)
    assert cap.tracer == "export"  # one node per op of every layer
    return cap, flat


def test_layers_share_measurements(one_thread: None, caplog: pytest.LogCaptureFixture) -> None:
    small, flat2 = _gpt(2)
    big, flat8 = _gpt(8)
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        p2 = _profile(small, flat2, (4,), repeats=1)
        p8 = _profile(big, flat8, (4,), repeats=1)
    assert len(p8.nodes) > 3 * len(p2.nodes) // 2
    assert p2.distinct == p8.distinct == p2.measured == p8.measured  # no disk cache here
    assert p8.from_cache - p2.from_cache == len(p8.nodes) - len(p2.nodes)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profiled")]
    assert f"profiled {len(p8.nodes)} nodes at 1 size(s) ({p8.measured} measured, " \
           f"{p8.from_cache} from cache" in lines[-1]
    # Identical layers cost the same.
    lin = sorted(n for n in p8.nodes if n.startswith("linear"))
    assert p8.nodes[lin[2]] == p8.nodes[lin[2 + 4]]  # 4 linear ops per layer


def test_profiles_persist_on_disk(tmp_path: Any, one_thread: None) -> None:
    torch.manual_seed(0)
    model = MLP(d_in=16, hidden=32, depth=2)
    cap, flat = captured(model, torch.randn(8, 16), torch.randint(0, 10, (8,)))
    first = _profile(cap, flat, (2, 8), cache_dir=tmp_path, repeats=1)
    (path,) = tmp_path.glob("profile-measured-*.json")
    doc = json.loads(path.read_text())
    assert doc["torch"] == torch.__version__ and doc["cost_model"] == "measured"
    assert doc["device"].startswith("cpu:")
    assert len(doc["entries"]) == first.distinct == first.measured
    again = _profile(cap, flat, (2, 8), cache_dir=tmp_path, repeats=1)
    assert again.measured == 0 and again.from_cache == 2 * len(again.nodes)
    assert again.nodes == first.nodes
    other = _profile(cap, flat, (2, 8), cost_model="analytic", cache_dir=tmp_path)
    assert other.measured == first.measured  # measured costs never answer analytic ones


# -- analytic ----------------------------------------------------------------------------------


def test_analytic_linear_flops() -> None:
    b, d_in, d_out = 8, 64, 48
    model = nn.Sequential(nn.Linear(d_in, d_in, bias=False), nn.Linear(d_in, d_out, bias=False))
    cap, flat = captured(model, torch.randn(b, d_in))
    rate = 1e12
    spec = DeviceSpec(name="compute-bound", memory_bytes=2**30, peak_flops={"float32": rate},
                      memory_bandwidth=1e30, interconnect_bandwidth=1e9, efficiency=1.0)
    prof = _profile(cap, flat, (b, 2 * b), cost_model="analytic", device_spec=spec)
    first, second = prof.nodes["_0"], prof.nodes["_1"]
    for i, s in enumerate((b, 2 * b)):
        assert first.fwd_s[i] * rate == pytest.approx(2 * s * d_in * d_in)
        # The graph input needs no grad: the first Linear's backward is its weight gradient.
        assert first.bwd_s[i] * rate == pytest.approx(2 * s * d_in * d_in)
        assert second.fwd_s[i] * rate == pytest.approx(2 * s * d_in * d_out)
        assert second.bwd_s[i] * rate == pytest.approx(2 * 2 * s * d_in * d_out)
    # x, which the first Linear keeps, and its output, which the second keeps: both charged
    # to the first (a graph input to the node that keeps it, a value to the node that made it).
    assert first.saved_bytes == (2 * b * d_in * 4, 2 * 2 * b * d_in * 4)
    assert second.saved_bytes == (0, 0)


def test_analytic_memory_bound_op() -> None:
    cap, flat = captured(nn.Sequential(nn.Linear(64, 64), nn.GELU()), torch.randn(32, 64))
    prof = _profile(cap, flat, (32,), cost_model="analytic", device_spec=A100)
    gelu = prof.nodes["_1"]
    moved = 2 * 32 * 64 * 4  # reads its input, writes its output
    assert gelu.fwd_s[0] == pytest.approx(moved / A100.memory_bandwidth)


def test_meta_transformer_lm_analytic() -> None:
    with torch.device("meta"):
        model = TransformerLM(layers=2, seq=16)
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    cap, flat = captured(model, ids, labels=ids)
    prof = _profile(cap, flat, (2, 4, 8), cost_model="analytic", device_spec=A100)
    assert prof.cost_model == "analytic" and prof.device == "a100-80gb"
    assert prof.from_cache > 0  # the second layer reuses the first's entries
    totals = [sum(c.fwd_s[i] + c.bwd_s[i] for c in prof.nodes.values()) for i in range(3)]
    saved = [sum(c.saved_bytes[i] for c in prof.nodes.values()) for i in range(3)]
    assert 0 < totals[0] < totals[1] < totals[2]
    assert 0 < saved[0] < saved[1] < saved[2]
    mm = [n for n in prof.nodes if n.startswith("linear")]
    assert mm and all(prof.nodes[n].fwd_s[0] > 0 and prof.nodes[n].bwd_s[0] > 0 for n in mm)
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(ValueError, match="meta device"):
        _profile(cap, flat, (2,), cost_model="measured")


class Gate(nn.Module):
    """Branches on a tensor's value, which fake tensors do not have."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if bool(x.sum() > 0) else self.lin(self.lin(x))


def test_value_branches_count_as_zero(caplog: pytest.LogCaptureFixture) -> None:
    with torch.device("meta"):
        model = nn.Sequential(Gate(), nn.ReLU())
    x = torch.zeros(4, 16, device="meta")
    cap = capture_pass(model, (x,), tracer="fx", leaf_modules=("Gate",))
    flat = cap.flatten_inputs((x,), {})
    spec = DeviceSpec(name="compute-bound", memory_bytes=2**30, peak_flops={"float32": 1e12},
                      memory_bandwidth=1e30, interconnect_bandwidth=1e9, efficiency=1.0)
    with caplog.at_level(logging.WARNING, logger="rannc_fx"):
        prof = _profile(cap, flat, (4,), cost_model="analytic", device_spec=spec)
    assert any("branches on tensor values" in r.getMessage() for r in caplog.records)
    # x.sum() > 0 read as False: the two-Linear branch.
    assert prof.nodes["_0"].fwd_s[0] * 1e12 == pytest.approx(2 * 2 * 4 * 16 * 16)


def test_meta_bert_analytic_reuses_layers() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    with torch.device("meta"):
        model = transformers.BertForPreTraining(cfg)
    ids = torch.zeros(4, 64, dtype=torch.long, device="meta")
    cap, flat = captured(model, ids, labels=ids)
    assert cap.tracer == "export"
    values = infer_values_pass(cap, flat)
    prof = profile_pass(cap, flat, values, batch_sizes=(1, 4), device_spec=A100,
                        cost_model="analytic")
    # Layers 2-4 are answered from layer 1's entries.
    assert prof.from_cache > 2 * len(prof.nodes) // 2
    fwd = [sum(c.fwd_s[i] for c in prof.nodes.values()) for i in range(2)]
    # Dense FLOPs of the 4 layers and the MLM head at 64 tokens per sample, as a floor.
    tokens, h = 64, 256
    flops = tokens * (4 * (2 * 4 * h * h + 2 * 2 * h * 1024) + 2 * h * 1024)
    assert fwd[0] >= flops / (A100.flops_for("float32") * A100.efficiency)
    assert fwd[1] == pytest.approx(4 * fwd[0], rel=0.25)


@pytest.mark.parametrize("name", ["gpt2", "bert", "resnet"])
def test_analytic_profile_of_a_real_cpu_model(name: str) -> None:
    """Fakes take the model's device: export bakes ``device=cpu`` into ops that make tensors
    (GPT-2's position ids, BERT's mask, ResNet's loss), so meta fakes met cpu ones there."""
    hf_models = pytest.importorskip("tests.hf_models")
    model, args, kwargs = getattr(hf_models, f"{name}_example")()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cap, flat = captured(model, *args, **kwargs)
    values = infer_values_pass(cap, flat)
    assert home_device(cap.gm, flat) == torch.device("cpu")
    prof = profile_pass(cap, flat, values, batch_sizes=(1, 3), device_spec=A100,
                        cost_model="analytic")
    assert prof.cost_model == "analytic" and prof.device == "a100-80gb"
    assert sum(c.fwd_s[1] for c in prof.nodes.values()) > sum(c.fwd_s[0] for c in prof.nodes.values()) > 0
    # Fake CPU tensors run the CPU kernels' meta functions, so what autograd keeps and the
    # transient bytes are exactly what the measured profile sees on real tensors.
    measured = profile_pass(cap, flat, values, batch_sizes=(1, 3), device_spec=CPU,
                            cost_model="measured", repeats=1)
    for n, c in prof.nodes.items():
        assert c.saved_bytes == measured.nodes[n].saved_bytes, n
        assert c.workspace_bytes == measured.nodes[n].workspace_bytes, n
        assert c.wheld_bytes == measured.nodes[n].wheld_bytes, n
    assert 0 < sum(c.wheld_bytes[1] for c in prof.nodes.values()) < sum(
        c.saved_bytes[1] for c in prof.nodes.values())
    after = model.state_dict()
    assert all(v.device.type == "cpu" and torch.equal(v, after[k]) for k, v in before.items())


def test_home_device_is_the_models_or_meta() -> None:
    lin = nn.Linear(4, 4)
    gm = torch.fx.symbolic_trace(lin)
    assert home_device(gm, [torch.zeros(2, 4)]) == torch.device("cpu")
    assert home_device(gm, [torch.zeros(2, 4, device="meta")]) == torch.device("meta")
    with torch.device("meta"):
        meta_gm = torch.fx.symbolic_trace(nn.Linear(4, 4))
    assert home_device(meta_gm, [torch.zeros(2, 4)]) == torch.device("meta")
    no_state = torch.fx.symbolic_trace(nn.ReLU())
    assert home_device(no_state, [torch.zeros(2, device="meta")]) == torch.device("meta")
    assert home_device(no_state, [3]) == torch.device("cpu")


def test_op_keys_take_any_argument() -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "Opaque()"

    class Outer:
        @staticmethod
        def inner(x: torch.Tensor) -> torch.Tensor:
            return x

    assert arg_sig(Opaque()).endswith("Opaque:Opaque()")
    assert qualname(Outer.inner).endswith("Outer.inner")
    assert qualname(F.relu) == "torch.nn.functional.relu"


# -- Profile.at --------------------------------------------------------------------------------


def test_profile_at_interpolates() -> None:
    c = NodeCost(fwd_s=(1.0, 2.0, 6.0), bwd_s=(3.0, 2.0, 1.0), saved_bytes=(10, 20, 40),
                 workspace_bytes=(0, 0, 0))
    p = Profile(batch_sizes=(2, 4, 8), cost_model="measured", device="cpu", nodes={"n": c})
    assert p.at("n", "fwd_s", 3) == pytest.approx(1.5)
    assert p.at("n", "fwd_s", 6) == pytest.approx(4.0)
    assert p.at("n", "fwd_s", 16) == pytest.approx(14.0)  # extrapolated from 4 and 8
    assert p.at("n", "fwd_s", 1) == pytest.approx(0.5)
    assert p.at("n", "bwd_s", 1) == pytest.approx(3.5)
    assert p.at("n", "bwd_s", 100) == 0.0  # clamped
    assert p.at("n", "saved_bytes", 4) == 20
    single = Profile(batch_sizes=(4,), cost_model="measured", device="cpu",
                     nodes={"n": NodeCost(fwd_s=(2.0,), bwd_s=(0.0,), saved_bytes=(8,),
                                          workspace_bytes=(8,))})
    assert single.at("n", "fwd_s", 6) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="unknown cost field"):
        p.at("n", "fwd", 2)
    with pytest.raises(KeyError):
        p.at("missing", "fwd_s", 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        Profile(batch_sizes=(4, 2), cost_model="measured", device="cpu", nodes={})
    assert math.isfinite(p.at("n", "workspace_bytes", 5))
