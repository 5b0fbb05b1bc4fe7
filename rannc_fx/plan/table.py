"""The plan as people read it: ``Plan.summary``'s table, one row a stage, and the lines after.

The head says how the plan runs (stages on ranks, micro-batches, schedule, device and cost
model, and the cluster's nodes where it spans several); each row is one stage: its blocks,
nodes and parameters, replicas and samples, its predicted times, its recomputation, sharding
and offloading, the micro-batches it holds, its memory against the budget, and over several
nodes its ranks and the node(s) they lie on; the lines after give the predicted (and simulated) step, each
lane's memory, the dynamic dimensions, the tail, the shared parameters and planning's notes.
"""

from __future__ import annotations

from typing import Literal, Protocol

from ..schedules.kinds import ScheduleName
from .device import DeviceSpec
from .parts import CutValue, SharedParam, Stage, Tail
from .values import DynamicDim

__all__ = ["Tabled", "plan_table"]


class Tabled(Protocol):
    """What the table reads of a plan: ``plan.Plan`` (which calls ``plan_table`` with itself,
    so this module names it by its fields)."""

    world_size: int
    global_batch: int
    micro_batches: int
    schedule: ScheduleName
    virtual_stages: int
    rank_order: Literal["stages", "pipelines"]
    device: DeviceSpec
    cost_model: Literal["measured", "analytic"]
    memory_budget: int
    stages: tuple[Stage, ...]
    dynamic_dims: tuple[DynamicDim, ...]
    cut_values: tuple[CutValue, ...]
    shared_params: tuple[SharedParam, ...]
    tail: Tail | None
    predicted_step_ms: float
    simulated_step_ms: float | None
    notes: tuple[str, ...]

    @property
    def lanes(self) -> tuple[tuple[int, ...], ...]: ...

    def in_flight(self, stage: int) -> int: ...


def plan_table(plan: Tabled) -> str:
    """A table: one row per stage, with predicted time and memory against the budget."""
    head = (
        f"rannc_fx plan: {len(plan.stages)} stage(s) on {plan.world_size} rank(s), "
        f"{plan.micro_batches} micro-batch(es) of {plan.global_batch // plan.micro_batches}"
        f"{'+' if plan.global_batch % plan.micro_batches else ''} samples, "
        f"schedule {plan.schedule}"
        + (f" ({plan.virtual_stages} stages a lane: {[list(x) for x in plan.lanes]})"
           if plan.virtual_stages > 1 else "")
        + f", device {plan.device.name} ({plan.cost_model} costs)"
    )
    N = plan.device.devices_per_node
    machines = N is not None and plan.world_size > N
    if machines:
        assert N is not None
        head += (f", {plan.world_size // N} nodes of {N} devices (network "
                 f"{plan.device.network_bandwidth or 0:.3g} B/s a device)"
                 + (", ranks by pipelines" if plan.rank_order == "pipelines" else ""))
    cols = ("stage", "blocks", "nodes", "params", "replicas", "samples", "fwd ms", "bwd ms",
            "recompute", "zero", "offload", "in flight", "comm ms", "accum ms",
            "allred ms", "optim ms", "memory", "of budget") + (
        ("ranks", "on node") if machines else ())
    rows = []
    for st in plan.stages:
        nparam = st.memory.params
        where = _at_ranks(st.ranks, N) if machines else ()
        rows.append((
            str(st.index),
            f"{st.first_block}-{st.end_block - 1}",
            str(st.num_nodes),
            # parameters on the host: what of them the device holds (two windows)
            _human_bytes(nparam) + (" fetched" if st.host_params else ""),
            str(st.replicas),
            str(st.samples),
            f"{st.fwd_ms:.2f}",
            f"{st.bwd_ms:.2f}",
            ("layers" if st.checkpoints else "yes") if st.recompute
            else "selective" if st.selective else "no",
            str(st.zero),
            f"params {_human_bytes(st.host_bytes)}" if st.host_params else
            f"{_human_bytes(st.host_bytes)}" if st.offload else "no",
            str(plan.in_flight(st.index)),
            f"{st.comm_ms:.2f}",
            f"{st.accumulate_ms:.2f}",
            f"{st.allreduce_ms:.2f}" + (f"+{st.gather_ms:.2f}" if st.zero else ""),
            f"{st.optimizer_ms:.2f}" + (f"+{st.host_ms:.2f}" if st.offload or (
                st.host_params and st.host_ms) else ""),
            _human_bytes(st.memory.total),
            f"{100 * st.memory.total / plan.memory_budget:.0f}%",
        ) + where)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))
    body = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    tail = [
        f"predicted step time {plan.predicted_step_ms:.2f} ms"
        + (f" (schedule simulated: {plan.simulated_step_ms:.2f} ms)"
           if plan.simulated_step_ms is not None else "")
        + "; memory budget "
        f"{_human_bytes(plan.memory_budget)} per device; {len(plan.cut_values)} cut value(s)",
    ]
    if plan.virtual_stages > 1:  # a stage's memory is its share at its lane's peak
        tail.append("memory per lane (its stages at their common peak): " + ", ".join(
            f"{'+'.join(map(str, lane))} {_human_bytes(m)} "
            f"({100 * m / plan.memory_budget:.0f}%)"
            for lane in plan.lanes
            for m in [sum(plan.stages[s].memory.total for s in lane)]))
    if plan.dynamic_dims:
        tail.append("dynamic dimension(s), up to the planned size: " + ", ".join(
            f"{d.name} <= {d.size}" for d in plan.dynamic_dims))
    if plan.tail is not None:
        tail.append(
            f"tail: {len(plan.tail.nodes)} node(s) from {', '.join(plan.tail.mixing)} (samples "
            f"mix there) run once a step on the whole batch on stage {len(plan.stages) - 1}'s "
            f"ranks, {plan.tail.fwd_ms:.2f} + {plan.tail.bwd_ms:.2f} ms"
        )
    for sp in plan.shared_params:
        tail.append(f"shared parameter {sp.name} used by stages {list(sp.stages)}")
    tail += [f"note: {n}" for n in plan.notes]
    return "\n".join([head, line, "-" * len(line), *body, *tail])


def _at_ranks(ranks: tuple[int, ...], node: int | None) -> tuple[str, str]:
    """A stage's ranks and the nodes (of ``node`` ranks each) they lie on: ``0-7`` where
    consecutive, ``0,8,16`` where not (laid out by pipelines)."""
    assert node is not None
    return _span(list(ranks)), _span(sorted({r // node for r in ranks}))


def _span(xs: list[int]) -> str:
    if xs == list(range(xs[0], xs[-1] + 1)):
        return str(xs[0]) if len(xs) == 1 else f"{xs[0]}-{xs[-1]}"
    return ",".join(map(str, xs))


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
