"""Input dimensions other than the batch's (a sequence length) at any size up to the plan's.

The capture keeps them symbolic where the model allows, the values the runtime sizes carry
formulas in them, and a plan then runs any length up to its own: here in one process (the
formulas against concrete propagation, the split stages against the model). The runs on
several ranks are in ``test_dynamic_lengths.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing import assert_close

import rannc_fx
from examples.models import gpt_example
from rannc_fx.capture.capture import capture_pass
from rannc_fx.plan.plan import Plan
from rannc_fx.plan.values import SAMPLES, ValueSpec, evaluate, formula_text
from rannc_fx.profile.fakes import computes_as
from rannc_fx.profile.noderun import home_device
from rannc_fx.progress import Progress
from rannc_fx.shapes.dynamic import dynamic_pass
from rannc_fx.shapes.infer import _fake_input, _FakeProp, shapes_pass
from rannc_fx.split.split import run_stages
from tests.harness import test_config


def test_a_formula_is_evaluated_and_printed_as_written():
    f = ((1, ()), (64, ("input_ids.1", SAMPLES)))
    assert evaluate(f, {"input_ids.1": 5, SAMPLES: 3}) == 64 * 15 + 1
    assert formula_text(f) == "1 + 64*input_ids.1*samples"
    assert formula_text(((-2, ("s",)), (1, ("s", "s")))) == "-2*s + s*s"
    assert formula_text(()) == "0"


def test_a_spec_at_other_sizes():
    rows = ValueSpec(name="h", kind="tensor", dtype="float32", shape=(32, 8), batch_dim=0,
                     formulas=(((1, ("s", SAMPLES)),), ((8, ()),)))
    assert rows.at_sizes({"s": 5}).shape_for(3) == (15, 8)
    size = ValueSpec(name="n", kind="int", int_coeffs=((32, 1),),
                     formulas=(((1, ()), (1, ("s", SAMPLES))),))
    assert size.at_sizes({"s": 5}).ints_for(3) == (16,)
    plain = ValueSpec(name="x", kind="tensor", dtype="float32", shape=(1, 4), batch_dim=0)
    assert plain.at_sizes({"s": 5}) is plain
    with pytest.raises(ValueError, match="1 formulas for 2 sizes"):
        ValueSpec(name="y", kind="tensor", shape=(1, 4), batch_dim=0, formulas=(((1, ()),),))


# -- the formulas against concrete propagation ----------------------------------------------

# model -> its dynamic dimensions, with every value sized (not only the boundaries'), and
# those pinned because some value's size is not a polynomial in them
MODELS = {
    "gpt": ({"input_ids.1", "labels.1"}, set()),
    "bert": ({"input_ids.1", "labels.1"}, set()),
    "gpt2": ({"input_ids.1", "labels.1"}, set()),
    "llama": ({"input_ids.1", "labels.1"}, set()),
    "t5": ({"input_ids.1", "labels.1"}, set()),
    "cnn": (set(), {"x.2", "x.3"}),  # strided convolutions: floor((h - 1) / 2) + 1
    "mlp": (set(), set()),  # a Linear's input width is its weight's: export-free run pins it
    "gpt-fx": ({"input_ids.1"}, set()),  # one symbolic run; the loss ties labels.1 to it
}


def _concrete(cg, flat, specs: list[ValueSpec], sizes: dict[str, int], samples: int):
    """Every node's value from a run on concrete fake inputs shaped as ``specs`` say."""
    mode = FakeTensorMode()
    device = computes_as(home_device(cg.gm, flat))
    fakes = []
    for t, spec in zip(flat, specs, strict=True):
        shape = spec.at_sizes(sizes).shape_for(samples) if spec.batch_dim is not None else (
            spec.at_sizes(sizes).shape)
        fakes.append(_fake_input(mode, torch.empty(shape, dtype=t.dtype), t, device))
    return _FakeProp(cg.gm, mode, Progress("test")).values_at(samples, fakes)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_formulas_equal_concrete_propagation_at_other_lengths(zoo, name):
    dims, pinned = MODELS[name]
    _, args, kwargs, cg = zoo(name.removesuffix("-fx"), "fx" if name.endswith("-fx") else "auto")
    flat = cg.flatten_inputs(args, kwargs)
    shapes = shapes_pass(cg, flat)
    assert shapes.formulas is not None
    tensors = [n for n, v in shapes.specs.items() if v.kind == "tensor" and not v.interleaved]
    dyn = dynamic_pass(shapes.formulas, shapes.specs, tensors, cg.input_names)
    assert {d.name for d in dyn.dims} == dims and set(dyn.pinned) == pinned
    specs = {**shapes.specs, **dyn.specs}
    inputs = [specs[n] for n in cg.input_names]
    for samples, shrink in ((2, 0), (3, 5), (1, 9)):
        sizes = {d.name: max(2, d.size - shrink) for d in dyn.dims}
        want = _concrete(cg, flat, inputs, sizes, samples)
        for node in tensors:
            spec = specs[node].at_sizes(sizes)
            got = spec.shape_for(samples) if spec.batch_dim is not None else spec.shape
            assert got == tuple(want[node].shape), (node, sizes, samples)
    if dims:  # the shorter runs above changed some values' sizes
        assert any(specs[n].formulas for n in tensors)


def test_the_dimensions_a_config_keeps_and_names_it_does_not_know():
    model, args, kwargs = gpt_example(batch=4)
    cg = capture_pass(model, args, kwargs)
    shapes = shapes_pass(cg, cg.flatten_inputs(args, kwargs))
    names = cg.input_names
    kept = dynamic_pass(shapes.formulas, shapes.specs, names, names, wanted=("input_ids.1",))
    assert [d.name for d in kept.dims] == ["input_ids.1"]
    assert kept.pinned == {"labels.1": "not in Config(dynamic_dims=...)"}
    assert dynamic_pass(shapes.formulas, shapes.specs, names, names, wanted="batch").dims == ()
    with pytest.raises(ValueError, match=r"names \['ids.1'\].*it has \['input_ids.1', 'labels.1'\]"):
        dynamic_pass(shapes.formulas, shapes.specs, names, names, wanted=("ids.1",))


def test_batch_only_capture_has_no_dynamic_dimension():
    model, args, kwargs = gpt_example(batch=4)
    partitioned = rannc_fx.partition(model, args, kwargs, world_size=2,
                                     config=test_config(stages=2, dynamic_dims="batch"))
    assert partitioned.plan.dynamic_dims == ()
    assert not any(s.formulas for s in partitioned.plan.inputs)


# -- the split stages at other lengths -------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3])
def test_the_stages_run_every_length_up_to_the_plan_s_like_the_model(stages):
    torch.manual_seed(0)
    model, args, kwargs = gpt_example(batch=4, layers=3)
    ref = copy.deepcopy(model)
    part = rannc_fx.partition(model, args, kwargs, world_size=stages,
                              config=test_config(stages=stages))
    plan = part.plan
    assert {d.name: d.size for d in plan.dynamic_dims} == {"input_ids.1": 32, "labels.1": 32}
    assert Plan.from_json(plan.to_json()) == plan
    assert "input_ids.1 <= 32" in plan.summary()
    g = torch.Generator().manual_seed(1)
    for length in (32, 17, 2):
        ids = torch.randint(0, 256, (3, length), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        at = plan.at_sizes({"input_ids.1": length, "labels.1": length})
        assert at.inputs[0].shape_for(3) == (3, length)
        flat = part.captured.flatten_inputs((ids,), {"labels": labels})
        outs = run_stages(part.stages, at, flat, part.captured.input_names,
                          part.captured.output_names)
        want = ref(ids, labels=labels)
        got = part.captured.unflatten_outputs(outs)
        assert_close(got["loss"], want["loss"]) and assert_close(got["logits"], want["logits"])
        for cv in at.cut_values:  # every message is sized for this length
            spec = cv.spec
            if spec.batch_dim is not None and spec.formulas:
                assert length in spec.shape_for(3) or 3 * length in spec.shape_for(3)


class _Fixed(torch.nn.Module):
    """A token input of any length, and features the code adds to a fixed (8, 6) table."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.table = torch.nn.Parameter(torch.zeros(8, 6))
        self.head = torch.nn.Linear(48, 1)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).mean(1).sum() + self.head((feats + self.table).flatten(1)).sum()


def test_the_log_says_which_dimensions_are_dynamic_and_which_the_code_fixes(caplog):
    ids, feats = torch.randint(0, 50, (4, 10)), torch.randn(4, 8, 6)
    model = _Fixed()
    with caplog.at_level("INFO", logger="rannc_fx"):
        part = rannc_fx.partition(model, (ids, feats), world_size=1,
                                  config=test_config(tracer="export"))
    assert [d.name for d in part.plan.dynamic_dims] == ["ids.1"]
    line = next(r.getMessage() for r in caplog.records if "dynamic dimension" in r.getMessage())
    assert line.endswith("dynamic dimension(s) ids.1 <= 10; static (the model's code fixes "
                         "them): feats.1 = 8, feats.2 = 6"), line
    assert_close(part(ids[:, :3], feats), model(ids[:, :3], feats))  # another length runs
