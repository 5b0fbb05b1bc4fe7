"""The stages one rank runs where a schedule puts several on a lane (interleaved 1F1B, ZBV).

``LaneModules`` holds them as ``stage_<s>`` children, so everything that asks a rank's module
for its parameters and buffers (placement, the optimizer, state dicts, gradient all-reduces,
``model.parameters()``) sees all of them, and the executor runs each by its own name. A rank
that runs one stage holds that stage's GraphModule itself; ``graph_modules`` answers both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import fx, nn

__all__ = ["LaneModules", "graph_modules"]


class LaneModules(nn.Module):
    """A rank's stages, by stage index (``stage_<s>``); called only stage by stage."""

    def __init__(self, stages: Mapping[int, fx.GraphModule]):
        super().__init__()
        self.indices = tuple(sorted(stages))
        for s in self.indices:
            self.add_module(f"stage_{s}", stages[s])

    def stage(self, index: int) -> fx.GraphModule:
        module = self.get_submodule(f"stage_{index}")
        assert isinstance(module, fx.GraphModule)
        return module

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(
            f"this rank runs stages {list(self.indices)}; the executor calls each one "
            "(lane.stage(index)), never all at once"
        )


def graph_modules(module: nn.Module) -> list[fx.GraphModule]:
    """The stage GraphModules a rank's module holds: itself, or a lane's stages in order."""
    if isinstance(module, LaneModules):
        return [module.stage(s) for s in module.indices]
    assert isinstance(module, fx.GraphModule), type(module)
    return [module]
