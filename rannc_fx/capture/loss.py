"""``compile(model, optimizer, loss_fn=...)``: the loss outside the model, run eagerly.

torch.distributed.pipelining's convention, and how most vision and audio training loops are
written (``loss = criterion(model(x), y)``): the model computes outputs, a loss function
compares them with targets. Such a loss is often code no tracer can turn into a graph (a
range check on the labels, ``masked_select``, ``.tolist()``, ``F.ctc_loss``). ``with_loss``
makes the model the compiled one calls as ``model(*args, target=y, **kwargs)``: the model's
own forward, then ``loss_fn(output, *targets)`` (``target`` a tensor or a tuple of them),
the loss kept whole as one node and run eagerly, with its autograd, in the last stage
(``capture/opaque``): per micro-batch where it is a mean (or a sum, ``loss_reduction``) over
the samples, else once a step on the whole batch (the tail).

The wrapped model is the user's: an instance of a subclass of its class that shares its
parameters, buffers and children, so every name stays the model's (the loss's own state, if
it has any, is under ``loss_fn.``), and its forward runs the model's forward on itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["LossFn", "with_loss"]


class LossFn(nn.Module):
    """A loss function as a module kept whole (its module's state under ``loss_fn.``)."""

    fn: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        if isinstance(fn, nn.Module):  # a criterion module: its state under loss_fn's names
            for table in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
                self.__dict__[table] = fn.__dict__[table]
        self.__dict__["fn"] = fn

    def forward(self, output: Any, *targets: Any) -> Any:
        return self.fn(output, *targets)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)


def with_loss(model: nn.Module, loss_fn: Callable[..., Any]) -> nn.Module:
    """``model`` whose call takes ``target=`` and returns ``loss_fn(model's output, *targets)``."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output, *targets) -> loss, got {loss_fn!r}")
    base = type(model)

    def forward(self: Any, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        if target is None:
            raise TypeError(
                f"the model was compiled with loss_fn={self.loss_fn.extra_repr()}: call it with "
                "the loss's targets, model(*inputs, target=y) (a tuple for several), and it "
                "returns the loss"
            )
        targets = target if isinstance(target, tuple) else (target,)
        return self.loss_fn(base.forward(self, *args, **kwargs), *targets)

    cls = type(f"{base.__name__}WithLoss", (base,), {"forward": forward, "__module__":
                                                       base.__module__})
    wrapped: nn.Module = object.__new__(cls)
    state = dict(model.__dict__)
    state["_modules"] = {**model._modules, "loss_fn": LossFn(loss_fn)}  # the model's stay its
    wrapped.__dict__.update(state)
    return wrapped

