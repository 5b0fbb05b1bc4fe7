"""Pipeline schedules as data: which micro-batch each stage runs, forward or backward, in order.

A schedule is one list of ``Action``s per stage (every replica of a stage runs its stage's
list). A generator returns compute actions only (``F`` forward, ``B`` backward); ``lowering``
adds recomputation, communication and the once-per-step actions, and ``simulate`` checks and
times the result. GPipe fill-drain with 3 stages and 4 micro-batches (one row per stage, one
column per clock tick; a stage waits for its producer's action of the same micro-batch):

    tick  0   1   2   3   4   5   6   7   8   9   10  11
    st 0  0F0 0F1 0F2 0F3 .   .   .   .   0B3 0B2 0B1 0B0
    st 1  .   1F0 1F1 1F2 1F3 .   .   1B3 1B2 1B1 1B0 .
    st 2  .   .   2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 .   .

1F1B (one forward, one backward) with the same sizes: stage s runs min(m, S - s - 1) forwards
to fill the pipeline, then alternates, so it holds at most min(m, S - s) micro-batches'
activations instead of m:

    tick  0   1   2   3   4   5   6   7   8   9   10  11
    st 0  0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3
    st 1  .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .
    st 2  .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .

ZB-H1 (zero bubble, Qi et al. 2024, at 1F1B's peak memory) splits each backward into ``B``
(the gradients of the stage's inputs, which the previous stage waits for) and ``W`` (its
parameters', which nobody waits for: ``backward_split``), runs 1F1B's order of ``F`` and
``B``, and lets stage ``s`` hold ``s`` of its ``W``s back, so the later stages, which set the
pace, send their gradients up sooner; the held ``W``s fill the waits of the drain:

    tick  0   1   2   3   4   5   6   7   8   9   10  11  12  13  14
    st 0  0F0 0F1 0F2 .   .   0B0 0W0 0F3 0B1 0W1 0B2 0W2 .   0B3 0W3
    st 1  .   1F0 1F1 .   1B0 1F2 1B1 1W0 1F3 1B2 1W1 1W2 1B3 1W3 .
    st 2  .   .   2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3 .

(one tick per action here; a ``B`` or a ``W`` takes about half a full backward.) An
interleaved schedule adds more than one stage per rank; nothing downstream is written per
schedule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple

from ..plan import Plan

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "clock_ticks",
    "format_schedule",
    "gpipe_schedule",
    "in_flight",
    "make_schedule",
    "one_f_one_b_schedule",
    "plan_grid",
    "zero_bubble_h1_schedule",
]


class Kind(Enum):
    """What an action does. Compute: F, R, B. Messages: RECV_*, SEND_*. Once a step: the rest."""

    F = "F"  # forward of one micro-batch
    R = "R"  # recompute one micro-batch's forward (its activations) right before its backward
    B = "B"  # backward of one micro-batch (only its inputs' gradients where a W follows)
    W = "W"  # the parameters' gradients of one micro-batch, after its B
    RECV_F = "RECV_F"  # post the receives of one micro-batch's inputs
    SEND_F = "SEND_F"  # send one micro-batch's cut values to the stages that read them
    RECV_B = "RECV_B"  # post the receives of the gradients of one micro-batch's outputs
    SEND_B = "SEND_B"  # send the gradients of one micro-batch's inputs to their producers
    SCATTER = "SCATTER"  # the local batch's pieces to the replicas that read them (all mbs)
    GATHER = "GATHER"  # model outputs home, the loss to every rank, buffers made equal
    REDUCE = "REDUCE"  # gradient all-reduces among replicas and holders of shared parameters

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.R, Kind.B, Kind.W)

    @property
    def once(self) -> bool:
        """Once per step, for all micro-batches (no micro-batch of its own)."""
        return self in (Kind.SCATTER, Kind.GATHER, Kind.REDUCE)


class Action(NamedTuple):
    """Stage ``stage`` does ``kind`` for micro-batch ``microbatch`` (None: once a step)."""

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``str`` printed: ``1F0``, ``0W3``, ``2REDUCE``."""
        m = re.fullmatch(r"(\d+)([A-Z_]+?)(\d*)", text.strip())
        if m is None or m.group(2) not in Kind._value2member_map_:
            raise ValueError(f"{text!r} is not an action: stage, kind ({', '.join(k.value for k in Kind)}), micro-batch, e.g. '1F0'")
        kind = Kind(m.group(2))
        mb = int(m.group(3)) if m.group(3) else None
        if kind.once != (mb is None):
            raise ValueError(f"{text!r}: {kind.value} " + ("runs once a step, without a micro-batch" if kind.once else "needs a micro-batch"))
        return cls(int(m.group(1)), kind, mb)


Schedule = list[list[Action]]  # one list per stage, in the order that stage runs them


def _check_sizes(num_stages: int, micro_batches: int) -> None:
    if num_stages < 1 or micro_batches < 1:
        raise ValueError(
            f"a schedule needs at least one stage and one micro-batch, got "
            f"num_stages={num_stages}, micro_batches={micro_batches}"
        )


def gpipe_schedule(num_stages: int, micro_batches: int) -> Schedule:
    """GPipe fill-drain: every forward in micro-batch order, then every backward in reverse
    (the last stage turns around on the micro-batch it finished last)."""
    _check_sizes(num_stages, micro_batches)
    return [
        [Action(s, Kind.F, i) for i in range(micro_batches)]
        + [Action(s, Kind.B, i) for i in reversed(range(micro_batches))]
        for s in range(num_stages)
    ]


def one_f_one_b_schedule(num_stages: int, micro_batches: int) -> Schedule:
    """1F1B: ``min(m, S - s - 1)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards; backwards in micro-batch order."""
    _check_sizes(num_stages, micro_batches)
    out: Schedule = []
    for s in range(num_stages):
        warm = min(micro_batches, num_stages - s - 1)
        acts = [Action(s, Kind.F, i) for i in range(warm)]
        for k in range(micro_batches - warm):
            acts += [Action(s, Kind.F, warm + k), Action(s, Kind.B, k)]
        acts += [Action(s, Kind.B, i) for i in range(micro_batches - warm, micro_batches)]
        out.append(acts)
    return out


def zero_bubble_h1_schedule(num_stages: int, micro_batches: int) -> Schedule:
    """ZB-H1: 1F1B's order of forwards and input backwards ``B``; each micro-batch's ``W``
    right after its ``B``, except that stage ``s`` holds ``s`` of them back (so the later
    stages, which set the pace, send their gradients up sooner) and runs one before each
    ``B`` of the drain, where it would wait for the next stage, and the rest at the end.
    A stage then holds at most ``min(m, S)`` micro-batches' activations, 1F1B's first
    stage's, if only partly: what its held ``W``s read."""
    _check_sizes(num_stages, micro_batches)
    out: Schedule = []
    for s in range(num_stages):
        warm = min(micro_batches, num_stages - s - 1)
        lag = s
        acts = [Action(s, Kind.F, i) for i in range(warm)]
        held: list[int] = []
        for k in range(micro_batches - warm):
            acts += [Action(s, Kind.F, warm + k), Action(s, Kind.B, k)]
            held.append(k)
            if len(held) > lag:
                acts.append(Action(s, Kind.W, held.pop(0)))
        for k in range(micro_batches - warm, micro_batches):
            if held:
                acts.append(Action(s, Kind.W, held.pop(0)))
            acts.append(Action(s, Kind.B, k))
            held.append(k)
        acts += [Action(s, Kind.W, k) for k in held]
        out.append(acts)
    return out


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "zbh1": zero_bubble_h1_schedule,
}


def make_schedule(name: str, num_stages: int, micro_batches: int) -> Schedule:
    """The named schedule's compute actions (``Plan.schedule`` names one)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, micro_batches)


def in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches whose forward ran and whose backward has not, at any point."""
    live = most = 0
    for a in actions:
        if a.kind is Kind.F:
            live += 1
            most = max(most, live)
        elif a.kind is Kind.B:
            live -= 1
    return most


def clock_ticks(schedule: Schedule) -> dict[Action, int]:
    """The earliest tick of every compute action if each takes one tick.

    A forward waits for the previous stage's forward of the same micro-batch, a backward for
    the next stage's backward of it (the last stage's backward for its own forward, earlier
    in its list), and every action for the one before it on its own stage.
    """
    n = len(schedule)
    tick: dict[Action, int] = {}
    pending = [[a for a in actions if a.kind in (Kind.F, Kind.B, Kind.W)] for actions in schedule]
    last = [-1] * n
    while any(pending):
        progressed = False
        for s in range(n):
            while pending[s]:
                a = pending[s][0]
                dep = _dependency(a, n)
                if dep is not None and dep not in tick:
                    break
                t = max(last[s], tick[dep] if dep is not None else -1) + 1
                tick[a] = last[s] = t
                pending[s].pop(0)
                progressed = True
        if not progressed:
            stuck = ", ".join(str(p[0]) for p in pending if p)
            raise ValueError(f"schedule deadlocks: {stuck} wait on actions that never run")
    return tick


def format_schedule(schedule: Schedule, rows: Sequence[tuple[str, int]] | None = None) -> str:
    """The compute actions as the tick table of this module's docstring.

    ``rows`` lists (label, stage) per printed row, e.g. one per rank; default one per stage.
    """
    tick = clock_ticks(schedule)
    width = max(tick.values(), default=-1) + 1
    cell = max(4, *(len(str(a)) + 1 for a in tick))
    rows = rows if rows is not None else [(f"st {s}", s) for s in range(len(schedule))]
    label = max(6, *(len(name) + 1 for name, _ in rows))
    lines = ["tick".ljust(label) + "".join(str(t).ljust(cell) for t in range(width)).rstrip()]
    for name, s in rows:
        line = ["."] * width
        for a in schedule[s]:
            if a in tick:
                line[tick[a]] = str(a)
        lines.append(name.ljust(label) + "".join(c.ljust(cell) for c in line).rstrip())
    return "\n".join(lines)


def plan_grid(plan: Plan) -> str:
    """One step of ``plan``'s schedule, one row per rank: its stage's forwards and backwards
    by clock tick (a recomputing stage runs R before each of its B)."""
    sched = make_schedule(plan.schedule, len(plan.stages), plan.micro_batches)
    rows = [(f"rank {r}", plan.stage_of_rank(r).index) for r in range(plan.world_size)]
    return format_schedule(sched, rows)


def _dependency(a: Action, num_stages: int) -> Action | None:
    assert a.microbatch is not None
    if a.kind is Kind.W:
        return None  # its own B, earlier in the same list
    if a.kind is Kind.F:
        return Action(a.stage - 1, Kind.F, a.microbatch) if a.stage > 0 else None
    if a.stage < num_stages - 1:
        return Action(a.stage + 1, Kind.B, a.microbatch)
    return None  # the last stage's backward follows its own forward (same-stage order)
