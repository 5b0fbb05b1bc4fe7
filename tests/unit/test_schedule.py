"""Schedules as data, their lowering and their simulation: no processes."""

from __future__ import annotations

import itertools
import re

import pytest

import rannc_fx.schedules.generators as schedule_mod
import rannc_fx.schedules.lowering as lowering_mod
from rannc_fx.schedules.generators import (
    Action,
    Kind,
    clock_ticks,
    format_schedule,
    gpipe_schedule,
    in_flight,
    one_f_one_b_schedule,
)
from rannc_fx.schedules.kinds import make_schedule
from rannc_fx.schedules.lowering import Topology, format_lowered, lower, split_at_gather
from rannc_fx.schedules.simulate import (
    SPLIT_NODE_MS,
    SPLIT_OVERHEAD,
    ScheduleError,
    plan_durations,
    simulate,
)
from tests.dist_utils import make_plan, scalar, tensor

F, B, R, W = Kind.F, Kind.B, Kind.R, Kind.W


@pytest.mark.parametrize("text", ["1F0", "0W3", "2B13", "0RECV_F3", "3GATHER", "1SEND_B0"])
def test_an_action_parses_back_from_its_printed_form(text):
    assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("1X0")
    with pytest.raises(ValueError, match="runs once a step"):
        Action.parse("1REDUCE0")


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("mbs", [1, 2, 4, 7, 16])
def test_zbh1_splits_every_backward_and_holds_at_most_1f1b_s_peak(stages, mbs):
    sched = make_schedule("zbh1", stages, mbs)
    for s, actions in enumerate(sched):
        for i in range(mbs):  # F, then B, then W of every micro-batch, once each
            at = [a.kind for a in actions if a.microbatch == i]
            assert at == [F, B, W]
        # 1F1B's order of F and B
        assert [a for a in actions if a.kind is not W] == one_f_one_b_schedule(stages, mbs)[s]
        live = most = 0  # forwards whose W has not run: what the stage keeps something of
        for a in actions:
            live += {F: 1, W: -1}.get(a.kind, 0)
            most = max(most, live)
        assert most <= min(mbs, stages)


@pytest.mark.parametrize("stages,mbs", [(2, 4), (3, 4), (4, 8), (4, 4), (8, 32)])
def test_zbh1_takes_a_third_of_1f1b_s_bubble_when_f_b_and_w_cost_alike(stages, mbs):
    topo = Topology.chain(stages, [False] * stages)
    one_f = simulate(lower(one_f_one_b_schedule(stages, mbs), topo), topo,
                     lambda a: {F: 1.0, B: 2.0}.get(a.kind, 0.0)).makespan
    zb = simulate(lower(make_schedule("zbh1", stages, mbs), topo), topo,
                  lambda a: {F: 1.0, B: 1.0, W: 1.0}.get(a.kind, 0.0)).makespan
    assert one_f == 3 * mbs + 3 * (stages - 1)  # 1F1B's bubble: (S - 1)(F + B + W)
    # ZB-H1's: (S - 1)(F + B - W) in the paper's analysis, here one slot more at most
    assert 3 * mbs + (stages - 1) <= zb <= 3 * mbs + (stages - 1) + 1


def test_action_prints_compactly():
    assert str(Action(1, F, 0)) == "1F0"
    assert repr(Action(2, B, 13)) == "2B13"
    assert str(Action(0, Kind.RECV_F, 3)) == "0RECV_F3"
    assert str(Action(3, Kind.GATHER)) == "3GATHER"
    assert [str(a) for a in gpipe_schedule(2, 2)[1]] == ["1F0", "1F1", "1B1", "1B0"]
    assert [str(a) for a in one_f_one_b_schedule(2, 2)[0]] == ["0F0", "0F1", "0B0", "0B1"]


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("mbs", [1, 2, 4, 7])
def test_gpipe_is_fill_drain(stages, mbs):
    sched = gpipe_schedule(stages, mbs)
    assert len(sched) == stages
    for s, actions in enumerate(sched):
        assert all(a.stage == s for a in actions)
        assert [a.microbatch for a in actions if a.kind is F] == list(range(mbs))
        assert [a.microbatch for a in actions if a.kind is B] == list(reversed(range(mbs)))
        assert [a.kind for a in actions] == [F] * mbs + [B] * mbs
        assert in_flight(actions) == mbs


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("mbs", [1, 2, 4, 7])
def test_1f1b_holds_at_most_min_m_and_stages_left(stages, mbs):
    sched = one_f_one_b_schedule(stages, mbs)
    for s, actions in enumerate(sched):
        assert [a.microbatch for a in actions if a.kind is F] == list(range(mbs))
        assert [a.microbatch for a in actions if a.kind is B] == list(range(mbs))
        assert in_flight(actions) == min(mbs, stages - s)
        # a backward never comes before its own forward
        seen = set()
        for a in actions:
            assert a.kind is F or a.microbatch in seen
            seen.add(a.microbatch)
        # steady state: after the warm-up, forwards and backwards alternate
        warm = min(mbs, stages - s - 1)
        steady = [a.kind for a in actions[warm : warm + 2 * (mbs - warm)]]
        assert steady == [F, B] * (mbs - warm)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("mbs", [1, 3, 8])
def test_unit_ticks_take_two_m_plus_s_minus_one(name, stages, mbs):
    # both schedules take 2 * (m + n - 1) ticks when every action takes one
    tick = clock_ticks(make_schedule(name, stages, mbs))
    assert max(tick.values()) + 1 == 2 * (mbs + stages - 1)
    for a, t in tick.items():
        if a.kind is F and a.stage > 0:
            assert t > tick[Action(a.stage - 1, F, a.microbatch)]
        if a.kind is B and a.stage < stages - 1:
            assert t > tick[Action(a.stage + 1, B, a.microbatch)]


def _docstring_tables(doc: str) -> str:
    return "\n".join(line[4:] for line in doc.splitlines() if line.startswith("    "))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1"])
def test_format_schedule_is_the_docstring_table(name):
    text = format_schedule(make_schedule(name, 3, 4))
    assert text in _docstring_tables(schedule_mod.__doc__ or "")
    rows = format_schedule(make_schedule(name, 2, 2), [("rank 0", 0), ("rank 1", 0), ("rank 2", 1)])
    assert [line.split()[:2] for line in rows.splitlines()[1:]] == [
        ["rank", "0"], ["rank", "1"], ["rank", "2"]]


def test_unit_ticks_report_a_deadlock():
    # 0B0 waits on 1B0, 1B0 on 1F0, 1F0 on 0F0, and 0F0 comes after 0B0 on stage 0.
    bad = [[Action(0, B, 0), Action(0, F, 0)], [Action(1, F, 0), Action(1, B, 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        clock_ticks(bad)


def test_bad_sizes_and_names():
    with pytest.raises(ValueError, match="at least one"):
        gpipe_schedule(0, 2)
    with pytest.raises(ValueError, match="at least one"):
        one_f_one_b_schedule(2, 0)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        make_schedule("zb", 2, 2)


# -- lowering ------------------------------------------------------------------------------------


def test_lowering_is_the_docstring_example():
    low = lower(gpipe_schedule(2, 2), Topology.chain(2, [False, True]))
    assert format_lowered(low) in _docstring_tables(lowering_mod.__doc__ or "")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,mbs", [(1, 1), (2, 3), (3, 2), (4, 6)])
def test_lowering_rules(name, stages, mbs):
    recompute = [s % 2 == 1 for s in range(stages)]
    low = lower(make_schedule(name, stages, mbs), Topology.chain(stages, recompute))
    for s, acts in enumerate(low):
        kinds = [a.kind for a in acts]
        assert kinds[0] is Kind.SCATTER and kinds[-1] is Kind.REDUCE
        assert kinds.count(Kind.GATHER) == 1
        compute = [a for a in acts if a.kind in (F, B)]
        assert compute == make_schedule(name, stages, mbs)[s]  # order kept
        for i in range(mbs):
            pos = {a.kind: p for p, a in enumerate(acts) if a.microbatch == i}
            assert (R in pos) == recompute[s]
            if recompute[s]:
                assert pos[R] == pos[B] - 1 or acts[pos[B] - 1].kind is Kind.RECV_F
                assert pos[R] < pos[B]
            if s > 0:
                assert pos[Kind.RECV_F] < pos[F] and pos[Kind.SEND_B] > pos[B]
            if s < stages - 1:
                assert pos[Kind.SEND_F] == pos[F] + 1 and pos[Kind.RECV_B] < pos[B]
        # receives never cross a once-a-step action
        gather = kinds.index(Kind.GATHER)
        first, rest = split_at_gather(acts)
        assert len(first) == gather + 1 and first + rest == acts
        for a in first:
            assert a.kind is not Kind.RECV_B or any(b.kind is B for b in first)
    # fill-drain returns at GATHER with every backward still to run
    if name == "gpipe" or mbs == 1 or stages == 1:
        for acts in low:
            assert not any(a.kind is B for a in split_at_gather(acts)[0])


def test_receives_are_posted_one_compute_action_early():
    low = lower(one_f_one_b_schedule(3, 4), Topology.chain(3))
    middle = [str(a)[1:] for a in low[1]]
    # RECV_F1 is posted before F0 runs, RECV_B0 before F1, RECV_F2 before B0, ...
    assert middle[:9] == ["SCATTER", "RECV_F0", "RECV_F1", "F0", "SEND_F0", "RECV_B0", "F1",
                          "SEND_F1", "RECV_F2"]


# -- simulation ----------------------------------------------------------------------------------


def _unit(f: float = 1.0, b: float = 2.0, r: float = 1.0):
    return lambda a: {F: f, B: b, R: r}.get(a.kind, 0.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,mbs", itertools.product(range(1, 6), range(1, 9)))
def test_uniform_stages_take_m_plus_s_minus_one_slots(name, stages, mbs):
    topo = Topology.chain(stages)
    sim = simulate(lower(make_schedule(name, stages, mbs), topo), topo, _unit())
    assert sim.makespan == (stages + mbs - 1) * 3


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,mbs", [(1, 3), (2, 2), (3, 4), (4, 8)])
def test_recomputation_adds_a_forward_per_backward(name, stages, mbs):
    topo = Topology.chain(stages, [True] * stages)
    sim = simulate(lower(make_schedule(name, stages, mbs), topo), topo, _unit())
    # every slot takes f + r + b; an R needs no message, so each stage but the last runs its
    # first R while it waits for the first gradient
    assert sim.makespan == (stages + mbs - 1) * 4 - (stages - 1)


def test_a_bottleneck_stage_sets_the_steady_state():
    # stage 1 of 3 takes 3x (t = 3 + 6), the others t = 1 + 2; 5 micro-batches
    def dur(a):
        k = 3.0 if a.stage == 1 else 1.0
        return {F: k, B: 2 * k}.get(a.kind, 0.0)

    topo = Topology.chain(3)
    gpipe = simulate(lower(gpipe_schedule(3, 5), topo), topo, dur).makespan
    assert gpipe == (3 + 9 + 3) + 4 * 9  # sum of t + (m - 1) * t_max
    # 1F1B hides stage 2's round trip for the last micro-batch behind stage 1's previous
    # backward: stage 0's F0, stage 1's 5 slots, stage 0's last B
    one_f_one_b = simulate(lower(one_f_one_b_schedule(3, 5), topo), topo, dur).makespan
    assert one_f_one_b == 1 + 5 * 9 + 2


def test_simulation_finds_a_hang():
    topo = Topology.chain(2)
    # stage 0 waits for the gradient of micro-batch 0 before it has sent the forward
    low = [[Action(0, Kind.SCATTER), Action(0, Kind.RECV_B, 0), Action(0, B, 0),
            Action(0, F, 0), Action(0, Kind.SEND_F, 0), Action(0, Kind.GATHER),
            Action(0, Kind.REDUCE)],
           [Action(1, Kind.SCATTER), Action(1, Kind.RECV_F, 0), Action(1, F, 0),
            Action(1, B, 0), Action(1, Kind.SEND_B, 0), Action(1, Kind.GATHER),
            Action(1, Kind.REDUCE)]]
    with pytest.raises(ScheduleError, match="hangs: 0B0"):
        simulate(low, topo, _unit())


def test_simulation_finds_messages_posted_out_of_order():
    topo = Topology.chain(2)
    low = lower(gpipe_schedule(2, 2), topo)
    # stage 1 posts the receive for micro-batch 1 before micro-batch 0's
    a, b = low[1].index(Action(1, Kind.RECV_F, 0)), low[1].index(Action(1, Kind.RECV_F, 1))
    low[1][a], low[1][b] = low[1][b], low[1][a]
    with pytest.raises(ScheduleError, match=re.escape(
            "lane 0 sends F0 (0->1), F1 (0->1) to lane 1 where it posts receives for F1 (0->1), "
            "F0 (0->1)")):
        simulate(low, topo, _unit())


def test_outputs_on_two_stages_and_shared_parameters_do_not_hang():
    # stage 0 holds an auxiliary output, the last stage the loss; stages 0 and 2 share a weight
    topo = Topology(
        num_stages=3,
        sends_to=(frozenset({1, 2}), frozenset({2}), frozenset()),
        grads_to=(frozenset(), frozenset({0}), frozenset({0, 1})),
        recompute=(False, True, False),
        output_stages=frozenset({0, 2}),
        shared=(frozenset({0, 2}),),
    )
    for name in ("gpipe", "1f1b"):
        low = lower(make_schedule(name, 3, 4), topo)
        sim = simulate(low, topo, _unit())
        reduce = [sim.start[Action(s, Kind.REDUCE)] for s in range(3)]
        assert reduce[0] == reduce[2]  # one collective: both start together


def test_plan_durations_price_every_action_from_the_plan():
    values = {"x": tensor("x", (1, 6)), "y": tensor("y", (1,), dtype="int64"),
              "h": tensor("h", (1, 8), requires_grad=True), "loss": scalar("loss")}
    plan = make_plan(global_batch=8, micro_batches=4, replicas=(1, 1), values=values,
                     inputs=["x", "y"], stage_io=[(["x"], ["h"]), (["h", "y"], ["loss"])],
                     outputs=["loss"], schedule="1f1b", recompute=[True, False])
    plan = plan.model_copy(update={"stages": tuple(
        st.model_copy(update={"comm_ms": 2.0, "accumulate_ms": 0.5, "allreduce_ms": 3.0,
                              "optimizer_ms": 1.0}) for st in plan.stages)})
    from rannc_fx.schedules.lowering import topology_of

    topo = topology_of(plan)
    low = lower(make_schedule(plan.schedule, 2, 4), topo)
    dur = plan_durations(plan, low)
    assert dur(Action(0, F, 0)) == pytest.approx(1e-3 * (1.0 + 1.0))
    assert dur(Action(0, R, 2)) == pytest.approx(1e-3 * 1.0)
    assert dur(Action(0, B, 0)) == pytest.approx(1e-3 * (2.0 + 1.0))  # the first: no add
    assert dur(Action(0, B, 1)) == pytest.approx(1e-3 * (2.0 + 1.0 + 0.5))
    assert dur(Action(1, Kind.REDUCE)) == pytest.approx(1e-3 * 4.0)
    assert dur(Action(1, Kind.SEND_F, 0)) == 0.0
    assert simulate(low, topo, dur).makespan > 0
    # split backwards: half the backward each and what splitting costs, the accumulation in W
    low = lower(make_schedule("zbh1", 2, 4), topo)
    dur = plan_durations(plan, low)
    half = 1.0 * (1 + SPLIT_OVERHEAD)
    walk = SPLIT_NODE_MS * plan.stages[1].num_nodes  # B walks the autograd graph
    assert dur(Action(1, B, 1)) == pytest.approx(1e-3 * (half + walk + 1.0))
    assert dur(Action(1, W, 1)) == pytest.approx(1e-3 * (half + 0.5))
    assert dur(Action(1, W, 0)) == pytest.approx(1e-3 * half)
    # the first stage's inputs need no gradient: its B makes nothing, its W the whole backward
    assert dur(Action(0, B, 1)) == pytest.approx(1e-3 * 1.0)
    assert dur(Action(0, W, 1)) == pytest.approx(1e-3 * (2.0 + 0.5))
    # a stage whose parameters are mostly frozen (LoRA) has little weight gradient to defer
    frozen = plan.model_copy(update={"stages": tuple(
        st.model_copy(update={"memory": st.memory.model_copy(update={"params": 1000,
                                                                      "grads": 100})})
        for st in plan.stages)})
    dur = plan_durations(frozen, low)
    assert dur(Action(1, W, 0)) == pytest.approx(1e-3 * 2.0 * 0.05 * (1 + SPLIT_OVERHEAD))
    assert dur(Action(1, B, 0)) == pytest.approx(
        1e-3 * (2.0 * 0.95 * (1 + SPLIT_OVERHEAD) + walk + 1.0))


def test_plan_grid_has_a_row_per_rank():
    from rannc_fx.runtime import plan_grid

    values = {"x": tensor("x", (1, 6)), "y": tensor("y", (1,), dtype="int64"),
              "h": tensor("h", (1, 8), requires_grad=True), "loss": scalar("loss")}
    plan = make_plan(global_batch=12, micro_batches=4, replicas=(2, 1), values=values,
                     inputs=["x", "y"], stage_io=[(["x"], ["h"]), (["h", "y"], ["loss"])],
                     outputs=["loss"], schedule="1f1b")
    lines = plan_grid(plan).splitlines()
    assert [line.split()[:3] for line in lines[1:]] == [
        ["rank", "0", "0F0"], ["rank", "1", "0F0"], ["rank", "2", "."]]
    # the ranks of stage 0 run 1F1B's warm-up forward, then alternate
    assert lines[1].split()[2:] == ["0F0", "0F1", ".", "0B0", "0F2", "0B1", "0F3", "0B2", ".",
                                    "0B3"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1"])
@pytest.mark.parametrize("stages,mbs", [(1, 1), (2, 4), (4, 8)])
def test_a_schedule_round_trips_through_torch_s_csv_format(name, stages, mbs):
    from torch.distributed.pipelining.schedules import _Action

    from rannc_fx.schedules.csv_format import schedule_csv, schedule_from_csv

    sched = make_schedule(name, stages, mbs)
    text = schedule_csv(sched)
    assert schedule_from_csv(text) == sched
    rows = [line.split(",") for line in text.splitlines()]
    for s, row in enumerate(rows):  # torch's own parser reads every cell
        for cell in row:
            act = _Action.from_str(cell)
            assert act.stage_index == s
            assert act.computation_type.value == ("I" if name == "zbh1" and cell[len(str(s))]
                                                  in "BI" else cell[len(str(s))])
    if name == "zbh1":
        assert "0I0" in rows[0] and "0W0" in rows[0]
    # torch's own check of a schedule accepts it: every stage's F, then B (or I, then W)
    from torch.distributed.pipelining.schedules import _validate_schedule

    actions = {s: [_Action.from_str(c) for c in row] for s, row in enumerate(rows)}
    assert _validate_schedule(actions, stages, stages, mbs) == {s: s for s in range(stages)}


def test_a_torch_csv_with_a_lost_weight_backward_or_another_stage_is_refused():
    from rannc_fx.schedules.csv_format import schedule_from_csv

    with pytest.raises(ValueError, match=r"row 0, \(stage, micro-batch\) \[\(0, 1\)\]: .* "
                                         r"needs its W"):
        schedule_from_csv("0F0,0F1,0I0,0W0,0I1\n")
    with pytest.raises(ValueError, match="an action of stage 1, which row 0 runs"):
        schedule_from_csv("1F0,0F0\n1B0,0B0\n")
    with pytest.raises(ValueError, match="'compute_only' format"):
        schedule_from_csv("0F0,0SEND_F0,0B0\n")
