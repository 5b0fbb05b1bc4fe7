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

(one tick per action here; a ``B`` or a ``W`` takes about half a full backward.)
Interleaved 1F1B and ZBV put several stages on each lane (``schedule_virtual``); a schedule
is one list per lane, and nothing downstream is written per schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import Action, Kind, Schedule, in_flight
from .virtual import interleaved_1f1b_schedule, zbv_schedule

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "check_sizes",
    "clock_ticks",
    "format_schedule",
    "gpipe_schedule",
    "in_flight",
    "interleaved_1f1b_schedule",
    "one_f_one_b_schedule",
    "zbv_schedule",
    "zero_bubble_h1_schedule",
]


def check_sizes(num_stages: int, micro_batches: int) -> None:
    if num_stages < 1 or micro_batches < 1:
        raise ValueError(
            f"a schedule needs at least one stage and one micro-batch, got "
            f"num_stages={num_stages}, micro_batches={micro_batches}"
        )


def gpipe_schedule(num_stages: int, micro_batches: int,
                   lanes: Sequence[Sequence[int]] | None = None) -> Schedule:
    """GPipe fill-drain: every forward in micro-batch order, then every backward in reverse
    (the last stage turns around on the micro-batch it finished last). Where a lane holds
    several stages (``lanes``), it runs its stages' forwards in stage order and their
    backwards in reverse, breadth first (torch's LoopedBFS)."""
    check_sizes(num_stages, micro_batches)
    lanes = lanes if lanes is not None else [[s] for s in range(num_stages)]
    return [
        [Action(s, Kind.F, i) for s in lane for i in range(micro_batches)]
        + [Action(s, Kind.B, i) for s in reversed(lane) for i in reversed(range(micro_batches))]
        for lane in lanes
    ]


def one_f_one_b_schedule(num_stages: int, micro_batches: int) -> Schedule:
    """1F1B: ``min(m, S - s - 1)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards; backwards in micro-batch order."""
    check_sizes(num_stages, micro_batches)
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
    check_sizes(num_stages, micro_batches)
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


def clock_ticks(schedule: Schedule) -> dict[Action, int]:
    """The earliest tick of every compute action if each takes one tick.

    A forward waits for the previous stage's forward of the same micro-batch, a backward for
    the next stage's backward of it (the last stage's backward for its own forward), a ``W``
    for its ``B``, and every action for the one before it on its own lane.
    """
    n = len(schedule)
    stages = 1 + max((a.stage for actions in schedule for a in actions), default=-1)
    tick: dict[Action, int] = {}
    pending = [[a for a in actions if a.kind in (Kind.F, Kind.B, Kind.W)] for actions in schedule]
    last = [-1] * n
    while any(pending):
        progressed = False
        for s in range(n):
            while pending[s]:
                a = pending[s][0]
                dep = _dependency(a, stages)
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

    ``rows`` lists (label, lane) per printed row, e.g. one per rank; default one per lane.
    """
    tick = clock_ticks(schedule)
    width = max(tick.values(), default=-1) + 1
    cell = max(4, *(len(str(a)) + 1 for a in tick))
    rows = rows if rows is not None else [
        (f"{'st' if all(len({a.stage for a in acts}) <= 1 for acts in schedule) else 'ln'} {s}", s)
        for s in range(len(schedule))
    ]
    label = max(6, *(len(name) + 1 for name, _ in rows))
    lines = ["tick".ljust(label) + "".join(str(t).ljust(cell) for t in range(width)).rstrip()]
    for name, s in rows:
        line = ["."] * width
        for a in schedule[s]:
            if a in tick:
                line[tick[a]] = str(a)
        lines.append(name.ljust(label) + "".join(c.ljust(cell) for c in line).rstrip())
    return "\n".join(lines)


def _dependency(a: Action, num_stages: int) -> Action | None:
    assert a.microbatch is not None
    if a.kind is Kind.W:
        return Action(a.stage, Kind.B, a.microbatch)
    if a.kind is Kind.F:
        return Action(a.stage - 1, Kind.F, a.microbatch) if a.stage > 0 else None
    if a.stage < num_stages - 1:
        return Action(a.stage + 1, Kind.B, a.microbatch)
    return Action(a.stage, Kind.F, a.microbatch)  # the last stage turns around
