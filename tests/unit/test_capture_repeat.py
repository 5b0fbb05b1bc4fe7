"""Repeated submodules traced once under torch.export: the same graph as a plain export.

Each model is exported twice, with and without the shortcut; the graphs must hold the same
nodes in the same order (ops, arguments by position, get_attr targets, output shapes), and
both must compute the model's outputs and gradients on real weights.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from rannc_fx.capture.graph import CapturedGraph
from rannc_fx.capture.trace import trace_export
from tests.hf_models import bert_example, gpt2_example, llama_example, t5_example


def _rows(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """The graph as text with node names replaced by positions."""
    index: dict[fx.Node, int] = {}
    rows = []
    for n in gm.graph.nodes:
        index[n] = len(index)
        args = pytree.tree_map(lambda a: f"%{index[a]}" if isinstance(a, fx.Node) else a,
                               (n.args, n.kwargs))
        val = n.meta.get("val")
        shape = str(tuple(val.shape)) if isinstance(val, torch.Tensor) else repr(val)
        rows.append((n.op, str(n.target), repr(args), shape))
    return rows


def _capture(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             caplog: pytest.LogCaptureFixture) -> tuple[CapturedGraph, CapturedGraph, int]:
    """(plain export, shortcut export, how many calls the shortcut copied)."""
    plain = trace_export(model, args, kwargs, 0, repeated=False)
    assert plain.copied_calls == 0
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="rannc_fx"):
        fast = trace_export(model, args, kwargs, 0, repeated=True)
    return plain, fast, fast.copied_calls


def _outputs_and_grads(captured: CapturedGraph, model: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    outs = captured.gm(*captured.flatten_inputs(args, kwargs))
    sum(o.float().sum() for o in outs if o.is_floating_point()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [o.detach() for o in outs], grads


def _check_same(plain: CapturedGraph, fast: CapturedGraph, model: nn.Module,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    assert _rows(fast.gm) == _rows(plain.gm)
    assert fast.input_names == plain.input_names and fast.in_spec == plain.in_spec
    assert fast.out_spec == plain.out_spec and fast.output_leaf_index == plain.output_leaf_index
    assert list(dict(fast.gm.named_parameters())) == list(dict(plain.gm.named_parameters()))
    own = {id(t) for t in (*model.parameters(), *model.buffers())}

    def foreign(c: CapturedGraph) -> list[str]:  # constants export lifted out of the code
        return [n for n, t in (*c.gm.named_parameters(), *c.gm.named_buffers()) if id(t) not in own]

    assert foreign(fast) == foreign(plain)
    outs_a, grads_a = _outputs_and_grads(plain, model, args, kwargs)
    outs_b, grads_b = _outputs_and_grads(fast, model, args, kwargs)
    torch.testing.assert_close(outs_b, outs_a)
    assert grads_b.keys() == grads_a.keys() and grads_a
    torch.testing.assert_close(grads_b, grads_a)
    with torch.no_grad():
        want = pytree.tree_leaves(model(*args, **kwargs))
    got = pytree.tree_leaves(fast.unflatten_outputs(outs_b))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# -- transformers models -------------------------------------------------------------------------


@pytest.mark.parametrize("example", [bert_example, gpt2_example, llama_example, t5_example],
                         ids=["bert", "gpt2", "llama", "t5"])
def test_hf_model_graph_equals_plain_export(example: Any, caplog: pytest.LogCaptureFixture) -> None:
    model, args, kwargs = example(layers=3)
    plain, fast, copied = _capture(model, args, kwargs, caplog)
    assert copied, caplog.text
    _check_same(plain, fast, model, args, kwargs)


def test_an_encoder_decoder_is_exported_at_most_twice(caplog: pytest.LogCaptureFixture) -> None:
    # T5's decoder members of a kind see other lengths than its encoder's, so shells must be
    # traced after all, kind after kind: the export again keeps every kind whole at once
    # (kept one kind at a time, this T5 was exported three times, twice as long as plainly)
    model, args, kwargs = t5_example()
    with caplog.at_level(logging.DEBUG, logger="rannc_fx"):
        fast = trace_export(model, args, kwargs, 0)
    assert caplog.text.count("exporting again") <= 1, caplog.text
    assert fast.copied_calls >= 1


def test_outputs_that_are_not_tensors_end_the_export_at_once(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A cache object among the outputs (transformers' use_cache=True) fails whatever traces
    the layers or sizes: the export with the repeated layers' stand-ins raises it, and neither
    a plain export nor one with only the batch dimension dynamic follows (the stand-ins' own
    retry keeps every kind whole once, as for any model: 6 exports before)."""
    from rannc_fx.capture import trace

    exports = []
    run = trace._run_export
    monkeypatch.setattr(trace, "_run_export", lambda *a: exports.append(1) or run(*a))
    model, args, kwargs = llama_example(use_cache=True)
    with pytest.raises(RuntimeError, match=r"Found <class '[\w.]*DynamicCache'> in output"):
        trace_export(model, args, kwargs, 0)
    assert len(exports) <= 2, len(exports)


def test_copies_read_their_own_layer_and_keep_symbolic_shapes(caplog: pytest.LogCaptureFixture) -> None:
    model, args, kwargs = bert_example(layers=3)
    fast = trace_export(model, args, kwargs, 0)
    assert fast.copied_calls == 2
    weight = "bert.encoder.layer.2.attention.self.query.weight"
    (attr,) = [n for n in fast.gm.graph.nodes if n.op == "get_attr" and n.target == weight]
    (linear,) = attr.users
    stack = linear.meta["nn_module_stack"]
    assert list(stack.values())[-1][0] == "bert.encoder.layer.2.attention.self.query"
    batch = linear.meta["val"].shape[0]
    assert isinstance(batch, torch.SymInt)
    assert not any(n.target is torch.ops.rannc_fx.repeated_call.default for n in fast.gm.graph.nodes)


# -- plain modules -------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, index: int = 0, scale: float = 1.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.index = index  # differs between blocks, never read by forward
        self.scale = scale

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        y = x + self.scale * torch.relu(self.fc(self.norm(x)))
        return (y if bias is None else y + bias), x


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h, _ = block(h)
        return self.head(h).sum(-1)


def _stack(*, scales: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0), widths: int = 16) -> Stack:
    torch.manual_seed(0)
    return Stack([Block(widths, i, s) for i, s in enumerate(scales)])


def test_module_list_of_identical_blocks(caplog: pytest.LogCaptureFixture) -> None:
    model = _stack()
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert copied == 3
    _check_same(plain, fast, model, args, {})


def test_meta_device_model(caplog: pytest.LogCaptureFixture) -> None:
    with torch.device("meta"):
        model = _stack()
    args = (torch.randn(4, 5, 16, device="meta"),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert copied == 3
    assert _rows(fast.gm) == _rows(plain.gm)


def test_attribute_read_by_forward_is_not_copied(caplog: pytest.LogCaptureFixture) -> None:
    model = _stack(scales=(1.0, 2.0, 1.0, 0.5))  # `scale` reaches the graph as a constant
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert not copied and "reads [('', 'scale')]" in caplog.text
    _check_same(plain, fast, model, args, {})


class Adapted(nn.Module):
    """A linear layer with adapters looked up by name (as PEFT's LoRA layers do)."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, out)
        self.adapters = nn.ModuleDict({"default": nn.Linear(width, 4, bias=False)})  # alike

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for name in ("default", "other"):
            if name in self.adapters:
                y = y + self.adapters[name](x).mean(-1, keepdim=True)
        return y


class TwoAdapted(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.q, self.v = Adapted(width, width), Adapted(width, width // 2)  # not one kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).sum(-1) + self.v(x).sum(-1)


def test_a_container_read_by_key_is_no_member(caplog: pytest.LogCaptureFixture) -> None:
    """The two ``adapters`` dicts are alike, but nothing calls them: an empty shell of the
    second would make ``name in self.adapters`` false and drop its adapter from the graph."""
    torch.manual_seed(0)
    model = TwoAdapted()
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert not copied
    read = {str(n.target) for n in fast.gm.graph.nodes if n.op == "get_attr" and n.users}
    assert {"q.adapters.default.weight", "v.adapters.default.weight"} <= read
    _check_same(plain, fast, model, args, {})


def test_different_shapes_and_hooks_are_not_one_kind(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = Stack([Block(16), Block(16), Block(16), Block(16)])
    model.blocks[1].fc = nn.Linear(16, 16, bias=False)  # other parameters
    model.blocks[2].register_forward_hook(lambda m, i, o: (o[0] * 3, o[1]))
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert copied == 1  # blocks 0 and 3 alone are alike
    _check_same(plain, fast, model, args, {})


class Twice(nn.Module):
    """The same blocks called on inputs of two shapes, and a block returning its input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([Block(16) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        a, _ = self.blocks[0](h)
        b, _ = self.blocks[1](h[:, :3])  # other input shape: traced on its own
        c, same = self.blocks[2](a)
        d, _ = self.blocks[3](c, bias=same)  # a tensor keyword: another call signature
        return a.sum() + b.sum() + d.sum() + same.sum()


def test_calls_with_other_inputs_are_traced(caplog: pytest.LogCaptureFixture) -> None:
    model = Twice()
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert copied == 1
    assert "traced on its own" in caplog.text
    _check_same(plain, fast, model, args, {})


class RowsBlock(nn.Module):
    """A size computed inside the block (``x.shape[0] * x.shape[1]``): a SymInt every copy
    reads."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x).reshape(x.shape[0] * x.shape[1], -1).relu()
        return y.reshape(x.shape), x


class AccumulatingBlock(nn.Module):
    """Writes into a tensor it was passed: its calls cannot be copies of the first."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        acc.add_(y.detach())
        return y


class Accumulate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([AccumulatingBlock(16) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        acc = torch.zeros_like(h)
        for block in self.blocks:
            h = block(h, acc)
        return h.sum() + acc.sum()


def test_a_size_the_first_block_computes_is_shared_by_the_copies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = Stack([RowsBlock(16) for _ in range(4)])
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert copied == 3
    _check_same(plain, fast, model, args, {})


def test_a_block_that_writes_to_its_input_is_traced_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Accumulate()
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert copied == 0
    _check_same(plain, fast, model, args, {})


class NormBlock(nn.Module):
    """Batch norm in training mode updates its running statistics: a buffer written in place."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x))


def test_blocks_that_update_buffers(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), *[NormBlock(16) for _ in range(3)], nn.Linear(16, 2))
    args = (torch.randn(8, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert copied == 2
    assert _rows(fast.gm) == _rows(plain.gm)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    outs_a = plain.gm(*args)
    stats_a = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    outs_b = fast.gm(*args)
    torch.testing.assert_close(outs_b, outs_a)
    torch.testing.assert_close(model.state_dict(), stats_a)


def test_global_hook_turns_the_shortcut_off(caplog: pytest.LogCaptureFixture) -> None:
    model = _stack()
    args = (torch.randn(4, 5, 16),)
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        plain, fast, copied = _capture(model, args, {}, caplog)
    finally:
        handle.remove()
    assert not copied
    assert _rows(fast.gm) == _rows(plain.gm)


def test_gpt2_layers_scaled_by_their_index_are_traced_each(caplog: pytest.LogCaptureFixture) -> None:
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=3, n_head=2, use_cache=False,
        scale_attn_by_inverse_layer_idx=True,  # each layer's `scaling` is 1 / (index + 1)
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (4, 8))
    plain, fast, copied = _capture(model, (ids,), {"labels": ids}, caplog)
    assert not copied and "'scaling')]" in caplog.text
    _check_same(plain, fast, model, (ids,), {"labels": ids})


class Recorded(Stack):
    """Hooks added during the call on every block's sublayer (as transformers records outputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        handles = [m.register_forward_hook(lambda m, i, o: seen.append(o))
                   for m in self.modules() if isinstance(m, nn.LayerNorm)]
        try:
            out = super().forward(x)
        finally:
            for h in handles:
                h.remove()
        return out + sum(s.sum() for s in seen)


def test_hooks_added_during_the_call(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = Recorded([Block(16) for _ in range(3)])
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert not copied and "a hook is set inside it" in caplog.text
    _check_same(plain, fast, model, args, {})


class Log:
    """A Python object the blocks write to: a side effect no copy would make."""

    def __init__(self) -> None:
        self.items: list[torch.Tensor] = []


class Logged(Block):
    def forward(self, x: torch.Tensor, log: Log) -> torch.Tensor:  # type: ignore[override]
        y, _ = super().forward(x)
        log.items.append(y * 2)
        return y


class Logging(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Logged(16) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log = Log()
        for block in self.blocks:
            x = block(x, log)
        return x.sum() + sum(s.sum() for s in log.items)


def test_argument_that_is_not_data(caplog: pytest.LogCaptureFixture) -> None:
    model = Logging()
    args = (torch.randn(4, 5, 16),)
    plain, fast, copied = _capture(model, args, {}, caplog)
    assert not copied and "neither a tensor nor plain data" in caplog.text
    _check_same(plain, fast, model, args, {})
