"""The merged trace as a Chrome trace (Perfetto, chrome://tracing), the plan's prediction beside
it, and the summary of a step: per stage, busy, bubble and communication time.

``build_trace`` turns every rank's record (``trace.Recorder.part``) into one JSON object:

    process 0 "measured"     one row per rank ("rank 2: stage 1 replica 0"), its events shifted
                             to rank 0's clock by the offset measured at the first traced step
    process 1 "predicted"    one row per stage: ``simulate`` run on the plan and schedule of
                             each traced step, from its per-stage costs, drawn from the
                             step's measured start

and ``otherData.rannc_fx`` keeps what the summary needs (ranks, step starts, the clock
alignment, the predicted breakdown), so ``python -m rannc_fx trace summary FILE`` works on a
saved file alone.

How the summary splits a rank's step (from the first rank's call to the last rank's last
event), in fractions of that step:

    busy     F, R, B and the optimizer step
    bubble   waiting (for a receive, GATHER, REDUCE, an agreement) until the last rank it waits
             for started the matching action (a send, its own GATHER, ...): nothing was on the
             way yet, so no faster link would shorten it
    comm     the rest of those waits (the message or collective itself), and posting messages
    other    time in no event: the executor's own work and the script's between calls

The prediction's breakdown comes from the plan: busy is the stages' compute and optimizer
time, comm their message and all-reduce time, bubble the rest of the simulated makespan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..plan.plan import Plan
from ..schedules.generators import Kind
from ..schedules.lowering import lower_plan
from ..schedules.simulate import plan_durations, simulate

__all__ = ["StageShare", "TraceSummary", "build_trace", "format_summary", "summarize"]

MEASURED, PREDICTED = 0, 1  # Chrome process ids
BUCKETS = ("busy", "bubble", "comm", "other")


def build_trace(
    parts: Sequence[Mapping[str, Any]], clock: Mapping[str, Any],
    plans: Mapping[int, tuple[Plan, str]],
) -> dict[str, Any]:  # fmt: skip
    """One Chrome trace from every rank's record; times in microseconds from the first call."""
    offsets = {int(r): int(v) for r, v in clock.get("offset_ns", {}).items()}
    starts: dict[int, dict[int, int]] = {}  # step -> rank -> its call's start, rank 0's clock
    for p in parts:
        for step, t in p["starts"].items():
            starts.setdefault(int(step), {})[p["rank"]] = t - offsets.get(p["rank"], 0)
    base = min((t for by_rank in starts.values() for t in by_rank.values()), default=0)

    def us(t_ns: int | float) -> float:
        return (t_ns - base) / 1e3

    events: list[dict[str, Any]] = [
        _meta("process_name", MEASURED, 0, "measured"),
        _meta("process_name", PREDICTED, 0, "predicted (the plan's simulated schedule)"),
    ]
    ranks = {}
    for p in sorted(parts, key=lambda p: p["rank"]):
        r, off = p["rank"], offsets.get(p["rank"], 0)
        ranks[r] = {"stage": p["stage"], "replica": p["replica"]}
        events.append(_meta("thread_name", MEASURED, r,
                            f"rank {r}: stage {p['stage']} replica {p['replica']}"))
        events.append({"ph": "M", "name": "thread_sort_index", "pid": MEASURED, "tid": r,
                       "args": {"sort_index": r}})
        for step, t in p["starts"].items():
            events.append({"name": f"step {step}", "ph": "i", "s": "t", "pid": MEASURED,
                           "tid": r, "ts": us(t - off), "args": {"step": int(step)}})
        for e in p["events"]:
            args = {k: v for k, v in e.items() if k not in ("name", "cat", "start", "end")}
            args.update(stage=p["stage"], replica=p["replica"])
            events.append({"name": e["name"], "cat": e["cat"], "ph": "X", "pid": MEASURED,
                           "tid": r, "ts": us(e["start"] - off),
                           "dur": (e["end"] - e["start"]) / 1e3, "args": args})
    predicted = {}
    for step, (plan, schedule) in sorted(plans.items()):
        if step not in starts:
            continue
        at = us(min(starts[step].values()))
        drawn, predicted[step] = _predicted(plan, schedule, at, step)
        events.extend(drawn)
    if plans:
        plan = next(iter(plans.values()))[0]
        for s in range(len(plan.stages)):
            events.append(_meta("thread_name", PREDICTED, s, f"stage {s}"))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"rannc_fx": {
            "version": 1,
            "clock": dict(clock),
            "ranks": {str(r): v for r, v in ranks.items()},
            "step_starts": {str(s): {str(r): us(t) for r, t in by.items()}
                            for s, by in starts.items()},
            "predicted": {str(s): v for s, v in predicted.items()},
        }},
    }  # fmt: skip


def _meta(what: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": {"name": name}}


def _predicted(
    plan: Plan, schedule: str, at_us: float, step: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The simulated step drawn from ``at_us``, and its busy / comm / bubble per stage."""
    topology, lowered = lower_plan(plan, schedule)
    durations = plan_durations(plan, lowered)
    sim = simulate(lowered, topology, durations)
    drawn: list[dict[str, Any]] = []
    stages: list[dict[str, float]] = [{} for _ in plan.stages]  # a lane's, for each its stages
    for k, actions in enumerate(lowered):  # a row per lane (its ranks run this list)
        busy = comm = 0.0
        for a in actions:
            d = durations(a)
            if d <= 0:
                continue
            st = plan.stages[a.stage]
            label = a.kind.value + ("" if a.microbatch is None else str(a.microbatch))
            cat = "compute" if a.kind.is_compute else "collective"
            drawn.append({"name": label, "cat": cat, "ph": "X", "pid": PREDICTED, "tid": k,
                          "ts": at_us + sim.start[a] * 1e6, "dur": d * 1e6,
                          "args": {"step": step, "stage": a.stage, "kind": a.kind.value,
                                   "microbatch": a.microbatch}})
            if a.kind in (Kind.F, Kind.B):
                comm += st.comm_ms / 2
            elif a.kind is Kind.REDUCE:
                comm += sum(plan.stages[s].allreduce_ms + plan.stages[s].gather_ms
                            for s in topology.lanes[k])
            busy += d * 1e3
        busy -= comm
        lane = {"busy_ms": busy, "comm_ms": comm,
                "bubble_ms": max(0.0, sim.makespan * 1e3 - busy - comm)}
        for s in topology.lanes[k]:
            stages[s] = lane
    return drawn, {"makespan_ms": sim.makespan * 1e3, "stages": stages}


# -- the summary ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageShare:
    """One stage's step, as fractions of the step time (measured: mean over its ranks)."""

    stage: int
    ranks: tuple[int, ...]
    measured: dict[str, float]  # BUCKETS
    predicted: dict[str, float] | None  # busy, bubble, comm


@dataclass(frozen=True)
class TraceSummary:
    steps: tuple[int, ...]
    step_ms: float  # measured, mean over the traced steps
    predicted_ms: float | None
    stages: tuple[StageShare, ...]
    clock_uncertainty_us: float
    unmatched: int  # waits whose matching action was not found on a peer

    @property
    def error(self) -> float | None:
        """Measured over predicted step time, minus one."""
        if not self.predicted_ms:
            return None
        return self.step_ms / self.predicted_ms - 1


def summarize(trace: Mapping[str, Any]) -> TraceSummary:
    """Busy, bubble, comm and other per stage, measured and predicted (see the module doc)."""
    meta = trace["otherData"]["rannc_fx"]
    ranks = {int(r): v for r, v in meta["ranks"].items()}
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["pid"] == MEASURED:
            by_step.setdefault(e["args"]["step"], {}).setdefault(e["tid"], []).append(e)
    steps = sorted(int(s) for s in meta["step_starts"])
    totals: dict[int, dict[str, float]] = {r: dict.fromkeys(BUCKETS, 0.0) for r in ranks}
    step_us: list[float] = []
    unmatched = 0
    for step in steps:
        rows = by_step.get(step, {})
        begin = min(meta["step_starts"][str(step)].values())
        end = max((e["ts"] + e["dur"] for evs in rows.values() for e in evs), default=begin)
        span = max(end - begin, 1e-9)
        step_us.append(span)
        for r in ranks:
            got = dict.fromkeys(BUCKETS, 0.0)
            for e in rows.get(r, []):
                bubble, missing = _bubble(e, r, rows)
                unmatched += missing
                if e["cat"] in ("compute", "optimizer"):
                    got["busy"] += e["dur"]
                else:
                    got["bubble"] += bubble
                    got["comm"] += e["dur"] - bubble
            got["other"] = max(0.0, span - got["busy"] - got["bubble"] - got["comm"])
            for k in BUCKETS:
                totals[r][k] += got[k] / span / len(steps)
    predicted = [meta["predicted"][str(s)] for s in steps if str(s) in meta["predicted"]]
    stage_ids = sorted({v["stage"] for v in ranks.values()})
    shares = []
    for s in stage_ids:
        mine = [r for r in ranks if ranks[r]["stage"] == s]
        measured = {k: sum(totals[r][k] for r in mine) / len(mine) for k in BUCKETS}
        pred = None
        if predicted:
            pred = {
                k: sum(p["stages"][s][f"{k}_ms"] / p["makespan_ms"] for p in predicted)
                / len(predicted)
                for k in ("busy", "bubble", "comm")
            }  # fmt: skip
        shares.append(StageShare(s, tuple(sorted(mine)), measured, pred))
    halves = meta["clock"].get("uncertainty_ns", {}).values()
    return TraceSummary(
        steps=tuple(steps),
        step_ms=sum(step_us) / len(step_us) / 1e3 if step_us else 0.0,
        predicted_ms=(sum(p["makespan_ms"] for p in predicted) / len(predicted)
                      if predicted else None),
        stages=tuple(shares),
        clock_uncertainty_us=max((float(h) / 1e3 for h in halves), default=0.0),
        unmatched=unmatched,
    )  # fmt: skip


def matching_start(e: Mapping[str, Any], rank: int,
                   rows: Mapping[int, Sequence[Mapping[str, Any]]]) -> float | None:
    """When the last of the ranks a waiting event waits for started the matching action
    (None: the event waits for nobody, or a peer has no matching event)."""
    args = e["args"]
    peers, match = args.get("peers") or [], args.get("match")
    if not peers or match is None:
        return None
    starts = []
    for p in peers:
        found = [
            x["ts"] for x in rows.get(p, [])
            if x["args"].get("kind") == match
            and (x["args"].get("microbatch") is None
                 or x["args"]["microbatch"] == args.get("microbatch"))
            and ("to" not in x["args"] or rank in x["args"]["to"])
        ]  # fmt: skip
        if not found:
            return None
        starts.append(found[0])
    return max(starts)


def _bubble(e: Mapping[str, Any], rank: int,
            rows: Mapping[int, Sequence[Mapping[str, Any]]]) -> tuple[float, int]:
    """(bubble microseconds of a waiting event, 1 if its match was missing else 0)."""
    if e["cat"] not in ("wait", "collective") or not e["args"].get("peers"):
        return 0.0, 0
    sent = matching_start(e, rank, rows)
    if sent is None:
        return 0.0, 1
    return min(max(0.0, sent - e["ts"]), e["dur"]), 0


def format_summary(s: TraceSummary) -> str:
    """The summary as a table (percent of the step time)."""
    steps = (f"step {s.steps[0]}" if len(s.steps) == 1
             else f"steps {s.steps[0]}-{s.steps[-1]}")
    head = f"rannc_fx trace: {steps}, step {s.step_ms:.2f} ms measured"
    if s.predicted_ms is not None and s.error is not None:
        head += f", {s.predicted_ms:.2f} ms predicted (error {100 * s.error:+.1f} %)"
    lines = [head, f"{'':14}{'measured, % of step':^32}   {'predicted':^24}",
             f"{'stage':<6}{'ranks':<8}" + "".join(f"{k:>8}" for k in BUCKETS) + "   "
             + "".join(f"{k:>8}" for k in BUCKETS[:3])]
    for st in s.stages:
        row = f"{st.stage:<6}{','.join(map(str, st.ranks)):<8}"
        row += "".join(f"{100 * st.measured[k]:>8.1f}" for k in BUCKETS) + "   "
        if st.predicted is not None:
            row += "".join(f"{100 * st.predicted[k]:>8.1f}" for k in BUCKETS[:3])
        lines.append(row)
    lines.append(f"clocks aligned to rank 0 within +-{s.clock_uncertainty_us:.0f} us"
                 + (f"; {s.unmatched} wait(s) without a matching action" if s.unmatched else ""))
    return "\n".join(lines)
