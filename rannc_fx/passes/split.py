"""Build one fx.GraphModule per stage from the plan's node-to-stage assignment (split_module)."""

# INTERFACE (to be implemented)

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from ..plan import Plan, ValueSpec
from .capture import CapturedGraph

__all__ = ["StageInterface", "split_pass", "stage_interfaces"]


@dataclass(frozen=True)
class StageInterface:
    inputs: tuple[str, ...]  # graph-input placeholders and cut values, in placeholder order
    outputs: tuple[str, ...]  # values the stage returns: cut values and model outputs, in order
    cut_values: tuple[tuple[str, int, tuple[int, ...]], ...]  # (value, producer, consumers)


def stage_interfaces(
    captured: CapturedGraph, node_stage: dict[str, int], values: dict[str, ValueSpec], num_stages: int
) -> list[StageInterface]:
    raise NotImplementedError


def split_pass(captured: CapturedGraph, plan: Plan) -> list[fx.GraphModule]:
    raise NotImplementedError
