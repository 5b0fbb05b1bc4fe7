"""A launch over several nodes on gloo ranks: the network measured apart from the links
inside a node, torchrun's ``LOCAL_WORLD_SIZE`` as the node size, and a plan whose stages
lie in different nodes training as one process does."""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import pytest

from examples.models import mlp_example
from rannc_fx.startup.probe import measure_link
from tests.dist_utils import run_ranks
from tests.harness import Run, train_against_reference
from tests.unit.test_links_and_optimizer import CPU


def _probe(rank: int, world: int) -> tuple[float, ...] | None:
    link = measure_link(CPU, rounds=3, large_rounds=2, node=2)
    if link is None:
        return None
    assert link.network_bandwidth is not None and link.network_latency is not None
    return (link.bandwidth, link.latency, link.allreduce_bandwidth, link.network_bandwidth,
            link.network_latency)


def test_over_nodes_the_network_is_measured_apart() -> None:
    """4 ranks in nodes of 2: rank 0 times rank 1 (its node), rank 2 (the next node's first)
    and an all-reduce over node 0's ranks; the others take part and get nothing."""
    got = run_ranks(_probe, 4)
    assert got[1:] == [None, None, None]
    assert got[0] is not None and all(math.isfinite(x) and x > 0 for x in got[0])


def _launched_on_two_nodes() -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # what torchrun sets on each of two nodes of 2


def _plan_over_nodes(run: Run) -> dict[str, Any]:
    plan = run.cm.plan
    return dict(node=plan.device.devices_per_node, network=plan.device.network_bandwidth,
                summary=plan.summary(), comm=[st.comm_ms for st in plan.stages])


def test_a_launch_over_two_nodes_plans_by_them_and_trains_like_one_process() -> None:
    """torchrun's LOCAL_WORLD_SIZE 2 of WORLD_SIZE 4: the plan is for two nodes of 2 (the
    network measured: not in the Config), its two stages one a node, their boundary on the
    network; three Adam steps match one process (loss and every parameter)."""
    got = train_against_reference(
        functools.partial(mlp_example, batch=8),
        dict(replicas=(2, 2), micro_batches=2, rank_order="stages"), 4, steps=3,
        setup=_launched_on_two_nodes, check=_plan_over_nodes)
    extra = got[0].extra
    assert extra["node"] == 2 and extra["network"] is not None and extra["network"] > 0
    assert "2 nodes of 2 devices" in extra["summary"], extra["summary"]
    rows = extra["summary"].splitlines()[3:5]
    assert rows[0].split()[-2:] == ["0-1", "0"] and rows[1].split()[-2:] == ["2-3", "1"], rows


def _pipelines(run: Run) -> dict[str, Any]:
    plan = run.cm.plan
    return dict(order=plan.rank_order, ranks=[st.ranks for st in plan.stages],
                summary=plan.summary())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelines_laid_out_one_a_node_train_like_one_process(schedule: str) -> None:
    """Two nodes of 2, each holding one replica's whole pipeline (rank_order='pipelines'):
    stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3, each stage's replica group across
    the nodes; three Adam steps match one process (loss and every parameter)."""
    got = train_against_reference(
        functools.partial(mlp_example, batch=8),
        dict(replicas=(2, 2), micro_batches=2, schedule=schedule, rank_order="pipelines",
             devices_per_node=2, network_bandwidth=5e8, network_latency=2e-5), 4, steps=3,
        check=_pipelines)
    extra = got[0].extra
    assert extra["order"] == "pipelines" and extra["ranks"] == [(0, 2), (1, 3)], extra
    assert "ranks by pipelines" in extra["summary"], extra["summary"]
    rows = extra["summary"].splitlines()[3:5]
    assert rows[0].split()[-2:] == ["0,2", "0-1"] and rows[1].split()[-2:] == ["1,3", "0-1"]
