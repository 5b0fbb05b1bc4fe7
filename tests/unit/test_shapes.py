"""infer_values_pass: per-sample shapes, batch dims and integer formulas from fake propagation."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from rannc_fx.capture.capture import capture_pass
from rannc_fx.plan.values import ValueSpec
from rannc_fx.runtime.pieces import interleave, sample_major
from rannc_fx.shapes.infer import infer_dtypes_pass, infer_values_pass
from tests.conftest import zoo_example


def values(model: nn.Module, *args: torch.Tensor, tracer: str = "fx") -> dict[str, ValueSpec]:
    cg = capture_pass(model, args, tracer=tracer)  # type: ignore[arg-type]
    return infer_values_pass(cg, cg.flatten_inputs(args, {}))


def by_target(model_values: dict[str, ValueSpec], prefix: str) -> list[ValueSpec]:
    return [v for k, v in model_values.items() if k.startswith(prefix)]


class _Reshapes(nn.Module):
    """x: (B, 3, 4) -> flattened per sample, then two rows per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x.view(x.size(0), -1))  # (B, 6)
        pairs = h.view(h.size(0), 2, 3)  # (B, 2, 3)
        return pairs.flatten(0, 1).sum(-1)  # (2B,): two rows per sample


def test_fx_graph_batch_dims_shapes_and_sizes():
    v = values(_Reshapes(), torch.randn(8, 3, 4))
    assert v["x"] == ValueSpec(name="x", kind="tensor", dtype="float32", shape=(1, 3, 4), batch_dim=0)
    assert v["size"].kind == "int" and v["size"].int_coeffs == ((1, 0),)
    assert v["view"].shape == (1, 12) and v["view"].batch_dim == 0
    assert v["lin"].shape == (1, 6) and v["lin"].requires_grad and not v["x"].requires_grad
    assert v["flatten"].shape == (2, 3) and v["flatten"].batch_dim == 0
    assert v["sum_1"].shape == (2,) and v["sum_1"].shape_for(5) == (10,)
    assert v["lin"].nbytes_for(5) == 5 * 6 * 4


def test_export_graph_sym_sizes_are_ints_in_the_sample_count():
    v = values(_Reshapes(), torch.randn(8, 3, 4), tracer="export")
    sizes = by_target(v, "sym_size")
    assert sizes and all(s.kind == "int" and s.int_coeffs == ((1, 0),) for s in sizes)
    tensors = [s for s in v.values() if s.kind == "tensor"]
    assert {s.shape for s in tensors if s.batch_dim is not None} >= {(1, 3, 4), (1, 12), (1, 6), (2, 3)}


def test_attention_reshapes_are_interleaved_but_what_leaves_the_layer_is_not(zoo):
    # nn.MultiheadAttention views (seq, batch, h) as (seq * batch, h) around out_proj
    _, args, kwargs, cg = zoo("gpt")
    assert cg.tracer == "export"
    v = infer_values_pass(cg, cg.flatten_inputs(args, kwargs))
    inter = [s for s in v.values() if s.interleaved]
    assert inter and all(s.batch_dim == 0 for s in inter)
    assert not any(v[n].interleaved for n in cg.output_names)


def test_shape_tuples_and_sizes_of_the_transformer_lm(zoo):
    _, args, kwargs, cg = zoo("gpt", "fx")
    v = infer_values_pass(cg, cg.flatten_inputs(args, kwargs))
    shape = next(s for s in v.values() if s.kind == "ints")
    assert shape.int_coeffs == ((1, 0), (0, 32)) and shape.ints_for(3) == (3, 32)
    assert v["flatten"].shape == (32, 256) and v["flatten"].batch_dim == 0  # logits.flatten(0, 1)
    assert v["encoder"].shape == (1, 32, 64)  # a leaf that only runs for real (mask check)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "bert", "gpt2", "resnet"])
def test_every_zoo_value_has_a_spec(zoo, name):
    model, args, kwargs, cg = zoo(name)
    state = copy.deepcopy(model.state_dict())
    v = infer_values_pass(cg, cg.flatten_inputs(args, kwargs))
    runnable = [n.name for n in cg.gm.graph.nodes if n.op not in ("get_attr", "output")]
    assert set(v) == set(runnable)
    for name_ in cg.input_names:
        assert v[name_].kind == "tensor" and v[name_].batch_dim == 0 and v[name_].shape[0] == 1
        assert not v[name_].requires_grad
    outs = [v[n] for n in cg.output_names]
    loss = outs[0]
    assert loss.shape == () and loss.batch_dim is None and loss.requires_grad
    assert all(o.batch_dim == 0 for o in outs[1:])  # logits
    # Fake propagation never touches the real state (BatchNorm statistics included).
    assert all(torch.equal(t, state[k]) for k, t in model.state_dict().items())


@pytest.mark.parametrize("name", ["cnn", "gpt", "gpt2"])
def test_the_dtypes_pass_gives_the_shape_pass_s_dtypes_under_each_autocast_state(zoo, name):
    """compile() infers the dtypes of the states it did not plan under with the cheap pass."""
    if name == "gpt2":
        pytest.importorskip("transformers")
    model, args, kwargs, cg = zoo(name)
    flat = cg.flatten_inputs(args, kwargs)
    got = {}
    for state in (None, torch.bfloat16):
        with torch.autocast("cpu", dtype=state or torch.float32, enabled=state is not None):
            want = {n: v.dtype for n, v in infer_values_pass(cg, flat).items()}
            got[state] = infer_dtypes_pass(cg, flat)
        assert got[state] == want
    lowered = [n for n, d in got[torch.bfloat16].items() if d != got[None][n]]
    assert lowered, "autocast changed no dtype: the comparison would pass a pass that ignores it"


def test_meta_model_gives_the_same_values_as_a_real_one(zoo):
    pytest.importorskip("transformers")
    _, args, kwargs, real = zoo("gpt2")
    with torch.device("meta"):
        model, margs, mkwargs = zoo_example("gpt2")
    meta = capture_pass(model, margs, mkwargs)
    got = infer_values_pass(meta, meta.flatten_inputs(margs, mkwargs))
    want = infer_values_pass(real, real.flatten_inputs(args, kwargs))
    # transformers' attention adds .contiguous() calls off the CPU, so the meta graph has a
    # few more nodes (and names shift); every value of the real graph is among the meta ones.
    def bag(cg, specs):
        return Counter((str(n.target), specs[n.name].model_copy(update={"name": ""}))
                       for n in cg.gm.graph.nodes if n.name in specs)

    extra = bag(meta, got) - bag(real, want)
    assert not bag(real, want) - bag(meta, got)
    assert {target for target, _ in extra} <= {"aten.contiguous.default"}
    assert [got[k] for k in meta.output_names] == [want[k] for k in real.output_names]


class _Branchy(nn.Module):
    """A leaf whose Python reads a tensor value: fake tensors cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if bool(x.sum() > 0) else -self.lin(x)


class _WithBranchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu()


def test_meta_leaf_that_needs_real_values_is_named():
    with torch.device("meta"):
        model = _WithBranchy()
    x = torch.randn(8, 4)
    cg = capture_pass(model, (x,), tracer="fx", leaf_modules=("_Branchy",))
    with pytest.raises(ValueError, match="node inner .*does not run"):
        infer_values_pass(cg, cg.flatten_inputs((x,), {}))


# -- values that micro-batching would break --------------------------------------------------


class _Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.row = nn.Parameter(torch.zeros(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


@pytest.mark.parametrize(("fn", "message"), [
    (lambda m, x: x.view(8, -1), r"node view \(view\) does not run at 3 samples: .*x.view\(x.size\(0\), -1\)"),
    (lambda m, x: torch.cat([m.row, x]), "not in proportion"),
    (lambda m, x: x * (1.0 / x.size(0)), "non-integer that depends on the sample count"),
])
def test_values_that_micro_batches_would_change_are_refused(fn, message):
    with pytest.raises(ValueError, match=message):
        values(_Lambda(fn), torch.randn(8, 4))


@pytest.mark.parametrize(("fn", "node"), [
    (lambda m, x: torch.cat([x, 2 * x]).sum(0), "cat"),
    (lambda m, x: x.repeat(2, 1).sum(0), "repeat"),
    (lambda m, x: x.view(x.size(0), 2, 2).transpose(0, 1).reshape(-1, 2).relu(), "relu"),
])
def test_values_whose_samples_interleave_are_marked(fn, node):
    v = values(_Lambda(fn), torch.randn(8, 4))
    assert v[node].interleaved and v[node].batch_dim == 0
    assert not v["x"].interleaved


@pytest.mark.parametrize(("fn", "node", "blocks"), [
    (lambda m, x: torch.cat([x, 2 * x, 3 * x]) + 1, "add", 3),
    (lambda m, x: x.repeat(2, 1).relu(), "relu", 2),
    (lambda m, x: x.view(x.size(0), 2, 2).transpose(0, 1).reshape(-1, 2).relu(), "relu", 2),
    (lambda m, x: x.view(x.size(0), 2, 2).transpose(0, 1).reshape(-1).view(-1, 1), "view_1", 2),
    (lambda m, x: x.reshape(2, -1), "reshape", None),  # half the samples in each row
])
def test_interleaved_layouts_are_recorded_where_known(fn, node, blocks):
    """The recorded layout is the real one: regrouped by it, each sample's rows are the
    rows the function gives for that sample alone."""
    x = torch.randn(6, 4)
    model = _Lambda(fn)
    spec = values(model, x)[node]
    assert spec.interleaved and spec.interleave == blocks
    if blocks is None:
        return
    gm = torch.fx.symbolic_trace(model)
    taps: dict[str, torch.Tensor] = {}
    interp = torch.fx.Interpreter(gm)
    run_node = interp.run_node
    interp.run_node = lambda n: taps.setdefault(n.name, run_node(n))  # type: ignore[method-assign]

    def at(batch: torch.Tensor) -> torch.Tensor:
        taps.clear()
        interp.run(batch)
        return taps[node]

    whole = sample_major(at(x), spec, 6)
    one_by_one = torch.cat([at(x[b : b + 1]) for b in range(6)], spec.batch_dim)
    torch.testing.assert_close(whole, one_by_one)
    torch.testing.assert_close(interleave(whole, spec, 6), at(x))


def test_a_view_back_undoes_the_interleaving():
    # multi-head attention's (seq, batch, h) -> (seq * batch, h) -> (seq, batch, h)
    def fn(m, x):
        s = x.transpose(0, 1)
        flat = s.reshape(-1, x.size(2)) * 2
        return flat.view(x.size(1), x.size(0), x.size(2)).transpose(0, 1)

    v = values(_Lambda(fn), torch.randn(8, 3, 4))
    assert v["mul"].interleaved and v["mul"].shape == (3, 4) and v["mul"].interleave == 3
    assert not v["view"].interleaved and v["view"].batch_dim == 1


def test_batch_major_reshapes_are_fine():
    v = values(_Lambda(lambda m, x: x.view(x.size(0), 2, 2).transpose(1, 2).reshape(-1, 2)),
               torch.randn(8, 4))
    assert v["reshape"].shape == (2, 2) and v["reshape"].batch_dim == 0
