"""capture_pass: the flat graph computes what the model computes, on the model's own tensors."""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from examples.models import MLP, ResCNN, gpt_example, mlp_example
from rannc_fx.capture.capture import (
    CapturedGraph,
    CaptureError,
    capture_pass,
    retarget_device_pass,
)
from tests.conftest import zoo_example

# (zoo model, tracer asked for, tracer that must have captured it)
CASES = [
    ("mlp", "auto", "fx"),
    ("mlp", "export", "export"),
    ("cnn", "auto", "fx"),
    ("cnn", "export", "export"),
    ("gpt", "auto", "export"),  # fx would keep nn.TransformerEncoder whole; see below
    ("bert", "auto", "export"),  # torch.fx cannot trace transformers 5 models
    ("gpt2", "auto", "export"),
    ("resnet", "auto", "export"),
]
IDS = [f"{m}-{t}" for m, t, _ in CASES]


def run(cg: CapturedGraph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return cg.unflatten_outputs(cg.gm(*cg.flatten_inputs(args, kwargs)))


def assert_same(out: Any, expected: Any) -> None:
    """Same pytree structure and type, bitwise equal leaves."""
    assert type(out) is type(expected)
    assert pytree.tree_structure(out) == pytree.tree_structure(expected)
    for o, e in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


def assert_same_state(model: nn.Module, ref: nn.Module) -> None:
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        torch.testing.assert_close(b, rb, rtol=0, atol=0, msg=name)


def first_samples(args: tuple[Any, ...], kwargs: dict[str, Any], batch: int, n: int) -> Any:
    return pytree.tree_map(
        lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t,
        (args, kwargs),
    )


# -- equivalence -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "tracer", "expect"), CASES, ids=IDS)
def test_graph_computes_what_the_model_does(zoo, name, tracer, expect):
    model, args, kwargs, cg = zoo(name, tracer)
    assert cg.tracer == expect
    ref = copy.deepcopy(model)
    assert_same(run(cg, args, kwargs), ref(*args, **kwargs))
    assert_same_state(model, ref)  # BatchNorm statistics moved exactly as in eager mode

    # The flat form: one placeholder per tensor leaf, a flat tuple of tensors out.
    placeholders = [n.name for n in cg.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == cg.input_names
    assert len(placeholders) == len(cg.tensor_leaf_index)
    flat_out = cg.gm(*cg.flatten_inputs(args, kwargs))
    assert isinstance(flat_out, tuple)
    assert all(isinstance(t, torch.Tensor) for t in flat_out)
    output = next(n for n in cg.gm.graph.nodes if n.op == "output")
    assert [n.name for n in output.args[0]] == cg.output_names


@pytest.mark.parametrize(("name", "tracer", "expect"), CASES, ids=IDS)
@pytest.mark.parametrize("samples", [1, 3])
def test_graph_runs_at_other_batch_sizes(zoo, name, tracer, expect, samples):
    """Captured at the example's batch, run on micro-batches of another size."""
    model, args, kwargs, cg = zoo(name, tracer)
    batch = cg.flatten_inputs(args, kwargs)[0].shape[0]
    sub_args, sub_kwargs = first_samples(args, kwargs, batch, samples)
    ref = copy.deepcopy(model)
    assert_same(run(cg, sub_args, sub_kwargs), ref(*sub_args, **sub_kwargs))


def test_gpt_forced_tracers(zoo):
    """TransformerLM: fx keeps nn.TransformerEncoder whole; export traces it layer by layer."""
    model, args, kwargs, cg = zoo("gpt", "fx")
    assert [n.target for n in cg.gm.graph.nodes if n.op == "call_module"] == [
        "embed", "encoder", "norm", "head"]
    assert_same(run(cg, args, kwargs), copy.deepcopy(model)(*args, **kwargs))
    model, args, kwargs, cg = zoo("gpt", "export")
    layers = {p for n in cg.gm.graph.nodes
              for p, _ in (n.meta.get("nn_module_stack") or {}).values()
              if p.startswith("encoder.layers.")}
    assert {"encoder.layers.0", "encoder.layers.1"} <= layers
    assert not any(n.op == "call_module" for n in cg.gm.graph.nodes)
    assert_same(run(cg, args, kwargs), copy.deepcopy(model)(*args, **kwargs))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).relu()


def test_auto_prefers_export_to_an_opaque_torch_nn_container():
    """torch.fx keeps torch.nn modules whole; a whole encoder layer is no place to cut."""
    model, x = _Encoder(), torch.randn(4, 5, 16)
    cg = capture_pass(model, (x,))
    assert cg.tracer == "export" and cg.num_nodes > 20
    torch.testing.assert_close(run(cg, (x,), {}), model(x), rtol=0, atol=0)
    kept = capture_pass(model, (x,), leaf_modules=("TransformerEncoderLayer",))
    assert kept.tracer == "fx"
    assert [n.target for n in kept.gm.graph.nodes if n.op == "call_module"] == ["layer"]


class _MaskedEncoder(nn.Module):
    """nn.TransformerEncoder with a mask but no is_causal: it compares the mask with a causal
    one, a data-dependent branch that torch.export refuses."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.register_buffer("mask", torch.triu(torch.full((5, 5), float("-inf")), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, mask=self.mask).relu()


def test_auto_says_when_it_keeps_a_container_whole(caplog):
    model, x = _MaskedEncoder(), torch.randn(4, 5, 16)
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        cg = capture_pass(model, (x,))
        capture_pass(model, (x,), leaf_modules=("TransformerEncoder",))
    first, second = [r for r in caplog.records if r.name == "rannc_fx"]
    assert cg.tracer == "fx"
    assert first.levelno == logging.WARNING
    assert "kept encoder (TransformerEncoder) as one node" in first.getMessage()
    assert second.levelno == logging.INFO and "with torch.fx" in second.getMessage()
    torch.testing.assert_close(run(cg, (x,), {}), model(x), rtol=0, atol=0)


# -- parameters and buffers ------------------------------------------------------------------


@pytest.mark.parametrize(("name", "tracer", "expect"), CASES, ids=IDS)
def test_parameters_and_buffers_are_the_models_own(zoo, name, tracer, expect):
    model, _, _, cg = zoo(name, tracer)
    own = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(cg.gm.named_parameters(remove_duplicate=False))
    assert theirs and all(p is own[n] for n, p in theirs.items())
    assert {id(p) for p in cg.gm.parameters()} == {id(p) for p in model.parameters()}
    own_b = dict(model.named_buffers(remove_duplicate=False))
    assert all(b is own_b[n] for n, b in cg.gm.named_buffers() if n in own_b)


@pytest.mark.parametrize(("name", "canonical", "alias"), [
    ("gpt", "embed.weight", "head.weight"),
    ("gpt2", "transformer.wte.weight", "lm_head.weight"),
])
def test_tied_parameters_are_one_object(zoo, name, canonical, alias):
    model, _, _, cg = zoo(name)
    assert cg.aliases[alias] == canonical
    weight = model.get_parameter(canonical)
    names = [n for n, p in cg.gm.named_parameters(remove_duplicate=False) if p is weight]
    assert set(names) == {canonical, alias}
    assert sum(1 for p in cg.gm.parameters() if p is weight) == 1  # the optimizer sees it once


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)  # b is never called: its weight only lives on under b's name


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_tied_parameter_is_reachable_under_every_name(tracer):
    model = _Tied()
    cg = capture_pass(model, (torch.randn(2, 4),), tracer=tracer)
    assert cg.aliases == {"b.weight": "a.weight"}
    assert cg.gm.get_parameter("b.weight") is cg.gm.get_parameter("a.weight") is model.a.weight


@pytest.mark.parametrize(("name", "tracer"), [("cnn", "auto"), ("cnn", "export"), ("resnet", "auto")])
def test_batch_norm_statistics_update_the_models_buffers(zoo, name, tracer):
    model, args, kwargs, cg = zoo(name, tracer)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert bns
    for bn in bns:
        bn.reset_running_stats()
    cg.gm(*cg.flatten_inputs(args, kwargs))
    for bn in bns:
        assert bn.num_batches_tracked.item() == 1
        assert bn.running_mean.abs().sum() > 0


def test_capture_does_not_touch_the_model():
    model, args, kwargs = zoo_example("cnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for tracer in ("fx", "export"):
        capture_pass(model, args, kwargs, tracer=tracer)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training


# -- meta device -----------------------------------------------------------------------------


def _on_meta(cg: CapturedGraph, model: nn.Module) -> None:
    state = [*cg.gm.parameters(), *cg.gm.buffers()]
    assert state and all(t.device.type == "meta" for t in state)
    assert all(t.device.type == "meta" for t in model.parameters())


def test_meta_transformer_lm_captures_without_memory():
    with torch.device("meta"):
        model, args, kwargs = gpt_example()
    assert args[0].device.type == "meta"
    cg = capture_pass(model, args, kwargs)
    _on_meta(cg, model)
    assert cg.aliases == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("real_ids", [False, True])
def test_meta_gpt2_captures_and_runs_after_materializing(real_ids):
    """Capture on meta (export bakes device=meta into factory calls), then run on the CPU."""
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model, args, kwargs = zoo_example("gpt2")
    if real_ids:
        ids = torch.randint(0, 512, tuple(args[0].shape))
        args, kwargs = (ids,), {"labels": ids}
    cg = capture_pass(model, args, kwargs)
    assert cg.tracer == "export"
    _on_meta(cg, model)

    retarget_device_pass(cg.gm, "cpu")
    devices = [a for n in cg.gm.graph.nodes for a in pytree.tree_leaves((n.args, n.kwargs))
               if isinstance(a, torch.device)]
    assert devices and all(d.type == "cpu" for d in devices)
    cg.gm.to_empty(device="cpu")  # weights would be loaded here
    ids = torch.randint(0, 512, (3, 16))
    out = run(cg, (ids,), {"labels": ids})
    assert out.logits.shape == (3, 16, 512) and out.loss.shape == ()


# -- errors ----------------------------------------------------------------------------------


class _SignFlip(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # data-dependent Python control flow
            return -h
        return h


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.flip = _SignFlip()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flip(self.lin(x)).relu()


class _BranchyRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.isnan().any():  # a check of the inputs
            raise ValueError("a NaN in the inputs")
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent Python control flow in the model's own forward
            return -h
        return h


class _BranchyState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lin(x).sum() > 0:  # the branch reads the parameters: nothing left to pipeline
            return -x
        return x


def test_data_dependent_code_in_a_submodule_keeps_that_module_whole():
    model, x = _Branchy(), torch.randn(4, 4)
    for tracer in ("auto", "fx", "export"):
        cg = capture_pass(model, (x,), tracer=tracer)  # type: ignore[arg-type]
        assert set(cg.opaque) == {"flip"}, tracer
        for sign in (1.0, -1.0):
            torch.testing.assert_close(run(cg, (sign * x,), {}), model(sign * x), rtol=0, atol=0)


def test_data_dependent_code_in_the_forward_itself_runs_eagerly_around_the_graph():
    model = _BranchyRoot()
    # samples whose rows of lin(x) sum to +10 each in the first half, -30 in the second: each
    # half takes its own branch, the whole batch the second half's
    w, b = model.lin.weight.detach(), model.lin.bias.detach()
    u = w.sum(0) / w.sum(0).square().sum()
    x = torch.stack([(t - b.sum()) * u for t in (10.0, 10.0, -30.0, -30.0)])
    for tracer in ("auto", "fx", "export"):
        cg = capture_pass(model, (x,), tracer=tracer)  # type: ignore[arg-type]
        assert cg.pieces == (1, 2), tracer  # the check before the body, the branch after it
        assert set(cg.opaque) == {"forward_pre", "forward_post"}, tracer
        # the branch reads the batch's sum: per micro-batch it would not be the model's
        assert [r.reduces for r in cg.opaque["forward_post"]] == ["coupled"]
        for sign in (1.0, -1.0):
            torch.testing.assert_close(run(cg, (sign * x,), {}), model(sign * x), rtol=0, atol=0)
        with pytest.raises(ValueError, match="NaN"):  # the check runs, eagerly, in the graph
            run(cg, (torch.full((4, 4), float("nan")),), {})


def test_a_branch_on_the_parameters_own_output_gives_a_capture_error_with_ways_out():
    x = torch.randn(4, 4)
    with pytest.raises(CaptureError) as info:
        capture_pass(_BranchyState(), (x,))
    msg = str(info.value)
    assert "torch.fx failed: TraceError" in msg and "torch.export failed" in msg
    assert re.search(r"test_capture\.py:\d+ in forward: if self\.lin\(x\)\.sum\(\) > 0:", msg)
    assert "torch.cond" in msg and "loss_fn=" in msg
    assert "cannot run in pieces: the code from line" in msg
    assert info.value.__cause__ is not None
    with pytest.raises(CaptureError) as forced:
        capture_pass(_BranchyState(), (x,), tracer="fx")
    msg = str(forced.value)
    assert "torch.fx failed" in msg and "test_capture.py:" in msg
    assert "Config(tracer='export')" in msg and "torch.export failed" not in msg


def test_the_frame_a_capture_error_names_is_the_model_s_never_the_capture_s():
    """The innermost frame of the model's code: torch's frames and every module of the
    capture folder (the tracers and the stand-ins that run the model) are skipped, whatever
    the module's name."""
    from rannc_fx.capture import failure

    ours = sorted(Path(failure.__file__).parent.glob("*.py"))
    assert len(ours) > 10 and not [p.name for p in ours if failure._is_user_file(str(p))]
    assert failure._is_user_file(__file__)


def test_the_suggested_leaf_module_way_out_works():
    model, x = _Branchy(), torch.randn(4, 4)
    cg = capture_pass(model, (x,), leaf_modules=("_SignFlip",))
    assert cg.tracer == "fx"
    assert [n.target for n in cg.gm.graph.nodes if n.op == "call_module"] == ["lin", "flip"]
    for sign in (1.0, -1.0):
        torch.testing.assert_close(run(cg, (sign * x,), {}), model(sign * x), rtol=0, atol=0)


def test_forced_fx_on_a_transformers_model_runs_the_loss_it_cannot_trace_eagerly():
    pytest.importorskip("transformers")
    model, args, kwargs = zoo_example("bert")
    cg = capture_pass(model, args, kwargs, tracer="fx")
    # the loss (a CrossEntropyLoss made in the forward) after the encoder's graph, eagerly
    assert cg.tracer == "fx" and cg.pieces is not None and "forward_post" in cg.opaque
    assert cg.checked == "values"  # the graph computed what the model does on the example


def test_export_with_one_sample_is_refused():
    model = MLP()
    with pytest.raises(CaptureError, match="at least 2 samples"):
        capture_pass(model, (torch.randn(1, 32), torch.tensor([3])), tracer="export")


def test_export_names_an_input_whose_batch_size_the_model_fixes():
    class Fixed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.ones(8, 1)  # broadcasting pins the batch at 8

    with pytest.raises(CaptureError, match=r"fixed the batch dimension of input 'x' at 8: at "
                                           r"forward\(\), line \d+: `return x \+ torch.ones\(8, 1\)"
                                           r"[^`]*` ties it to that size"):
        capture_pass(Fixed(), (torch.randn(8, 3),), tracer="export")


# -- inputs and outputs ----------------------------------------------------------------------


class _Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, flag: bool = True, extra: torch.Tensor | None = None):
        y = self.lin(x)
        if flag:
            y = y * 2
        if extra is not None:
            y = y + extra
        return {"y": y, "scale": 2, "none": None}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_non_tensor_inputs_and_outputs_are_baked_and_checked(tracer):
    model, x = _Flagged(), torch.randn(3, 4)
    kwargs = {"flag": False, "extra": None}
    cg = capture_pass(model, (x,), kwargs, tracer=tracer)
    assert cg.input_names == ["x"]
    assert {i: v for i, v in cg.constant_inputs.items() if v is not None} == {1: False}
    assert_same(run(cg, (x,), kwargs), model(x, **kwargs))
    assert cg.unflatten_outputs(cg.gm(x))["scale"] == 2
    with pytest.raises(ValueError, match="baked in"):
        cg.flatten_inputs((x,), {"flag": True, "extra": None})
    with pytest.raises(ValueError, match="baked in|structure"):
        cg.flatten_inputs((x,), {"flag": False, "extra": x})
    with pytest.raises(ValueError, match="structure"):
        cg.flatten_inputs((x,), {"flag": False})


def test_keyword_order_does_not_matter(zoo):
    pytest.importorskip("transformers")
    _, args, kwargs, cg = zoo("bert")
    flipped = dict(reversed(list(kwargs.items())))
    assert all(a is b for a, b in zip(cg.flatten_inputs(args, kwargs),
                                      cg.flatten_inputs(args, flipped), strict=True))


# -- fingerprint and logging -----------------------------------------------------------------


def test_fingerprint_is_stable_and_tells_models_apart(zoo):
    def fp(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> str:
        return capture_pass(model, args, kwargs).fingerprint()

    _, args, _ = mlp_example()
    same = {fp(MLP(), args), fp(MLP(), args), zoo("mlp")[3].fingerprint()}
    assert len(same) == 1 and len(same.pop()) == 64
    different = {fp(MLP(), args), fp(MLP(depth=3), args), fp(MLP(hidden=32), args)}
    x = torch.randn(2, 3, 8, 8)
    different |= {fp(ResCNN(), (x, torch.tensor([0, 1]))), fp(ResCNN((8, 16)), (x, torch.tensor([0, 1])))}
    assert len(different) == 5
    assert zoo("mlp", "export")[3].fingerprint() != zoo("mlp")[3].fingerprint()


def test_one_log_line_per_capture(caplog):
    model, args, kwargs = mlp_example()
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        capture_pass(model, args, kwargs)
    lines = [r.getMessage() for r in caplog.records if r.name == "rannc_fx"]
    assert len(lines) == 1
    assert re.fullmatch(r"captured MLP with torch\.fx: \d+ nodes in \d+\.\d\d s", lines[0])
