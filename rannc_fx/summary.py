"""A plan as people read it: one row per stage, time and memory against the budget."""

from __future__ import annotations

from .plan import Plan

__all__ = ["human_bytes", "summarize"]


def summarize(plan: Plan) -> str:
    """A table: one row per stage, with predicted time and memory against the budget."""
    head = (
        f"rannc_fx plan: {len(plan.stages)} stage(s) on {plan.world_size} rank(s), "
        f"{plan.micro_batches} micro-batch(es) of {plan.global_batch // plan.micro_batches}"
        f"{'+' if plan.global_batch % plan.micro_batches else ''} samples, "
        f"schedule {plan.schedule}, device {plan.device.name} ({plan.cost_model} costs)"
    )
    cols = ("stage", "blocks", "nodes", "params", "replicas", "samples", "fwd ms", "bwd ms",
            "recompute", "in flight", "comm ms", "accum ms", "allred ms", "optim ms",
            "memory", "of budget")
    rows = []
    for st in plan.stages:
        nparam = st.memory.params
        rows.append((
            str(st.index),
            f"{st.first_block}-{st.end_block - 1}",
            str(st.num_nodes),
            human_bytes(nparam),
            str(st.replicas),
            str(st.samples),
            f"{st.fwd_ms:.2f}",
            f"{st.bwd_ms:.2f}",
            "yes" if st.recompute else "no",
            str(plan.in_flight(st.index)),
            f"{st.comm_ms:.2f}",
            f"{st.accumulate_ms:.2f}",
            f"{st.allreduce_ms:.2f}",
            f"{st.optimizer_ms:.2f}",
            human_bytes(st.memory.total),
            f"{100 * st.memory.total / plan.memory_budget:.0f}%",
        ))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))
    body = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    tail = [
        f"predicted step time {plan.predicted_step_ms:.2f} ms"
        + (f" (schedule simulated: {plan.simulated_step_ms:.2f} ms)"
           if plan.simulated_step_ms is not None else "")
        + "; memory budget "
        f"{human_bytes(plan.memory_budget)} per device; {len(plan.cut_values)} cut value(s)",
    ]
    for sp in plan.shared_params:
        tail.append(f"shared parameter {sp.name} used by stages {list(sp.stages)}")
    return "\n".join([head, line, "-" * len(line), *body, *tail])


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


