"""Shapes as formulas in the sample count (shapes_symbolic) against concrete propagation.

The shape pass reads every value's sizes as formulas from one symbolic propagation (torch
export's own, or one FakeTensor run with a symbolic batch) and evaluates them wherever a size
is needed; the profile costs each distinct op signature from them. Here both are checked
against running the graph on concrete fake tensors at several sample counts, node by node.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from rannc_fx.capture.capture import capture_pass
from rannc_fx.capture.graph import batch_size_of, inputs_for_samples
from rannc_fx.plan.device import DeviceSpec
from rannc_fx.profile import profile as profile_module
from rannc_fx.profile.fakes import computes_as
from rannc_fx.profile.noderun import home_device
from rannc_fx.profile.profile import profile_pass
from rannc_fx.progress import Progress
from rannc_fx.shapes.infer import _fake_input, _FakeProp, _propagated, shapes_pass
from rannc_fx.shapes.symbolic import Leaf
from tests.conftest import zoo_example
from tests.unit.test_shapes import _WithBranchy

# Which propagation gives each model's formulas: torch.export's values, or one run of ours.
MODELS = {
    "mlp": "one run", "cnn": "one run", "bert": "torch.export's", "gpt2": "torch.export's",
    "resnet": "torch.export's", "llama": "torch.export's", "t5": "torch.export's",
    "gpt": "torch.export's", "gpt-fx": "one run",
}


def _concrete(cg, flat, samples: int) -> dict[str, object]:
    """Every node's value from a run on concrete fake tensors of ``samples`` samples."""
    mode = FakeTensorMode()
    batch = batch_size_of(flat)
    device = computes_as(home_device(cg.gm, flat))
    resized = inputs_for_samples(flat, batch, samples, fake=True)
    fakes = [_fake_input(mode, r, o, device) for r, o in zip(resized, flat, strict=True)]
    return _FakeProp(cg.gm, mode, Progress("test")).values_at(samples, fakes)


def _facts(v: object) -> object:
    """What a value says about sizes: shapes, dtypes, requires_grad of tensors; ints."""
    def leaf(x: object) -> object:
        if isinstance(x, torch.Tensor | Leaf):
            return (tuple(int(d) for d in x.shape), x.dtype, bool(x.requires_grad))
        return int(x) if isinstance(x, torch.SymInt) else x
    return pytree.tree_map(leaf, v)


@pytest.fixture
def captured(zoo):
    """(model, captured, flat inputs) of a zoo model, captured once a session (``zoo``); the
    fake runs here leave it as it is."""

    def get(name: str):
        model, args, kwargs, cg = zoo(*(("gpt", "fx") if name == "gpt-fx" else (name,)))
        return model, cg, cg.flatten_inputs(args, kwargs)

    return get


@pytest.mark.parametrize("name", sorted(MODELS))
def test_formulas_equal_concrete_propagation_at_every_size(captured, name):
    _, cg, flat = captured(name)
    shapes = shapes_pass(cg, flat)
    assert shapes.formulas is not None and shapes.formulas.source == MODELS[name]
    for samples in (1, 2, 3, 7):
        want = _concrete(cg, flat, samples)
        assert set(shapes.formulas.vals) <= set(want)
        for node in shapes.formulas.vals:
            got = shapes.formulas.value_at(node, samples)
            assert _facts(got) == _facts(want[node]), (node, samples)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_specs_from_formulas_equal_the_fit_at_several_sizes(captured, name):
    _, cg, flat = captured(name)
    shapes = shapes_pass(cg, flat)
    assert shapes.formulas is not None
    got = shapes.specs
    want = _propagated(cg, flat, 0, Progress("test"))

    def plain(specs):
        return {k: v.model_copy(update={"interleaved": False, "interleave": None})
                for k, v in specs.items()}

    assert plain(got) == plain(want)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "mlp", "cnn"])
def test_profile_from_formulas_equals_the_walk(captured, name, monkeypatch):
    _, cg, flat = captured(name)
    shapes = shapes_pass(cg, flat)
    kw = dict(batch_sizes=(1, 2, 5), device_spec=DeviceSpec.preset("a100-80gb"),
              cost_model="analytic")
    walk = profile_pass(cg, flat, shapes.specs, **kw)

    def no_run(*args, **kwargs):
        raise AssertionError("the formulas' profile ran the graph")

    monkeypatch.setattr(profile_module, "walk_run", no_run)
    fast = profile_pass(cg, flat, shapes.specs, formulas=shapes.formulas, **kw)
    assert fast.nodes == walk.nodes
    # each distinct signature is counted at most once per size, whatever the graph's length
    assert fast.measured <= len(set(shapes.formulas.signatures.values())) * 3


def test_identical_layers_share_their_signatures():
    model, args, kwargs = zoo_example("bert")
    small = capture_pass(model, args, kwargs)
    deep_model, args, kwargs = importlib.import_module("tests.hf_models").bert_example(layers=6)
    deep = capture_pass(deep_model, args, kwargs)
    s2 = shapes_pass(small, small.flatten_inputs(args, kwargs)).formulas
    s6 = shapes_pass(deep, deep.flatten_inputs(args, kwargs)).formulas
    assert s2 is not None and s6 is not None
    assert set(s6.signatures.values()) == set(s2.signatures.values())
    assert len(s6.signatures) > len(s2.signatures)


@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_under_another_autocast_state_export_values_take_its_dtypes(captured, name):
    """Export's sizes (its dynamic dimensions too) hold in any autocast state; its dtypes
    are the capture's: each value takes the one a run under this state gives it."""
    _, cg, flat = captured(name)
    assert cg.autocast == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        shapes = shapes_pass(cg, flat)
        want = _propagated(cg, flat, 0, Progress("test"))
    assert shapes.formulas is not None
    assert shapes.formulas.source == ("torch.export's, in this autocast state's dtypes"
                                      if cg.tracer == "export" else "one run")
    assert {k: v.dtype for k, v in shapes.specs.items()} == {k: v.dtype for k, v in want.items()}
    assert "bfloat16" in {v.dtype for v in shapes.specs.values()}


class _Tied(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(8, -1).relu()


def test_a_size_tied_to_the_example_batch_has_no_formulas_and_is_named():
    x = torch.randn(8, 4)
    cg = capture_pass(_Tied(), (x,), tracer="fx")
    with pytest.raises(ValueError, match=r"node view .*x.view\(x.size\(0\), -1\)"):
        shapes_pass(cg, cg.flatten_inputs((x,), {}))


class _BranchyThenView(_WithBranchy):
    """A leaf whose Python reads a tensor value (fake tensors cannot run it), then a size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).view(x.size(0), 2, 2)


def test_a_leaf_that_reads_tensor_values_gets_the_specs_of_the_fit():
    x = torch.randn(8, 4)
    cg = capture_pass(_BranchyThenView(), (x,), tracer="fx", leaf_modules=("_Branchy",))
    flat = cg.flatten_inputs((x,), {})
    shapes = shapes_pass(cg, flat)
    assert shapes.specs == _propagated(cg, flat, 0, Progress("test"))
    if shapes.formulas is not None:  # a run on zeros at the example's size: formulas must hold
        for samples in (1, 3):
            want = _concrete(cg, flat, samples)
            for node in shapes.formulas.vals:
                assert _facts(shapes.formulas.value_at(node, samples)) == _facts(want[node])
