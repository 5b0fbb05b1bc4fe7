"""The search on a cluster of nodes (``rannc_fx.search.nodes``) against the independent
oracle: stages inside one node or over whole nodes, each boundary's messages at the link it
crosses, a replica group over nodes all-reducing hierarchically."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rannc_fx.search import (
    CostTable,
    NoFeasiblePlan,
    SearchResult,
    SearchSpace,
    StageChoice,
    evaluate,
    needed_sizes,
    search_pass,
)
from tests.search_oracle import across_nodes, placeable
from tests.unit.test_search import (
    _search_matches_oracle,
    compare,
    compare_pareto,
    random_case,
    random_table,
)


def node_case(rng: np.random.Generator, max_blocks: int = 6, max_world: int = 6
              ) -> tuple[CostTable, SearchSpace]:
    """A random case (``random_case``) whose ranks fill two or more nodes, with a network
    slower than the node's links or now and then faster (costed as fast as they are:
    ``nodes.crossing_s``); forced replicas over part of a node drawn again."""
    while True:
        table, space = random_case(rng, max_blocks, max_world, tight=0.5)
        sizes = [n for n in range(2, space.world_size) if space.world_size % n == 0]
        if not sizes:
            continue
        space = dataclasses.replace(
            space, devices_per_node=int(rng.choice(sizes)),
            network_bandwidth=space.link_bandwidth * float(rng.uniform(0.05, 1.5)),
            network_latency=space.link_latency + float(rng.uniform(0, 0.5)))
        if space.replicas is None or all(placeable(space, sum(space.replicas[:s]), r)
                                         for s, r in enumerate(space.replicas)):
            return table, space


def _crosses(space: SearchSpace, stages: tuple[StageChoice, ...]) -> tuple[bool, bool]:
    """Whether a boundary of the plan lies between nodes, and whether a stage's replicas
    span nodes."""
    N, first, boundary, spans = space.devices_per_node, 0, False, False
    for s, st in enumerate(stages):
        spans |= st.replicas > N
        boundary |= s > 0 and first % N == 0
        first += st.replicas
    return boundary, spans


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_across_nodes(seed: int) -> None:
    rng = np.random.default_rng(700 + seed)
    seen = {"plans": 0, "a boundary between nodes": 0, "replicas over nodes": 0}
    for it in range(70):
        table, space = node_case(rng)
        assert across_nodes(space)
        if it % 3 == 2:  # ZB-H1 too (the oracle's step and memory; not its figures)
            got = _search_matches_oracle(table, dataclasses.replace(
                space, schedules=("1f1b", "zbh1")))
        else:
            got, _ = compare(table, space)
        if got is None:
            continue
        seen["plans"] += 1
        boundary, spans = _crosses(space, got.stages)
        seen["a boundary between nodes"] += boundary
        seen["replicas over nodes"] += spans
    assert seen["plans"] > 20 and min(seen.values()) > 3, seen


def _pareto_above_the_least(table: CostTable, space: SearchSpace, slacks: tuple[float, ...]
                            ) -> list[tuple[SearchSpace, SearchResult | None]]:
    """The space (its budget 0: nothing fits) at each slack times the least largest stage
    the search reports, and the search's result there, held to the Pareto oracle's."""
    with pytest.raises(NoFeasiblePlan) as info:
        search_pass(table, space)
    spaces = [dataclasses.replace(space, memory_budget=k * info.value.largest_stage_bytes)
              for k in slacks]
    return [(sp, compare_pareto(table, sp)) for sp in spaces]


def test_matches_pareto_across_nodes_larger() -> None:
    """Tables too big to enumerate, on 8 and 12 ranks in nodes of 2, 3, 4 and 6."""
    rng = np.random.default_rng(11)
    for B, W, N in ((12, 8, 4), (10, 12, 3), (9, 12, 6), (12, 8, 2)):
        space = SearchSpace(world_size=W, global_batch=4 * W, memory_budget=0.0,
                            link_bandwidth=2.0, link_latency=0.01, micro_batches=(1, 2, 4, 8),
                            devices_per_node=N, network_bandwidth=0.3, network_latency=0.05)
        table = random_table(rng, B, tuple(range(1, 4 * W + 1)), monotone=True)
        table = dataclasses.replace(table, act=table.act * 4, cut=table.cut * 3)
        for _, got in _pareto_above_the_least(table, space, (1.05, 4.0)):
            assert got is not None


@pytest.mark.parametrize("fine_ranks, fine_nodes", [(4, 8), (4, 2)],
                         ids=["cluster counts", "whole nodes"])
def test_large_clusters_place_stages_in_cluster_counts_as_the_oracle_does(
        monkeypatch: pytest.MonkeyPatch, fine_ranks: int, fine_nodes: int) -> None:
    """Past ``FINE_RANKS`` ranks a stage's replicas are a divisor of a node or k whole nodes
    (k a power of two or divisor of the node count), past ``FINE_NODES`` nodes whole nodes
    only and the states count nodes: lowered here so that the oracle can enumerate such
    clusters, the search's optimum over those counts is the oracle's."""
    from rannc_fx.search import nodes

    monkeypatch.setattr(nodes, "FINE_RANKS", fine_ranks)
    monkeypatch.setattr(nodes, "FINE_NODES", fine_nodes)
    rng = np.random.default_rng(17)
    for B, W, N in ((8, 8, 2), (9, 12, 2), (8, 12, 4), (10, 12, 3), (8, 16, 4)):
        space = SearchSpace(world_size=W, global_batch=2 * W, memory_budget=0.0,
                            link_bandwidth=2.0, link_latency=0.01, micro_batches=(1, 2, 4),
                            devices_per_node=N, network_bandwidth=0.4, network_latency=0.05)
        assert nodes.coarse(space) == (W // N > fine_nodes)
        table = random_table(rng, B, tuple(range(1, 2 * W + 1)), monotone=True)
        table = dataclasses.replace(table, act=table.act * 4, cut=table.cut * 3)
        for sp, got in _pareto_above_the_least(table, space, (1.1, 3.0)):
            assert got is not None
            assert all(s.replicas in nodes.usable_replicas(sp) for s in got.stages)


@pytest.mark.parametrize("seed", range(2))
def test_pipelines_inside_nodes_or_over_them_match_the_oracle(seed: int) -> None:
    """rank_order='pipelines' (replica k's whole pipeline on consecutive ranks): each stage's
    replica group spread over the nodes, its boundaries inside a node where the pipeline
    fits in one, crossing after every N stages where it spans several; the search's optimum
    with those replicas forced is the brute-force oracle's."""
    rng = np.random.default_rng(900 + seed)
    done = 0
    for _ in range(60):
        table, space = node_case(rng)
        W, N = space.world_size, space.devices_per_node
        counts = [S for S in range(1, min(W, table.num_blocks) + 1)
                  if W % S == 0 and (N % S == 0 or S % N == 0)]
        S = int(rng.choice(counts))
        space = dataclasses.replace(space, replicas=(W // S,) * S, stages=None,
                                    rank_order="pipelines")
        try:
            sizes_ok = set(needed_sizes(space)) <= set(table.sizes.tolist())
        except ValueError:
            sizes_ok = False
        if not sizes_ok:
            continue
        got, _ = compare(table, space)  # brute force: budgets at the boundary allowed for
        done += got is not None
    assert done > 10, done


def _uniform(W: int) -> tuple[CostTable, SearchSpace]:
    space = SearchSpace(world_size=W, global_batch=4 * W, memory_budget=1e9,
                        link_bandwidth=300e9, link_latency=10e-6, micro_batches=(1,))
    table = random_table(np.random.default_rng(3), 4, tuple(range(1, 4 * W + 1)), monotone=True)
    return dataclasses.replace(table, grad_bytes=table.grad_bytes * 1e9,
                               param_bytes=table.param_bytes * 1e9), space


def test_a_replica_group_over_two_nodes_all_reduces_at_the_networks_rate() -> None:
    """16 ranks, one stage x 16: as 2 nodes of 8 the all-reduce crosses the network (each
    device's eighth of the gradients, at a ninth of NVLink's rate), slower than one flat
    group of 16 on NVLink, by the hierarchical formula; a group inside one node is as flat."""
    table, flat = _uniform(16)
    nodes = dataclasses.replace(flat, devices_per_node=8, network_bandwidth=50e9,
                                network_latency=15e-6)
    one = (StageChoice(0, 4, 16),)
    a = evaluate(table, flat, one, 1).stages[0].allreduce_s
    b = evaluate(table, nodes, one, 1).stages[0].allreduce_s
    G = float(table.grad_bytes[0, 4])
    inside = 7 / 8 * G / 300e9 + 7 * 10e-6
    across = 1 / 2 * G / 8 / 50e9 + 1 * 15e-6
    assert b == pytest.approx(2 * (inside + across), rel=1e-12)
    assert b > a == pytest.approx(2 * (15 / 16 * G / 300e9 + 15 * 10e-6), rel=1e-12)
    two = (StageChoice(0, 2, 8), StageChoice(2, 4, 8))  # each stage's group inside a node
    for st, c in zip(two, evaluate(table, nodes, two, 1).stages, strict=True):
        G = float(table.grad_bytes[st.start, st.end])
        assert c.allreduce_s == pytest.approx(2 * (7 / 8 * G / 300e9 + 7 * 10e-6), rel=1e-12)


def test_one_node_plans_are_unchanged() -> None:
    """A node as large as the world (or larger) is the flat space: the same plan and step."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        table, space = random_case(rng, 6, 5)
        try:
            flat = search_pass(table, space)
        except NoFeasiblePlan:
            continue
        for N in (space.world_size, space.world_size + 3):
            one = dataclasses.replace(space, devices_per_node=N, network_bandwidth=1e-3)
            got = search_pass(table, one)
            assert (got.stages, got.micro_batches, got.schedule) == (
                flat.stages, flat.micro_batches, flat.schedule)
            assert got.evaluation == flat.evaluation


def test_bad_nodes_are_refused_with_the_way_out() -> None:
    table, space = _uniform(16)
    nodes = dataclasses.replace(space, devices_per_node=8, network_bandwidth=50e9)
    with pytest.raises(ValueError, match=r"stage 1 on ranks 6\.\.15, over part of a node"):
        search_pass(table, dataclasses.replace(nodes, replicas=(6, 10)))
    with pytest.raises(ValueError, match="world size 16 is not a whole number of nodes of 6"):
        search_pass(table, dataclasses.replace(nodes, devices_per_node=6))
    with pytest.raises(ValueError, match="need the network's bandwidth"):
        search_pass(table, dataclasses.replace(nodes, network_bandwidth=None))
    with pytest.raises(ValueError, match=r"ranks 4\.\.11 lie over part of a node"):
        evaluate(table, nodes, (StageChoice(0, 2, 4), StageChoice(2, 3, 8),
                                StageChoice(3, 4, 4)), 1)


def test_partition_over_two_nodes_shows_each_ranks_node_and_pays_the_network() -> None:
    """The same model on 16 h100s as one stage x 16: as 2 nodes of 8 (the preset's DGX
    nodes) its all-reduce takes longer than in one node of 16 (fully sharded, its gathers
    and reduce-scatters), and the summary says which
    node each stage's ranks are on; planned for 8 ranks, the nodes change nothing."""
    import torch

    from rannc_fx import Config, partition

    with torch.device("meta"):  # 64 MiB of gradients: the all-reduce is its bytes, not latency
        model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4)))
    args = (torch.randn(32, 2048, device="meta"),)
    plans = {N: partition(model, args, world_size=16, device="h100-80gb",
                          config=Config(replicas=(16,), devices_per_node=N, zero=0)).plan
             for N in (8, 16)}
    two, one = plans[8], plans[16]
    assert two.stages[0].allreduce_ms > one.stages[0].allreduce_ms > 0
    # fully sharded (ZeRO-3), its gathers and reduce-scatters cross the network too
    full = {N: partition(model, args, world_size=16, device="h100-80gb",
                         config=Config(replicas=(16,), devices_per_node=N, zero=3)).plan
            for N in (8, 16)}
    assert [p.stages[0].zero for p in full.values()] == [3, 3]
    assert full[8].stages[0].scatter_ms > full[16].stages[0].scatter_ms > 0
    assert full[8].stages[0].fetch_ms > full[16].stages[0].fetch_ms > 0
    # ZeRO left to the search: the stage fits whole, so the chain alone keeps it whole; the
    # planner's pass over every stage fully sharded finds that faster and keeps it
    searched = partition(model, args, world_size=16, device="h100-80gb",
                         config=Config(replicas=(16,), devices_per_node=8)).plan
    assert searched.stages[0].zero == 3
    assert searched.predicted_step_ms == full[8].predicted_step_ms < two.predicted_step_ms
    assert "2 nodes of 8 devices" in two.summary() and "nodes of" not in one.summary()
    row = two.summary().splitlines()[3].split()
    assert row[-2:] == ["0-15", "0-1"], two.summary()
    small = [partition(model, args, world_size=8, device="h100-80gb",
                       config=Config(devices_per_node=N)).plan for N in (8, None)]
    assert small[0].stages == small[1].stages
    assert small[0].predicted_step_ms == small[1].predicted_step_ms


def test_the_search_lays_ranks_out_by_pipelines_where_that_is_faster() -> None:
    """16 h100s in 2 nodes of 8, 8 stages x 2 forced, of a model whose values between stages
    outweigh its parameters: stage by stage, the boundary in the middle crosses the network;
    by pipelines (each replica's 8 stages in one node) none does, and the replica groups'
    small all-reduce crosses instead. The search takes the pipelines, at a shorter step than
    the same stages laid out stage by stage; forced, each order gets its own layout. A model
    whose parameters outweigh its values keeps the layout stage by stage."""
    import torch

    from rannc_fx import Config, partition

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
    args = (torch.randn(64, 4096, 64, device="meta"),)

    def plan(order: str | None):  # noqa: ANN202
        cfg = Config(replicas=(2,) * 8, micro_batches=4, schedule="gpipe", rank_order=order)
        return partition(model, args, world_size=16, device="h100-80gb", config=cfg).plan

    free, stages, pipelines = plan(None), plan("stages"), plan("pipelines")
    assert stages.rank_order == "stages" and stages.stages[1].ranks == (2, 3)
    assert pipelines.rank_order == "pipelines" and pipelines.stages[1].ranks == (1, 9)
    assert pipelines.predicted_step_ms < stages.predicted_step_ms
    assert free.rank_order == "pipelines"
    assert free.predicted_step_ms == pipelines.predicted_step_ms
    assert max(st.comm_ms for st in pipelines.stages) < max(st.comm_ms for st in stages.stages)
    with torch.device("meta"):  # the other way round: parameters outweigh the values
        heavy = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8)))
    cfg = Config(replicas=(2,) * 8, micro_batches=4, schedule="gpipe")
    kept = partition(heavy, (torch.randn(32, 2048, device="meta"),), world_size=16,
                     device="h100-80gb", config=cfg).plan
    assert kept.rank_order == "stages"  # its replica groups all-reduce inside a node
    with pytest.raises(ValueError, match="the same replicas on every stage"):
        partition(model, args, world_size=16, device="h100-80gb",
                  config=Config(replicas=(4, 4, 2, 2, 2, 2), rank_order="pipelines"))
