"""A stage's backward in two parts (``runtime/backward_split.py``): the inputs' gradients
first, the parameters' later, together equal to one backward, each node's work done once."""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from rannc_fx.runtime.backward_split import (
    Held,
    SavedBoxes,
    backward_inputs,
    backward_weights,
    keeping_for_split,
)

TOL = dict(rtol=1e-6, atol=1e-6)


class Tied(nn.Module):
    """One weight read at two places, one below the other (and a bias after the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.mid = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.mid(x @ self.w)) @ self.w.T) + self.b


class FirstStage(nn.Module):
    """Embeddings of the ids and a residual block: the inputs need no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(16, 8), nn.Parameter(torch.randn(4, 8) / 3)
        self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos
        return h + self.b(torch.tanh(self.a(self.norm(h))))


class TwoOutputs(nn.Module):
    """Two outputs, one computed from the other, a frozen layer and a multi-output op."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.frozen = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1, h2 = self.a(x).chunk(2, dim=-1)
        y = self.b(F.gelu(h1)) * self.frozen(h2)
        return y, y.sum(-1, keepdim=True) * 2


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Linear(16, 8))


def _run(make: Callable[[], nn.Module], input_grad: bool, split: bool,
         boxes: SavedBoxes | None = None) -> tuple[Any, ...]:
    torch.manual_seed(0)
    m = make()
    x = torch.randn(4, 8, requires_grad=input_grad)
    with keeping_for_split(boxes) if boxes is not None else contextlib.nullcontext():
        outs = m(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    params = list(m.parameters())
    if split:
        work = backward_inputs(outs, grads, [x], params, boxes)
        in_b = {n for n, p in m.named_parameters() if p.grad is not None}
        if input_grad:
            assert x.grad is not None
            # the vectors' gradients come with B's kernels; the tied weight, which W would
            # reach at two depths, with B's walk; the other matrices' wait for W
            assert in_b == {n for n, p in m.named_parameters() if p.requires_grad
                            and (p.dim() < 2 or (make is Tied and n == "w"))}, in_b
        else:  # nobody waits for B: W runs the whole backward
            assert not in_b, in_b
        backward_weights(work)
    else:
        torch.autograd.backward(outs, grads)
    return x.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("make", [_mlp, Tied, TwoOutputs], ids=["mlp", "tied", "two-outputs"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "no-input-grad"])
@pytest.mark.parametrize("drop", [False, True], ids=["all-kept", "b-drops"])
@pytest.mark.parametrize("engine", [True, False], ids=["engine", "public-call"])
def test_the_two_parts_equal_one_backward(make, input_grad, drop, engine, monkeypatch):
    """With ``drop``, B empties the saved tensors its W does not read: W, which raises on an
    empty one, still makes every gradient. Alike through autograd's engine entry and,
    where a torch has none, through ``torch.autograd.backward``."""
    if not engine:
        monkeypatch.setattr("rannc_fx.runtime.backward_split._ENGINE", None)
    want_x, want = _run(make, input_grad, split=False)
    got_x, got = _run(make, input_grad, split=True, boxes=SavedBoxes() if drop else None)
    assert_close(got_x, want_x, **TOL)
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert_close(got[name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_each_node_of_the_backward_runs_once():
    """B runs the input side, W the parameter side: each matmul node once in each, and no
    node on the inputs' path again in W (where the weights are not tied)."""
    torch.manual_seed(0)
    m = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    y = m(x)
    calls: dict[str, int] = {}

    def count(phase: str) -> Callable[..., None]:
        def hook(_: Any) -> None:
            calls[phase] = calls.get(phase, 0) + 1
        return hook

    gelu = y.grad_fn
    while "Gelu" not in type(gelu).__name__:
        gelu = next(f for f, _ in gelu.next_functions if f is not None and "AccumulateGrad"
                    not in type(f).__name__ and "TBackward" not in type(f).__name__)
    h = gelu.register_prehook(count("B"))
    work = backward_inputs([y], [torch.ones_like(y)], [x], list(m.parameters()))
    h.remove()
    h = gelu.register_prehook(count("W"))
    backward_weights(work)
    h.remove()
    assert calls == {"B": 1}  # GELU's node is on the inputs' path only: W never runs it


def test_a_stage_that_returns_its_input_and_one_without_parameters():
    x = torch.randn(4, 8, requires_grad=True)
    work = backward_inputs([x, x * 3], [torch.ones(4, 8), torch.ones(4, 8)], [x], [])
    backward_weights(work)
    assert_close(x.grad, torch.full((4, 8), 4.0))
    lin = copy.deepcopy(nn.Linear(8, 8))
    y = lin(torch.randn(4, 8))  # an input without a gradient: W does the whole backward
    work = backward_inputs([y], [torch.ones_like(y)], [], list(lin.parameters()))
    assert lin.weight.grad is None and lin.bias.grad is None
    backward_weights(work)
    assert_close(lin.bias.grad, torch.full((8,), 4.0))


def _node_named(y: torch.Tensor, name: str) -> Any:
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if name in node.name():
            return node
        seen.add(node)
        todo += [c for c, _ in node.next_functions if c is not None and c not in seen]
    raise AssertionError(name)


@pytest.mark.parametrize("make", [FirstStage, Tied], ids=["first-stage", "tied"])
def test_no_node_runs_twice_where_w_would_start_below_itself(make):
    """A first stage (the ids need no gradient: W runs the one backward, B nothing) and a
    weight read at two depths (B computes it): tanh's node, between the two places W
    would start from, runs once in all, and the gradients are one backward's."""
    torch.manual_seed(0)
    m = make()
    x = torch.randint(0, 16, (2, 4)) if make is FirstStage else torch.randn(4, 8,
                                                                            requires_grad=True)
    want = copy.deepcopy(m)
    want(x).backward(torch.ones(2, 4, 8) if make is FirstStage else torch.ones(4, 8))
    boxes = SavedBoxes()
    with keeping_for_split(boxes):
        y = m(x)
    calls: list[str] = []
    tanh = _node_named(y, "Tanh")
    h = tanh.register_prehook(lambda _: calls.append("B"))
    work = backward_inputs([y], [torch.ones_like(y)], [x], list(m.parameters()), boxes)
    h.remove()
    h = tanh.register_prehook(lambda _: calls.append("W"))
    backward_weights(work)
    h.remove()
    assert calls == (["W"] if make is FirstStage else ["B"])
    for (name, p), q in zip(m.named_parameters(), want.parameters(), strict=True):
        assert_close(p.grad, q.grad, **TOL, msg=lambda msg, n=name: f"{n}: {msg}")


def test_b_drops_the_saved_tensors_w_does_not_read():
    """Between B and W a micro-batch holds what the weight GEMMs read (the Linear layers'
    inputs), not the saved tensors of GELU, LayerNorm or attention's matmuls and softmax."""
    torch.manual_seed(0)
    d, heads = 32, 4
    attn = nn.MultiheadAttention(d, heads, batch_first=True)
    mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    x = torch.randn(2, 16, d, requires_grad=True)
    boxes = SavedBoxes()
    with keeping_for_split(boxes):
        h = x + attn(x, x, x, need_weights=False)[0]
        y = h + mlp(h)
    params = [*attn.parameters(), *mlp.parameters()]
    weights = {p.untyped_storage()._cdata for p in params}

    def held(bs: list[Held]) -> int:  # bytes of activations' storages, each once
        st = {b.tensor.untyped_storage()._cdata: b.tensor.untyped_storage().nbytes()
              for b in bs if b.tensor is not None}
        return sum(n for k, n in st.items() if k not in weights)

    before = held(boxes)
    work = backward_inputs([y], [torch.ones_like(y)], [x], params, boxes)
    kept = {b.name for b in boxes if b.tensor is not None and b.name}
    dropped = {b.name for b in boxes if b.tensor is None}
    assert kept <= {"AddmmBackward0", "MmBackward0", "LinearBackward0"}, kept
    assert {"GeluBackward0", "NativeLayerNormBackward0"} <= dropped, dropped
    assert any("Softmax" in n or "Attention" in n or "Bmm" in n for n in dropped), dropped
    assert held(boxes) < 0.5 * before, (held(boxes), before)
    backward_weights(work)
    want_x, want = x.grad.clone(), [p.grad.clone() for p in params]
    for p in [x, *params]:
        p.grad = None
    h = x + attn(x, x, x, need_weights=False)[0]
    (h + mlp(h)).backward(torch.ones_like(y))
    assert_close(x.grad, want_x, **TOL)
    for g, p in zip(want, params, strict=True):
        assert_close(p.grad, g, **TOL)


@pytest.mark.parametrize("make", [_mlp, Tied], ids=["mlp", "tied"])
def test_the_graph_and_what_w_read_are_freed_after_w(make):
    """The boxes hold no node (the graph holds them): once W has run and the step drops its
    outputs, every saved tensor is gone, none kept alive by a cycle through the graph (the
    tied weight's W runs tanh's node, which saved its own output)."""
    torch.manual_seed(0)
    m = make()
    x = torch.randn(4, 8, requires_grad=True)
    boxes = SavedBoxes()
    with keeping_for_split(boxes):
        y = m(x)
    weights = {p.untyped_storage()._cdata for p in m.parameters()}
    refs = [weakref.ref(b.tensor) for b in boxes
            if b.tensor is not None and b.tensor.untyped_storage()._cdata not in weights
            and b.tensor is not x]
    work = backward_inputs([y], [torch.ones_like(y)], [x], list(m.parameters()), boxes)
    assert any(r() is not None for r in refs)  # what W reads
    backward_weights(work)
    del y, work, boxes
    assert refs and all(r() is None for r in refs)
