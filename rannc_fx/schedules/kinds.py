"""The schedule kinds: one entry a schedule, holding everything the rest of the package asks
of it.

A plan and the Config name their schedule by a string (``Plan.schedule``, JSON-friendly);
every other module reads what that schedule does from its ``ScheduleKind`` here
(``kind_of(name)``), never by comparing the name. A schedule with several stages a lane is
tried on the searched lanes from its entry alone (``planner/virtual.py``); the search's own
DP costs GPipe, 1F1B and ZB-H1 by their formulas, and ZB-H1 is chosen by name
(``planner/zb_choice.py``).

    name         title             B/W split  backward in call  stages a lane  searched as
    gpipe        GPipe             no         no (loss.backward) 1             itself
    1f1b         1F1B              no         yes               1             itself
    zbh1         ZB-H1             yes        yes               1             GPipe or 1F1B,
                                                                              then tried
    interleaved  interleaved 1F1B  no         yes               virtual (>=2) 1F1B, then cut
    zbv          ZBV               yes        yes               2             1F1B, then cut
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

from .actions import Schedule, in_flight
from .generators import (
    check_sizes,
    gpipe_schedule,
    one_f_one_b_schedule,
    zero_bubble_h1_schedule,
)
from .virtual import interleaved_1f1b_schedule, zbv_schedule

__all__ = [
    "GPIPE",
    "INTERLEAVED",
    "KINDS",
    "NAMES",
    "ONE_F_ONE_B",
    "ZBH1",
    "ZBV",
    "ScheduleKind",
    "ScheduleName",
    "kind_of",
    "make_schedule",
    "virtual_of",
]

ScheduleName = Literal["gpipe", "1f1b", "zbh1", "interleaved", "zbv"]
Lanes = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule and what it implies.

    ``generate(stages, micro_batches, stages_a_lane)`` returns its compute actions, one list
    a lane. ``splits_backward``: a backward runs as ``B`` (input gradients) then ``W``
    (weight gradients), apart. ``backward_in_call``: each micro-batch's backward runs inside
    the call (the model's only gradient-carrying output must be a scalar loss, and no tail
    can run between the forwards and the backwards); otherwise it runs at
    ``loss.backward()``. ``lane_stages``: stages a lane holds (``None``: the Config's
    ``virtual_stages``, at least 2). ``search_as``: the schedules the search costs where
    this one is named (``None``: its own choice); the planner then tries this one on the
    searched stages."""

    name: ScheduleName
    title: str
    generate: Callable[[int, int, int], Schedule]
    splits_backward: bool
    backward_in_call: bool
    lane_stages: int | None
    search_as: tuple[ScheduleName, ...] | None

    @property
    def several_a_lane(self) -> bool:
        """A lane holds several stages (interleaved 1F1B, ZBV)."""
        return self.lane_stages != 1

    @property
    def plain(self) -> bool:
        """One stage a lane and whole backwards (GPipe, 1F1B): the search costs these in
        closed form, and only these run layer-by-layer recomputation and parameters kept in
        host memory."""
        return not self.several_a_lane and not self.splits_backward

    @property
    def forwards_first(self) -> bool:
        """Every forward runs before any backward: a part that mixes the batch's samples (the
        tail) can run once between them."""
        return not self.backward_in_call

    def stages_a_lane(self, virtual: int | None = None) -> int:
        """Stages a lane: the fixed count, or ``virtual`` (>= 2) where the Config sets it."""
        if self.lane_stages is not None:
            if virtual not in (None, self.lane_stages):
                raise ValueError(f"schedule {self.name!r} runs {self.lane_stages} stage(s) a "
                                 f"lane, not virtual_stages={virtual}")
            return self.lane_stages
        if virtual is None or virtual < 2:
            raise ValueError(f"schedule {self.name!r} needs virtual_stages >= 2 (stages a "
                             f"lane), got {virtual}")
        return virtual

    def lanes(self, num_stages: int, virtual: int) -> Lanes:
        """The stages each lane holds: one a lane; interleaved 1F1B's lane ``p`` of ``P`` holds
        ``p, p + P, ...``; ZBV's holds ``p`` and ``2P - 1 - p`` (the first and the last stage
        on the first lane)."""
        n, v = num_stages, virtual
        if v == 1 and self.lane_stages == 1:
            return tuple((s,) for s in range(n))
        if self.lane_stages == 2 and v == 2 and n % 2 == 0 and n >= 4:
            return tuple((p, n - 1 - p) for p in range(n // 2))
        if self.lane_stages is None and v >= 2 and n % v == 0 and n >= 2 * v:
            lanes = n // v
            return tuple(tuple(c * lanes + p for c in range(v)) for p in range(lanes))
        raise ValueError(
            f"schedule {self.name!r} with {n} stages and virtual_stages={v}: interleaved needs "
            "virtual_stages >= 2 and at least 2 lanes of that many stages, zbv "
            "virtual_stages=2 and an even stage count of at least 4, the others "
            "virtual_stages=1"
        )

    def make(self, num_stages: int, micro_batches: int, virtual: int | None = None) -> Schedule:
        """The compute actions, one list a lane."""
        v = self.stages_a_lane(virtual)
        check_sizes(num_stages, micro_batches)
        return self.generate(num_stages, micro_batches, v)

    def in_flight(self, num_stages: int, micro_batches: int, virtual: int,
                  stage: int) -> int:
        """Micro-batches whose activations (or, recomputing, inputs) ``stage`` holds at once:
        GPipe all ``m``, 1F1B ``min(m, S - s)``, the others counted off their own lists."""
        m = micro_batches
        if self is GPIPE:
            return m
        if self is ONE_F_ONE_B:
            return min(m, num_stages - stage)
        lanes = self.lanes(num_stages, virtual)
        lane = next(k for k, held in enumerate(lanes) if stage in held)
        return in_flight(self.make(num_stages, m, virtual)[lane], stage)


GPIPE = ScheduleKind("gpipe", "GPipe", lambda n, m, v: gpipe_schedule(n, m),
                     splits_backward=False, backward_in_call=False, lane_stages=1,
                     search_as=("gpipe",))
ONE_F_ONE_B = ScheduleKind("1f1b", "1F1B", lambda n, m, v: one_f_one_b_schedule(n, m),
                           splits_backward=False, backward_in_call=True, lane_stages=1,
                           search_as=("1f1b",))
ZBH1 = ScheduleKind("zbh1", "ZB-H1", lambda n, m, v: zero_bubble_h1_schedule(n, m),
                    splits_backward=True, backward_in_call=True, lane_stages=1, search_as=None)
INTERLEAVED = ScheduleKind("interleaved", "interleaved 1F1B", interleaved_1f1b_schedule,
                           splits_backward=False, backward_in_call=True, lane_stages=None,
                           search_as=("1f1b",))
ZBV = ScheduleKind("zbv", "ZBV", zbv_schedule, splits_backward=True, backward_in_call=True,
                   lane_stages=2, search_as=("1f1b",))

KINDS: dict[str, ScheduleKind] = {k.name: k for k in (GPIPE, ONE_F_ONE_B, ZBH1, INTERLEAVED, ZBV)}
NAMES: tuple[ScheduleName, ...] = get_args(ScheduleName)
assert tuple(KINDS) == NAMES


def kind_of(name: str) -> ScheduleKind:
    """The kind a schedule's name names."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(KINDS)}") from None


def name_of(name: str) -> ScheduleName:
    """``name`` as a ``ScheduleName`` (checked)."""
    return cast(ScheduleName, kind_of(name).name)


def virtual_of(name: str, virtual: int | None = None) -> int:
    """Stages a lane under schedule ``name``: 1, ZBV's 2, or interleaved 1F1B's ``virtual``."""
    return kind_of(name).stages_a_lane(virtual)


def make_schedule(name: str, num_stages: int, micro_batches: int,
                  virtual: int | None = None,
                  lanes: Sequence[Sequence[int]] | None = None) -> Schedule:
    """The named schedule's compute actions, one list per lane (``Plan.schedule`` names one).
    ``lanes``: GPipe over another schedule's lanes (a plan's deferred backward)."""
    kind = kind_of(name)
    if lanes is not None and kind is GPIPE:
        check_sizes(num_stages, micro_batches)
        return gpipe_schedule(num_stages, micro_batches, lanes)
    return kind.make(num_stages, micro_batches, virtual)
