"""Several stages a lane (interleaved 1F1B, ZBV) as data: orders, lowering, simulation, CSV."""

from __future__ import annotations

import pytest

from rannc_fx.plan.plan import lane_layout
from rannc_fx.schedules.csv_format import schedule_csv, schedule_from_csv
from rannc_fx.schedules.generators import (
    Action,
    Kind,
    clock_ticks,
    in_flight,
)
from rannc_fx.schedules.kinds import make_schedule, virtual_of
from rannc_fx.schedules.lowering import Topology, lower, messages_received, messages_sent
from rannc_fx.schedules.simulate import simulate


def _torch_order(cls_name: str, lanes: int, virtual: int, mbs: int) -> list[list[tuple]]:
    """torch.distributed.pipelining's own order for each rank, without a process group: its
    per-rank generator reads only these attributes (torch pinned in the Makefile)."""
    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, cls_name)
    sched = object.__new__(cls)
    sched.pp_group_size, sched.n_local_stages = lanes, virtual
    sched._n_microbatches, sched.num_stages = mbs, lanes * virtual
    sched.number_of_rounds = max(1, mbs // lanes)
    sched.microbatches_per_round = mbs // sched.number_of_rounds
    kind = {"F": "F", "I": "B", "B": "B", "W": "W"}
    return [
        [(a.stage_index, kind[a.computation_type.value], a.microbatch_index)
         for a in cls._calculate_single_rank_operations(sched, r) if a is not None]
        for r in range(lanes)
    ]


@pytest.mark.parametrize("lanes", [2, 3, 5, 8])
def test_interleaved_rounds_that_torch_cannot_make_run_the_larger_first(lanes):
    """Where ``max(1, m // P)`` rounds do not divide ``m`` (torch refuses: 32 micro-batches on
    5 lanes), rounds differ by one micro-batch, the larger first; every such schedule, and
    its lowering with recomputation, runs to the end."""
    for v in (2, 3):
        for m in range(1, 34):
            sched = make_schedule("interleaved", lanes * v, m, v)
            clock_ticks(sched)
            topo = Topology.chain(lanes * v, [True] * (lanes * v),
                                  lane_layout("interleaved", lanes * v, v))
            simulate(lower(sched, topo), topo, lambda a: 1.0 if a.kind.is_compute else 0.0)
    first = make_schedule("interleaved", 10, 32, 2)[0]
    # 6 rounds of 6, 6, 5, 5, 5, 5: the first stage's forwards of the first round, then the
    # second stage's
    assert [a.microbatch for a in first[:6]] == list(range(6))
    assert {a.stage for a in first[:6]} == {0} and first[6].stage == 5


def _cases(name: str) -> list[tuple[int, int, int]]:
    out = []
    for lanes in (2, 3, 4):
        for v in ((2, 3) if name == "interleaved" else (2,)):
            for m in range(1, 13):
                if name == "interleaved" and m % max(1, m // lanes):
                    continue  # torch and rannc_fx both refuse these
                out.append((lanes, v, m))
    return out


@pytest.mark.parametrize("lanes,v,m", _cases("interleaved"))
def test_interleaved_1f1b_runs_torch_s_order(lanes, v, m):
    ours = make_schedule("interleaved", lanes * v, m, v)
    assert [[(a.stage, a.kind.value, a.microbatch) for a in acts] for acts in ours] == \
        _torch_order("ScheduleInterleaved1F1B", lanes, v, m)
    clock_ticks(ours)  # cannot deadlock


@pytest.mark.parametrize("lanes,v,m", _cases("zbv"))
def test_zbv_runs_torch_s_order(lanes, v, m):
    ours = make_schedule("zbv", lanes * 2, m)
    assert [[(a.stage, a.kind.value, a.microbatch) for a in acts] for acts in ours] == \
        _torch_order("ScheduleZBVZeroBubble", lanes, 2, m)
    clock_ticks(ours)


def test_lanes_hold_the_stages_torch_puts_on_a_rank():
    assert lane_layout("interleaved", 8, 2) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert lane_layout("zbv", 6, 2) == ((0, 5), (1, 4), (2, 3))
    assert lane_layout("1f1b", 3, 1) == ((0,), (1,), (2,))
    assert virtual_of("zbv") == 2
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        virtual_of("interleaved")
    with pytest.raises(ValueError, match="runs 1 stage"):
        virtual_of("1f1b", 2)
    with pytest.raises(ValueError, match="even stage count of at least 4"):
        lane_layout("zbv", 6 + 1, 2)


def _lowered(name: str, lanes: int, v: int, m: int, recompute: bool):
    n = lanes * v
    topo = Topology.chain(n, [recompute] * n, lane_layout(name, n, v))
    return topo, lower(make_schedule(name, n, m, v), topo)


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
@pytest.mark.parametrize("recompute", [False, True])
def test_every_lowered_virtual_schedule_matches_its_messages_and_never_hangs(name, recompute):
    for lanes, v, m in _cases(name):
        topo, low = _lowered(name, lanes, v, m, recompute)
        sim = simulate(low, topo, lambda a: 1.0 if a.kind.is_compute else 0.0)
        assert len(sim.end) == sum(len(x) for x in low)
        for k, acts in enumerate(low):
            # once a step, once a lane; each stage's compute on its own lane
            assert [a.kind for a in acts].count(Kind.REDUCE) == 1
            assert {a.stage for a in acts} == set(topo.lanes[k])


def test_zbv_receives_follow_the_order_their_sender_sends():
    # lane 0 (stages 0, 3) sends lane 1 (stages 1, 2) forwards of stage 0 and gradients of
    # stage 3, interleaved in its own order; lane 1 posts the receives in that order
    topo, low = _lowered("zbv", 2, 2, 4, False)
    sent = [lab for a in low[0] for d, lab in messages_sent(a, topo) if d == 1 and a.microbatch
            is not None]
    got = [lab for a in low[1] for s, lab in messages_received(a, topo) if s == 0 and a.microbatch
           is not None]
    assert sent == got
    assert {lab[0] for lab in sent} == {"F", "B"}  # both kinds on one pair of lanes
    # the compute order is still torch's: receives moved, nothing else
    compute = [a for a in low[1] if a.kind.is_compute]
    assert compute == make_schedule("zbv", 4, 4)[1]


@pytest.mark.parametrize("lanes,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_interleaving_shortens_the_bubble_by_the_stages_a_lane(lanes, m):
    """Equal stages, a forward 1 and a backward 2 per half stage: 1F1B over ``lanes`` stages
    takes (m + P - 1) x 6, interleaved 1F1B over twice as many halves (m + (P - 1) / 2) x 6."""

    def makespan(name: str, n: int, v: int, f: float, b: float, w: float) -> float:
        lanes_ = lane_layout(name, n, v)
        topo = Topology.chain(n, None, lanes_)
        sched = make_schedule(name, n, m, v if v > 1 else None)
        split = any(a.kind is Kind.W for acts in sched for a in acts)
        dur = {Kind.F: f, Kind.B: b if split else b + w, Kind.W: w}
        return simulate(lower(sched, topo), topo, lambda a: dur.get(a.kind, 0.0)).makespan

    assert makespan("1f1b", lanes, 1, 2, 4, 0) == (m + lanes - 1) * 6
    assert makespan("interleaved", 2 * lanes, 2, 1, 2, 0) == (m + (lanes - 1) / 2) * 6
    # ZBV, backward split in halves: within P - 1 forwards of no bubble at all
    zbv = makespan("zbv", 2 * lanes, 2, 1, 1, 1)
    assert 6 * m <= zbv <= 6 * m + lanes - 1


def test_in_flight_per_stage_of_a_lane():
    # interleaved, 4 lanes of 2, m = 8: lane 0 fills with 10 forwards, all 8 of its first stage
    sched = make_schedule("interleaved", 8, 8, 2)
    assert [[in_flight(sched[p], s) for s in lane]
            for p, lane in enumerate(lane_layout("interleaved", 8, 2))] == \
        [[8, 4], [8, 4], [7, 3], [5, 1]]
    sched = make_schedule("zbv", 8, 8)
    assert [[in_flight(sched[p], s) for s in lane] for p, lane in enumerate(lane_layout("zbv", 8, 2))] \
        == [[8, 1], [7, 2], [6, 3], [5, 4]]


@pytest.mark.parametrize("name,lanes,v,m", [("interleaved", 2, 2, 4), ("interleaved", 3, 3, 6),
                                            ("zbv", 2, 2, 4), ("zbv", 4, 2, 3)])
def test_a_virtual_schedule_round_trips_through_torch_s_csv(name, lanes, v, m):
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule

    sched = make_schedule(name, lanes * v, m, v)
    text = schedule_csv(sched)
    assert schedule_from_csv(text) == sched
    rows = [[_Action.from_str(c) for c in line.split(",")] for line in text.splitlines()]
    actions = dict(enumerate(rows))
    mapping = _validate_schedule(actions, lanes, lanes * v, m)
    assert {s: mapping[s] for s in mapping} == {s: p for p, lane in
                                                enumerate(lane_layout(name, lanes * v, v))
                                                for s in lane}


def test_two_sources_on_one_lane_get_a_receive_each_in_their_sender_s_order():
    """ZBV, 4 stages, stage 0 also feeds stage 2 (a skip): stage 0's gradients come from
    stages 1 and 2, both on lane 1, which runs 2's backward first; one receive action for
    both would post them in the other order."""
    topo = Topology(
        num_stages=4,
        sends_to=(frozenset({1, 2}), frozenset({2}), frozenset({3}), frozenset()),
        grads_to=(frozenset(), frozenset({0}), frozenset({0, 1}), frozenset({2})),
        recompute=(False,) * 4,
        output_stages=frozenset({3}),
        lanes=lane_layout("zbv", 4, 2),
    )
    low = lower(make_schedule("zbv", 4, 4), topo)
    recv = [a for a in low[0] if a.kind is Kind.RECV_B and a.microbatch == 0]
    assert [str(a) for a in recv] == ["0RECV_B0<2", "0RECV_B0<1"]
    assert all(Action.parse(str(a)) == a for a in low[0] + low[1])
    simulate(low, topo, lambda a: 1.0 if a.kind.is_compute else 0.0)  # matches, no hang
    with pytest.raises(ValueError, match="only a receive names"):
        Action.parse("0F0<1")
