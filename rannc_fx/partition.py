"""The offline API: plan a model and get its stage GraphModules, runnable in this process."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from .capture.capture import CapturedGraph
from .plan.config import Config
from .plan.device import DeviceSpec
from .plan.plan import Plan
from .planner import plan_model, split_stages
from .progress import note
from .split.split import run_stages

__all__ = ["Partitioned", "partition"]

@dataclass
class Partitioned:
    """A plan and its stages, runnable in this process (stage after stage)."""

    plan: Plan
    stages: list[fx.GraphModule]
    captured: CapturedGraph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cg = self.captured
        flat = cg.flatten_inputs(args, kwargs)
        return cg.unflatten_outputs(
            run_stages(self.stages, self.plan, flat, cg.input_names, cg.output_names))

    def __repr__(self) -> str:
        return f"Partitioned(\n{self.plan.summary()}\n)"


def partition(
    model: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int,
    device: DeviceSpec | str | torch.device | None = None,
    config: Config | None = None,
    global_batch: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Partitioned:
    """Capture, profile, group, search and split ``model`` for ``world_size`` devices.

    ``example_args``/``example_kwargs`` are one global batch (what a whole step sees), unless
    ``global_batch`` says how many samples a step really has (costs are computed for that).
    ``device`` is where costs come from: a ``DeviceSpec`` or preset name plans with the
    analytic cost model (needed for a meta-device model); a ``torch.device`` (default: where
    the model's parameters live) is measured. ``optimizer`` (the one training will use) is
    timed on that device for the optimizer-step cost; without it the step is estimated from
    the device's memory bandwidth and ``Config.optimizer_state_factor``.
    """
    cfg = Config.from_env(config)
    planned = plan_model(
        model, example_args, example_kwargs, world_size=world_size, device=device,
        config=cfg, global_batch=global_batch, optimizer=optimizer,
    )  # fmt: skip
    stages = split_stages(planned.captured, planned.values, planned.plan, debug=cfg.debug)
    # the plan's table is print(parted)'s, not the log's: the line count stays one per pass
    note("partitioned %s in %.2f s total", planned.captured.model_name,
         time.perf_counter() - planned.started)
    return Partitioned(plan=planned.plan, stages=stages, captured=planned.captured)


