"""Sends waited mid-step (``runtime/release.py``): only once the receiver has surely posted."""

from __future__ import annotations

from rannc_fx.runtime.actions import Kind
from rannc_fx.runtime.lowering import Topology, lower
from rannc_fx.runtime.release import release_points
from rannc_fx.runtime.routing import Transfer
from rannc_fx.runtime.schedule import make_schedule


def _t(kind: str, i: int, src: int, dst: int, stage: int) -> Transfer:
    return Transfer(kind, "h", 0, i, src, dst, 0, 1, 0, 0, True, stage)  # type: ignore[arg-type]


def _two_ranks(m: int, rank: int) -> dict[int, list[tuple[int, Kind, int]]]:
    """1F1B on two stages, one rank each: stage 0 sends its cut value to rank 1 and gets its
    gradient back."""
    topo = Topology.chain(2)
    low = lower(make_schedule("1f1b", 2, m), topo)
    sends, receives, other = {}, {}, {}
    for i in range(m):
        fwd, grad = _t("cut", i, 0, 1, 1), _t("grad", i, 1, 0, 1)
        if rank == 0:
            sends[(0, Kind.SEND_F, i)] = [fwd]
            receives[(0, Kind.B, i)] = [grad]
        else:
            sends[(1, Kind.SEND_B, i)] = [grad]
            receives[(1, Kind.F, i)] = [fwd]
        other[id(fwd)] = other[id(grad)] = 1 - rank  # the stage at the other end
    return release_points(low, topo, rank, sends, receives, other)


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
