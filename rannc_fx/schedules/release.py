"""When a rank may wait for a send without waiting on its peer: sends released mid-step.

A gloo send keeps its tensor until the rank waits for it, and waiting blocks until the peer
has posted the matching receive. Waited only at the step's end, every cut value and gradient a
rank sends stays allocated for the rest of the step (on the small CPU models of
``benchmarks/memory_cpu.py`` up to 14 % of a rank's step memory, which the plan counts only
while the micro-batch is in flight). Waited too early, a send could block a rank on a peer
that is itself waiting.

The lowered lists say when it is safe. Rank ``j`` of lane ``d`` posts the receive of this
rank's message at a fixed index ``r`` of ``d``'s list. Once this rank has received a message
from ``j`` that ``j`` sent at an index ``q > r`` of the same list, ``j`` has passed ``r``: the
receive is posted, and the send completes on the transports' own threads without the peer
doing anything more. So a send is released after the first compute action (the one that waits
for that message) that has received such a message from every rank the send goes to::

    1F1B, 2 stages         lane 0   F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 ...
                           lane 1   RECV_F0 F0 B0 SEND_B0 RECV_F1 ...
    rank 0's SEND_F0 (received at lane 1's index 0) is released at its B0, which waits for
    the gradient rank 1 sent at index 3 > 0: the micro-batch's cut value goes with its
    activations.

``release_points`` computes this once per list (``rank_release``: for a rank, from its
stages' transfers); ``StageRunner`` keeps each send's ``Pending`` by (kind, micro-batch), and
the executor waits for the released ones after each compute action of its in-call list.
A send with no such point (the last ones of a step) is waited at the step's end, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .actions import Action, Kind
from .lowering import Topology, messages_received, messages_sent
from .routing import Transfer

__all__ = ["rank_release", "release_points"]

Key = tuple[int, Kind, int]  # (stage, SEND_F or SEND_B, micro-batch)


def rank_release(lowered: Sequence[Sequence[Action]], topology: Topology, lane: int,
                 runners: Mapping[int, Any], micro_batches: int, producers: Sequence[int]
                 ) -> dict[int, list[tuple[int, str, int]]]:
    """Index of this rank's list (lane ``lane``'s) -> the sends (stage, "F" or "B",
    micro-batch) it waits for after that action, from its ``StageRunner``s' transfers."""
    sends: dict[Key, list[Transfer]] = {}
    receives: dict[Key, list[Transfer]] = {}
    for s, r in runners.items():
        for i in range(micro_batches):
            sends[(s, Kind.SEND_F, i)] = r.messages_of("cut out", i)
            sends[(s, Kind.SEND_B, i)] = r.messages_of("grad out", i)
            receives[(s, Kind.F, i)] = r.messages_of("cut in", i)
            receives[(s, Kind.B, i)] = r.messages_of("grad in", i)
    points = release_points(lowered, topology, lane, sends, receives, producers)
    return {p: [(s, "F" if kind is Kind.SEND_F else "B", i) for s, kind, i in keys]
            for p, keys in points.items()}


def release_points(
    lowered: Sequence[Sequence[Action]],
    topology: Topology,
    lane: int,
    sends: Mapping[Key, Sequence[Transfer]],
    receives: Mapping[Key, Sequence[Transfer]],
    producers: Sequence[int],
) -> dict[int, list[Key]]:
    """Index of a compute action in lane ``lane``'s list -> the sends to wait for after it.

    ``sends[(stage, SEND_F or SEND_B, i)]``: the transfers this rank sends at that action to
    other ranks; ``receives[(stage, F or B, i)]``: those the compute action waits for from
    other ranks; ``producers[slot]``: the stage that makes cut value ``slot``."""
    recv_at = _index(lowered, topology, (Kind.RECV_F, Kind.RECV_B), messages_received)
    send_at = _index(lowered, topology, (Kind.SEND_F, Kind.SEND_B), messages_sent)
    acts = lowered[lane]
    # per compute action: rank it received from -> the index its sender sent it at
    heard: list[tuple[int, dict[int, int]]] = []
    for p, a in enumerate(acts):
        if a.kind not in (Kind.F, Kind.B) or a.microbatch is None:
            continue
        got: dict[int, int] = {}
        for t in receives.get((a.stage, a.kind, a.microbatch), ()):
            q = send_at.get(_label(t, producers))
            if q is not None:
                got[t.src] = max(got.get(t.src, -1), q)
        if got:
            heard.append((p, got))
    out: dict[int, list[Key]] = {}
    for p, a in enumerate(acts):
        if a.kind not in (Kind.SEND_F, Kind.SEND_B) or a.microbatch is None:
            continue
        key = (a.stage, a.kind, a.microbatch)
        when = _released(p, sends.get(key, ()), heard, recv_at, producers)
        if when is not None:
            out.setdefault(when, []).append(key)
    return out


def _label(t: Transfer, producers: Sequence[int]) -> tuple[str, int, int, int]:
    """The lowering's label of the message ``t`` is part of: (what, from stage, to stage,
    micro-batch); a cut value goes from its producer to ``t.stage``, its gradient back."""
    made = producers[t.slot]
    if t.kind == "cut":
        return ("F", made, t.stage, t.microbatch)
    return ("B", t.stage, made, t.microbatch)


def _released(p: int, transfers: Sequence[Transfer], heard: list[tuple[int, dict[int, int]]],
              recv_at: Mapping[tuple[str, int, int, int], int], producers: Sequence[int]
              ) -> int | None:
    """The first compute action after ``p`` by which every receiver has posted its receive
    (None: none in this list)."""
    if not transfers:
        return None
    need: dict[int, int] = {}  # receiving rank -> the index of its receive
    for t in transfers:
        r = recv_at.get(_label(t, producers))
        if r is None:
            return None
        need[t.dst] = max(need.get(t.dst, -1), r)
    for c, got in heard:
        if c <= p:
            continue
        for j in [j for j, r in need.items() if got.get(j, -1) > r]:
            del need[j]
        if not need:
            return c
    return None


def _index(lowered: Sequence[Sequence[Action]], topology: Topology, kinds: tuple[Kind, ...],
           messages: Callable[[Action, Topology], list[tuple[int, Any]]]
           ) -> dict[tuple[str, int, int, int], int]:
    """Message label -> the index, in the list of the lane that posts it, of the action of
    ``kinds`` posting it (a receive or a send, by ``messages``)."""
    out: dict[tuple[str, int, int, int], int] = {}
    for acts in lowered:
        for p, a in enumerate(acts):
            if a.kind in kinds:
                for _, (what, src, dst, i) in messages(a, topology):
                    out[(str(what), int(src), int(dst), int(i or 0))] = p
    return out
