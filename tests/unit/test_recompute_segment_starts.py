"""Recomputation layer by layer in the planner: the segments the model's layers make
(``group/layers.py``), what a stage holds with them (``search/segments.py``), and the
search choosing them where recomputing a whole stage does not fit."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import rannc_fx
from examples.models import gpt_example
from rannc_fx import Config
from rannc_fx.group.boundary import recomputed_values
from rannc_fx.group.layers import node_layers
from rannc_fx.planner.analyze import analyze
from rannc_fx.search import NoFeasiblePlan
from rannc_fx.search.segments import _range_max
from tests import hf_models
from tests.harness import test_config

CFG = test_config(cost_model="analytic", zero=0, offload=False)


def _analysis(model: nn.Module, args: tuple, kwargs: dict):
    return analyze(model, args, kwargs, world_size=2, device="cpu", config=CFG)


def _layer(node, prefix: str) -> str | None:
    """``<prefix>.<i>`` where the node's module path has it (the test's own reading)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(path) for path, _ in stack.values()]
    found = re.search(rf"{re.escape(prefix)}\.\d+", paths[-1]) if paths else None
    return found.group(0) if found else None


def _layers(a, prefix: str) -> list[list[str | None]]:
    """The layer of each node of each segment."""
    gm = {n.name: n for n in a.captured.gm.graph.nodes}
    names = [n for b in a.blocks.blocks for n in b]
    starts = [names.index(s) for s in a.table.segments.starts] + [len(names)]
    return [[_layer(gm[n], prefix) for n in names[x:y]]
            for x, y in zip(starts, starts[1:], strict=False)]


def test_the_lm_has_a_segment_a_layer_each_keeping_its_residual_stream() -> None:
    model, args, kwargs = gpt_example(layers=4)
    a = _analysis(model, args, kwargs)
    sg = a.table.segments
    assert sg is not None
    # the embedding, each layer (its first one with the mask made where it is read), the
    # final norm and head
    assert [set(x) for x in _layers(a, "encoder.layers")] == [{None}, {None, "encoder.layers.0"},
                                            *({f"encoder.layers.{k}"} for k in range(1, 4)),
                                            {None}]
    # all of the chain's activations, at every size
    np.testing.assert_allclose(sg.act.sum(axis=1), a.table.act.sum(axis=1))
    # what enters a layer is the residual stream: samples x seq x d fp32, once
    seq, d = model.pos.shape
    per_sample = seq * d * 4
    np.testing.assert_array_equal(sg.kept[:, 0], 0.0)
    np.testing.assert_allclose(sg.kept[:, 1:], np.broadcast_to(a.table.sizes[:, None] * per_sample,
                                                           sg.kept[:, 1:].shape))


@pytest.mark.parametrize("name,prefix", [("bert", "bert.encoder.layer"),
                                         ("gpt2", "transformer.h"),
                                         ("llama", "model.layers")])
def test_hf_models_are_cut_at_their_layers(name: str, prefix: str) -> None:
    model, args, kwargs = getattr(hf_models, f"{name}_example")()
    a = _analysis(model, args, kwargs)
    sg = a.table.segments
    assert sg is not None
    n = model.config.num_hidden_layers
    segs = _layers(a, prefix)
    # every layer in a segment of its own, but for a node or two at either end (a segment
    # starts at the atomic group before or after a layer's first node, whichever fewer
    # bytes cross)
    homes = []
    for k in range(n):
        counts = [seg.count(f"{prefix}.{k}") for seg in segs]
        homes.append(int(np.argmax(counts)))
        assert counts[homes[-1]] >= 0.9 * sum(counts), (k, counts)
    assert homes == sorted(set(homes)), homes  # one segment each, in order
    np.testing.assert_allclose(sg.act.sum(axis=1), a.table.act.sum(axis=1), rtol=1e-9)
    assert (sg.kept >= 0).all()
    # no segment starts at a value a stage rebuilds under another name (BERT's mask)
    assert not set(sg.starts[1:]) & recomputed_values(a.captured.gm, a.values)


class _Mixed(nn.Module):
    """A list of alike residual layers, each an nn.Sequential of unlike modules, and a list of
    unlike modules."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.ReLU()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        for m in self.mixed:
            x = m(x)
        return x.sum()


def test_layers_are_children_of_a_list_of_alike_modules() -> None:
    a = _analysis(_Mixed(), (torch.randn(4, 8),), {})
    gm = {n.name: n for n in a.captured.gm.graph.nodes}
    names = [n for b in a.blocks.blocks for n in b]
    got = node_layers([gm[n] for n in names])
    # each residual layer whole (not its LayerNorm, Linear and Tanh apart); the unlike list's
    # members are no layers
    assert [x for x in dict.fromkeys(got) if x is not None] == ["layers.0", "layers.1",
                                                                 "layers.2"]
    assert got[-1] is None
    # a segment starts at each of them, none inside one
    starts = [_layer(gm[s], "layers") for s in a.table.segments.starts]
    assert [x for x in starts if x is not None] == ["layers.0", "layers.1", "layers.2"]
    assert len(a.table.segments.starts) <= 6


def test_a_model_without_layers_has_no_segments_and_refuses_to_be_forced() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x))).sum()

    args = (torch.randn(4, 8),)
    assert _analysis(Two(), args, {}).table.segments is None
    cfg = CFG.model_copy(update={"recompute": True, "recompute_layers": True})
    with pytest.raises(ValueError, match="no layers to recompute one by one"):
        rannc_fx.partition(Two(), args, world_size=1, device="cpu", config=cfg)


def test_range_max_by_sparse_table() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(size=37)
    lo = rng.integers(0, 38, 500)
    hi = rng.integers(0, 38, 500)
    want = [x[a:b].max() if b > a else 0.0 for a, b in zip(lo, hi, strict=True)]
    np.testing.assert_array_equal(_range_max(x, lo, hi), want)


def _plan(mib: float, **options) -> rannc_fx.Plan:
    model, args, kwargs = gpt_example(layers=4)
    cfg = CFG.model_copy(update={"device_memory": int(mib * 2**20), "memory_margin": 0.0, "stages": 1,
                                 "micro_batches": 1, **options})
    return rannc_fx.partition(model, args, kwargs, world_size=2, device="cpu", config=cfg).plan


def _least(**options) -> float:
    with pytest.raises(NoFeasiblePlan) as info:
        _plan(1, **options)
    return info.value.largest_stage_bytes


def test_the_search_recomputes_layer_by_layer_where_a_whole_stage_does_not_fit() -> None:
    """One stage on 2 ranks, one micro-batch: recomputing the whole stage needs more than
    recomputing it layer by layer (its layers' inputs and one layer's activations rather than
    all four layers'); between the two, only layer by layer fits."""
    whole, layered = _least(recompute_layers=False), _least()
    assert layered < whole
    mib = (whole + layered) / 2 / 2**20
    with pytest.raises(NoFeasiblePlan):
        _plan(mib, recompute_layers=False)
    plan = _plan(mib)
    st = plan.stages[0]
    assert st.recompute and st.memory.total <= plan.memory_budget
    # the checkpoints are the layers' starts after the stage's first node's segment
    assert len(st.checkpoints) == 5  # the four layers and the head
    assert "layers" in plan.summary()
    # where the whole stage's recomputation fits, it is taken: a forward less per micro-batch
    roomy = _plan(whole / 2**20 * 1.01, recompute=True)
    assert roomy.stages[0].recompute and roomy.stages[0].checkpoints == ()
    assert roomy.predicted_step_ms < plan.predicted_step_ms
    # forced: every recomputing stage layer by layer
    forced = _plan(whole / 2**20 * 1.01, recompute=True, recompute_layers=True)
    assert forced.stages[0].checkpoints == st.checkpoints


@pytest.mark.parametrize("schedule", ["zbh1", "zbv", "interleaved"])
def test_layers_are_refused_where_the_schedule_recomputes_stages_whole(schedule: str) -> None:
    with pytest.raises(ValueError, match="recompute_layers=True with schedule"):
        Config(recompute_layers=True, schedule=schedule)
    Config(recompute_layers=None, schedule=schedule)  # searched: these stages recompute whole
