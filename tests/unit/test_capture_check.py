"""capture_check: a torch.fx graph that is not the model is caught, and export captures it."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import pytest
import torch
from torch import nn

import rannc_fx
from rannc_fx.capture.capture import CapturedGraph, CaptureError, capture_pass
from rannc_fx.shapes.infer import infer_values_pass
from tests.unit.test_capture import _MaskedEncoder, assert_same, run
from tests.unit.test_shapes import _WithBranchy

try:
    from transformers.utils import ModelOutput
except ImportError:  # the cases that need it skip
    ModelOutput = None


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@dataclasses.dataclass
class _Sample:
    sample: torch.Tensor


class _WithSample(_Plain):
    """Returns an object with ``.sample``, as diffusers' models do."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        return _Sample(self.lin(x))


class _Wrapper(nn.Module):
    """The idiom for library outputs: on a torch.fx Proxy, hasattr is always true."""

    def __init__(self, inner: nn.Module, *, model_output: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(8, 4)
        self.model_output = model_output

    def forward(self, x: torch.Tensor) -> Any:
        out = self.inner(x)
        out = out.sample if hasattr(out, "sample") else out
        y = self.head(out)
        return _output(sample=y, loss=y.square().mean()) if self.model_output else y


if ModelOutput is not None:

    @dataclasses.dataclass
    class _Output(ModelOutput):
        sample: torch.Tensor | None = None
        loss: torch.Tensor | None = None


def _output(**fields: torch.Tensor) -> Any:
    return _Output(**fields)


def _needs(case: str) -> None:
    if case == "model-output" and ModelOutput is None:
        pytest.skip("needs transformers' ModelOutput")


def _wrapper(case: str) -> nn.Module:
    _needs(case)
    inner = _WithSample() if case == "inner-with-sample" else _Plain()
    return _Wrapper(inner, model_output=case == "model-output")


class _TypeChecks(nn.Module):
    """isinstance on a Proxy is false: torch.fx drops the doubling and the tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        h = h * 2 if isinstance(h, torch.Tensor) else h
        return h


class _TupleIfTensor(_TypeChecks):
    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        return (h,) if isinstance(h, torch.Tensor) else h


# -- auto: torch.export where torch.fx's graph is not the model ------------------------------


@pytest.mark.parametrize(("case", "tracer"), [
    ("inner-tensor", "export"),  # fx takes `out.sample` of a tensor
    ("model-output", "export"),
    ("inner-with-sample", "fx"),  # fx's graph is right here: it must be kept
])
def test_auto_captures_what_the_model_computes(case, tracer, caplog):
    model, x = _wrapper(case), torch.randn(6, 8)
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        cg = capture_pass(model, (x,))
    assert cg.tracer == tracer
    assert cg.checked == ("values" if tracer == "fx" else None)
    assert_same(run(cg, (x,), {}), model(x))
    (line,) = [r for r in caplog.records if r.name == "rannc_fx"]
    if tracer == "export":
        assert line.levelno == logging.WARNING
        msg = line.getMessage()
        assert "captured _Wrapper with torch.export" in msg
        assert "torch.fx's graph differed from the model on the example inputs" in msg
        assert "getattr(inner_lin, 'sample')" in msg and "no attribute 'sample'" in msg
    else:
        assert line.levelno == logging.INFO


@pytest.mark.parametrize(("model", "why"), [
    (_TypeChecks(), r"the output \(a float32 tensor of shape \(6, 8\)\) differs from the "
                    r"model's in \d+ of 48 elements, by up to"),
    (_TupleIfTensor(), r"the model returns \(Tensor\(6, 8\),\) but the graph returns Tensor\(6, 8\)"),
])
def test_any_output_that_differs_is_caught(model, why):
    x = torch.randn(6, 8)
    cg = capture_pass(model, (x,))
    assert cg.tracer == "export"
    assert_same(run(cg, (x,), {}), model(x))
    with pytest.raises(CaptureError, match=why):
        capture_pass(model, (x,), tracer="fx")


@pytest.mark.parametrize("case", ["inner-tensor", "model-output"])
def test_forced_fx_names_the_difference(case):
    model = _wrapper(case)
    with pytest.raises(CaptureError) as info:
        capture_pass(model, (torch.randn(6, 8),), tracer="fx")
    msg = str(info.value)
    assert "torch.fx's graph differs from the model on the example inputs: its node getattr_1 " \
           "(getattr(inner_lin, 'sample')) raises AttributeError: 'Tensor' object has no " \
           "attribute 'sample', where the model runs without error" in msg
    assert "Config(tracer='export')" in msg
    assert "torch.cond" not in msg  # not a data-dependent branch: no advice for one
    assert isinstance(info.value.__cause__, Exception)


class _EncoderWrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = _MaskedEncoder()  # torch.export fails on it; fx keeps its encoder whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.enc(x)
        return out.sample if hasattr(out, "sample") else out


def test_the_graph_kept_when_export_fails_is_checked_too():
    with pytest.raises(CaptureError) as info:
        capture_pass(_EncoderWrapper(), (torch.randn(4, 5, 16),))
    msg = str(info.value)
    assert "torch.export failed: GuardOnDataDependentSymNode" in msg
    assert "torch.fx's graph differs from the model on the example inputs: its node getattr_1" in msg


def test_partition_of_the_wrapper_plans_and_runs():
    """Before the check, shape inference failed on the fx graph's getattr with a guess at the
    batch size."""
    model, x = _wrapper("inner-tensor"), torch.randn(6, 8)
    parted = rannc_fx.partition(model, (x,), world_size=2)
    assert parted.captured.tracer == "export"
    torch.testing.assert_close(parted(x), model(x))


# -- the check keeps what torch.fx captures right --------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_correct_fx_graphs_are_kept_and_checked(zoo, name):
    _, _, _, cg = zoo(name)
    assert cg.tracer == "fx" and cg.checked == "values"


class _Noisy(nn.Module):
    """Dropout and batch norm in training mode: both runs must see the same masks and stats."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x))) + torch.rand_like(x)


def test_the_check_leaves_buffers_and_random_state_as_they_were():
    model, x = _Noisy(), torch.randn(6, 8)
    state = copy.deepcopy(model.state_dict())
    rng = torch.random.get_rng_state()
    cg = capture_pass(model, (x,))
    assert cg.tracer == "fx" and cg.checked == "values"
    assert torch.equal(torch.random.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert model.bn.num_batches_tracked.item() == 0


# -- meta device: shapes and dtypes only -----------------------------------------------------


def test_meta_models_are_checked_on_shapes():
    with torch.device("meta"):
        right, wrong = _Wrapper(_WithSample()), _Wrapper(_Plain())
        x = torch.randn(6, 8)  # as the driver gives a meta model
    cg = capture_pass(right, (x,))
    assert cg.tracer == "fx" and cg.checked == "shapes"
    cg = capture_pass(wrong, (x,))  # the graph fails on meta as on the CPU
    assert cg.tracer == "export" and cg.gm.head.weight.device.type == "meta"
    with torch.device("meta"):
        wrong_values = _TypeChecks()
    assert capture_pass(wrong_values, (x,)).tracer == "fx"  # no values on meta: not caught


def test_a_model_that_cannot_run_is_captured_unchecked_and_said_so(caplog):
    with torch.device("meta"):
        model = _WithBranchy()
    x = torch.randn(8, 4)
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        cg = capture_pass(model, (x,), tracer="fx", leaf_modules=("_Branchy",))
    assert cg.tracer == "fx" and cg.checked is None
    assert any("could not check torch.fx's graph of _WithBranchy" in r.getMessage()
               for r in caplog.records)
    # shape inference then says what it found, not a guess at the batch size
    with pytest.raises(ValueError, match="fails at the example's 8 samples too, so the sample "
                                         "count is not the cause.*meta device has no values"):
        infer_values_pass(cg, cg.flatten_inputs((x,), {}))


# -- shape inference names what it found -----------------------------------------------------


class _FixedBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(8, -1).relu()


def test_shape_inference_says_the_graph_runs_at_the_example_batch():
    x = torch.randn(8, 4)
    cg: CapturedGraph = capture_pass(_FixedBatch(), (x,))
    assert cg.tracer == "fx" and cg.checked == "values"
    with pytest.raises(ValueError, match=r"does not run at 3 samples: .*; it runs at the "
                                         r"example's 8 samples, so the model's code ties a size"):
        infer_values_pass(cg, cg.flatten_inputs((x,), {}))
