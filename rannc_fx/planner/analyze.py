"""Everything before the search: capture -> shapes -> profile -> group -> costs, and the
search space. ``driver.plan_model`` runs it, then the search and ``build_plan``.

It starts from ``captured.capture_model`` (capture and shapes on the example batch).

The costs are for a ``Target``: the device's figures and the one rule that picks the cost
model (``pick_target``), for ``partition()`` and ``compile()`` alike:

    measured   the plan is for a torch device: each op is timed there; a model whose tensors
               are elsewhere (built on the meta device, or on another device) runs on fakes
               and each op it profiles is made real on that device, timed and freed
               (``profile/materialize``), so a model of any size is costed on its own kernels
    analytic   a ``DeviceSpec`` or preset name (no device at all), or
               ``Config.cost_model="analytic"``: FLOPs and bytes priced with the spec

``partition()`` picks for the ``device`` it is given (default: where the model is);
``compile()`` picks for the rank's device, with the link figures it measured between ranks
in the spec. ``Config``'s link figures, where set, win over both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..capture.capture import CapturedGraph
from ..capture.graph import autocast_as
from ..group.group import BlockGraph, group_pass
from ..plan.config import Config
from ..plan.device import DeviceSpec, device_of
from ..plan.plan import loss_output
from ..plan.values import ValueSpec, dtype_itemsize
from ..profile.fakes import fake_device
from ..profile.optimizer import ParameterCosts, parameter_costs
from ..profile.profile import Profile, profile_pass
from ..runtime.comm import BUCKET_BYTES
from ..schedules.kinds import GPIPE, kind_of
from ..search import SCHEDULES, CostTable, SearchSpace, needed_sizes, run_sizes
from ..search.table import build_cost_table
from ..shapes.symbolic import SymbolicValues
from ..shapes.tail import TailCost, tail_cost
from .captured import Captured, capture_model

__all__ = ["Analysis", "Target", "analyze", "pick_target"]

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
    formulas: SymbolicValues | None = None
    tail: TailCost | None = None  # the tail's once-a-step costs at the whole batch


def analyze(
    model: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    world_size: int,
    device: DeviceSpec | str | torch.device | Target | None = None,
    config: Config | None = None,
    global_batch: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    param_costs: ParameterCosts | None = None,
) -> Analysis:
    """Run capture, shapes, profile, group and costs: the inputs of the search.

    ``device`` is what ``pick_target`` picks the spec and cost model for (``partition()``'s
    argument), or a ``Target`` already picked (``compile()``: the rank's device, with the
    measured link in its spec).
    ``param_costs`` (optimizer step and gradient accumulation per tensor) are measured here
    unless given (``compile()`` measures them on every rank at once).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one device")
    cfg = Config.from_env(config)
    t0 = time.perf_counter()
    target = device if isinstance(device, Target) else pick_target(device_of(model), device, cfg)
    # the ops run as the plan's kind of device runs them, under the autocast it plans for
    fakes = fake_device(target.spec.device_type)
    with _planned_autocast(fakes.type, cfg):
        cap = capture_model(model, example_args, example_kwargs or {}, cfg, device=fakes)
        captured, flat, values = cap.graph, cap.inputs, cap.values
        batch = global_batch or _batch_size(captured, values, flat, cfg.batch_dim)
        return _analyzed(cap, batch, target, cfg, t0, world_size=world_size,
                         optimizer=optimizer, param_costs=param_costs)


def _planned_autocast(device_type: str, cfg: Config) -> contextlib.AbstractContextManager[None]:
    """``Config.autocast_dtype`` in force for ``device_type`` (where unset: the caller's
    state)."""
    if cfg.autocast_dtype is None:
        return contextlib.nullcontext()
    return autocast_as(device_type, cfg.autocast_dtype)


def _analyzed(cap: Captured, batch: int, target: Target, cfg: Config,
              t0: float, *, world_size: int, optimizer: torch.optim.Optimizer | None,
              param_costs: ParameterCosts | None) -> Analysis:
    """Profile, group and costs on the captured graph."""
    captured, flat, values = cap.graph, cap.inputs, cap.values
    spec, run_device, cost_model = target.spec, target.measure_on, target.cost_model
    budget = int((cfg.device_memory or spec.memory_bytes) * (1 - cfg.memory_margin))
    loss = loss_output([values[n] for n in captured.output_names])
    space = _search_space(cfg, world_size=world_size, global_batch=batch, budget=budget, spec=spec,
                          one_loss=loss is not None, tail=captured.tail is not None)
    local = -(-batch // world_size)  # each rank assembles its local batch's outputs
    space = dataclasses.replace(
        space, output_bytes=_local_output_bytes(captured, values, local, batch)
    )
    sizes = needed_sizes(space)
    runs = run_sizes(space)

    profile = profile_pass(
        captured, flat, values,
        # the tail runs on the whole batch: its nodes' costs there, not extrapolated; the
        # smallest size a replica may run (an uneven split's floor), where ops fail first
        batch_sizes=tuple(sorted({*_profile_sizes(sizes), *([batch] if captured.tail else []),
                                  *runs[:1]})),
        device_spec=spec,
        cost_model=cost_model,
        device=run_device,
        cache_dir=cfg.profile_cache_dir,
        repeats=cfg.profile_repeats,
        formulas=cap.formulas,
        candidates=runs,
    )
    _check_tail_runs(captured, profile, batch)
    blocks = group_pass(captured, profile, values, max_blocks=cfg.max_blocks)
    if cfg.debug:
        log.info("captured graph:\n%s", captured.gm.print_readable(print_output=False))
        for b, nodes in enumerate(blocks.blocks):
            log.info("block %d: %s", b, " ".join(nodes))
    if param_costs is None:
        param_costs = parameter_costs(optimizer, run_device, spec, cfg.optimizer_state_factor,
                                      repeats=cfg.profile_repeats)
    tail = tail_cost(captured, profile, values, batch)
    table = build_cost_table(
        captured, blocks, profile, values, sizes=sizes, tail=tail,
        optimizer=param_costs.optimizer, accumulate=param_costs.accumulate,
    )
    return Analysis(captured, values, profile, blocks, table, space, spec, cost_model, cfg, t0,
                    cap.formulas, tail)


# -- the target and helpers ------------------------------------------------------------------


def _check_tail_runs(captured: CapturedGraph, profile: Profile, batch: int) -> None:
    """A tail node that raised on the whole batch: the tail runs on nothing else."""
    tail = set(captured.tail.nodes) if captured.tail is not None else set()
    for f in profile.failures:
        if f.node in tail and f.samples == batch:
            raise RuntimeError(
                f"node {f.node!r} runs once a step on the whole batch of {batch} samples (the "
                f"model mixes its samples there), but raised when profiled there: {f.error}")


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


@dataclass(frozen=True)
class Target:
    """The spec a plan is made for, and the device its op costs are timed on (None: analytic)."""

    spec: DeviceSpec
    measure_on: torch.device | None

    @property
    def cost_model(self) -> Literal["measured", "analytic"]:
        return "analytic" if self.measure_on is None else "measured"


def pick_target(
    home: torch.device,
    device: DeviceSpec | str | torch.device | None,
    config: Config,
    *,
    spec: DeviceSpec | None = None,
) -> Target:
    """The target for a model whose tensors are on ``home`` (``device_of(model)``).

    ``device``: a ``DeviceSpec`` or preset name (analytic), a torch device, or None (``home``).
    ``spec``: that torch device's figures when the caller knows them better than
    ``DeviceSpec.of`` does (``compile()`` measured the link).
    """
    run: torch.device | None = None
    if isinstance(device, DeviceSpec) or (isinstance(device, str) and device in DeviceSpec.presets()):
        spec = device if isinstance(device, DeviceSpec) else DeviceSpec.preset(device)
    else:
        run = _indexed(torch.device(device) if device is not None else home)
        if run.type == "meta":
            raise ValueError(
                "the model's parameters are on the meta device, so there is nothing to measure "
                "on: pass device=<a torch device, e.g. torch.device('cuda')> to measure its ops "
                f"there, or a preset ({', '.join(DeviceSpec.presets())}) or a DeviceSpec to plan "
                "it with the analytic cost model"
            )
        spec = spec or DeviceSpec.of(run)
    links = {
        "interconnect_bandwidth": config.link_bandwidth,
        "interconnect_latency": config.link_latency,
        "allreduce_bandwidth": config.allreduce_bandwidth,
        "devices_per_node": config.devices_per_node or launched_node_size(),
        "network_bandwidth": config.network_bandwidth,
        "network_latency": config.network_latency,
    }
    spec = spec.model_copy(update={k: v for k, v in links.items() if v is not None})
    if config.cost_model == "measured" and run is None:
        raise ValueError(
            f"cost_model='measured' times the model's ops on a device, but device={spec.name!r} "
            "is a spec, not a device: pass a torch device, or use cost_model='auto' (analytic "
            "here)"
        )
    return Target(spec, run if config.cost_model != "analytic" else None)


def launched_node_size(world: int | None = None) -> int | None:
    """The ranks a node holds under torchrun (``LOCAL_WORLD_SIZE``) where they are fewer
    than the world's (``world``, else ``WORLD_SIZE``): a launch over several nodes; else
    None."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if world is None:
        text = os.environ.get("WORLD_SIZE", "")
        world = int(text) if text.isdigit() else None
    if not local.isdigit() or world is None:
        return None
    return int(local) if 0 < int(local) < world else None


def _indexed(dev: torch.device) -> torch.device:
    """``cuda`` as the ``cuda:N`` it means now, so that equal devices compare equal."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _search_space(
    cfg: Config,
    *,
    world_size: int,
    global_batch: int,
    budget: int,
    spec: DeviceSpec,
    one_loss: bool = True,
    tail: bool = False,
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
    named = None if cfg.schedule is None else kind_of(cfg.schedule)
    in_call = named is not None and named.backward_in_call
    if in_call and not one_loss:
        raise ValueError(
            f"schedule={cfg.schedule!r} runs each micro-batch's backward inside the call, which "
            "needs the model's only output that carries a gradient to be a scalar loss; this "
            "model returns none or several (an auxiliary loss?): return their sum as the loss, "
            "or use schedule='gpipe' (or None, searched)"
        )
    if in_call and tail:
        raise ValueError(
            f"schedule={cfg.schedule!r} runs backwards before the last forward, but this model "
            "mixes its samples (a contrastive loss), and that part runs once on the whole "
            "batch, between every forward and every backward; use schedule='gpipe' (or None, "
            "searched)"
        )
    # ZB-H1, interleaved 1F1B and ZBV are not searched: the searched plan is tried with them
    # (planner/zb_choice.py, planner/virtual.py), the last two on 1F1B's lanes
    schedules: tuple[str, ...] = (
        named.search_as if named is not None and named.search_as is not None
        else SCHEDULES if one_loss and not tail else (GPIPE.name,))
    host_bw, host_budget = _host(spec, cfg)
    # recomputing layer by layer or selectively reruns forwards inside one backward: not
    # under a schedule named that splits it (ZB-H1, ZBV), nor layer by layer where the lanes
    # are costed without it (interleaved)
    inside = named is None or named.plain
    unsplit = named is None or not named.splits_backward
    return SearchSpace(
        world_size=world_size,
        global_batch=global_batch,
        memory_budget=budget,
        link_bandwidth=spec.interconnect_bandwidth,
        link_latency=spec.interconnect_latency,
        allreduce_bandwidth=spec.allreduce_bandwidth,
        devices_per_node=spec.devices_per_node or 0,
        network_bandwidth=spec.network_bandwidth,
        network_latency=spec.network_latency,
        optimizer_state_factor=cfg.optimizer_state_factor,
        micro_batches=candidates,
        stages=cfg.forced_stages,
        replicas=cfg.replicas,
        schedules=schedules,
        recompute=cfg.recompute,
        layers=cfg.recompute_layers if inside or cfg.recompute_layers is not None else False,
        selective=(cfg.recompute_selective if unsplit or cfg.recompute_selective is not None
                   else False),
        zero=None if cfg.zero is None else bool(cfg.zero),
        # ZeRO-2 only where asked for: it changes what .grad holds (the owners' share)
        grad_shards=cfg.zero == 2,
        # ZeRO-3 under GPipe and 1F1B only (parameters gathered per use, as host_params')
        full_shard=(cfg.zero == 3 if cfg.zero is not None else None) if inside else False,
        offload=cfg.offload,
        # parameters in host memory run under GPipe and 1F1B (not a lane's several stages,
        # nor a split backward)
        host_params=cfg.host_params if inside else False,
        host_bandwidth=host_bw,
        host_overlap=spec.copies_beside_compute,
        host_step_bandwidth=spec.host_step_bandwidth,
        host_budget=host_budget,
        reduce_bucket=BUCKET_BYTES,
    )


def _host(spec: DeviceSpec, cfg: Config) -> tuple[float | None, float]:
    """The host the search may offload optimizer state to: the device's, less the margin.
    Forced onto a device without one (the CPU, whose host is its own memory), offloading
    runs the same path, costed as if the host were apart and unbounded."""
    if spec.host_bandwidth is not None and spec.host_memory_bytes is not None:
        return spec.host_bandwidth, spec.host_memory_bytes * (1 - cfg.memory_margin)
    if cfg.offload or cfg.host_params:
        return spec.host_bandwidth or spec.memory_bandwidth, math.inf
    return None, 0.0


def _local_output_bytes(captured: CapturedGraph, values: dict[str, ValueSpec],
                        samples: int, whole: int) -> float:
    """Bytes of the batched model outputs of ``samples`` samples (each rank's local batch;
    the tail's are its samples' rows of the ``whole`` batch's)."""
    total = 0
    for name in dict.fromkeys(captured.output_names):
        spec = values.get(name)
        if spec is not None and spec.kind == "tensor" and spec.batch_dim is not None:
            total += math.prod(spec.shape_for(samples, whole)) * dtype_itemsize(
                spec.dtype or "float32")
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
