"""group_pass: atomic groups never split, a valid chain, coarsening, boundaries, the log line."""

from __future__ import annotations

import logging
import operator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from examples.models import cnn_example, gpt_example, mlp_example
from rannc_fx.capture.capture import CapturedGraph, capture_pass
from rannc_fx.group.group import (
    BlockGraph,
    atomic_groups,
    coarsen,
    group_pass,
    is_view,
    recomputed_values,
)
from rannc_fx.plan.values import ValueSpec
from rannc_fx.profile.optimizer import SizeCurve
from rannc_fx.profile.profile import NodeCost, Profile
from rannc_fx.search.table import build_cost_table, interpolation_weights, range_sums
from rannc_fx.shapes.infer import infer_values_pass

# -- inputs: the real capture and shapes passes, a synthetic profile -------------------------


def capture(model: nn.Module, args: tuple[Any, ...],
            kwargs: dict[str, Any] | None = None) -> tuple[CapturedGraph, list[torch.Tensor]]:
    """The captured graph and its flat inputs."""
    kwargs = dict(kwargs or {})
    cg = capture_pass(model, args, kwargs)
    return cg, cg.flatten_inputs(args, kwargs)


def value_specs(cg: CapturedGraph, flat: list[torch.Tensor]) -> dict[str, ValueSpec]:
    return infer_values_pass(cg, flat)


def _captured(gm: fx.GraphModule, flat: list[torch.Tensor]) -> CapturedGraph:
    """A CapturedGraph around a hand-made flat graph."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    outs = [a.name for a in gm.graph.output_node().args[0]]
    _, spec = pytree.tree_flatten(tuple(range(len(outs))))
    _, in_spec = pytree.tree_flatten((tuple(flat), {}))
    return CapturedGraph(gm=gm, tracer="fx", in_spec=in_spec, out_spec=spec, input_names=names,
                         tensor_leaf_index=list(range(len(names))), output_names=outs)


def synthetic_profile(cg: CapturedGraph, values: dict[str, ValueSpec],
                      sizes: tuple[int, ...] = (1, 2, 4)) -> Profile:
    """Costs that grow with each node's output size and the parameters it reads."""
    gm = cg.gm
    nodes = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        spec = values[n.name]
        pbytes = sum(
            t.numel() * 4 for a in n.all_input_nodes if a.op == "get_attr"
            for t in [gm.get_parameter(a.target) if a.target in dict(gm.named_parameters())
                      else torch.empty(0)])
        if n.op == "call_module":
            pbytes += sum(p.numel() * 4 for p in gm.get_submodule(n.target).parameters())
        out = [spec.nbytes_for(s) if spec.kind == "tensor" else 0 for s in sizes]
        fwd = tuple(1e-9 * (o + pbytes * s) + 1e-7 for o, s in zip(out, sizes, strict=True))
        nodes[n.name] = NodeCost(fwd_s=fwd, bwd_s=tuple(2 * f for f in fwd),
                                 saved_bytes=tuple(out), workspace_bytes=tuple(2 * o for o in out))
    return Profile(batch_sizes=sizes, cost_model="analytic", device="cpu", nodes=nodes)


def prepared(example: Any, **kw: Any) -> tuple[CapturedGraph, list[torch.Tensor],
                                                 dict[str, ValueSpec], Profile]:
    model, args, kwargs = example(**kw)
    cg, flat = capture(model, args, kwargs)
    values = value_specs(cg, flat)
    return cg, flat, values, synthetic_profile(cg, values)


# -- checks every BlockGraph must pass -------------------------------------------------------


def check_block_graph(cg: CapturedGraph, bg: BlockGraph, values: dict[str, ValueSpec]) -> None:
    calls = [n for n in cg.gm.graph.nodes if n.op in ("call_function", "call_method",
                                                      "call_module")]
    block_of = bg.block_of()
    assert sorted(block_of) == sorted(n.name for n in calls), "every call node in one block"
    assert sum(len(b) for b in bg.blocks) == len(calls)
    assert all(bg.blocks), "no empty block"
    recomputed = recomputed_values(cg.gm, values)
    B = len(bg.blocks)
    assert len(bg.params) == B and len(bg.boundary) == B + 1
    assert bg.boundary[0] == () and bg.boundary[B] == ()
    want: list[list[str]] = [[] for _ in range(B + 1)]
    for n in calls:
        users = [block_of[u.name] for u in n.users if u.name in block_of]
        if n.name in recomputed:
            continue
        for u in users:
            assert u >= block_of[n.name], f"{n.name} is read by an earlier block"
        assert values[n.name].kind == "tensor" or all(u == block_of[n.name] for u in users), (
            f"constant {n.name} crosses a block boundary")
        for k in range(block_of[n.name] + 1, max(users, default=0) + 1):
            want[k].append(n.name)
    assert [list(b) for b in bg.boundary] == want


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("example", [mlp_example, cnn_example, gpt_example])
@pytest.mark.parametrize("max_blocks", [2, 5, 1000])
def test_builtin_models_group_into_a_valid_chain(example, max_blocks):
    cg, _, values, profile = prepared(example)
    bg = group_pass(cg, profile, values, max_blocks=max_blocks)
    check_block_graph(cg, bg, values)
    assert len(bg.blocks) <= max_blocks
    if max_blocks == 1000:
        assert len(bg.blocks) == len(atomic_groups(cg.gm, values))


def _trace(fn: Any, shape: tuple[int, ...]) -> tuple[CapturedGraph, dict[str, ValueSpec]]:
    """A one-input graph of ``fn(module, x)`` over a module with a weight and a buffer."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> Any:
            return fn(self, x)

    gm = fx.symbolic_trace(M())
    out = gm.graph.output_node()
    out.args = (tuple(pytree.tree_leaves(out.args[0])),)
    gm.recompile()
    flat = [torch.randn(*shape)]
    cg = _captured(gm, flat)
    return cg, value_specs(cg, flat)


def _same_block(bg: BlockGraph, *names: str) -> bool:
    b = bg.block_of()
    return len({b[n] for n in names}) == 1


def _atomic(cg: CapturedGraph, values: dict[str, ValueSpec]) -> BlockGraph:
    prof = synthetic_profile(cg, values)
    bg = group_pass(cg, prof, values, max_blocks=10_000)
    check_block_graph(cg, bg, values)
    return bg


def test_views_and_inplace_ops_stay_with_their_producer():
    def fn(m, x):
        h = torch.relu(x @ m.w)
        v = h.view(-1, 4, 2).transpose(1, 2)
        v.mul_(2.0)
        g = torch.sigmoid(v)
        return (g.sum(),)

    cg, values = _trace(fn, (4, 8))
    names = [n.name for n in cg.gm.graph.nodes]
    relu = next(n for n in names if n.startswith("relu"))
    view = next(n for n in names if n.startswith("view"))
    tr = next(n for n in names if n.startswith("transpose"))
    mul_ = next(n for n in names if n.startswith("mul_"))
    bg = _atomic(cg, values)
    assert _same_block(bg, relu, view, tr, mul_)


def test_inplace_write_keeps_earlier_readers_with_it():
    def fn(m, x):
        h = torch.tanh(x)
        early = h * 3.0  # reads h before the write
        h.add_(1.0)
        return (early + h,)

    cg, values = _trace(fn, (4, 8))
    bg = _atomic(cg, values)
    assert _same_block(bg, "tanh", "mul", "add_")


def test_getitem_stays_with_its_multi_output_op_and_constants_never_cross():
    def fn(m, x):
        a, b = torch.chunk(x, 2, dim=1)
        dt = x.dtype
        y = torch.relu(a).to(dt)
        z = torch.exp(b) * 2
        w = (y + z).to(dt)  # the dtype is read far from where it is made
        return (w,)

    cg, values = _trace(fn, (4, 8))
    assert values["getattr_1"].kind == "constant"
    bg = _atomic(cg, values)
    assert _same_block(bg, "chunk", "getitem", "getitem_1")
    # the dtype's readers pull the whole path between them into one block (a cycle merged)
    assert _same_block(bg, "getattr_1", "to", "to_1", "add")


def test_parameter_only_chain_joins_its_first_consumer_and_ints_may_cross():
    def fn(m, x):
        wt = m.w.t() * 0.5
        h = torch.relu(x @ wt)
        n = h.shape[0]
        h = torch.tanh(h)
        h = torch.sigmoid(h)
        return (h.reshape(n, 2, 4),)

    cg, values = _trace(fn, (4, 8))
    bg = _atomic(cg, values)
    assert _same_block(bg, "t", "mul", "matmul")
    assert values["getitem"].kind == "int"
    b = bg.block_of()
    assert b["getattr_1"] < b["reshape"], "the size is free to cross"
    assert all("getitem" not in names for names in bg.boundary), "ints are not counted"


def test_value_reduced_over_the_batch_never_crosses():
    # BERT's pretraining loss: a masked-LM mean plus a next-sentence mean. Each replica
    # computes its own partial means; a cut between them and their sum would send one
    # replica's whole (routing.cut_transfers) and drop the others'
    def fn(m, x):
        h = torch.relu(x @ m.w)
        a = torch.tanh(h).mean()
        b = torch.sigmoid(h).mean()
        w = (m.w * 2.0).sum()  # from parameters only: the same on every replica
        return (a + b, w)

    cg, values = _trace(fn, (4, 8))
    assert values["mean"].batch_dim is None and values["mean_1"].batch_dim is None
    bg = _atomic(cg, values)
    assert _same_block(bg, "mean", "mean_1", "add")
    assert not _same_block(bg, "relu", "add")


def test_residual_value_crosses_every_boundary_it_spans():
    def fn(m, x):
        h = torch.relu(x)
        a = torch.tanh(h)
        a = torch.sigmoid(a)
        a = torch.exp(a)
        return (a + h,)

    cg, values = _trace(fn, (4, 8))
    bg = _atomic(cg, values)
    assert [len(b) for b in bg.blocks] == [1, 1, 1, 1, 1]
    assert bg.boundary == ((), ("relu",), ("relu", "tanh"), ("relu", "sigmoid"),
                           ("relu", "exp"), ())


def test_coarsening_merges_communication_heavy_cuts_first():
    # six groups; cut 3 carries almost nothing, the others a lot
    compute = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]).numpy()
    cut = torch.tensor([0, 100, 100, 1, 100, 100, 0]).numpy()
    assert coarsen(compute, cut, 2) == [0, 3]
    assert coarsen(compute, cut, 6) == list(range(6))
    # a tiny group goes into a neighbour before big groups are merged
    compute = torch.tensor([5.0, 5.0, 0.01, 5.0]).numpy()
    cut = torch.tensor([0, 10, 10, 10, 0]).numpy()
    starts = coarsen(compute, cut, 3)
    assert len(starts) == 3 and 2 not in starts


def test_coarsening_identical_layers_stays_balanced():
    # equal scores everywhere: merging must not snowball into the first block
    assert coarsen(np.ones(8), np.array([0] + [10] * 7 + [0]), 4) == [0, 2, 4, 6]
    starts = coarsen(np.array([5.0] + [1.0] * 8), np.array([0] + [10] * 8 + [0]), 3)
    assert max(np.diff([*starts, 9])[1:]) <= 4, starts


def test_cheap_cut_survives_coarsening_on_a_real_graph():
    class Bottleneck(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.down = nn.Linear(64, 2)
            self.up = nn.Linear(2, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.a(x))
            h = F.relu(self.a(h))
            z = self.down(h)
            h = F.relu(self.up(z))
            return self.b(F.relu(self.b(h)))

    cg, flat = capture(Bottleneck(), (torch.randn(8, 64),))
    values = value_specs(cg, flat)
    bg = group_pass(cg, synthetic_profile(cg, values), values, max_blocks=2)
    check_block_graph(cg, bg, values)
    assert bg.boundary[1] == ("down",), bg.blocks


def test_tied_parameters_are_named_once_and_modules_report_their_parameters():
    cg, _, values, profile = prepared(gpt_example)
    bg = group_pass(cg, profile, values, max_blocks=1000)
    everything = [p for ps in bg.params for p in ps]
    assert "embed.weight" in everything and "head.weight" not in everything
    assert "pos" in everything
    assert sum(everything.count(p) for p in ("embed.weight",)) == 2  # embedding and head


def test_log_line(caplog):
    cg, _, values, profile = prepared(mlp_example)
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        bg = group_pass(cg, profile, values, max_blocks=4)
    msgs = [r.getMessage() for r in caplog.records if r.name == "rannc_fx"]
    n = sum(len(b) for b in bg.blocks)
    assert any(m.startswith(f"grouped {n} nodes into {len(bg.blocks)} blocks in ") for m in msgs)


def test_is_view_reads_aten_schemas():
    g = fx.Graph()
    x = g.placeholder("x")
    v = g.call_function(torch.ops.aten.view.default, (x, [4]))
    a = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    s = g.call_function(torch.ops.aten.split.Tensor, (x, 2))
    gi = g.call_function(operator.getitem, (s, 0))
    assert is_view(v) and not is_view(a) and is_view(s) and is_view(gi)


def test_export_graphs_group(hf=None):
    hf_models = pytest.importorskip("tests.hf_models")
    for example in (hf_models.bert_example, hf_models.gpt2_example, hf_models.resnet_example):
        cg, _, values, profile = prepared(example)
        for mb in (3, 1000):
            bg = group_pass(cg, profile, values, max_blocks=mb)
            check_block_graph(cg, bg, values)


def test_large_graph_groups_fast():

    from examples.models import MLP

    model = MLP(d_in=8, hidden=8, depth=400)
    cg, flat = capture(model, (torch.randn(2, 8), torch.randint(0, 10, (2,))))
    values = value_specs(cg, flat)
    profile = synthetic_profile(cg, values)
    bg = group_pass(cg, profile, values, max_blocks=64)
    assert len(bg.blocks) == 64
    check_block_graph(cg, bg, values)


# -- the cost table --------------------------------------------------------------------------


def _interp(profile: Profile, node: str, field: str, samples: int) -> float:
    """Profile.at as documented: linear between profiled sizes, end segments beyond, >= 0."""
    try:
        return profile.at(node, field, samples)
    except NotImplementedError:
        pass
    xs, ys = profile.batch_sizes, getattr(profile.nodes[node], field)
    i = 0
    while i < len(xs) - 2 and samples > xs[i + 1]:
        i += 1
    return max(0.0, ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (samples - xs[i]))


def test_cost_table_matches_a_direct_sum():
    hf_models = pytest.importorskip("tests.hf_models")
    cg, _, values, profile = prepared(hf_models.gpt2_example)  # tied embedding and LM head
    bg = group_pass(cg, profile, values, max_blocks=6)
    sizes = (1, 3, 4, 8)
    # one second per tensor plus one per byte, for the optimizer step; no accumulation cost
    per_tensor = SizeCurve((0.0, 1.0), (1.0, 2.0), "test")
    table = build_cost_table(cg, bg, profile, values, sizes=sizes, optimizer=per_tensor)
    assert table.accumulate_s is None
    B = len(bg.blocks)
    assert table.fwd.shape == (4, B) and table.cut.shape == (4, B + 1)
    assert table.param_bytes.shape == (B, B + 1)
    for k, s in enumerate(sizes):
        for b, nodes in enumerate(bg.blocks):
            for field, arr in (("fwd_s", table.fwd), ("bwd_s", table.bwd),
                               ("saved_bytes", table.act)):
                want = sum(_interp(profile, n, field, s) for n in nodes)
                assert arr[k, b] == pytest.approx(want, rel=1e-9, abs=1e-15)
            want_ws = max(_interp(profile, n, "workspace_bytes", s) for n in nodes)
            assert table.workspace[k, b] == pytest.approx(want_ws)
        for b, crossing in enumerate(bg.boundary):
            assert table.cut[k, b] == sum(values[v].nbytes_for(s) for v in crossing)
    assert (table.cut[:, 0] == 0).all() and (table.cut[:, B] == 0).all()

    def tensors(i: int, j: int) -> dict[int, torch.Tensor]:
        out = {}
        for ps in bg.params[i:j]:
            for p in ps:
                t = cg.gm.get_parameter(p) if p in dict(cg.gm.named_parameters()) else \
                    cg.gm.get_buffer(p)
                out[id(t)] = t
        return out

    for i in range(B):
        for j in range(i + 1, B + 1):
            ts = tensors(i, j)
            assert table.param_bytes[i, j] == sum(t.numel() * 4 for t in ts.values())
            assert table.grad_bytes[i, j] == sum(t.numel() * 4 for t in ts.values()
                                                 if isinstance(t, nn.Parameter))
            assert table.optimizer_s is not None
            assert table.optimizer_s[i, j] == sum(1 + t.numel() * 4 for t in ts.values()
                                                  if isinstance(t, nn.Parameter))
    # every parameter once: the tied embedding / head weight is not counted twice
    total = sum(p.numel() * 4 for p in cg.gm.parameters())
    assert table.grad_bytes[0, B] == total


def test_range_sums_count_shared_tensors_once():
    # a tensor used by blocks 0 and 3 of 5, another by block 2 only
    items = [(0, 0, 10.0), (3, 3, 10.0), (0, 3, -10.0), (2, 2, 1.0)]
    m = range_sums(5, items)
    assert m[0, 5] == 11 and m[0, 1] == 10 and m[1, 3] == 1 and m[1, 4] == 11
    assert m[3, 4] == 10 and m[4, 5] == 0 and m[0, 3] == 11


def test_interpolation_weights_follow_the_profile():
    w = interpolation_weights((2, 4, 8), (1, 2, 3, 8, 16))
    v = torch.tensor([2.0, 4.0, 10.0]).numpy()
    assert (w @ v).tolist() == [1.0, 2.0, 3.0, 10.0, 22.0]
    assert interpolation_weights((4,), (2, 8)).tolist() == [[0.5], [2.0]]


@pytest.mark.parametrize("example", [mlp_example, cnn_example])
def test_real_analytic_profile_feeds_grouping_and_the_cost_table(example):
    from rannc_fx.plan.device import DeviceSpec
    from rannc_fx.profile.profile import profile_pass

    model, args, kwargs = example()
    cg, flat = capture(model, args, kwargs)
    values = value_specs(cg, flat)
    profile = profile_pass(cg, flat, values, batch_sizes=(1, 2, 4),
                           device_spec=DeviceSpec.preset("cpu"), cost_model="analytic",
                           cache_dir=None)
    bg = group_pass(cg, profile, values, max_blocks=5)
    check_block_graph(cg, bg, values)
    table = build_cost_table(cg, bg, profile, values, sizes=(1, 3, 8))
    assert (table.fwd > 0).any() and (table.cut[:, 1:-1] > 0).all()
    assert table.cut[2, 1] == pytest.approx(8 * table.cut[0, 1])  # cuts scale with samples
