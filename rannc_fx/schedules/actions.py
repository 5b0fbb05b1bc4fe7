"""What a schedule is made of: ``Action`` (a stage does one kind of work for one micro-batch,
or once a step) and ``Schedule`` (one list of actions per lane, in the order its ranks run them).

A *lane* is the ranks that run one list: the replicas of one stage, or, where a schedule puts
several stages on each rank (interleaved 1F1B, ZBV), the replicas of each of those stages. A
schedule with one stage per lane lists lane ``s``'s actions for stage ``s``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

__all__ = ["Action", "Kind", "Schedule", "in_flight"]


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
    """Stage ``stage`` does ``kind`` for micro-batch ``microbatch`` (None: once a step); a
    receive with a ``peer`` posts only what that stage sends (``1RECV_B0<3``)."""

    stage: int
    kind: Kind
    microbatch: int | None = None
    peer: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        peer = "" if self.peer is None else f"<{self.peer}"
        return f"{self.stage}{self.kind.value}{mb}{peer}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``str`` printed: ``1F0``, ``0W3``, ``2REDUCE``, ``1RECV_B0<3``."""
        m = re.fullmatch(r"(\d+)([A-Z_]+?)(\d*)(?:<(\d+))?", text.strip())
        if m is None or m.group(2) not in Kind._value2member_map_:
            raise ValueError(f"{text!r} is not an action: stage, kind ({', '.join(k.value for k in Kind)}), micro-batch, e.g. '1F0'")
        kind = Kind(m.group(2))
        mb = int(m.group(3)) if m.group(3) else None
        if kind.once != (mb is None):
            raise ValueError(f"{text!r}: {kind.value} " + ("runs once a step, without a micro-batch" if kind.once else "needs a micro-batch"))
        peer = int(m.group(4)) if m.group(4) else None
        if peer is not None and kind not in (Kind.RECV_F, Kind.RECV_B):
            raise ValueError(f"{text!r}: only a receive names the stage it receives from")
        return cls(int(m.group(1)), kind, mb, peer)


Schedule = list[list[Action]]  # one list per lane, in the order its ranks run them


def in_flight(actions: Sequence[Action], stage: int | None = None) -> int:
    """The most micro-batches whose forward ran and whose backward has not, at any point
    (of ``stage``'s, where a lane holds several). Where a micro-batch's backward is split,
    it counts until its ``W``: the weight gradients read what the forward saved."""
    split = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.W}
    live = most = 0
    for a in actions:
        if stage is not None and a.stage != stage:
            continue
        if a.kind is Kind.F:
            live += 1
            most = max(most, live)
        elif a.kind is Kind.W or (a.kind is Kind.B and (a.stage, a.microbatch) not in split):
            live -= 1
    return most
