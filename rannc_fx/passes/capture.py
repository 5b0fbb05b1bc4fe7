"""Capture an nn.Module as one flat fx.GraphModule: torch.fx where it traces, else torch.export."""

# INTERFACE (to be implemented): see CapturedGraph and capture_pass below.

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["CaptureError", "CapturedGraph", "capture_pass"]


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the failing code or op and the ways out."""


@dataclass
class CapturedGraph:
    """A model as one flat graph.

    ``gm`` takes the tensor leaves of ``(args, kwargs)`` as positional placeholders, in pytree
    order, and returns a flat tuple of tensor leaves (never a pytree). ``in_spec`` /
    ``out_spec`` turn the user's call into that and the flat result back into what the model
    returns (tensor, tuple, dict, HF ModelOutput). Non-tensor leaves of the inputs (``None``,
    bools) are baked into the graph; ``constant_inputs`` records them by leaf index and
    ``flatten_inputs`` checks that a later call passes the same ones.

    ``gm``'s parameters and buffers are the model's own objects (same identity), under their
    fully qualified names in the model; a tied parameter is one object reachable under all its
    names (``aliases`` maps every other name to the canonical one).
    """

    gm: fx.GraphModule
    tracer: Literal["fx", "export"]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_names: list[str]  # placeholder names, one per tensor leaf, in order
    tensor_leaf_index: list[int]  # leaf index (in the flattened (args, kwargs)) of each placeholder
    constant_inputs: dict[int, Any] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)  # node name producing each output leaf
    aliases: dict[str, str] = field(default_factory=dict)

    def flatten_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        raise NotImplementedError

    def unflatten_outputs(self, flat: list[Any] | tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A hash of the graph's ops and the parameter/buffer names, shapes and dtypes."""
        raise NotImplementedError


def capture_pass(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    tracer: Literal["auto", "fx", "export"] = "auto",
    leaf_modules: tuple[str, ...] = (),
    batch_dim: int = 0,
) -> CapturedGraph:
    raise NotImplementedError
