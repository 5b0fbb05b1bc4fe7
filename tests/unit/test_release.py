"""Sends waited mid-step (``schedules/release.py``): only once the receiver has surely posted."""

from __future__ import annotations

import random

import pytest

from rannc_fx.plan.plan import lane_layout
from rannc_fx.schedules.actions import Kind
from rannc_fx.schedules.kinds import make_schedule
from rannc_fx.schedules.lowering import Topology, lower, messages_received
from rannc_fx.schedules.release import release_points
from rannc_fx.schedules.routing import Transfer
from rannc_fx.schedules.simulate import simulate


def _t(kind: str, i: int, src: int, dst: int, stage: int) -> Transfer:
    return Transfer(kind, "h", 0, i, src, dst, 0, 1, 0, 0, True, stage)  # type: ignore[arg-type]


def _two_ranks(m: int, rank: int) -> dict[int, list[tuple[int, Kind, int]]]:
    """1F1B on two stages, one rank each: stage 0 sends its cut value (slot 0) to rank 1 and
    gets its gradient back."""
    topo = Topology.chain(2)
    low = lower(make_schedule("1f1b", 2, m), topo)
    sends, receives = {}, {}
    for i in range(m):
        fwd, grad = _t("cut", i, 0, 1, 1), _t("grad", i, 1, 0, 1)
        if rank == 0:
            sends[(0, Kind.SEND_F, i)] = [fwd]
            receives[(0, Kind.B, i)] = [grad]
        else:
            sends[(1, Kind.SEND_B, i)] = [grad]
            receives[(1, Kind.F, i)] = [fwd]
    return release_points(low, topo, rank, sends, receives, [0])


def test_a_cut_value_goes_with_its_micro_batch_and_the_last_gradient_waits_for_the_end():
    # lane 0: SCATTER F0 SEND_F0 RECV_B0 F1 SEND_F1 B0 RECV_B1 F2 SEND_F2 B1 RECV_B2 F3
    #         SEND_F3 RECV_B3 B2 B3 GATHER REDUCE
    # lane 1: SCATTER RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 RECV_F2 B1 SEND_B1 F2 RECV_F3 B2
    #         SEND_B2 F3 B3 SEND_B3 GATHER REDUCE
    # rank 0's B0 (6) holds the gradient rank 1 sent at 5, after its receives of F0 (1) and
    # F1 (3): both cut values are received by then; F2's receive (7) is passed by SEND_B1 (9),
    # which rank 0's B1 (10) waits for; F3's (11) by SEND_B2 (13), B2 (15)
    assert _two_ranks(4, 0) == {6: [(0, Kind.SEND_F, 0), (0, Kind.SEND_F, 1)],
                                10: [(0, Kind.SEND_F, 2)], 15: [(0, Kind.SEND_F, 3)]}
    # rank 1's gradient i is received at rank 0's RECV_B i (3, 7, 11, 14), passed by SEND_F
    # i + 1 (5, 9, 13), which rank 1's F i + 1 (6, 10, 14) waits for; the last: no later wait
    assert _two_ranks(4, 1) == {6: [(1, Kind.SEND_B, 0)], 10: [(1, Kind.SEND_B, 1)],
                                14: [(1, Kind.SEND_B, 2)]}


def test_one_micro_batch_the_cut_value_goes_at_its_backward_the_gradient_at_the_end():
    # lane 0: SCATTER F0 SEND_F0 GATHER RECV_B0 B0 REDUCE; lane 1: SCATTER RECV_F0 F0 GATHER
    # B0 SEND_B0 REDUCE: rank 1 hears nothing from rank 0 after its gradient is sent
    assert _two_ranks(1, 0) == {5: [(0, Kind.SEND_F, 0)]}
    assert _two_ranks(1, 1) == {}


@pytest.mark.parametrize("name,stages,v", [("1f1b", 3, 1), ("zbh1", 4, 1), ("gpipe", 3, 1),
                                           ("interleaved", 6, 2), ("zbv", 4, 2)])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_every_released_send_has_its_receive_posted_whatever_the_durations(name, stages, v, m):
    """On the simulator's timeline, with random action times: a send released after compute
    action p comes after the send, and its receiver started the receive before p ended (so
    waiting cannot block on the receiver's program)."""
    lanes = lane_layout(name, stages, v)
    topo = Topology.chain(stages, lanes=lanes)
    low = lower(make_schedule(name, stages, m, v), topo)
    rank = topo.lane_of  # one rank a lane
    cuts = [_t("cut", i, rank[s], rank[s + 1], s + 1)._replace(slot=s)
            for s in range(stages - 1) for i in range(m)]
    grads = [t._replace(kind="grad", src=t.dst, dst=t.src) for t in cuts]
    between = [t for t in cuts + grads if t.src != t.dst]
    rng = random.Random(m * 31 + stages)
    for trial in range(5):
        times = {a: rng.uniform(0.5, 2.0) for acts in low for a in acts
                 if a.kind in (Kind.F, Kind.B, Kind.W, Kind.R)}
        sim = simulate(low, topo, lambda a, times=times: times.get(a, 0.0))
        released = 0
        for k, acts in enumerate(low):
            sends = {(s, kind, i): [t for t in between if t.src == k and t.microbatch == i and (
                t.kind == "cut" and t.slot == s if kind is Kind.SEND_F
                else t.kind == "grad" and t.stage == s)]
                for s in range(stages) for kind in (Kind.SEND_F, Kind.SEND_B) for i in range(m)}
            receives = {(s, kind, i): [t for t in between if t.dst == k and t.microbatch == i and (
                t.kind == "cut" and t.stage == s if kind is Kind.F
                else t.kind == "grad" and t.slot == s)]
                for s in range(stages) for kind in (Kind.F, Kind.B) for i in range(m)}
            for p, keys in release_points(low, topo, k, sends, receives,
                                          list(range(stages))).items():
                for s, kind, i in keys:
                    released += 1
                    sent = acts.index(next(a for a in acts if (a.stage, a.kind, a.microbatch)
                                           == (s, kind, i)))
                    assert p > sent
                    label = ("F" if kind is Kind.SEND_F else "B", s,
                             s + 1 if kind is Kind.SEND_F else s - 1, i)
                    recv = next(a for other in low for a in other
                                if a.kind in (Kind.RECV_F, Kind.RECV_B)
                                and any(lab == label for _, lab in messages_received(a, topo)))
                    assert sim.start[recv] <= sim.end[acts[p]], (name, trial, recv, acts[p])
        # something is released wherever a later message comes back (two micro-batches)
        assert released or m < 2 or name == "gpipe"
