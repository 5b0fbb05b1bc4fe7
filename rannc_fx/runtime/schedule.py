"""Pipeline schedules as data: which micro-batch each stage runs, forward or backward, in order.

GPipe fill-drain with 3 stages and 4 micro-batches (``Action`` strings, one row per stage,
one column per clock tick; a stage waits for its producer's action of the same micro-batch):

    tick  0   1   2   3   4   5   6   7   8   9   10  11
    st 0  0F0 0F1 0F2 0F3 .   .   .   .   0B3 0B2 0B1 0B0
    st 1  .   1F0 1F1 1F2 1F3 .   .   1B3 1B2 1B1 1B0 .
    st 2  .   .   2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 .   .

All forwards run when the model is called, all backwards when ``loss.backward()`` is called;
backwards go in reverse micro-batch order, so the last stage turns around on the micro-batch
it finished last and every stage frees activations as it goes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["Action", "Schedule", "clock_ticks", "format_schedule", "gpipe_schedule"]

Kind = Literal["F", "B"]


class Action(NamedTuple):
    """Stage ``stage`` runs the forward (``"F"``) or backward (``"B"``) of one micro-batch."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)


Schedule = list[list[Action]]  # one list per stage, in the order that stage runs them


def gpipe_schedule(num_stages: int, micro_batches: int) -> Schedule:
    """GPipe fill-drain: every forward in micro-batch order, then every backward in reverse."""
    if num_stages < 1 or micro_batches < 1:
        raise ValueError(
            f"a schedule needs at least one stage and one micro-batch, got "
            f"num_stages={num_stages}, micro_batches={micro_batches}"
        )
    return [
        [Action(s, "F", i) for i in range(micro_batches)]
        + [Action(s, "B", i) for i in reversed(range(micro_batches))]
        for s in range(num_stages)
    ]


def clock_ticks(schedule: Schedule) -> dict[Action, int]:
    """The earliest tick of every action if each takes one tick and waits on its dependencies.

    A forward waits for the previous stage's forward of the same micro-batch, a backward for
    the next stage's backward of it (the last stage's first backward waits for its own last
    forward), and every action for the one before it on its own stage.
    """
    n = len(schedule)
    tick: dict[Action, int] = {}
    pending = [list(actions) for actions in schedule]
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


def format_schedule(schedule: Schedule) -> str:
    """The schedule as the tick table in this module's docstring."""
    tick = clock_ticks(schedule)
    width = max(tick.values(), default=-1) + 1
    cell = max(4, *(len(str(a)) + 1 for a in tick))
    rows = ["tick".ljust(6) + "".join(str(t).ljust(cell) for t in range(width)).rstrip()]
    for s, actions in enumerate(schedule):
        line = ["."] * width
        for a in actions:
            line[tick[a]] = str(a)
        rows.append(f"st {s}".ljust(6) + "".join(c.ljust(cell) for c in line).rstrip())
    return "\n".join(rows)


def _dependency(a: Action, num_stages: int) -> Action | None:
    if a.kind == "F":
        return Action(a.stage - 1, "F", a.microbatch) if a.stage > 0 else None
    if a.stage < num_stages - 1:
        return Action(a.stage + 1, "B", a.microbatch)
    return None  # the last stage's backward follows its own forwards (same-stage order)
