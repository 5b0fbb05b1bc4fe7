"""The one driver of the compiler: capture -> shapes -> profile -> group -> costs -> search ->
plan -> split. ``partition()`` (offline) and ``compile()`` (training, on rank 0) both plan
through ``plan_model``; every rank splits through ``split_stages``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..config import Config
from ..device import DeviceSpec
from ..passes.capture import CapturedGraph
from ..passes.optcost import ParameterCosts
from ..passes.search import (
    CostTable,
    NoFeasiblePlan,
    SearchResult,
    SearchSpace,
    StageChoice,
    search_pass,
)
from ..passes.split import split_pass
from ..plan import Plan
from ..progress import Progress, note
from ..values import ValueSpec
from .analyze import Analysis, Target, analyze
from .build import build_plan
from .virtual import virtual_variants
from .zero_bubble import step_ms, zero_bubble

__all__ = ["Planned", "choose", "plan_model", "run_search", "split_stages"]

log = logging.getLogger("rannc_fx")


@dataclass
class Planned:
    """A plan with the captured graph and value specs it was made from (what ``split`` needs)."""

    plan: Plan
    captured: CapturedGraph
    values: dict[str, ValueSpec]
    started: float


def plan_model(
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
) -> Planned:
    """Every pass up to the plan: ``analyze``, then the search and ``build_plan``."""
    a = analyze(
        model, example_args, example_kwargs, world_size=world_size, device=device,
        config=config, global_batch=global_batch, optimizer=optimizer, param_costs=param_costs,
    )  # fmt: skip
    t0 = time.perf_counter()
    try:
        result = run_search(a.table, a.space)
    except NoFeasiblePlan as e:
        tail = a.tail
        if tail is None or a.captured.tail is None:
            raise
        raise NoFeasiblePlan(
            f"{e} The model mixes its samples at {', '.join(a.captured.tail.mixing)}: from there "
            f"it runs once a step on the whole batch of {a.space.global_batch} samples, on every "
            f"replica of the last stage, which holds {tail.held_bytes / 2**20:.1f} MiB for it "
            "(its inputs, their gradients, its activations and outputs; more replicas do not "
            "shrink it); a smaller global batch does",
            largest_stage_bytes=e.largest_stage_bytes, world_size=e.world_size,
            micro_batches=e.micro_batches,
        ) from None
    p = Progress("plan")
    seconds = time.perf_counter() - t0
    plan = choose(a, result, seconds)
    p.done(
        "built the plan in %.2f s: %d stages on %d ranks, %d cut value(s), %d shared parameter(s), "
        "predicted step %.2f ms (schedule simulated: %.2f ms)", p.seconds, len(plan.stages),
        plan.world_size, len(plan.cut_values), len(plan.shared_params), plan.predicted_step_ms,
        plan.simulated_step_ms or plan.predicted_step_ms,
    )  # fmt: skip
    return Planned(plan, a.captured, a.values, a.started)


def choose(a: Analysis, result: SearchResult, seconds: float = 0.0) -> Plan:
    """The plan: the searched one, or a schedule the search does not cost on its stages or
    lanes (``_with_schedules``), or the same on the plans searched without what the first
    used, where its simulated step is shorter."""
    plan = _with_schedules(a, result, seconds)
    # the schedules tried after the search keep its lanes: the plan it makes without
    # recomputing layer by layer or selectively, then also without offloading, then without sharding either,
    # may suit them better (the 1024-layer BERT-large's on 32 V100s interleaved, the 100 B
    # BERT's on 33 A100s under ZBV, the 512-layer BERT-large's interleaved). Those schedules
    # never keep parameters on the host, so neither do these searches
    if a.space.host_params:
        return plan
    space, current = dataclasses.replace(a.space, host_params=False), result
    for field in ("host_params", "layers", "offload", "zero"):
        if getattr(a.space, field) is not None or not any(_uses(st, field)
                                                         for st in current.stages):
            continue  # forced by the user, or not used
        if field == "layers":  # and without selective recomputation: both rerun in B
            space = dataclasses.replace(space, layers=False, selective=(
                False if a.space.selective is None else a.space.selective))
        else:  # without sharding, without offloading either (unless the user forced it)
            space = dataclasses.replace(space, offload=False if field == "offload" or (
                a.space.offload is None) else a.space.offload)
            if field == "zero":
                space = dataclasses.replace(space, zero=False)
        b = dataclasses.replace(a, space=space)
        try:
            current = search_pass(b.table, b.space)
        except NoFeasiblePlan:
            break
        try:  # ZB-H1's own search is not repeated: it searches sharding and offloading
            other = _with_schedules(b, current, seconds, search_zbh1=False)
        except ValueError:  # a named schedule that does not fit this one: the first did
            continue
        if step_ms(other) < step_ms(plan):
            note("plan: with %s=False too, %s: simulated step %.2f ms against %.2f ms",
                 field, other.schedule, step_ms(other), step_ms(plan))
            plan = other
    return plan


def _with_schedules(a: Analysis, result: SearchResult, seconds: float, *,
                    search_zbh1: bool = True) -> Plan:
    """The searched plan, or ZB-H1 (searched itself, ``search_zbh1``, or on its stages),
    interleaved 1F1B or ZBV on its stages where shorter. The lanes' schedules first: ZB-H1's
    search then looks only for plans predicted shorter than the best so far."""
    def build(r: SearchResult) -> Plan:
        return build_plan(a, r, search_seconds=seconds)

    plan = virtual_variants(a, result, build(result), build)
    return zero_bubble(a, result, plan, build, search=search_zbh1)


def _uses(st: StageChoice, field: str) -> bool:
    """The searched stage keeps its parameters in host memory, recomputes layer by layer,
    offloads, or shards (or offloads)."""
    if field == "host_params":
        return st.host
    return (st.layers or st.selective) if field == "layers" else st.offload if field == "offload" else (
        st.zero or st.offload)


def run_search(table: CostTable, space: SearchSpace) -> SearchResult:
    """``search_pass`` with its progress lines and its one line (the kernel logs no INFO: it
    imports no torch, so it cannot tell rank 0 from the others)."""
    p = Progress("search")

    def progress(done: int, total: int, dps: int, best: float) -> None:
        p.update(done, "bounds and scans, %d DPs, best step so far %s", dps,
                 f"{1e3 * best:.1f} ms" if math.isfinite(best) else "none", total=total)

    result = search_pass(table, space, progress=progress)
    p.done(
        "searched %d blocks x %d ranks x %d micro-batch counts in %.2f s (%d DPs): %d stages "
        "(replicas %s), m=%d, %s, %d recomputing, predicted %.1f ms", table.num_blocks,
        space.world_size, len(set(space.micro_batches)), p.seconds, result.dps,
        len(result.stages), "/".join(str(s.replicas) for s in result.stages),
        result.micro_batches, result.schedule, sum(s.recompute for s in result.stages),
        1e3 * result.evaluation.step_s,
    )  # fmt: skip
    return result


def split_stages(
    captured: CapturedGraph, values: dict[str, ValueSpec], plan: Plan, *, debug: bool = False
) -> list[fx.GraphModule]:
    """One GraphModule per stage of ``plan`` (``debug`` logs each one's code)."""
    stages = split_pass(captured, plan, values=values)
    if debug:
        for st, gm in zip(plan.stages, stages, strict=True):
            log.info("stage %d (blocks %d-%d):\n%s", st.index, st.first_block,
                     st.end_block - 1, gm.print_readable(print_output=False))
    return stages
