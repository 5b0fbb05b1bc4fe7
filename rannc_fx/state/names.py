"""The plain model's state-dict names, and the tensors this rank holds under them: what
the model's and the optimizer's parts of a checkpoint are keyed by."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["StateNames"]


@dataclass
class StateNames:
    """The plain model's state-dict keys, and the tensors this rank holds under them."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]  # every key of the whole model
    local: dict[str, torch.Tensor]  # this rank's keys -> its (live) tensors
    params: dict[str, nn.Parameter]  # this rank's parameters under every name they have
    param_names: frozenset[str]  # every parameter name of the whole model

    @classmethod
    def of(cls, model: nn.Module, held: set[int] | None = None) -> StateNames:
        """``held``: ids of the tensors this rank keeps (``None``: all of them)."""
        sd = model.state_dict(keep_vars=True)
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
        local = {k: v for k, v in sd.items() if held is None or id(v) in held}
        named = dict(model.named_parameters(remove_duplicate=False))
        params = {k: p for k, p in named.items() if held is None or id(p) in held}
        return cls(shapes, local, params, frozenset(named))

    def names_of(self) -> dict[int, list[str]]:
        """id(tensor) -> its keys, for the tensors this rank holds."""
        out: dict[int, list[str]] = {}
        for k, t in self.local.items():
            out.setdefault(id(t), []).append(k)
        for k, p in self.params.items():
            if id(p) in out and k not in out[id(p)]:
                out[id(p)].append(k)
        return out
