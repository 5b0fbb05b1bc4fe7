"""Schedules that put several stages on each lane: interleaved 1F1B and the V-shape zero bubble.

With ``P`` lanes and ``v`` stages a lane, a micro-batch crosses every lane ``v`` times, so
the pipeline fills and drains ``v`` times faster than with ``P`` stages of ``v`` times the
work; the price is ``v`` times the messages.

Interleaved 1F1B (Megatron's virtual pipeline, Narayanan et al. 2021): lane ``p`` holds
stages ``p, p + P, ..., p + (v - 1) P``. Its forwards go round by round (``m / rounds``
micro-batches a round, ``rounds = max(1, m // P)``, where that divides ``m``; else rounds
of ``P`` and a shorter last one), each round through its stages in order; its backwards
likewise, its stages in reverse. Lane ``p`` runs ``(v - 1) * per_round
+ 2 (P - 1 - p)`` forwards to fill the pipeline, then one forward and one backward in turn.
P = 2, v = 2, m = 2 (stages 0 and 2 on lane 0, 1 and 3 on lane 1):

    tick  0   1   2   3   4   5   6   7   8   9
    ln 0  0F0 0F1 2F0 2F1 .   2B0 .   2B1 0B0 0B1
    ln 1  .   1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 .

ZBV (Qi et al. 2024, section 6): two stages a lane in a V, lane ``p`` holds stage ``p`` and
stage ``2P - 1 - p``, so the first lane runs the first and the last stage and the turn of
the V (stages ``P - 1`` and ``P``) stays on one rank; backwards split into ``B`` and ``W``,
and the ``W``s fill what would be bubbles. Its order is the paper's: the first stage's
forwards to fill, then forwards of both, then steady F B W on each stage in turn, then the
remaining backwards and the held ``W``s. With fewer than ``2P - 1`` micro-batches it is
the order for ``2P - 1`` without the missing ones. P = 2, m = 4 (stages 0 and 3 on lane
0, 1 and 2 on lane 1):

    tick  0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18 ...
    ln 0  0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 ...
    ln 1  .   1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 ...

Both produce the very orders of torch.distributed.pipelining's ``ScheduleInterleaved1F1B``
and ``ScheduleZBVZeroBubble`` (checked in the tests), so plans can be compared with them
action by action.
"""

from __future__ import annotations

from .actions import Action, Kind, Schedule

__all__ = ["interleaved_1f1b_schedule", "zbv_schedule"]


def _rounds(num_lanes: int, micro_batches: int) -> list[list[int]]:
    """The micro-batches of each round (a round goes through a lane's stages in turn):
    ``max(1, m // P)`` rounds, torch's where they divide ``m`` evenly, else the larger ones
    (one micro-batch more) first."""
    m, lanes = micro_batches, num_lanes
    rounds = max(1, m // lanes)
    base, extra = divmod(m, rounds)
    out, a = [], 0
    for r in range(rounds):
        size = base + (1 if r < extra else 0)
        out.append(list(range(a, a + size)))
        a += size
    return out


def interleaved_1f1b_schedule(num_stages: int, micro_batches: int, virtual: int) -> Schedule:
    """Interleaved 1F1B with ``virtual`` stages a lane (``num_stages / virtual`` lanes)."""
    if virtual < 2 or num_stages % virtual or num_stages < 2 * virtual:
        raise ValueError(
            f"interleaved 1F1B needs at least 2 stages a lane, at least 2 lanes, and a stage "
            f"count that is a multiple of the stages a lane: got {num_stages} stages, "
            f"{virtual} a lane"
        )
    lanes = num_stages // virtual
    rounds = _rounds(lanes, micro_batches)
    per = len(rounds[0])
    # the lane's k-th forward and k-th backward: (chunk, micro-batch), round by round
    fwd = [(c, i) for r in rounds for c in range(virtual) for i in r]
    bwd = [(c, i) for r in rounds for c in reversed(range(virtual)) for i in r]
    total = len(fwd)
    out: Schedule = []
    for p in range(lanes):
        def at(chunk: int, i: int, kind: Kind, p: int = p) -> Action:
            return Action(chunk * lanes + p, kind, i)

        warm = min((virtual - 1) * per + 2 * (lanes - 1 - p), total)
        acts = [at(*fwd[k], Kind.F) for k in range(warm)]
        for k in range(total - warm):
            acts += [at(*fwd[warm + k], Kind.F), at(*bwd[k], Kind.B)]
        acts += [at(*bwd[k], Kind.B) for k in range(total - warm, total)]
        out.append(acts)
    return out


def zbv_schedule(num_stages: int, micro_batches: int, virtual: int = 2) -> Schedule:
    """ZBV: two stages a lane in a V (``num_stages / 2`` lanes), backwards split in B and W."""
    if virtual != 2 or num_stages % 2 or num_stages < 4:
        raise ValueError(f"ZBV runs two stages a lane: needs an even stage count, got "
                         f"{num_stages} stages, {virtual} a lane (at least 2 lanes)")
    lanes = num_stages // 2
    n = max(2 * lanes - 1, micro_batches)  # enough to fill the V; extras dropped below
    out: Schedule = []
    for p in range(lanes):
        first, second = p, num_stages - 1 - p
        count = {(first, Kind.F): 0, (second, Kind.F): 0, (first, Kind.B): 0,
                 (second, Kind.B): 0, (first, Kind.W): 0, (second, Kind.W): 0}
        acts: list[Action] = []

        def run(stage: int, kind: Kind, acts: list[Action] = acts,
                count: dict[tuple[int, Kind], int] = count) -> None:
            acts.append(Action(stage, kind, count[stage, kind]))
            count[stage, kind] += 1

        for _ in range(2 * (lanes - p) - 1):  # fill: the first stage's forwards
            run(first, Kind.F)
        for _ in range(p):  # both stages' forwards
            run(second, Kind.F)
            run(first, Kind.F)
        for _ in range(lanes - p):  # the second stage turns around
            run(second, Kind.F)
            run(second, Kind.B)
            run(second, Kind.W)
        while count[second, Kind.F] < count[first, Kind.F] or count[first, Kind.F] < n:
            if count[first, Kind.F] < n:
                run(first, Kind.F)
            run(first, Kind.B)
            run(first, Kind.W)
            run(second, Kind.F)
            run(second, Kind.B)
            run(second, Kind.W)
        for _ in range(p):  # drain: input backwards first, weights held
            run(first, Kind.B)
            run(second, Kind.B)
        for _ in range(lanes - p):
            run(first, Kind.B)
            run(first, Kind.W)
        while count[second, Kind.W] < count[second, Kind.B]:
            run(second, Kind.W)
        while count[first, Kind.W] < count[first, Kind.B]:
            run(first, Kind.W)
        out.append([a for a in acts if a.microbatch is not None and a.microbatch < micro_batches])
    return out
