"""A stage's backward in two parts (``runtime/backward_split.py``): the inputs' gradients
first, the parameters' later, together equal to one backward, each node's work done once."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from rannc_fx.runtime.backward_split import backward_inputs, backward_weights

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


def _run(make: Callable[[], nn.Module], input_grad: bool, split: bool) -> tuple[Any, ...]:
    torch.manual_seed(0)
    m = make()
    x = torch.randn(4, 8, requires_grad=input_grad)
    outs = m(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    params = list(m.parameters())
    if split:
        work = backward_inputs(outs, grads, [x], params)
        if input_grad:
            assert x.grad is not None
        # nothing of W yet: the matrices' gradients (a vector's comes with B's kernels)
        assert all(p.grad is None for p in params if p.dim() >= 2)
        backward_weights(work)
    else:
        torch.autograd.backward(outs, grads)
    return x.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("make", [_mlp, Tied, TwoOutputs], ids=["mlp", "tied", "two-outputs"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "no-input-grad"])
def test_the_two_parts_equal_one_backward(make, input_grad):
    want_x, want = _run(make, input_grad, split=False)
    got_x, got = _run(make, input_grad, split=True)
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
    assert lin.weight.grad is None and lin.bias.grad is not None
    backward_weights(work)
    assert_close(lin.bias.grad, torch.full((8,), 4.0))
