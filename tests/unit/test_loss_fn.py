"""Losses no tracer captures, at capture: a criterion module kept whole and run eagerly, and a
loss in the forward itself named in the error with the way out. The models and losses are
shared with ``distributed/test_loss_fn.py``, where they train."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from rannc_fx.capture.capture import CaptureError, capture_pass


def masked_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the labels that are not 0: a mean over kept tokens, not samples."""
    if labels.max() >= logits.shape[-1]:
        raise ValueError(f"label {int(labels.max())} out of range")
    picked = logits.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    return -torch.masked_select(picked, labels > 0).mean()


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WithCriterion(nn.Module):
    """The model with its loss as a submodule called in its forward (unmodified style)."""

    def __init__(self, body: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.body = body
        self.criterion = _Criterion(loss)

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.body(x), *targets)


class Inline(nn.Module):
    """The loss computed in the model's own forward, and a check of the inputs before the body:
    capture runs both eagerly around the traced body (``capture_pieces``)."""

    def __init__(self, body: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.body = body
        self.loss = loss

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise ValueError("the inputs hold a NaN or an infinity")
        out = self.body(x)
        return self.loss(out, *targets)


class _Criterion(nn.Module):
    def __init__(self, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, out: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return self.loss(out, *targets)


def test_a_criterion_is_kept_whole_and_a_loss_in_the_forward_itself_is_named():
    body, loss = Mlp(), masked_nll
    x, y = torch.randn(6, 6), torch.tensor([0, 1, 2, 3, 0, 4])  # two labels the mask drops
    cg = capture_pass(WithCriterion(body, loss), (x, y), tracer="export")
    assert set(cg.opaque) == {"criterion"}
    assert cg.opaque["criterion"][0].reduces == "coupled"  # a mean over the kept labels

    class Inline(nn.Module):  # the data-dependent code in the model's own forward
        def __init__(self) -> None:
            super().__init__()
            self.body = Mlp()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return masked_nll(self.body(x), y)

    with pytest.raises(CaptureError) as e:
        capture_pass(Inline(), (x, y), tracer="export")
    assert "loss_fn" in str(e.value) and "test_loss_fn.py" in str(e.value)
