"""Capture of models whose ``forward`` takes ``*args`` / ``**kwargs``: wrappers, a keyword that
lands in a transformers LM's ``**kwargs``, a PEFT LoRA model (tier 0, no processes)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from rannc_fx.capture.capture import CapturedGraph, capture_pass
from rannc_fx.capture.graph import CaptureError
from tests.hf_models import llama_example, lora_llama_example


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                scale: float = 1.0) -> torch.Tensor:
        y = self.proj(x) * scale
        return y if mask is None else y * mask.unsqueeze(-1)


class Forwarding(nn.Module):
    """What accelerate's hooks and user wrappers do: hand every argument on unread."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


class Named(nn.Module):
    """Named parameters, and tensors (one nested in a dict) that land in ``**kwargs``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, **kwargs: Any) -> Any:
        h = self.proj(x) + kwargs["bias"]
        if y is not None:
            h = h + y
        extra = kwargs.get("extra")
        if extra is not None:
            h = h * extra["gates"][0].unsqueeze(-1)
        return {"h": h, "total": h.sum()}


def _run(cg: CapturedGraph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return cg.unflatten_outputs(cg.gm(*cg.flatten_inputs(args, kwargs)))


def _symbolic(cg: CapturedGraph, name: str) -> list[bool]:
    """Which dimensions of input ``name`` the graph keeps symbolic."""
    (node,) = [n for n in cg.gm.graph.nodes if n.op == "placeholder" and n.name == name]
    return [not is_concrete_int(s) for s in node.meta["val"].shape]


def _inputs(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 100 + seq)
    x = torch.randn(batch, seq, 8, generator=g)
    return x, torch.randn(batch, seq, 8, generator=g), torch.rand(batch, seq, generator=g)


@pytest.mark.parametrize("tracer", ["auto", "export"])
def test_a_wrapper_that_forwards_args_and_kwargs(tracer):
    model = Forwarding()
    x, _, mask = _inputs(4, 6)
    cg = capture_pass(model, (x,), {"mask": mask, "scale": 2.0}, tracer=tracer)
    assert cg.input_names == ["args_0", "mask"]
    for batch, seq in [(4, 6), (3, 6), (5, 3)]:  # other batch sizes and lengths
        if cg.tracer == "fx" and seq != 6:
            continue  # fx graphs are not shape-specialized; nothing to show
        x, _, mask = _inputs(batch, seq)
        torch.testing.assert_close(_run(cg, (x,), {"mask": mask, "scale": 2.0}),
                                   model(x, mask=mask, scale=2.0))
    if tracer == "export":
        assert _symbolic(cg, "args_0") == [True, True, False]
        assert _symbolic(cg, "mask") == [True, True]
    with pytest.raises(ValueError, match="baked in"):
        cg.flatten_inputs((x,), {"mask": mask, "scale": 3.0})


def test_named_parameters_plus_tensors_in_kwargs():
    model = Named()
    x, y, gate = _inputs(4, 6)
    bias = torch.randn(4, 6, 8)
    kwargs = {"y": y, "bias": bias, "extra": {"gates": [gate]}}
    cg = capture_pass(model, (x,), kwargs, tracer="export")
    assert cg.input_names == ["x", "y", "bias", "extra_gates_0"]
    assert _symbolic(cg, "bias") == [True, True, False]
    assert _symbolic(cg, "extra_gates_0") == [True, True]
    x, y, gate = _inputs(3, 5)
    kwargs = {"bias": torch.randn(3, 5, 8), "extra": {"gates": [gate]}, "y": y}  # any order
    got, want = _run(cg, (x,), kwargs), model(x, **kwargs)
    torch.testing.assert_close(got["h"], want["h"])
    torch.testing.assert_close(got["total"], want["total"])


@pytest.mark.parametrize("as_tensor", [True, False])
def test_llama_with_num_items_in_batch(as_tensor):
    """``num_items_in_batch`` lands in LlamaForCausalLM's ``**kwargs``. A 0-dim tensor is an
    input of the graph (not batched: every micro-batch divides by the step's count); an int is
    baked in, and a call with another one is refused."""
    model, args, kwargs = llama_example()
    ref = copy.deepcopy(model)

    def n(k: int) -> Any:
        return torch.tensor(k) if as_tensor else k

    cg = capture_pass(model, args, {**kwargs, "num_items_in_batch": n(40)})
    assert cg.tracer == "export"
    if as_tensor:
        assert cg.input_names == ["input_ids", "labels", "num_items_in_batch"]
        assert _symbolic(cg, "num_items_in_batch") == []
    else:
        assert cg.input_names == ["input_ids", "labels"]
    assert _symbolic(cg, "input_ids") == [True, True]
    ids = args[0][:3, :10]
    for count in ([40, 7] if as_tensor else [40]):
        got = _run(cg, (ids,), {"labels": ids, "num_items_in_batch": n(count)})
        want = ref(ids, labels=ids, num_items_in_batch=n(count))
        torch.testing.assert_close(got.loss, want.loss)
        torch.testing.assert_close(got.logits, want.logits)
    if not as_tensor:
        with pytest.raises(ValueError, match="baked in"):
            cg.flatten_inputs((ids,), {"labels": ids, "num_items_in_batch": 7})


def test_lora_model_captures_with_its_adapters():
    """PeftModel.forward(*args, **kwargs): torch.fx refuses its control flow, torch.export
    captures it; the graph reads every adapter (none lost to the repeated-layer shortcut) and
    computes the model's loss and the adapters' gradients; the base stays frozen."""
    model, args, kwargs = lora_llama_example()
    cg = capture_pass(model, args, kwargs)
    assert cg.tracer == "export"
    read = {str(n.target) for n in cg.gm.graph.nodes if n.op == "get_attr" and n.users}
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapters) == 8 and adapters <= read
    ref = copy.deepcopy(model)
    got, want = _run(cg, args, kwargs), ref(*args, **kwargs)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.requires_grad == q.requires_grad
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
        else:
            assert p.grad is None, name


def test_a_tensor_attribute_of_the_model_keeps_its_name():
    """A plain tensor attribute (no buffer) is a constant export lifts: named as the model
    names it, not ``lifted_tensor_0``."""
    model = Forwarding()
    model.scale = torch.tensor([2.0])  # type: ignore[assignment]
    model.forward = lambda *a, **kw: Forwarding.forward(model, *a, **kw) * model.scale  # type: ignore[method-assign]
    x, _, mask = _inputs(4, 6)
    cg = capture_pass(model, (x,), {"mask": mask}, tracer="export")
    assert "scale" in {str(n.target) for n in cg.gm.graph.nodes if n.op == "get_attr"}
    torch.testing.assert_close(_run(cg, (x,), {"mask": mask}), model(x, mask=mask))


class _InBatchNegatives(nn.Module):
    """A bi-encoder trained with in-batch negatives: every query against every key."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.tie = tie  # an int from the batch size ties the graph to it

    def forward(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        logits = self.q(queries) @ self.k(keys).T
        n = int(logits.shape[0]) if self.tie else len(logits)
        return nn.functional.cross_entropy(logits, torch.arange(n))


def test_len_of_a_tensor_keeps_the_batch_dimension_symbolic():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    cg = capture_pass(_InBatchNegatives(), (x, y), tracer="export")
    (mm,) = [n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.matmul.default]
    assert all(isinstance(d, torch.SymInt) for d in mm.meta["val"].shape)  # (b, b)


def test_a_model_that_mixes_its_samples_and_ties_the_batch_is_refused_at_the_line():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    model = _InBatchNegatives(tie=True)
    with pytest.raises(CaptureError, match=r"at forward\(\), line \d+: `n = int\(logits.shape"
                                           r"\[0\]\) if self.tie else len\(logits\)`, where "
                                           r"logits is a batch x batch matrix .* runs that part "
                                           r"once a step on the whole batch, but this line also "
                                           r"ties the batch"):
        capture_pass(model, (x, y), tracer="export")
