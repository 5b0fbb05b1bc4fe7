"""Everything before the search: capture -> shapes -> profile -> group -> costs, and the
search space. ``driver.plan_model`` runs it, then the search and ``build_plan``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..config import Config
from ..device import DeviceSpec
from ..passes.capture import CapturedGraph, capture_pass
from ..passes.costs import build_cost_table
from ..passes.group import BlockGraph, group_pass
from ..passes.optcost import ParameterCosts, parameter_costs
from ..passes.profile import Profile, profile_pass
from ..passes.search import CostTable, SearchSpace, needed_sizes
from ..passes.shapes import infer_values_pass
from ..plan import ValueSpec, loss_output

__all__ = ["Analysis", "analyze"]

log = logging.getLogger("rannc_fx")


@dataclass
class Analysis:
    """Everything the passes before the search produce; benchmarks compare plans on ``table``."""

    captured: CapturedGraph
    values: dict[str, ValueSpec]
    profile: Profile
    blocks: BlockGraph
    table: CostTable
    space: SearchSpace
    spec: DeviceSpec
    cost_model: Literal["measured", "analytic"]
    config: Config
    started: float


def analyze(
    model: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int,
    device: DeviceSpec | str | torch.device | None = None,
    config: Config | None = None,
    global_batch: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    param_costs: ParameterCosts | None = None,
) -> Analysis:
    """Run capture, shapes, profile, group and costs: the inputs of the search.

    ``param_costs`` (optimizer step and gradient accumulation per tensor) are measured here
    unless given (``compile()`` measures them on every rank at once).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one device")
    cfg = Config.from_env(config)
    kwargs = dict(example_kwargs or {})
    t0 = time.perf_counter()
    if any(p.device.type == "meta" for p in model.parameters()):
        # a meta model computes on meta: bring real example inputs along (shapes are all we use)
        example_args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to("meta"), (tuple(example_args), kwargs)
        )

    captured = capture_pass(
        model, tuple(example_args), kwargs,
        tracer=cfg.tracer, leaf_modules=cfg.leaf_modules, batch_dim=cfg.batch_dim,
    )
    flat = captured.flatten_inputs(tuple(example_args), kwargs)
    values = infer_values_pass(captured, flat, batch_dim=cfg.batch_dim)
    batch = global_batch or _batch_size(captured, values, flat, cfg.batch_dim)

    spec, run_device, cost_model = _resolve_device(model, device, cfg)
    budget = int((cfg.device_memory or spec.memory_bytes) * (1 - cfg.memory_margin))
    loss = loss_output([values[n] for n in captured.output_names])
    space = _search_space(cfg, world_size=world_size, global_batch=batch, budget=budget, spec=spec,
                          one_loss=loss is not None)
    local = -(-batch // world_size)  # each rank assembles its local batch's outputs
    space = dataclasses.replace(
        space, output_bytes=_local_output_bytes(captured, values, local)
    )
    sizes = needed_sizes(space)

    profile = profile_pass(
        captured, flat, values,
        batch_sizes=_profile_sizes(sizes),
        device_spec=spec,
        cost_model=cost_model,
        device=run_device,
        cache_dir=cfg.profile_cache_dir,
        repeats=cfg.profile_repeats,
    )
    blocks = group_pass(captured, profile, values, max_blocks=cfg.max_blocks)
    if cfg.debug:
        log.info("captured graph:\n%s", captured.gm.print_readable(print_output=False))
        for b, nodes in enumerate(blocks.blocks):
            log.info("block %d: %s", b, " ".join(nodes))
    if param_costs is None:
        measure_on = run_device if cost_model == "measured" else None
        param_costs = parameter_costs(optimizer, measure_on, spec, cfg.optimizer_state_factor)
    table = build_cost_table(
        captured, blocks, profile, values, sizes=sizes,
        optimizer=param_costs.optimizer, accumulate=param_costs.accumulate,
    )
    return Analysis(captured, values, profile, blocks, table, space, spec, cost_model, cfg, t0)


# -- helpers ---------------------------------------------------------------------------------


def _batch_size(
    captured: CapturedGraph, values: dict[str, ValueSpec], flat: list[torch.Tensor], batch_dim: int
) -> int:
    for name, t in zip(captured.input_names, flat, strict=True):
        v = values[name]
        if v.kind == "tensor" and v.batch_dim is not None:
            return int(t.shape[v.batch_dim]) // v.shape[v.batch_dim]
    raise ValueError(
        f"no input has a batch dimension (dim {batch_dim}) that varies with the batch size; "
        "rannc_fx splits micro-batches along it: set Config(batch_dim=...) to the right dimension"
    )


def _resolve_device(
    model: nn.Module, device: DeviceSpec | str | torch.device | None, cfg: Config
) -> tuple[DeviceSpec, torch.device | None, Literal["measured", "analytic"]]:
    """(spec, device to measure on or None, cost model)."""
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if isinstance(device, DeviceSpec) or (isinstance(device, str) and device in DeviceSpec.presets()):
        spec = device if isinstance(device, DeviceSpec) else DeviceSpec.preset(device)
        run: torch.device | None = None
    else:
        if device is None:
            p = next(model.parameters(), None)
            run = p.device if p is not None else torch.device("cpu")
        else:
            run = torch.device(device)
        if run.type == "meta":
            raise ValueError(
                "the model's parameters are on the meta device, so nothing can be measured; "
                f"pass device=<a preset: {', '.join(DeviceSpec.presets())}> or a DeviceSpec "
                "to plan it with the analytic cost model"
            )
        spec = DeviceSpec.of(run)
    links = {
        "interconnect_bandwidth": cfg.link_bandwidth,
        "interconnect_latency": cfg.link_latency,
        "allreduce_bandwidth": cfg.allreduce_bandwidth,
    }
    spec = spec.model_copy(update={k: v for k, v in links.items() if v is not None})
    cost_model: Literal["measured", "analytic"]
    if cfg.cost_model == "auto":
        cost_model = "analytic" if (on_meta or run is None) else "measured"
    else:
        cost_model = cfg.cost_model
    if cost_model == "measured" and (on_meta or run is None):
        raise ValueError(
            "cost_model='measured' needs a real device and real weights; "
            + ("the model is on the meta device" if on_meta else f"device={spec.name!r} is a spec")
            + ": use cost_model='analytic' (or 'auto')"
        )
    return spec, run, cost_model


def _search_space(
    cfg: Config,
    *,
    world_size: int,
    global_batch: int,
    budget: int,
    spec: DeviceSpec,
    one_loss: bool = True,
) -> SearchSpace:
    if cfg.replicas is not None and sum(cfg.replicas) != world_size:
        raise ValueError(
            f"replicas={list(cfg.replicas)} sum to {sum(cfg.replicas)}, not the world size "
            f"{world_size}; give counts that add up to {world_size}"
        )
    if cfg.micro_batches is not None:
        if cfg.micro_batches > global_batch:
            raise ValueError(
                f"micro_batches={cfg.micro_batches} exceeds the global batch of {global_batch} "
                "samples; use at most that many micro-batches"
            )
        candidates: tuple[int, ...] = (cfg.micro_batches,)
    else:
        limit = min(cfg.max_micro_batches, global_batch)
        pow2 = {1 << i for i in range(limit.bit_length()) if (1 << i) <= limit}
        divisors = {d for d in range(1, limit + 1) if global_batch % d == 0}
        candidates = tuple(sorted(pow2 | divisors))
    if cfg.schedule == "1f1b" and not one_loss:
        raise ValueError(
            "schedule='1f1b' runs each micro-batch's backward inside the call, which needs the "
            "model's only output that carries a gradient to be a scalar loss; this model "
            "returns none or several (an auxiliary loss?): return their sum as the loss, or use "
            "schedule='gpipe' (or None, searched)"
        )
    schedules = (cfg.schedule,) if cfg.schedule else ("gpipe", "1f1b") if one_loss else ("gpipe",)
    return SearchSpace(
        world_size=world_size,
        global_batch=global_batch,
        memory_budget=budget,
        link_bandwidth=spec.interconnect_bandwidth,
        link_latency=spec.interconnect_latency,
        allreduce_bandwidth=spec.allreduce_bandwidth,
        optimizer_state_factor=cfg.optimizer_state_factor,
        micro_batches=candidates,
        stages=cfg.forced_stages,
        replicas=cfg.replicas,
        schedules=schedules,
        recompute=cfg.recompute,
    )


def _local_output_bytes(captured: CapturedGraph, values: dict[str, ValueSpec],
                        samples: int) -> float:
    """Bytes of the batched model outputs of ``samples`` samples (each rank's local batch)."""
    total = 0
    for name in dict.fromkeys(captured.output_names):
        spec = values.get(name)
        if spec is not None and spec.kind == "tensor" and spec.batch_dim is not None:
            total += spec.nbytes_for(samples)
    return float(total)


def _profile_sizes(sizes: tuple[int, ...], most: int = 4) -> tuple[int, ...]:
    """At most ``most`` sizes spread geometrically over ``sizes``; the rest are interpolated."""
    if len(sizes) <= most:
        return tuple(sizes)
    lo, hi = math.log(sizes[0]), math.log(sizes[-1])
    picks = {sizes[0], sizes[-1]}
    for k in range(1, most - 1):
        target = math.exp(lo + (hi - lo) * k / (most - 1))
        picks.add(min(sizes, key=lambda s: abs(s - target)))
    return tuple(sorted(picks))
