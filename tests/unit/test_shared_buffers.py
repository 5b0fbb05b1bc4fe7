"""Buffers and constants that several stages read, in one process: what capture finds the
forward writes, a value computed from a written buffer is not recomputed elsewhere, the search
keeps a shared BatchNorm in one stage, and a plan that splits a written buffer's readers is
refused. The models, shared with ``distributed/test_shared_buffers.py``."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from rannc_fx.capture.capture import CapturedGraph, capture_pass
from rannc_fx.group.group import CALL_OPS, BlockGraph, recomputed_values, written_state
from rannc_fx.partition import partition
from rannc_fx.plan.config import Config
from rannc_fx.plan.plan import Plan
from rannc_fx.plan.values import ValueSpec
from rannc_fx.split.split import split_pass
from tests.unit.test_group import value_specs
from tests.unit.test_split import make_plan


class Rotary(nn.Module):
    """Rotary position angles from one ``inv_freq`` buffer (non-persistent, as in transformers)."""

    def __init__(self, d: int, *, persistent: bool) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", torch.empty(d // 2), persistent=persistent)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Also what computes the buffer on each stage of a meta-device model."""
        n = self.inv_freq.numel()
        with torch.no_grad():
            steps = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
            self.inv_freq.copy_(1.0 / 10000 ** (steps / n))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _angles(h, self.inv_freq)


def _angles(h: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(h.shape[1], dtype=inv_freq.dtype, device=h.device)
    f = torch.outer(pos, inv_freq)
    return f.cos(), f.sin()


class Layer(nn.Module):
    """A residual layer that rotates its normalized input; with ``alias`` it holds the model's
    ``inv_freq`` as a buffer of its own (one tensor under several names)."""

    def __init__(self, d: int, alias: torch.Tensor | None = None, persistent: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.aliased = alias is not None
        if alias is not None:
            self.register_buffer("inv_freq", alias, persistent=persistent)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        cos, sin = _angles(x, self.get_buffer("inv_freq")) if self.aliased else rotary(x)
        a, b = self.norm(x).chunk(2, dim=-1)
        h = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        return x + torch.tanh(self.lin(h))


class RotaryLM(nn.Module):
    """A tied-embedding LM whose every layer reads one rotary ``inv_freq`` buffer."""

    def __init__(self, vocab: int = 64, d: int = 16, layers: int = 4, *,
                 persistent: bool = False, alias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rotary = Rotary(d, persistent=persistent)
        shared = self.rotary.inv_freq if alias else None
        self.layers = nn.ModuleList(Layer(d, shared, persistent) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, self.rotary)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class SharedBN(nn.Module):
    """One BatchNorm called after every layer: its running statistics are written by each call."""

    def __init__(self, d: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.bn(torch.tanh(layer(x)))
        return F.cross_entropy(self.head(x), y)


class Counter(nn.Module):
    """A buffer incremented in place, then read by every layer."""

    def __init__(self, d: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.count: torch.Tensor
        self.register_buffer("count", torch.zeros(()))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * (1 + 0.01 * self.count)
        return F.cross_entropy(self.head(x), y)


class Scaled(nn.Module):
    """A plain tensor attribute (neither parameter nor buffer: a graph constant) read by every
    layer."""

    def __init__(self, d: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.scale = torch.linspace(0.5, 1.5, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return F.cross_entropy(self.head(x), y)


MODELS = {"rotary": RotaryLM, "bn": SharedBN, "counter": Counter, "scaled": Scaled}


def _example(name: str, batch: int, **kw: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = MODELS[name](**kw)
    g = torch.Generator().manual_seed(1)
    if name == "rotary":
        ids = torch.randint(0, 64, (batch, 8), generator=g)
        return model, (ids, torch.roll(ids, -1, dims=1))
    return model, (torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g))


def _capture(model: nn.Module, tracer: str, args: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[CapturedGraph, list[torch.Tensor]]:
    args = args or (torch.randn(4, 16), torch.randint(0, 4, (4,)))
    cg = capture_pass(model, args, {}, tracer=tracer)  # type: ignore[arg-type]
    return cg, cg.flatten_inputs(args, {})


class _Functional(nn.Module):
    def __init__(self, training: bool) -> None:
        super().__init__()
        self.flag = training
        self.lin = nn.Linear(16, 4)
        self.register_buffer("mean", torch.zeros(16))
        self.register_buffer("var", torch.ones(16))
        self.register_buffer("cache", torch.zeros(2, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.batch_norm(x, self.mean, self.var, training=self.flag)
        self.cache[0].copy_(h.detach().mean(0))  # a write through a view
        return F.cross_entropy(self.lin(h), y)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_written_state_finds_running_statistics_and_in_place_writes(tracer):
    cases = [
        (SharedBN(), {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}),
        (Counter(), {"count"}),
        (_Functional(True), {"mean", "var", "cache"}),
        (_Functional(False), {"cache"}),
        (RotaryLM(), set()),
    ]
    ids = torch.randint(0, 64, (4, 8))
    for model, want in cases:
        cg, _ = _capture(model, tracer, (ids, ids) if isinstance(model, RotaryLM) else None)
        found = {name for name, _ in written_state(cg.gm).values()}
        assert found == want, (type(model).__name__, found)


def test_a_value_computed_from_a_written_buffer_is_not_recomputed_elsewhere():
    cg, flat = _capture(Counter(), "fx")
    values = value_specs(cg, flat)
    recomputed = recomputed_values(cg.gm, values)
    reads_count = [n.name for n in cg.gm.graph.nodes if n.op == "call_function"
                   and any(a.op == "get_attr" and a.target == "count" for a in n.all_input_nodes)]
    assert reads_count and not set(reads_count) & recomputed  # 0.01 * count: read after add_


def test_the_search_keeps_a_shared_batchnorm_in_one_stage():
    model, args = _example("bn", 8)
    parted = partition(model, args, {}, world_size=5, config=Config(
        replicas=(1,) * 5, micro_batches=2, profile_cache_dir=None, cost_model="analytic"))
    holders = [s for s, st in enumerate(parted.plan.stages) if "bn.running_mean" in st.buffer_names]
    assert len(holders) == 1, [st.buffer_names for st in parted.plan.stages]


def _split_after_first_reader(cg: CapturedGraph, values: dict[str, ValueSpec], name: str,
                               samples: int) -> Plan:
    """A plan of one node per block (no grouping asked) cut right after the first node that
    reads the written buffer ``name``: its later readers run in stage 1."""
    t = cg.gm.get_buffer(name)
    nodes = [n for n in cg.gm.graph.nodes if n.op in CALL_OPS]

    def reads(n: fx.Node) -> bool:
        if n.op == "call_module":
            return any(b is t for b in cg.gm.get_submodule(n.target).buffers())
        return any(a.op == "get_attr" and operator.attrgetter(a.target)(cg.gm) is t
                   for a in n.all_input_nodes)

    first = next(i for i, n in enumerate(nodes) if reads(n))
    bg = BlockGraph(blocks=tuple((n.name,) for n in nodes), params=((),) * len(nodes),
                    boundary=((),) * (len(nodes) + 1))
    return make_plan(cg, bg, values, [0, first + 1], samples=samples)


@pytest.mark.parametrize("name,tracer", [("bn", "fx"), ("bn", "export"), ("counter", "fx")])
def test_a_plan_that_splits_a_written_buffers_readers_is_refused(name, tracer):
    model, _ = _example(name, 4)
    cg, flat = _capture(model, tracer)
    values = value_specs(cg, flat)
    buffer = "count" if name == "counter" else "bn.running_mean"
    plan = _split_after_first_reader(cg, values, buffer, 4)
    pattern = "count" if name == "counter" else r"bn\.running_(mean|var)"
    with pytest.raises(ValueError, match=rf"'{pattern}' is written in the forward \(by node "
                       r"'\w+'\) and read by stages \[0, 1\].*make the plan again"):
        split_pass(cg, plan, values=values)
