"""StageExecutor in one process: where unbatched outputs go (``unbatched_peers``), a stage
module that disagrees with its plan, and a one-stage plan without a process group. The
hand-made stages and plans: ``tests/executor_cases.py``; on ranks: ``distributed/test_executor.py``."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.testing import assert_close

from rannc_fx.runtime import StageExecutor
from rannc_fx.runtime.outputs import unbatched_peers
from tests.executor_cases import CASES, LOCAL, MLP, TOL, _MlpBody, _Whole


@pytest.mark.parametrize(
    "replicas,want",
    [
        ((1, 1), {0: ([], {1: 1}), 1: ([0], {})}),
        ((1, 2), {0: ([], {1: 1}), 1: ([0], {}), 2: ([], {})}),
        ((2, 2), {0: ([], {1: 2}), 1: ([], {1: 3}), 2: ([0], {}), 3: ([1], {})}),
        ((1, 3), {0: ([], {1: 1}), 1: ([0], {}), 2: ([], {}), 3: ([], {})}),
        ((3, 1), {0: ([], {1: 3}), 1: ([], {1: 3}), 2: ([], {1: 3}), 3: ([0, 1, 2], {})}),
        ((2,), {0: ([], {}), 1: ([], {})}),
    ],
)
def test_loss_goes_from_its_stage_to_every_other_rank_round_robin(replicas, want):
    plan = CASES["mlp2" if len(replicas) == 2 else "mlp1"].plan(12, 1, replicas)
    assert {r: unbatched_peers(plan, r) for r in range(plan.world_size)} == want


def test_unbatched_outputs_of_two_stages_go_both_ways():
    plan = CASES["aux2"].plan(12, 1, (2, 1))  # stage 0 (ranks 0, 1) owns aux and n
    got = {r: unbatched_peers(plan, r) for r in range(3)}
    assert got == {0: ([2], {1: 2}), 1: ([], {1: 2}), 2: ([0, 1], {0: 0})}


def test_plan_and_module_must_agree():
    plan = CASES["mlp1"].plan(LOCAL, 1, (1,))
    gm = fx.symbolic_trace(_MlpBody(MLP()))  # takes x only; the plan's stage takes x and y
    with pytest.raises(ValueError, match="takes 1 inputs but the plan lists 2"):
        StageExecutor(plan, gm)


def test_one_stage_runs_without_a_process_group():
    case = CASES["mlp1"]
    plan = case.plan(LOCAL, 2, (1,))
    torch.manual_seed(0)
    net = case.net()
    ex = StageExecutor(plan, fx.symbolic_trace(_Whole(net)))
    flat = case.data(LOCAL, torch.Generator().manual_seed(0))
    loss = ex.forward(flat)[0]
    assert_close(loss, net(*flat)[0], **TOL)
    loss.backward()
    assert net.a.weight.grad is not None

