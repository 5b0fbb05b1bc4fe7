"""Per-node forward/backward time and memory, measured on the device or from an analytic model."""

# INTERFACE (to be implemented)

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from ..device import DeviceSpec
from ..plan import ValueSpec
from .capture import CapturedGraph

__all__ = ["NodeCost", "Profile", "profile_pass"]


class NodeCost(BaseModel):
    """One node's costs, one entry per ``Profile.batch_sizes`` (samples per replica)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]  # kept alive for backward, parameters excluded
    workspace_bytes: tuple[int, ...]  # transient peak while it runs (outputs included)


class Profile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_sizes: tuple[int, ...]
    cost_model: Literal["measured", "analytic"]
    device: str
    nodes: dict[str, NodeCost]  # by node name; placeholders, get_attr and output are absent

    def at(self, node: str, field: str, samples: int) -> float:
        """A node's cost for ``samples`` samples, interpolated (linearly) between profiled sizes."""
        raise NotImplementedError


def profile_pass(
    captured: CapturedGraph,
    flat_inputs: list[torch.Tensor],
    values: dict[str, ValueSpec],
    *,
    batch_sizes: tuple[int, ...],
    device_spec: DeviceSpec,
    cost_model: Literal["measured", "analytic"],
    device: torch.device | None = None,
    cache_dir: Path | None = None,
    repeats: int = 3,
) -> Profile:
    raise NotImplementedError
