"""Measuring a model whose tensors are not on the device: a meta-built model's ops made real on
the device one at a time (``profile/materialize``), costed as the same model built there."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from examples.models import TransformerLM, cnn_example
from rannc_fx.planner.analyze import analyze
from tests.harness import test_config

CPU = torch.device("cpu")
_BYTES = ("saved_bytes", "workspace_bytes", "kept_bytes", "rebuilt_bytes", "wheld_bytes")


def _lm() -> nn.Module:
    return TransformerLM(vocab=512, d_model=64, layers=2, seq=16)


def _analysis(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tracer: str,
              device: torch.device | str = CPU) -> Any:
    cfg = test_config(tracer=tracer, profile_cache_dir=None)
    return analyze(model, args, kwargs, world_size=2, device=device, config=cfg)


def _on_meta(args: Any) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), args)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_meta_model_is_measured_on_the_device_as_the_same_model_built_there(tracer, caplog):
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (4, 16))
    built = _analysis(_lm(), (ids,), {"labels": ids}, tracer)
    with torch.device("meta"):
        model = _lm()
    rng = torch.random.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="rannc_fx"):
        meta = _analysis(model, _on_meta((ids,)), _on_meta({"labels": ids}), tracer)
    assert not [r for r in caplog.records if "could not be measured" in r.getMessage()]
    assert torch.equal(torch.random.get_rng_state(), rng)  # the made-up values' own generator
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing stays real
    a, b = built.profile, meta.profile
    assert a.cost_model == b.cost_model == "measured" and a.device == b.device
    assert b.batch_sizes == a.batch_sizes and b.nodes.keys() == a.nodes.keys()
    # each op ran on the CPU's own kernels, and was timed there (a backward wherever the
    # real model's op has one)
    for name, cost in a.nodes.items():
        assert min(b.nodes[name].fwd_s) > 0, name
        assert (min(b.nodes[name].bwd_s) > 0) == (min(cost.bwd_s) > 0), name
    if tracer == "export":
        # torch.export records a meta model's strides as meta's kernels lay tensors out: the
        # fused attention's output is contiguous there, so the reshape after it copies where
        # the CPU kernel's layout lets it view (docs/limits.md). Per op, what the made-up
        # tensors saved is what the same fakes count; in all, within that reshape's copies
        counted = _analysis(model, _on_meta((ids,)), _on_meta({"labels": ids}), tracer,
                            device="cpu").profile
        a = counted
        total = [sum(c.saved_bytes[i] for c in p.nodes.values())
                 for p in (built.profile, b) for i in range(len(b.batch_sizes))]
        half = len(b.batch_sizes)
        assert all(x <= y <= 1.1 * x for x, y in zip(total[:half], total[half:], strict=True))
    # what it saves and holds is what the model saves and holds, to the byte
    for name, cost in a.nodes.items():
        for field in _BYTES:
            assert cost.series(field) == b.nodes[name].series(field), (name, field)
    # the repeated layer's signatures were measured once: far fewer ops timed than nodes
    assert 0 < b.measured < len(b.nodes) * len(b.batch_sizes)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_an_op_that_raises_at_a_size_raises_there_for_the_meta_model_too(tracer):
    """A training-mode BatchNorm at one sample (one value per channel) is an OpFailure of
    the profile, as it is for the model built on the CPU; the sizes it runs are measured."""
    model, args, kwargs = cnn_example(batch=4)
    built = _analysis(model, args, kwargs, tracer)
    with torch.device("meta"):
        meta_model, _, _ = cnn_example(batch=4)
    meta = _analysis(meta_model, _on_meta(args), _on_meta(kwargs), tracer)
    assert [f.model_dump() for f in meta.profile.failures] == [
        f.model_dump() for f in built.profile.failures]
    for name, cost in built.profile.nodes.items():
        assert cost.saved_bytes == meta.profile.nodes[name].saved_bytes, name


class _Cholesky(nn.Module):
    """An op that cannot run on made-up values: uniform [0, 1) matrices are not definite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x).reshape(-1, 2, 2, 2)[:, 0]
        return torch.linalg.cholesky(a @ a.transpose(-1, -2) - 4.0).sum()


def test_an_op_that_cannot_run_on_made_up_values_is_counted_and_says_so(caplog):
    with torch.device("meta"):
        model = _Cholesky()
    x = torch.zeros(4, 8, device="meta")
    with caplog.at_level(logging.WARNING, logger="rannc_fx"):
        a = _analysis(model, (x,), {}, "fx")
    (cholesky,) = [n for n in a.profile.nodes if "cholesky" in n]
    warned = [r.getMessage() for r in caplog.records if "could not be measured" in r.getMessage()]
    assert len(warned) == 1 and cholesky in warned[0] and "priced with cpu" in warned[0]
    assert min(a.profile.nodes[cholesky].fwd_s) > 0  # counted and priced, not free
    assert a.profile.cost_model == "measured"


def test_a_meta_model_without_a_device_names_both_ways_out():
    with torch.device("meta"):
        model = _lm()
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"torch\.device\('cuda'\).*preset"):
        analyze(model, (ids,), {"labels": ids}, world_size=2, config=test_config())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_meta_model_is_measured_on_the_gpu_with_its_fused_attention():
    """On the GPU its attention runs the fused kernel, which saves its output and a
    log-sum-exp row per head: the saved bytes grow linearly with the length."""
    cuda = torch.device("cuda", torch.cuda.current_device())

    def saved(seq: int) -> int:
        with torch.device("meta"):
            model = TransformerLM(vocab=512, d_model=256, layers=2, seq=seq)
        ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
        a = _analysis(model, (ids,), {"labels": ids}, "export", device=cuda)
        assert a.profile.cost_model == "measured"
        assert a.profile.device == torch.cuda.get_device_name(cuda)
        return sum(c.saved_bytes[0] for c in a.profile.nodes.values())

    assert saved(2048) <= 8.5 * saved(256)
