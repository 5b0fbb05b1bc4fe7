"""Join the user's autograd graph to the pipeline: ``loss.backward()`` reaches the executor.

The loss a call returns is the output of ``Bridge``; autograd calls its backward with the
gradient that reaches the loss (``d f(loss) / d loss`` for whatever the user differentiates),
and the executor either runs the deferred backwards with it or scales the gradients the call
already computed. An ``anchor`` leaf that requires a gradient makes the output require one even
when the values passed in do not (they come from other ranks, detached).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Bridge"]


class _Backward(Protocol):
    def backward(self, step_index: int, grads: list[torch.Tensor | None]) -> None: ...


class Bridge(torch.autograd.Function):
    """``Bridge.apply(executor, step, anchor, *values)``: copies of ``values`` whose backward
    calls ``executor.backward(step, their gradients)``."""

    @staticmethod
    def forward(
        ctx: Any, executor: _Backward, step: int, anchor: torch.Tensor, *values: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.executor, ctx.step = executor, step
        return tuple(v.clone() for v in values)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.executor.backward(ctx.step, list(grads))
        return (None,) * (3 + len(grads))
