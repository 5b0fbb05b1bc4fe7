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

from ..capture.capture import CapturedGraph
from ..plan.config import Config
from ..plan.device import DeviceSpec
from ..plan.plan import Plan
from ..plan.values import ValueSpec
from ..profile.optimizer import ParameterCosts
from ..progress import Progress, note
from ..search import (
    CostTable,
    NoFeasiblePlan,
    SearchResult,
    SearchSpace,
    needed_sizes,
    search_pass,
)
from ..search.nodes import PIPELINES, layout_problem, multi_node, usable_replicas
from ..split.split import split_pass
from .analyze import Analysis, Target, analyze
from .build import build_plan
from .virtual import virtual_variants
from .zb_choice import zero_bubble

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
    result: SearchResult | None = None
    failed: NoFeasiblePlan | None = None
    try:
        if a.config.rank_order != PIPELINES:
            result = run_search(a.table, a.space)
    except NoFeasiblePlan as e:
        failed = e  # laid out by pipelines, a plan may still fit
    found, a = by_pipelines(a, result)
    found, a = fully_sharded(a, found)
    if found is None:
        raise _explained(a, failed or NoFeasiblePlan(
            f"no plan laid out by pipelines (Config.rank_order) fits {a.space.world_size} "
            f"ranks in nodes of {a.space.devices_per_node}: the stage count must divide the "
            "node's devices or be a multiple of them, every stage with world / stages "
            "replicas")) from None
    result = found
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


def by_pipelines(a: Analysis, result: SearchResult | None
                 ) -> tuple[SearchResult | None, Analysis]:
    """``result`` (laid out stage by stage), or a plan laid out by pipelines where its step is
    shorter (``Config.rank_order`` None) or asked for (``"pipelines"``; ``result`` None):
    over several nodes, for every stage count S that divides a node's devices or is a
    multiple of them (the replicas W / S forced on each), the search with replica k's
    pipeline on ranks kS .. kS + S - 1 (``search.nodes``), bounded by ``result``'s step. The
    Analysis comes back with the space of the plan chosen (None: no plan at all)."""
    sp, cfg = a.space, a.config
    W, N, usable = sp.world_size, sp.devices_per_node, set(usable_replicas(sp))
    # a stage's memory is the same in either order and the pipelines' replica counts are
    # among those searched stage by stage, so where nothing fits stage by stage only a
    # layout that stage by stage would put over part of a node could: not searched then
    # (Config.rank_order='pipelines' searches it)
    if cfg.rank_order == "stages" or not multi_node(sp) or (
            sp.replicas is not None and len(set(sp.replicas)) > 1) or (
            result is None and cfg.rank_order is None):
        if cfg.rank_order == PIPELINES:
            raise ValueError(
                "rank_order='pipelines' lays out each replica's pipeline on its own ranks: it "
                f"needs ranks over several nodes (world {W}, nodes of {N or W}) and the same "
                f"replicas on every stage (replicas={sp.replicas}); use rank_order=None")
        return result, a
    counts = ([len(sp.replicas)] if sp.replicas is not None
              else [S for S in range(2, min(W, a.table.num_blocks) + 1)  # 1: as by stages
                    if W % S == 0 and (N % S == 0 or S % N == 0) and W // S in usable
                    and (sp.stages is None or sp.stages == S)])
    best, best_a = result, a
    for S in counts:
        space = dataclasses.replace(sp, replicas=(W // S,) * S, stages=None,
                                    rank_order=PIPELINES)
        if layout_problem(space) is not None or \
                not set(needed_sizes(space)) <= set(a.table.sizes.tolist()):
            continue
        below = best.evaluation.step_s if best is not None else math.inf
        try:
            got = search_pass(a.table, space, below=below)
        except NoFeasiblePlan:
            continue
        best, best_a = got, dataclasses.replace(a, space=space)
    if best is not result and best is not None:
        note("search: by pipelines (each replica's %d stages on consecutive ranks, %d "
             "replicas a stage), predicted %.1f ms%s", len(best.stages), best.stages[0].replicas,
             1e3 * best.evaluation.step_s, "" if result is None else
             f" against {1e3 * result.evaluation.step_s:.1f} ms stage by stage")
    return best, best_a


def fully_sharded(a: Analysis, result: SearchResult | None
                  ) -> tuple[SearchResult | None, Analysis]:
    """``result``, or the plan with every stage of several replicas fully sharded (ZeRO-3,
    plain FSDP where it is one stage) where its step is shorter. The search's chain takes a
    fully sharded stage only where nothing else fits at its recomputation level, as a stage
    takes offloading only where sharding the state does not fit: per micro-batch traffic
    against a once-a-step cost is the plan's trade, not a stage's, so the planner searches
    it whole, bounded by ``result``'s step. Searched only where ``Config.zero`` and
    ``host_params`` leave it open and something fits (where nothing does, nothing fully
    sharded does either: the chain holds those variants)."""
    sp = a.space
    if result is None or sp.full_shard is not None or sp.zero is False or sp.offload or \
            sp.host_params or sp.world_size < 2:
        return result, a
    space = dataclasses.replace(sp, zero=True, full_shard=True, offload=False,
                                host_params=False)
    try:
        got = search_pass(a.table, space, below=result.evaluation.step_s)
    except NoFeasiblePlan:
        return result, a
    if not any(st.full for st in got.stages):  # no stage with replicas: the same plan
        return result, a
    note("search: every stage with replicas fully sharded (ZeRO-3), predicted %.1f ms "
         "against %.1f ms", 1e3 * got.evaluation.step_s, 1e3 * result.evaluation.step_s)
    return got, dataclasses.replace(a, space=space)


def _explained(a: Analysis, e: NoFeasiblePlan) -> NoFeasiblePlan:
    """``e`` with what the search alone cannot say: the sizes nodes raised at, a tail."""
    why = str(e)
    if a.profile.failures:
        shown = a.profile.failures[:3]
        why += " Sizes ruled out: " + "; ".join(
            f"node {f.node} raised at {f.samples} sample(s): {f.error}" for f in shown) + (
            f" (and {len(a.profile.failures) - 3} more)" if len(a.profile.failures) > 3
            else "") + "."
    tail = a.tail
    if tail is not None and a.captured.tail is not None:
        why += (
            f" The model mixes its samples at {', '.join(a.captured.tail.mixing)}: from there "
            f"it runs once a step on the whole batch of {a.space.global_batch} samples, on every "
            f"replica of the last stage, which holds {tail.held_bytes / 2**20:.1f} MiB for it "
            "(its inputs, their gradients, its activations and outputs; more replicas do not "
            "shrink it); a smaller global batch does")
    if why == str(e):
        return e
    return NoFeasiblePlan(why, largest_stage_bytes=e.largest_stage_bytes,
                          world_size=e.world_size, micro_batches=e.micro_batches)


def choose(a: Analysis, result: SearchResult, seconds: float = 0.0) -> Plan:
    """The plan: the searched one, or a schedule the search does not cost where its simulated
    step is shorter (or the one ``Config.schedule`` names). Interleaved 1F1B and ZBV first,
    on the searched lanes and on every equal split of the ranks into lanes
    (``virtual_variants``); then ZB-H1, whose own search looks only for plans predicted
    shorter than the best so far, and on the searched stages (``zero_bubble``)."""
    def build(r: SearchResult) -> Plan:
        return build_plan(a, r, search_seconds=seconds)

    plan = virtual_variants(a, result, build(result), build)
    return zero_bubble(a, result, plan, build)


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
