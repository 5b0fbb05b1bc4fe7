"""Plans with several stages a lane (``planner/virtual.py``): interleaved 1F1B and ZBV on the
searched lanes, their balanced stage boundaries, and when the planner keeps them."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import rannc_fx
from examples.models import gpt_example
from rannc_fx.plan.config import Config
from rannc_fx.planner.virtual import balanced_stages
from rannc_fx.search.problem import CostTable, SearchSpace, StageChoice
from rannc_fx.search.terms import stage_terms
from tests.harness import test_config

WIDE = dict(d_model=512, layers=8, seq=512)  # analytic V100 costs: the same plan every run


def _plan(world: int = 4, **cfg: Any) -> rannc_fx.Plan:
    model, args, kwargs = gpt_example(batch=16, **WIDE)
    config = test_config(**cfg)
    return rannc_fx.partition(model, args, kwargs, world_size=world, device="v100-32gb",
                              config=config).plan


@pytest.mark.parametrize("schedule,lanes", [
    ("interleaved", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("zbv", [[0, 7], [1, 6], [2, 5], [3, 4]]),
])
def test_a_named_virtual_schedule_cuts_each_searched_lane_into_two_stages(schedule, lanes):
    one_f = _plan(stages=4, micro_batches=8, schedule="1f1b")
    plan = _plan(stages=4, micro_batches=8, schedule=schedule)
    assert plan.schedule == schedule and plan.virtual_stages == 2
    assert [list(x) for x in plan.lanes] == lanes
    assert len(plan.stages) == 8 and plan.world_size == 4
    for k, lane in enumerate(lanes):  # a lane's stages share its ranks
        assert {plan.stages[s].ranks for s in lane} == {(k,)}
    assert [s.first_block for s in plan.stages] == sorted(s.first_block for s in plan.stages)
    # no closed form: the predicted step is the simulated one
    assert plan.predicted_step_ms == plan.simulated_step_ms
    assert plan.simulated_step_ms < one_f.simulated_step_ms  # half the bubble, or less
    text = plan.summary()
    assert f"schedule {schedule} (2 stages a lane: {lanes})" in text
    # every lane fits: its stages' memory adds up
    assert all(sum(plan.stages[s].memory.total for s in lane) <= plan.memory_budget
               for lane in lanes)


def test_interleaving_more_stages_a_lane_shortens_the_fill_further():
    two = _plan(stages=2, micro_batches=8, schedule="interleaved", virtual_stages=2)
    four = _plan(stages=2, micro_batches=8, schedule="interleaved", virtual_stages=4)
    assert len(four.stages) == 8 and [list(x) for x in four.lanes] == [[0, 2, 4, 6],
                                                                      [1, 3, 5, 7]]
    assert four.simulated_step_ms < two.simulated_step_ms


def test_one_lane_and_named_schedules_stay_and_bad_settings_are_refused():
    assert _plan(world=1).virtual_stages == 1
    assert _plan(stages=4, micro_batches=8, schedule="1f1b").schedule == "1f1b"
    with pytest.raises(ValueError, match="virtual_stages=3 applies to schedule='interleaved'"):
        Config(schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match="one stage: there is no pipeline to interleave"):
        _plan(world=1, schedule="interleaved")


def test_zbv_with_recomputation_holds_what_r_rebuilt_until_w():
    plain = _plan(stages=4, micro_batches=8, schedule="zbv", recompute=False)
    rc = _plan(stages=4, micro_batches=8, schedule="zbv", recompute=True)
    assert all(st.recompute for st in rc.stages)

    def held(plan: rannc_fx.Plan, lane: tuple[int, ...]) -> int:
        return sum(plan.stages[s].memory.activations + plan.stages[s].memory.comm_buffers
                   for s in lane)

    # the first lane holds micro-batches long between F and B: recomputing keeps their inputs
    first, turn = rc.lanes[0], rc.lanes[-1]
    assert held(rc, first) < held(plain, first)
    # at the V's turn each B follows its F at once, and B and W are far apart: what W reads
    # of what R rebuilt waits there as long without recomputing, so recomputing saves little
    assert held(rc, first) < 0.5 * held(plain, first)
    assert 0.9 * held(plain, turn) < held(rc, turn) <= held(plain, turn)


@functools.cache
def _whole() -> int:
    """What the WIDE GPT's one-stage plan on 4 V100s needs of a device, its optimizer state
    sharded (ZeRO-1) and its parameters whole on each."""
    return _plan(world=4, zero=1).stages[0].memory.total


def _tight(world: int) -> dict[str, Any]:
    """A memory budget under which the search pipelines the WIDE GPT on ``world`` V100s: 0.3
    of what its one-stage plan on 4 ranks needs (fully sharded, ZeRO-3, a stage of several
    ranks would fit it: ZeRO as the search chose it before it had that)."""
    return dict(world=world, device_memory=int(0.3 * _whole()), memory_margin=0.0)


def test_interleaving_is_tried_on_other_lanes_than_the_searched_ones(monkeypatch):
    """The search pipelines the WIDE GPT on 8 lanes of one rank; the virtual schedules are
    also cut on fewer, wider lanes, and the plan is never longer than the one kept from the
    searched lanes alone. (Which one wins is a cost detail: on torch 2.13 interleaving on 4
    lanes of 2 ranks, on 2.15, which counts attention's FLOPs, plain 1F1B.)"""
    import rannc_fx.planner.virtual as virtual

    tight = {**_tight(8), "zero": 0}  # fully sharded, one stage of 8 would win
    tried: list[tuple[int, ...]] = []
    variant = virtual._variant

    def recording(a: Any, base: Any, schedule: str, v: int) -> Any:
        tried.append(tuple(st.replicas for st in base.stages))
        return variant(a, base, schedule, v)

    monkeypatch.setattr(virtual, "_variant", recording)
    plan = _plan(**tight)
    assert tried[0] == (1,) * 8 and (2,) * 4 in tried  # the searched lanes, then others
    choices = virtual.lane_choices
    monkeypatch.setattr(virtual, "lane_choices", lambda a, r: choices(a, r)[:1])
    tried.clear()
    searched = _plan(**tight)
    assert set(tried) == {(1,) * 8}
    assert plan.simulated_step_ms <= searched.simulated_step_ms
    if plan.lanes != searched.lanes:  # another lane layout wins only with several stages a lane
        assert plan.virtual_stages > 1 and len(plan.lanes) < 8


def test_the_bounds_that_skip_lanes_hold_and_skip_no_better_plan():
    """Every variant's simulated step is at least its bounds (``lanes.work_s`` before it is
    cut, ``lanes.step_bound`` after), so the plan ``virtual_variants`` keeps is the
    shortest of them all, built one by one."""
    from rannc_fx.plan.plan import lane_layout
    from rannc_fx.planner.analyze import analyze
    from rannc_fx.planner.build import build_plan
    from rannc_fx.planner.driver import run_search
    from rannc_fx.planner.lanes import lane_choices, step_bound, work_s
    from rannc_fx.planner.virtual import VIRTUAL, _variant, virtual_variants

    tight = _tight(8)
    model, args, kwargs = gpt_example(batch=16, **WIDE)
    a = analyze(model, args, kwargs, world_size=8, device="v100-32gb", config=test_config(
        device_memory=tight["device_memory"], memory_margin=0.0))
    # no stage fully sharded: a pipeline of eight stages of one rank, as the test needs
    a = replace(a, space=replace(a.space, full_shard=False))
    result = run_search(a.table, a.space)
    choices = lane_choices(a, result)
    assert len(choices) > 8 and choices[0].replicas == (1,) * 8
    steps = []
    for k, lanes in enumerate(choices):
        base = result if not k else replace(result, stages=tuple(
            StageChoice(0, 0, r) for r in lanes.replicas), micro_batches=lanes.m)
        for schedule, v in [("interleaved", v) for v in VIRTUAL] + [("zbv", 2)]:
            if v * len(lanes.replicas) > a.table.num_blocks:
                continue
            got = _variant(a, base, schedule, v)
            if got is None:
                continue
            step = 1e-3 * build_plan(a, got).simulated_step_ms
            bound = step_bound(got.evaluation, lane_layout(schedule, len(got.stages), v),
                               lanes.m, schedule == "zbv")
            assert bound <= step and (not k or work_s(a, lanes) <= step), (lanes, schedule, v)
            steps.append(step)
    assert len(steps) > 20
    plan = build_plan(a, result)
    kept = virtual_variants(a, result, plan, lambda r: build_plan(a, r))
    assert kept.simulated_step_ms == pytest.approx(min(plan.simulated_step_ms, 1e3 * min(steps)))


def test_lane_choices_are_the_searched_then_every_equal_split_by_their_work():
    from rannc_fx.planner.lanes import Lanes, lane_choices, work_s

    rng = np.random.default_rng(0)
    t = _table(rng, 6)
    a = SimpleNamespace(table=t.table, space=replace(t.space, micro_batches=(1, 2, 4, 8)))
    result = SimpleNamespace(stages=(StageChoice(0, 2, 3), StageChoice(2, 6, 1)),
                             micro_batches=2)
    got = lane_choices(a, result)
    assert got[0] == Lanes((3, 1), 2)
    # 4 ranks: 2 lanes of 2 (4 lanes of 1 would need 8 blocks for two stages each; the table
    # has 6), at each m whose 8 / (2 m) samples a replica the table has costs for (1, 2, 4)
    assert set(got[1:]) == {Lanes((2, 2), m) for m in (1, 2, 4)}
    assert [work_s(a, x) for x in got[1:]] == sorted(work_s(a, x) for x in got[1:])
    forced = SimpleNamespace(table=t.table, space=replace(a.space, stages=2))
    assert lane_choices(forced, result) == [Lanes((3, 1), 2)]


def test_a_named_virtual_schedule_that_does_not_fit_says_so():
    one_f = _plan(stages=4, micro_batches=8, schedule="1f1b")
    # 1F1B's first stage fits; a lane holding 8 micro-batches of its first stage does not
    budget = max(s.memory.total for s in one_f.stages)
    with pytest.raises(ValueError, match="schedule='interleaved' with 2 stages a lane does not "
                                         "fit the memory budget on the searched 4 lanes"):
        _plan(stages=4, micro_batches=8, schedule="interleaved", recompute=False,
              device_memory=budget, memory_margin=0.0)


def _table(rng: np.random.Generator, blocks: int) -> SimpleNamespace:
    sizes = np.array([1, 2, 4])
    q, b = len(sizes), blocks
    fwd = rng.uniform(0.5, 2.0, (q, b)) * sizes[:, None]
    cut = np.concatenate([np.zeros((q, 1)), rng.uniform(0, 1e6, (q, b - 1)), np.zeros((q, 1))],
                         axis=1)
    table = CostTable(sizes=sizes, fwd=fwd, bwd=2 * fwd, act=np.ones((q, b)),
                      workspace=np.zeros((q, b)), cut=cut, param_bytes=np.zeros((b, b + 1)),
                      grad_bytes=np.zeros((b, b + 1)))
    space = SearchSpace(world_size=4, global_batch=8, memory_budget=1e12, link_bandwidth=1e9)
    return SimpleNamespace(table=table, space=space)


@pytest.mark.parametrize("seed", range(5))
def test_balanced_boundaries_are_the_min_max_optimum_by_brute_force(seed):
    rng = np.random.default_rng(seed)
    blocks, replicas, recompute, m = 8, [1, 2, 1, 2], [False, True, False, False], 2
    a = _table(rng, blocks)
    got = balanced_stages(a, replicas, m, recompute)  # type: ignore[arg-type]
    assert got is not None and got[0][0] == 0 and got[-1][1] == blocks
    kidx = {1: 0, 2: 1, 4: 2}

    def time(i: int, j: int, r: int, rho: bool) -> float:
        k = kidx[-(-8 // (m * r))]
        t = stage_terms(a.table, a.space, k, np.array([i]), np.array([j]), np.zeros(1), m)
        return float(t.time(rho)[0])

    def worst(bounds: list[tuple[int, int]]) -> float:
        return max(time(i, j, r, rho) for (i, j), r, rho in zip(bounds, replicas, recompute,
                                                                strict=True))

    best = min(worst(list(itertools.pairwise((0, *cuts, blocks))))
               for cuts in itertools.combinations(range(1, blocks), len(replicas) - 1))
    assert worst(got) == pytest.approx(best, rel=1e-12)


def test_held_units_follow_the_lane_s_list_point_by_point():
    from rannc_fx.planner.virtual import held_units
    from rannc_fx.schedules.kinds import make_schedule

    # interleaved, 2 lanes of 2, 2 micro-batches: lane 0 runs 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    units = held_units(make_schedule("interleaved", 4, 2, 2)[0], (0, 2))
    assert max(u[0][1] + u[1][1] for u in units) == 4 and ((0, 2, 0), (0, 2, 0)) in units
    assert all(u[2] == 0 for us in units for u in us)  # no split backward
    # recomputing, a stage holds only inputs until B (the backward's activations are the
    # lane's one transient)
    rc = held_units(make_schedule("interleaved", 4, 2, 2)[0], (0, 2), [True, True])
    assert ((2, 0, 0), (2, 0, 0)) in rc and all(u[1] == 0 for us in rc for u in us)
    # ZBV, a split backward: from B to W a micro-batch holds what its W reads (the third
    # count); recomputing, its inputs until B, during B what R rebuilt
    lane = make_schedule("zbv", 4, 1)[1]  # 1F0 2F0 2B0 2W0 1B0 1W0
    assert [str(a) for a in lane] == ["1F0", "2F0", "2B0", "2W0", "1B0", "1W0"]
    assert held_units(lane, (1, 2)) == sorted({
        ((0, 0, 0), (0, 0, 0)), ((0, 1, 0), (0, 0, 0)), ((0, 1, 0), (0, 1, 0)),
        ((0, 1, 0), (0, 0, 1)), ((0, 0, 1), (0, 0, 0))})
    rc = held_units(lane, (1, 2), [True, True])
    assert ((1, 0, 0), (0, 1, 0)) in rc and ((1, 0, 0), (0, 0, 1)) in rc


def test_a_lane_s_memory_is_its_stages_at_the_peak_not_their_peaks_summed():
    from rannc_fx.plan.parts import MemoryEstimate
    from rannc_fx.search.evaluate import lane_memory
    from rannc_fx.search.problem import StageCost

    def cost(recompute: bool, ws: int) -> StageCost:
        return StageCost(samples=1, fwd_s=0, bwd_s=0, comm_s=0, allreduce_s=0, optimizer_s=0,
                         accumulate_s=0, recompute=recompute, memory=MemoryEstimate(
                             params=100, grads=10, optimizer_state=20, activations=0,
                             comm_buffers=0, workspace=ws))

    # activations, cuts in + out, out, (recomputing) what a backward rebuilds of both, and
    # what a micro-batch holds between a split B and its W
    per_mb = [(8.0, 2.0, 1.0, 8.0, 1.0, 3.0), (6.0, 2.0, 1.0, 6.0, 1.0, 2.0)]
    # (inputs only, whole, between B and W) per stage: stage 0 peaks at 2, stage 1 later at 2
    units = [((0, 0, 0), (0, 0, 0)), ((0, 2, 0), (0, 0, 0)), ((0, 1, 0), (0, 1, 0)),
             ((0, 0, 0), (0, 2, 0))]
    got = lane_memory([cost(False, 5), cost(False, 7)], per_mb, units)
    # peak: (2, 0): 2 x (8 + 2) = 20 (not 20 + 16); the larger workspace once
    assert [c.memory.activations for c in got] == [16, 0]
    assert [c.memory.comm_buffers for c in got] == [4, 0]
    assert sum(c.memory.total for c in got) == 2 * 130 + 20 + 7
    inputs_only = [tuple((w, 0, 0) for _, w, _ in us) for us in units]
    rc = lane_memory([cost(True, 0), cost(True, 0)], per_mb, inputs_only)
    # recomputing: each holds its inputs (c - o) per micro-batch, plus one backward's A + o
    assert sum(c.memory.activations + c.memory.comm_buffers for c in rc) == 2 * 1 + 8 + 1
    # selectively: each holds what it keeps (3 and 2 of 8 and 6) and its cut values per
    # micro-batch whole, plus the largest backward's rebuilt activations, once for the lane
    kept = [(3.0, 2.0, 1.0, 8.0, 0.0, 3.0), (2.0, 2.0, 1.0, 6.0, 0.0, 2.0)]
    sel = lane_memory([replace(cost(False, 0), selective=True)] * 2, kept, units)
    assert [c.memory.activations for c in sel] == [2 * 3 + 8, 0]
    assert [c.memory.comm_buffers for c in sel] == [2 * 2, 0]
    # split backwards: stage 0 holds 2 whole (2 x 10 = 20), or 1 whole and 2 between B and W
    # (10 + 2 x 3 = 16); stage 1, whose W reads 2 of its 6, 1 whole and 7 between (8 + 7 x 2
    # = 22): the lane's peak
    split = [((0, 2, 0), (0, 0, 0)), ((0, 1, 2), (0, 0, 0)), ((0, 0, 0), (0, 1, 7))]
    got = lane_memory([cost(False, 0), cost(False, 0)], per_mb, split)
    assert [c.memory.activations for c in got] == [0, 6 + 7 * 2]
    assert [c.memory.comm_buffers for c in got] == [0, 2]


def test_a_tensor_two_stages_of_a_lane_use_is_reduced_and_stepped_once():
    """ZBV's first lane holds the tied embedding's stage and the LM head's: the head's stage
    holds, reduces and steps nothing of it (what it has besides, it still does)."""
    from rannc_fx.plan.parts import MemoryEstimate
    from rannc_fx.search.evaluate import held_once
    from rannc_fx.search.problem import StageChoice, StageCost
    from rannc_fx.search.variants import allreduce_s

    space = SearchSpace(world_size=4, global_batch=8, memory_budget=1e9, link_bandwidth=1e3,
                        link_latency=1e-3)
    table = SimpleNamespace(shared=(((0, 3), 400.0, 400.0, 0.25),))

    def cost(grads: int, opt_s: float) -> StageCost:
        return StageCost(samples=1, fwd_s=0, bwd_s=0, comm_s=0, optimizer_s=opt_s,
                         allreduce_s=float(allreduce_s(space, np.array([grads]),
                                                       np.array([2]))[0]),
                         accumulate_s=0, memory=MemoryEstimate(
                             params=grads, grads=grads, optimizer_state=2 * grads,
                             activations=0, comm_buffers=0, workspace=0))

    lane = [StageChoice(0, 1, 2), StageChoice(3, 4, 2)]
    for extra, opt in ((0, 0.25), (100, 0.3)):  # the head alone, or with a bias of its own
        first, head = held_once(table, space, lane, [cost(500, 0.4), cost(400 + extra, opt)])
        assert first == cost(500, 0.4)  # the first user keeps it
        held = head.memory
        assert (held.params, held.grads, held.optimizer_state) == (extra, extra, 2 * extra)
        assert head.optimizer_s == pytest.approx(opt - 0.25)
        assert head.allreduce_s == pytest.approx(
            float(allreduce_s(space, np.array([extra]), np.array([2]))[0]) if extra else 0.0)
    # sharded over the lane's 2 replicas: each steps half of it
    sharded = [replace(st, zero=True) for st in lane]
    _, head = held_once(table, space, sharded, [cost(500, 0.2), cost(500, 0.3 / 2)])
    assert head.optimizer_s == pytest.approx(0.15 - 0.125)


def test_the_command_line_plans_a_named_virtual_schedule(tmp_path, capsys):
    from rannc_fx.__main__ import main as cli

    out = tmp_path / "plan.json"
    rc = cli(["plan", "examples.models:gpt_example", "--arg", "layers=4", "--meta", "--device",
              "v100-32gb", "--world-size", "4", "--global-batch", "64", "--stages", "2",
              "--micro-batches", "8", "--schedule", "interleaved", "--virtual-stages", "3",
              "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "schedule interleaved (3 stages a lane: [[0, 2, 4], [1, 3, 5]])" in text
    assert "memory per lane (its stages at their common peak): 0+2+4 " in text
    plan = rannc_fx.Plan.load(out)
    assert plan.virtual_stages == 3 and len(plan.stages) == 6 and len(plan.lanes) == 2
