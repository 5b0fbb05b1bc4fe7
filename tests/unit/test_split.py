"""split_pass: stages compose to the captured graph bit for bit, own their parameters, rebuild sizes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from examples.models import cnn_example, gpt_example, mlp_example
from rannc_fx.capture.capture import CapturedGraph, capture_pass
from rannc_fx.group.group import BlockGraph, group_pass, recomputed_values
from rannc_fx.plan.device import DeviceSpec
from rannc_fx.plan.plan import Block, CutValue, MemoryEstimate, OutputRef, Plan, Stage
from rannc_fx.plan.values import ValueSpec
from rannc_fx.split.split import run_stages, split_pass, stage_interfaces
from tests.unit.test_group import capture, prepared, synthetic_profile, value_specs

# -- plans for tests -------------------------------------------------------------------------


def make_plan(cg: CapturedGraph, bg: BlockGraph, values: dict[str, ValueSpec],
              starts: list[int], samples: int = 4) -> Plan:
    """A plan with one replica per stage; stage s covers blocks [starts[s], starts[s + 1])."""
    ends = [*starts[1:], len(bg.blocks)]
    node_stage = {n: s for s, (a, b) in enumerate(zip(starts, ends, strict=True))
                  for blk in bg.blocks[a:b] for n in blk}
    ifaces = stage_interfaces(cg, node_stage, values, len(starts))
    zero = MemoryEstimate(params=0, grads=0, optimizer_state=0, activations=0, comm_buffers=0,
                          workspace=0)
    stages = tuple(
        Stage(index=s, first_block=a, end_block=b, replicas=1, ranks=(s,), samples=samples,
              num_nodes=sum(len(x) for x in bg.blocks[a:b]), param_names=(),
              inputs=ifaces[s].inputs, outputs=ifaces[s].outputs, fwd_ms=0, bwd_ms=0,
              comm_ms=0, allreduce_ms=0, memory=zero)
        for s, (a, b) in enumerate(zip(starts, ends, strict=True))
    )
    return Plan(
        model_fingerprint="test", tracer=cg.tracer, world_size=len(starts), global_batch=samples,
        micro_batches=1, device=DeviceSpec.preset("cpu"), cost_model="analytic",
        memory_budget=1, optimizer_state_factor=2.0,
        blocks=tuple(Block(index=i, nodes=b, fwd_ms=0, bwd_ms=0, param_bytes=0,
                           activation_bytes=0) for i, b in enumerate(bg.blocks)),
        stages=stages,
        inputs=tuple(values[n] for n in cg.input_names),
        outputs=tuple(OutputRef(index=i, stage=node_stage.get(n, 0), spec=values[n])
                      for i, n in enumerate(cg.output_names)),
        cut_values=tuple(CutValue(producer=p, consumers=c, spec=values[n])
                         for n, p, c in (ifaces[0].cut_values if ifaces else ())),
        predicted_step_ms=0.0,
    )


def random_starts(rng: random.Random, num_blocks: int, num_stages: int) -> list[int]:
    return [0, *sorted(rng.sample(range(1, num_blocks), num_stages - 1))]


def _compose(cg: CapturedGraph, plan: Plan, stages: list[fx.GraphModule],
             flat: list[torch.Tensor]) -> list[Any]:
    return run_stages(stages, plan, flat, cg.input_names, cg.output_names)


def _float_leaves(outs: list[Any]) -> list[torch.Tensor]:
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _grads(gm: nn.Module, outs: list[Any]) -> dict[str, torch.Tensor]:
    loss = sum(o.float().sum() for o in _float_leaves(outs) if o.requires_grad)
    params = [p for p in gm.parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, params, allow_unused=True)  # type: ignore[arg-type]
    names = [n for n, p in gm.named_parameters() if p.requires_grad]
    return {n: g for n, g in zip(names, gs, strict=True) if g is not None}


def _buffers(gm: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in gm.named_buffers()}


def check_split(cg: CapturedGraph, flat: list[torch.Tensor], values: dict[str, ValueSpec],
                plan: Plan, *, model_out: list[torch.Tensor] | None = None) -> list[fx.GraphModule]:
    """Stages compose to ``cg.gm`` bit for bit (outputs, buffer updates) and match gradients."""
    gm = cg.gm
    before = _buffers(gm)
    want = list(gm(*flat))
    want_bufs = _buffers(gm)
    want_grads = _grads(gm, want)
    for n, b in gm.named_buffers():
        b.copy_(before[n])

    stages = split_pass(cg, plan, values=values)
    assert [type(s).__name__ for s in stages] == [f"stage_{i}" for i in range(len(stages))]
    got = _compose(cg, plan, stages, flat)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), "stages differ from the captured graph"
    for n, b in _buffers(gm).items():
        assert torch.equal(b, want_bufs[n]), f"buffer {n} updated differently"
    got_grads = _grads(gm, got)
    assert got_grads.keys() == want_grads.keys()
    for n, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-6, atol=1e-7, msg=n)
    if model_out is not None:
        for g, w in zip(_float_leaves(got), model_out, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    _check_structure(cg, plan, stages, values)
    return stages


def _check_structure(cg: CapturedGraph, plan: Plan, stages: list[fx.GraphModule],
                     values: dict[str, ValueSpec]) -> None:
    params = {id(p): n for n, p in cg.gm.named_parameters(remove_duplicate=False)}
    buffers = {id(b) for b in cg.gm.buffers()}
    recomputed = recomputed_values(cg.gm, values)
    for spec, st in zip(plan.stages, stages, strict=True):
        phs = [n for n in st.graph.nodes if n.op == "placeholder"]
        assert [p.target for p in phs] == list(spec.inputs)
        assert "def forward" in st.code
        out = st.graph.output_node().args[0]
        assert isinstance(out, tuple) and len(out) == len(spec.outputs)
        for name, p in st.named_parameters(remove_duplicate=False):
            assert id(p) in params, f"stage {spec.index} holds a parameter copy {name}"
            assert name in dict(cg.gm.named_parameters(remove_duplicate=False)), name
        for b in st.buffers():
            assert id(b) in buffers
        # a stage holds only what its nodes read
        used = {str(n.target) for n in st.graph.nodes if n.op in ("get_attr", "call_module")}
        for name, _ in st.named_parameters(remove_duplicate=False):
            assert any(name == u or name.startswith(u + ".") for u in used), name
    for cv in plan.cut_values:
        assert cv.name not in recomputed and cv.spec.kind == "tensor"


# -- composition on the model zoo ------------------------------------------------------------


def _model_leaves(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    return [x for x in pytree.tree_leaves(model(*args, **kwargs)) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("example", [mlp_example, cnn_example, gpt_example])
def test_builtin_models_compose_at_several_stage_counts(example):
    model, args, kwargs = example()
    cg, flat = capture(model, args, kwargs)
    values = value_specs(cg, flat)
    bg = group_pass(cg, synthetic_profile(cg, values), values, max_blocks=16)
    want = _float_leaves(_model_leaves(model, args, kwargs))
    rng = random.Random(0)
    B = len(bg.blocks)
    plans = [[0], [0, B // 2], list(range(B))]
    plans += [random_starts(rng, B, rng.randint(2, min(5, B))) for _ in range(3)]
    for starts in plans:
        check_split(cg, flat, values, make_plan(cg, bg, values, starts), model_out=want)


@pytest.mark.parametrize("name", ["bert_example", "gpt2_example", "resnet_example"])
def test_transformers_models_compose(name):
    hf_models = pytest.importorskip("tests.hf_models")
    model, args, kwargs = getattr(hf_models, name)()
    cg, flat = capture(model, args, kwargs)
    values = value_specs(cg, flat)
    bg = group_pass(cg, synthetic_profile(cg, values), values, max_blocks=12)
    want = _float_leaves(_model_leaves(model, args, kwargs))
    rng = random.Random(1)
    B = len(bg.blocks)
    # check_split also checks that masks and position ids are rebuilt where read, never sent
    for starts in ([0, B // 3, 2 * B // 3], random_starts(rng, B, 4), list(range(B))):
        check_split(cg, flat, values, make_plan(cg, bg, values, starts), model_out=want)


def test_tied_weight_is_one_parameter_held_by_both_stages():
    cg, flat, values, profile = prepared(gpt_example)
    bg = group_pass(cg, profile, values, max_blocks=64)
    users = [b for b, names in enumerate(bg.params) if "embed.weight" in names]
    assert len(users) == 2, users  # the embedding lookup and the LM head
    starts = [0, users[0] + 1, users[1]]
    plan = make_plan(cg, bg, values, starts)
    stages = check_split(cg, flat, values, plan)
    tied = cg.gm.get_parameter("embed.weight")
    # the graph may read the tied tensor under either name; it is one object in both stages
    assert any(p is tied for p in stages[0].parameters())
    assert any(p is tied for p in stages[-1].parameters())
    assert not any(p is tied for p in stages[1].parameters())


# -- sizes and data-free values --------------------------------------------------------------


class _Sizes(nn.Module):
    """Sizes made in one stage and used in another: ``n`` (a = 1), ``2 n`` and ``3 n``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        n = h.size(0)
        rows = h.view(n * 2, 4)  # a view of (2 B, 4): two rows per sample
        rows = torch.tanh(rows)
        rows = torch.sigmoid(rows)
        return self.out(rows).reshape(n, 8) * (n * 3)


def _one_node_blocks(cg: CapturedGraph, values: dict[str, ValueSpec]) -> BlockGraph:
    return group_pass(cg, synthetic_profile(cg, values), values, max_blocks=10_000)


def test_sizes_are_recomputed_from_the_sample_count():
    cg, flat = capture(_Sizes(), (torch.randn(6, 8),))
    values = value_specs(cg, flat)
    bg = _one_node_blocks(cg, values)
    b = bg.block_of()
    sigmoid = next(n for n in cg.gm.graph.nodes if "sigmoid" in n.name)
    tanh = next(n.name for n in cg.gm.graph.nodes if "tanh" in n.name)
    plan = make_plan(cg, bg, values, [0, b[tanh], b[next(iter(sigmoid.users)).name]])
    stages = check_split(cg, flat, values, plan)
    assert all(cv.spec.kind == "tensor" for cv in plan.cut_values)
    last = stages[-1].code
    assert ".size(0)" in last and "// 2" in last, last  # samples from the (2 B, 4) input
    # other sample counts: the sizes follow
    for batch in (1, 3):
        x = torch.randn(batch, 8)
        got = _compose(cg, plan, stages, [x])
        assert torch.equal(got[0], cg.gm(x)[0])


def test_a_size_needs_a_batched_input_to_count_from():
    class Mean(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            total = torch.exp(x).sum()
            return torch.tanh(total) / x.size(0)

    cg, flat = capture(Mean(), (torch.randn(4, 3),))
    values = value_specs(cg, flat)
    node_stage = {n.name: 0 for n in cg.gm.graph.nodes if n.op.startswith("call")}
    node_stage[next(n for n in node_stage if n.startswith("tanh"))] = 1
    node_stage[next(n for n in node_stage if n.startswith("truediv"))] = 1
    with pytest.raises(ValueError, match="batch dimension to count samples from"):
        stage_interfaces(cg, node_stage, values, 2)


class _Masked(nn.Module):
    """A mask made from a buffer and a size, read by two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("tri", torch.tril(torch.ones(8, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.size(1)
        m = self.tri[:s, :s] * 0.5
        h = torch.relu(self.a(x).transpose(1, 2) @ m)
        return torch.relu(self.b(h).transpose(1, 2) @ m)


def test_data_free_mask_is_rebuilt_in_each_stage():
    cg, flat = capture(_Masked(), (torch.randn(3, 8, 8),))
    values = value_specs(cg, flat)
    recomputed = recomputed_values(cg.gm, values)
    mask = [n for n in recomputed if values[n].kind == "tensor"]
    assert mask, "the mask is data-free"
    bg = _one_node_blocks(cg, values)
    plan = make_plan(cg, bg, values, list(range(len(bg.blocks))))
    stages = check_split(cg, flat, values, plan)
    assert not any(cv.name in mask for cv in plan.cut_values)
    readers = [st for st in stages if "tri" in dict(st.named_buffers())]
    assert len(readers) == 2, [st.code for st in stages]


# -- interfaces ------------------------------------------------------------------------------


def test_interfaces_list_residuals_once_per_consumer_in_order():
    class Res(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(x)
            a = torch.tanh(h)
            b = torch.sigmoid(a) + y
            return a * 2, b + h

    cg, flat = capture(Res(), (torch.randn(4, 3), torch.randn(4, 3)))
    values = value_specs(cg, flat)
    node_stage = {"relu": 0, "tanh": 0, "sigmoid": 1, "add": 1, "mul": 1, "add_1": 2}
    ifaces = stage_interfaces(cg, node_stage, values, 3)
    assert ifaces[0].inputs == ("x",) and ifaces[0].outputs == ("relu", "tanh")
    assert ifaces[1].inputs == ("y", "tanh") and ifaces[1].outputs == ("add", "mul")
    assert ifaces[2].inputs == ("relu", "add") and ifaces[2].outputs == ("add_1",)
    assert ifaces[0].cut_values == (("relu", 0, (2,)), ("tanh", 0, (1,)), ("add", 1, (2,)))
    with pytest.raises(ValueError, match="later stage"):
        stage_interfaces(cg, {**node_stage, "relu": 1}, values, 3)
    with pytest.raises(ValueError, match="in no stage"):
        stage_interfaces(cg, {k: v for k, v in node_stage.items() if k != "mul"}, values, 3)


def test_constants_cannot_cross_stages():
    class Cast(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dt = x.dtype
            return torch.tanh(x).to(dt)

    cg, flat = capture(Cast(), (torch.randn(4, 3),))
    values = value_specs(cg, flat)
    names = [n.name for n in cg.gm.graph.nodes if n.op.startswith("call")]
    node_stage = {n: 0 for n in names}
    node_stage[next(n for n in names if n.startswith("to"))] = 1
    with pytest.raises(ValueError, match="not a tensor"):
        stage_interfaces(cg, node_stage, values, 2)


def test_plan_for_another_graph_is_refused():
    cg, flat, values, profile = prepared(mlp_example)
    bg = group_pass(cg, profile, values, max_blocks=4)
    plan = make_plan(cg, bg, values, [0, 2])
    st = plan.stages[1]
    bad = plan.model_copy(update={"stages": (plan.stages[0], st.model_copy(
        update={"inputs": tuple(reversed(st.inputs))}))})
    if len(st.inputs) > 1:
        with pytest.raises(ValueError, match="made for another graph"):
            split_pass(cg, bad, values=values)


def test_stages_run_generated_code_not_an_interpreter():
    cg, flat, values, profile = prepared(mlp_example)
    bg = group_pass(cg, profile, values, max_blocks=4)
    stages = split_pass(cg, make_plan(cg, bg, values, [0, 2]), values=values)
    for st in stages:
        assert isinstance(st, fx.GraphModule)
        assert not isinstance(st, fx.Interpreter)
        # recompile() made forward from the stage's own source (an eval'd module), which is
        # what runs: no fx.Interpreter walks the graph node by node
        assert "eval_with_key" in type(st).forward.__code__.co_filename
        assert "Interpreter" not in st.code
        assert not any(n.op == "placeholder" and "weight" in n.name for n in st.graph.nodes), (
            "parameters are the stage's own attributes, not inputs")


class _InPlace(nn.Module):
    """In-place writes: a module with inplace=True, add_ on a residual, a mask filled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        early = h * 2  # read before the writes below
        h = self.act(h)
        g = self.b(h)
        g.add_(early)
        mask = torch.zeros(8, 8)
        mask.masked_fill_(torch.eye(8) > 0, 1.0)  # a written mask is not data-free
        return torch.relu_(g @ mask) + early


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_inplace_writes_compose_at_every_cut(tracer):
    x = torch.randn(4, 8)
    cg = capture_pass(_InPlace(), (x,), {}, tracer=tracer)
    flat = cg.flatten_inputs((x,), {})
    values = value_specs(cg, flat)
    bg = _one_node_blocks(cg, values)
    plan = make_plan(cg, bg, values, list(range(len(bg.blocks))))
    check_split(cg, flat, values, plan)
    assert len(bg.blocks) >= 3
