"""ZB-H1 chosen where it pays (``planner/zb_choice.py``): the searched plan's stages under
the zero-bubble schedule, simulated, kept only where that is shorter and fits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import rannc_fx
from examples.models import gpt_example
from rannc_fx.plan.config import Config
from tests.harness import test_config

# layers long enough that a split backward's walk of the graph costs little next to them;
# analytic V100 costs, so that the choice is the same on every run
WIDE = dict(d_model=512, layers=8, seq=512)


def _example(small: bool = False) -> Any:
    return gpt_example(batch=16) if small else gpt_example(batch=16, **WIDE)


def _plan(world: int = 4, small: bool = False, **cfg: Any) -> rannc_fx.Plan:
    model, args, kwargs = _example(small)
    config = test_config(**cfg)
    return rannc_fx.partition(model, args, kwargs, world_size=world, device="v100-32gb",
                              config=config).plan


def test_the_search_keeps_the_shortest_simulated_schedule_and_zbh1_beats_1f1b():
    searched = _plan(stages=4, micro_batches=8)
    named = [("1f1b", None), ("zbh1", None), ("zbv", None),
             *(("interleaved", v) for v in (2, 3, 4))]
    forced = {(s, v): _plan(stages=4, micro_batches=8, schedule=s, virtual_stages=v)
              for s, v in named}
    shortest = min(forced, key=lambda k: forced[k].simulated_step_ms)
    assert (searched.schedule, searched.virtual_stages) == (shortest[0], shortest[1] or (
        2 if shortest[0] == "zbv" else 1))
    assert searched.simulated_step_ms == forced[shortest].simulated_step_ms
    zb, one_f = forced["zbh1", None], forced["1f1b", None]
    assert [s.first_block for s in zb.stages] == [s.first_block for s in one_f.stages]
    assert zb.simulated_step_ms < one_f.simulated_step_ms
    assert [zb.in_flight(s) for s in range(4)] == [4, 4, 4, 4]
    assert "schedule zbh1" in zb.summary()


def test_small_layers_stay_1f1b_where_the_split_costs_more_than_the_bubble():
    # the built-in LM's default width: a split backward's walk of the graph (per node) would
    # cost more than the bubble it fills
    searched = _plan(small=True, stages=4, micro_batches=8)
    zb = _plan(small=True, stages=4, micro_batches=8, schedule="zbh1")
    assert searched.schedule != "zbh1"
    assert zb.simulated_step_ms > searched.simulated_step_ms


def test_one_stage_stays_and_a_named_schedule_is_kept():
    assert _plan(world=1).schedule != "zbh1"
    assert _plan(stages=4, micro_batches=8, schedule="gpipe").schedule == "gpipe"
    assert _plan(stages=4, micro_batches=8, schedule="zbh1").schedule == "zbh1"


class _TwoLosses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h).pow(2).mean(), h.abs().mean()


def test_a_model_with_two_losses_never_runs_zbh1():
    config = test_config(stages=2, micro_batches=4)
    plan = rannc_fx.partition(_TwoLosses(), (torch.randn(16, 8),), world_size=2,
                              config=config).plan
    assert plan.schedule == "gpipe"


def test_a_named_zbh1_that_does_not_fit_says_so():
    model, args, kwargs = _example()
    base = _plan(stages=4, micro_batches=8, schedule="1f1b")
    # 1F1B's largest stage (the first, holding 4): ZB-H1's later stages hold more (4 in flight
    # each, counting to their W, and what their held-back W reads)
    budget = max(s.memory.total for s in base.stages)
    with pytest.raises(ValueError, match=r"schedule='zbh1' holds on each stage the micro-batches "
                                         r"its 1F1B order keeps in flight"):
        rannc_fx.partition(model, args, kwargs, world_size=4, device="v100-32gb", config=test_config(
            stages=4, micro_batches=8,
            schedule="zbh1", recompute=False, device_memory=budget, memory_margin=0.0))



def test_a_named_zbh1_is_searched_where_the_searched_stages_do_not_fit_it():
    """The search's own ZB-H1 plan: at the budget of 1F1B's largest stage (8 ranks, stages
    of 2 replicas, nothing sharded) ZB-H1 on the 1F1B plan searched there does not fit (its
    last stage holds the weight backwards held back), while the ZB-H1 search finds stages
    that shard, or offload, their optimizer state and fit."""
    from rannc_fx.planner.analyze import analyze
    from rannc_fx.planner.zb_choice import zbh1_evaluation
    from rannc_fx.search import search_pass

    model, args, kwargs = _example()

    def config(**kw: Any) -> Config:
        return test_config(micro_batches=8, **kw)

    base = rannc_fx.partition(model, args, kwargs, world_size=8, device="v100-32gb",
                              config=config(schedule="1f1b", zero=False)).plan
    budget = max(s.memory.total for s in base.stages)
    tight = config(device_memory=budget, memory_margin=0.0)
    a = analyze(model, args, kwargs, world_size=8, device="v100-32gb", config=tight)
    searched = search_pass(a.table, a.space)
    assert not zbh1_evaluation(a, searched.stages, searched.micro_batches).fits
    zb = rannc_fx.partition(model, args, kwargs, world_size=8, device="v100-32gb",
                            config=config(device_memory=budget, memory_margin=0.0,
                                          schedule="zbh1")).plan
    assert zb.schedule == "zbh1"
    assert all(s.memory.total <= budget for s in zb.stages)
    assert any(s.zero or s.offload for s in zb.stages)
    assert not any(s.recompute for s in zb.stages)


def test_a_named_zbh1_is_the_shorter_of_the_searched_and_the_searched_stages():
    """Both ZB-H1 candidates fit on 6 ranks, the search's own (2 stages, m=4) and the
    searched plan's one stage run as ZB-H1, with different steps: the planner keeps the
    shorter by the simulator."""
    from rannc_fx.planner.analyze import analyze
    from rannc_fx.planner.build import build_plan
    from rannc_fx.planner.zb_choice import _on_stages, searched, step_ms
    from rannc_fx.search import search_pass

    model, args, kwargs = _example()
    a = analyze(model, args, kwargs, world_size=6, device="v100-32gb",
                config=test_config())
    result = search_pass(a.table, a.space)

    def build(r: Any) -> rannc_fx.Plan:
        return build_plan(a, r)

    own, on = searched(a, build), _on_stages(a, result, build, [])
    assert own is not None and on is not None
    steps = sorted([step_ms(own), step_ms(on)])
    assert steps[0] < steps[1]
    assert _plan(world=6, schedule="zbh1").simulated_step_ms == steps[0]


def test_zbh1_runs_on_recomputing_stages_with_their_memory_counted():
    # ZB-H1 holds a recomputing stage's inputs until its B, what R rebuilt until its W
    plain = _plan(stages=4, micro_batches=8, schedule="zbh1", recompute=False)
    rc = _plan(stages=4, micro_batches=8, schedule="zbh1", recompute=True)
    assert rc.schedule == "zbh1" and all(s.recompute for s in rc.stages)
    mem = [s.memory.total for s in rc.stages]
    assert all(a < b for a, b in zip(mem[:3], (s.memory.total for s in plain.stages),
                                     strict=False))  # inputs only until B
    assert mem[3] == plain.stages[3].memory.total  # its B follows its F at once: nothing saved
    assert rc.simulated_step_ms > plain.simulated_step_ms  # a forward more per micro-batch


@pytest.mark.parametrize("S", range(1, 9))
def test_zbh1_memory_counted_off_its_lists_matches_the_oracle(S):
    from rannc_fx.planner.virtual import held_units
    from rannc_fx.schedules.kinds import make_schedule
    from tests.search_oracle import zbh1_held

    for m in range(1, 13):
        sched = make_schedule("zbh1", S, m)
        for s in range(S):
            points = {p[0][1:] for p in held_units(sched[s], [s], [False])}
            corners = zbh1_held(s, S, m)
            (f, _), (_, most) = corners
            assert all(c in points for c in corners), (S, m, s, sorted(points), corners)
            assert all(w <= f and p <= most and w + p <= min(m, S) for w, p in points), (
                S, m, s, sorted(points))
