"""A schedule in torch.distributed.pipelining's CSV action format, both ways.

torch's runtime reads a schedule as CSV (``_PipelineScheduleRuntime._load_csv``, the
"compute_only" format): one row per pipeline rank, one cell per compute action, each written
``<stage><kind><micro-batch>`` with kinds ``F`` (forward), ``I`` (backward to the inputs
only), ``W`` (backward to the weights) and ``B`` (the whole backward). rannc_fx's ``B`` is
torch's ``I`` where the same stage has a ``W`` for that micro-batch, and its ``B`` otherwise,
so a plan's schedule can be compared with, or handed to, torch's own runtime, and a schedule
written for torch runs here (``schedule_from_csv``):

    0F0,0F1,0I0,0W0,0F2,0I1,0W1,...      rank 0 runs stage 0
    1F0,1I0,1F1,1I1,1W0,...              rank 1 runs stage 1

A row is a lane (a pipeline rank of torch's): where a schedule puts several stages on a
rank, its row holds all of their actions (``0F0,0F1,2F0,...``); ``schedule_from_csv`` checks
that no stage appears on two rows.
"""

from __future__ import annotations

import csv
import io
import re

from .generators import Action, Kind, Schedule

__all__ = ["schedule_csv", "schedule_from_csv"]

_CELL = re.compile(r"(\d+)([FIWB])(\d+)")


def schedule_csv(schedule: Schedule) -> str:
    """The schedule's compute actions as torch's CSV, one row per lane."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule:
        split = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.W}
        row = []
        for a in actions:
            if a.kind is Kind.B:
                row.append(f"{a.stage}{'I' if (a.stage, a.microbatch) in split else 'B'}"
                           f"{a.microbatch}")
            elif a.kind in (Kind.F, Kind.W):
                row.append(str(a))
            else:
                raise ValueError(f"{a} is not a compute action of a schedule (F, B or W); "
                                 "write the schedule before lowering")
        writer.writerow(row)
    return out.getvalue()


def schedule_from_csv(text: str) -> Schedule:
    """A schedule from torch's CSV (one row per lane: its stages' actions only)."""
    schedule: Schedule = []
    row_of: dict[int, int] = {}
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        actions = []
        kinds: dict[str, set[tuple[int, int]]] = {"I": set(), "B": set(), "W": set()}
        for cell in (c.strip() for c in row):
            if not cell:
                continue
            m = _CELL.fullmatch(cell)
            if m is None:
                raise ValueError(
                    f"row {r}: {cell!r} is not a compute action (<stage><F|I|W|B><micro-batch>, "
                    "e.g. '1I0'); rannc_fx reads the 'compute_only' format"
                )
            stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3))
            if row_of.setdefault(stage, r) != r:
                raise ValueError(f"row {r} holds {cell!r}, an action of stage {stage}, which "
                                 f"row {row_of[stage]} runs: a stage runs on one lane")
            kinds.setdefault(kind, set()).add((stage, mb))
            actions.append(Action(stage, Kind.B if kind in "IB" else Kind(kind), mb))
        if kinds["I"] != kinds["W"] or kinds["I"] & kinds["B"]:
            odd = sorted(kinds["I"] ^ kinds["W"] | kinds["I"] & kinds["B"])
            raise ValueError(f"row {r}, (stage, micro-batch) {odd}: a backward to the inputs (I) "
                             "needs its W, and a W its I (B is the whole backward, alone)")
        schedule.append(actions)
    return schedule
