"""The search pass against brute force and a Pareto-label oracle on random cost tables."""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import numpy as np
import pytest

from rannc_fx.passes.search import (
    CostTable,
    NoFeasiblePlan,
    SearchResult,
    SearchSpace,
    StageChoice,
    brute_force,
    evaluate,
    needed_sizes,
    samples_per_replica,
    search_pass,
)

GiB = 1024**3


# -- random tables -----------------------------------------------------------------------------
def _ranges(sizes: np.ndarray, uses: list[set[int]]) -> np.ndarray:
    """Bytes of blocks [i, j): the union of the parameters they use, each counted once."""
    B = len(uses)
    out = np.zeros((B, B + 1))
    for i in range(B):
        for j in range(i + 1, B + 1):
            out[i, j] = sum(sizes[p] for p in set().union(*uses[i:j]))
    return out


def random_table(rng: np.random.Generator, num_blocks: int, sizes: tuple[int, ...], *,
                 ints: bool = False, monotone: bool = False) -> CostTable:
    """Random costs; some parameters are shared between blocks, some have no gradient.

    ``monotone`` makes every per-sample cost grow with the samples (a profile's shape);
    otherwise costs at different sizes are unrelated. ``ints`` draws small integers (ties).
    """
    B, Q = num_blocks, max(1, len(sizes))

    def draw(*shape: int) -> np.ndarray:
        x = rng.uniform(0, 1, shape)
        if monotone:
            x = np.cumsum(x, axis=0)
        return np.round(4 * x) if ints else x

    cut = draw(Q, B + 1)
    cut[:, 0] = cut[:, B] = 0.0
    nparams = B + 2
    uses = [{b} for b in range(B)]
    for p in (B, B + 1):  # a tied embedding / head, and one shared by random neighbours
        a = int(rng.integers(0, B))
        uses[a].add(p)
        uses[int(rng.integers(a, B))].add(p)
    psize = draw(nparams) + 0.5
    frozen = np.where(rng.uniform(size=nparams) < 0.2, 0.0, 1.0)
    return CostTable(
        sizes=np.array(sizes or (1,)), fwd=draw(Q, B), bwd=draw(Q, B), act=draw(Q, B),
        workspace=draw(Q, B), cut=cut, param_bytes=_ranges(psize, uses),
        grad_bytes=_ranges(psize * frozen, uses),
        # the optimizer step and the gradient accumulation, each present about half the time
        optimizer_s=_ranges(draw(nparams) * frozen, uses) if rng.uniform() < 0.5 else None,
        accumulate_s=_ranges(draw(nparams) * frozen, uses) if rng.uniform() < 0.5 else None,
    )


def random_case(rng: np.random.Generator, max_blocks: int, max_world: int,
                ) -> tuple[CostTable, SearchSpace]:
    B = int(rng.integers(1, max_blocks + 1))
    W = int(rng.integers(1, max_world + 1))
    G = int(rng.integers(1, 4 * W + 5))
    mbs = tuple(int(m) for m in rng.choice(np.arange(1, 9), int(rng.integers(1, 4)),
                                           replace=False))
    stages = replicas = None
    pick = rng.uniform()
    if pick < 0.15:
        stages = int(rng.integers(1, min(B, W) + 2))  # one too many now and then
    elif pick < 0.3:
        cuts = sorted(rng.choice(np.arange(1, W), int(rng.integers(0, W)), replace=False))
        replicas = tuple(int(b - a) for a, b in zip([0, *cuts], [*cuts, W], strict=True))
    space = SearchSpace(world_size=W, global_batch=G, memory_budget=1.0,
                        link_bandwidth=float(rng.uniform(0.5, 5)),
                        optimizer_state_factor=float(rng.choice([0.0, 0.5, 2.0])),
                        micro_batches=mbs, stages=stages, replicas=replicas)
    table = random_table(rng, B, needed_sizes(space), ints=rng.uniform() < 0.3)
    scale = table.param_bytes[0, B] * 3 + table.act.sum() / 2 + 2
    return table, dataclasses.replace(
        space, memory_budget=float(rng.uniform(0.7, 2.5) * scale), **random_links(rng))


def random_links(rng: np.random.Generator) -> dict[str, float]:
    """Message latency and a separate all-reduce speed, each in about half the cases."""
    on = rng.uniform(size=2) < 0.5
    return dict(link_latency=float(on[0] * rng.uniform(0, 0.5)),
                allreduce_bandwidth=float(rng.uniform(0.2, 5)) if on[1] else None)


def outcome(fn, table: CostTable, space: SearchSpace) -> SearchResult | None:
    try:
        return fn(table, space)
    except NoFeasiblePlan:
        return None


def check_result(table: CostTable, space: SearchSpace, res: SearchResult) -> None:
    """Invariants every returned plan keeps."""
    st = res.stages
    assert st[0].start == 0 and st[-1].end == table.num_blocks
    assert all(a.end == b.start for a, b in zip(st, st[1:], strict=False))
    assert sum(s.replicas for s in st) == space.world_size
    assert res.micro_batches in space.micro_batches
    assert all(res.micro_batches * s.replicas <= space.global_batch for s in st)
    if space.stages is not None:
        assert len(st) == space.stages
    if space.replicas is not None:
        assert tuple(s.replicas for s in st) == space.replicas
    assert res.evaluation.fits
    # StageCost rounds each of its six parts to whole bytes: up to 3 bytes over in all
    assert all(c.memory <= space.memory_budget + 3 for c in res.evaluation.stages)
    assert evaluate(table, space, st, res.micro_batches) == res.evaluation


def compare(table: CostTable, space: SearchSpace, oracle=brute_force) -> bool:
    """search_pass and the oracle agree on feasibility and step time; True if feasible."""
    got, want = outcome(search_pass, table, space), outcome(oracle, table, space)
    assert (got is None) == (want is None), (space, got, want)
    if got is None or want is None:
        return False
    check_result(table, space, got)
    assert got.evaluation.step_s == pytest.approx(want.evaluation.step_s, rel=1e-9, abs=1e-12)
    return True


# -- the differential tests ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_small(seed: int) -> None:
    rng = np.random.default_rng(seed)
    feasible = sum(compare(*random_case(rng, 6, 5)) for _ in range(150))
    assert 30 < feasible < 140  # both outcomes are exercised


@pytest.mark.parametrize("seed", range(3))
def test_matches_brute_force_medium(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(12):
        table, space = random_case(rng, 10, 7)
        compare(table, space)


def pareto_oracle(table: CostTable, space: SearchSpace) -> SearchResult:
    """Exact optimum by labels (sum of t, max of u) per (block, ranks), no pruning.

    Costs come from the docstring's formulas written out again here, independently of the
    module. Free stage counts and replicas only.
    """
    B, W, G, bw = table.num_blocks, space.world_size, space.global_batch, space.link_bandwidth
    lat = space.link_latency
    kidx = {int(q): k for k, q in enumerate(table.sizes)}
    best: tuple[float, int, tuple[StageChoice, ...]] | None = None
    for m in space.micro_batches:
        labels: dict[tuple[int, int], list[tuple[float, float, tuple[StageChoice, ...]]]] = {
            (0, 0): [(0.0, 0.0, ())]}
        for j in range(1, B + 1):
            for n in range(1, W + 1):
                new = []
                for i in range(j):
                    for r in range(1, n + 1):
                        if m * r > G or not labels.get((i, n - r)):
                            continue
                        k = kidx[-(-G // (m * r))]
                        c = table.cut[k, i] + table.cut[k, j]
                        edges = (i > 0) + (j < B)
                        t = (table.fwd[k, i:j].sum() + table.bwd[k, i:j].sum() + 2 * c / bw
                             + 2 * lat * edges)
                        grad = table.grad_bytes[i, j]
                        mem = (table.param_bytes[i, j] + grad * (1 + space.optimizer_state_factor)
                               + m * (table.act[k, i:j].sum() + c) + table.workspace[k, i:j].max())
                        if mem > space.memory_budget:
                            continue
                        opt = 0 if table.optimizer_s is None else table.optimizer_s[i, j]
                        acc = 0 if table.accumulate_s is None else table.accumulate_s[i, j]
                        ar_bw = space.allreduce_bandwidth or bw
                        u = ((m - 1) * (t + acc) + 2 * (r - 1) / r * grad / ar_bw
                             + 2 * (r - 1) * lat + opt)
                        for s, mx, plan in labels[(i, n - r)]:
                            new.append((s + t, max(mx, u), (*plan, StageChoice(i, j, r))))
                new.sort(key=lambda x: (x[0], x[1]))
                front, low = [], math.inf
                for lab in new:  # keep the labels no other label beats on both
                    if lab[1] < low:
                        front.append(lab)
                        low = lab[1]
                labels[(j, n)] = front
        for s, mx, plan in labels.get((B, W), []):
            if best is None or s + mx < best[0]:
                best = (s + mx, m, plan)
    if best is None:
        raise NoFeasiblePlan("none")
    return SearchResult(best[1], best[2], evaluate(table, space, best[2], best[1]))


def test_matches_pareto_oracle_larger() -> None:
    """Tables too big to enumerate, where the pruning has more to cut."""
    rng = np.random.default_rng(7)
    for B, W in ((14, 6), (18, 5), (12, 8)):
        space = SearchSpace(world_size=W, global_batch=4 * W, memory_budget=1.0,
                            link_bandwidth=2.0, micro_batches=(1, 2, 4, 8))
        table = random_table(rng, B, needed_sizes(space), monotone=True)
        for frac in (0.25, 0.6):
            budget = frac * (table.param_bytes[0, B] * 3 + table.act.max(axis=0).sum() * 4)
            compare(table, dataclasses.replace(space, memory_budget=budget, **random_links(rng)),
                    pareto_oracle)


def transformer_like(num_blocks: int, space: SearchSpace, jitter: float = 0.0) -> CostTable:
    """Uniform layers between a big embedding and a big tied head, costs linear in samples."""
    B, rng = num_blocks, np.random.default_rng(0)
    q = np.array(needed_sizes(space), float)[:, None]
    per = np.ones(B)
    per[0], per[-1] = 0.2, 3.0
    per = per * (1 + jitter * rng.uniform(-1, 1, B))
    cut = np.zeros((len(q), B + 1))
    cut[:, 1:B] = q * 0.05
    params = np.full(B, 4.0)
    params[0] = 20.0
    uses = [{b} for b in range(B)]
    uses[-1].add(0)
    return CostTable(sizes=q[:, 0].astype(int), fwd=q * per, bwd=2 * q * per, act=q * per,
                     workspace=q * per / 4, cut=cut, param_bytes=_ranges(params, uses),
                     grad_bytes=_ranges(params, uses))


@pytest.mark.parametrize("jitter", [0.0, 0.01])
def test_transformer_like_against_brute_force(jitter: float) -> None:
    """Uniform layers give many exactly tied plans; ties must not lose the optimum."""
    for W, slack in ((4, 1.0), (6, 1.3), (5, 1e6)):
        space = SearchSpace(world_size=W, global_batch=16, memory_budget=0.0,
                            link_bandwidth=5.0, micro_batches=(1, 2, 4, 8))
        table = transformer_like(9, space, jitter)
        with pytest.raises(NoFeasiblePlan) as info:
            search_pass(table, space)
        budget = slack * info.value.largest_stage_bytes  # 1.0: just the least largest stage
        assert compare(table, dataclasses.replace(space, memory_budget=budget))


# -- the cost model ----------------------------------------------------------------------------
def test_needed_sizes() -> None:
    space = SearchSpace(world_size=4, global_batch=8, memory_budget=1, link_bandwidth=1,
                        micro_batches=(1, 2, 4))
    # m=1: 8 4 3 2; m=2: 4 2 2 1; m=4 (r <= 2): 2 1
    assert needed_sizes(space) == (1, 2, 3, 4, 8)
    forced = dataclasses.replace(space, replicas=(1, 3))
    # m=1: 8 3; m=2: 4 2; m=4: only r=1 -> 2
    assert needed_sizes(forced) == (2, 3, 4, 8)
    assert samples_per_replica(10, 3, 2) == 2


def test_evaluate_by_hand() -> None:
    # 3 blocks, 2 sizes; the plan is [0, 2) on 1 replica and [2, 3) on 2, with m = 2
    # and global batch 8: stage 0 has 4 samples per replica (size index 1), stage 1 has 2.
    table = CostTable(
        sizes=np.array([2, 4]),
        fwd=np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]),
        bwd=np.array([[2.0, 4.0, 6.0], [4.0, 8.0, 12.0]]),
        act=np.array([[10.0, 20.0, 30.0], [20.0, 40.0, 60.0]]),
        workspace=np.array([[5.0, 7.0, 1.0], [9.0, 3.0, 2.0]]),
        cut=np.array([[0.0, 1.0, 2.0, 0.0], [0.0, 2.0, 4.0, 0.0]]),
        param_bytes=np.array([[0, 100, 150, 400], [0, 0, 50, 300], [0, 0, 0, 250]], float),
        grad_bytes=np.array([[0, 100, 150, 300], [0, 0, 50, 200], [0, 0, 0, 200]], float),
    )
    space = SearchSpace(world_size=3, global_batch=8, memory_budget=1000, link_bandwidth=2.0,
                        optimizer_state_factor=2.0, micro_batches=(2,))
    ev = evaluate(table, space, (StageChoice(0, 2, 1), StageChoice(2, 3, 2)), 2)
    s0, s1 = ev.stages
    assert (s0.samples, s0.fwd_s, s0.bwd_s, s0.comm_s, s0.allreduce_s) == (4, 6, 12, 4, 0)
    assert (s0.params, s0.grads, s0.optimizer_state) == (150, 150, 300)
    assert (s0.activations, s0.comm_buffers, s0.workspace) == (120, 8, 9)
    assert (s1.samples, s1.fwd_s, s1.bwd_s, s1.comm_s, s1.allreduce_s) == (2, 3, 6, 2, 100)
    assert (s1.activations, s1.comm_buffers, s1.workspace, s1.memory) == (60, 4, 1, 915)
    # t = 22 and 11; step = 33 + max(1 * 22 + 0, 1 * 11 + 100)
    assert ev.step_s == 33 + 111
    assert ev.fits and s0.memory == 737

    # 0.5 s per message, all-reduces at half the link's speed, optimizer steps of the ranges
    opt = np.array([[0, 2, 3.5, 5.5], [0, 0, 1.5, 3.5], [0, 0, 0, 3]], float)
    table = dataclasses.replace(table, optimizer_s=opt)
    space = dataclasses.replace(space, link_latency=0.5, allreduce_bandwidth=1.0)
    s0, s1 = evaluate(table, space, (StageChoice(0, 2, 1), StageChoice(2, 3, 2)), 2).stages
    # one boundary each: 2 messages per micro-batch; stage 1's ring of 2 adds 2 messages
    assert (s0.comm_s, s0.allreduce_s, s0.optimizer_s) == (4 + 1, 0, 1.5 + 2)
    assert (s1.comm_s, s1.allreduce_s, s1.optimizer_s) == (2 + 1, 200 + 1, 2 + 1)
    # t = 23 and 12; step = 35 + max(23 + 3.5, 12 + 201 + 3)
    assert evaluate(table, space, (StageChoice(0, 2, 1), StageChoice(2, 3, 2)), 2).step_s == 251
    # micro-batch 2 adds its gradients into .grad: 15 s and 20 s
    acc = np.array([[0, 10, 15, 30], [0, 0, 5, 20], [0, 0, 0, 20]], float)
    table = dataclasses.replace(table, accumulate_s=acc)
    ev = evaluate(table, space, (StageChoice(0, 2, 1), StageChoice(2, 3, 2)), 2)
    assert [c.accumulate_s for c in ev.stages] == [15, 20]
    assert ev.step_s == 35 + max(23 + 15 + 3.5, 12 + 20 + 201 + 3)
    assert not evaluate(table, dataclasses.replace(space, memory_budget=914),
                        (StageChoice(0, 2, 1), StageChoice(2, 3, 2)), 2).fits
    with pytest.raises(ValueError, match="replicas sum"):
        evaluate(table, space, (StageChoice(0, 3, 2),), 2)
    with pytest.raises(ValueError, match="cover"):
        evaluate(table, space, (StageChoice(0, 1, 1), StageChoice(2, 3, 2)), 2)


def test_shared_parameter_counted_once() -> None:
    """A weight shared by blocks 1 and 2 counts once in a stage that holds both."""
    B = 4
    space = SearchSpace(world_size=2, global_batch=2, memory_budget=125.0, link_bandwidth=1.0,
                        optimizer_state_factor=0.0, micro_batches=(1,))
    uses = [{0}, {1, 4}, {2, 4}, {3}]
    psize = np.array([1.0, 1.0, 1.0, 1.0, 60.0])
    zeros = np.zeros((2, B))
    table = CostTable(sizes=np.array([1, 2]), fwd=zeros + 1, bwd=zeros + 1, act=zeros,
                      workspace=zeros, cut=np.zeros((2, B + 1)),
                      param_bytes=_ranges(psize, uses), grad_bytes=_ranges(psize, uses))
    ev = evaluate(table, space, (StageChoice(0, 1, 1), StageChoice(1, 4, 1)), 1)
    assert [c.params for c in ev.stages] == [1, 63] and not ev.fits  # 126 bytes > 125
    # Only blocks {0, 1} | {2, 3} fits: 62 + 62 bytes, the shared weight in both stages.
    res = search_pass(table, space)
    assert res.stages == (StageChoice(0, 2, 1), StageChoice(2, 4, 1))
    assert compare(table, space)


# -- infeasibility ------------------------------------------------------------------------------
def simple_table(num_blocks: int, global_batch: int) -> CostTable:
    """1 GiB of parameters per block (no gradients), activations of 0.1 GiB per sample."""
    B, q = num_blocks, np.arange(1, global_batch + 1, dtype=float)[:, None]
    ones = np.ones((len(q), B))
    params = np.triu(np.arange(B + 1)[None, :] - np.arange(B)[:, None]) * 0.25 * GiB
    return CostTable(sizes=q[:, 0].astype(int), fwd=ones * q, bwd=ones * q,
                     act=ones * q * 0.1 * GiB, workspace=ones * 0.0,
                     cut=np.zeros((len(q), B + 1)), param_bytes=params,
                     grad_bytes=np.zeros((B, B + 1)))


def test_no_feasible_plan_says_what_fits() -> None:
    # 4 blocks of 0.25 GiB plus 0.1 GiB per sample: at best two stages of 2 blocks and 8
    # samples, 0.5 + 1.6 GiB. 8 devices fit (4 stages x 2 replicas: 0.25 + 0.4 GiB), 7 do not.
    space = SearchSpace(world_size=2, global_batch=8, memory_budget=1.0 * GiB,
                        link_bandwidth=1.0, micro_batches=(1,))
    table = simple_table(4, 8)
    with pytest.raises(NoFeasiblePlan) as info:
        search_pass(table, space)
    e = info.value
    assert e.largest_stage_bytes == pytest.approx(2.1 * GiB)
    assert str(e).startswith("no plan fits 2 devices of 1.00 GiB: the best plan's largest "
                             "stage needs 2.10 GiB (1.10 GiB over). The smallest world size "
                             "that fits is 8;")
    assert e.world_size == 8
    search_pass(table, dataclasses.replace(space, world_size=8))
    with pytest.raises(NoFeasiblePlan):
        search_pass(table, dataclasses.replace(space, world_size=7))
    # the stage's memory at the least largest stage is exactly attainable
    search_pass(table, dataclasses.replace(space, memory_budget=e.largest_stage_bytes))
    assert "more micro-batches (global batch 8 allows up to 8) do not fit" in str(e)


def test_more_micro_batches_suggested() -> None:
    # workspace grows with samples and does not pile up over micro-batches: m=8 fits.
    table = simple_table(2, 8)
    table = dataclasses.replace(table, act=table.act * 0,
                                workspace=table.workspace + table.sizes[:, None] * 0.3 * GiB)
    space = SearchSpace(world_size=2, global_batch=8, memory_budget=1.0 * GiB,
                        link_bandwidth=1.0, micro_batches=(1, 2))
    with pytest.raises(NoFeasiblePlan, match=r"or use more micro-batches \(4 fit; global "
                                               r"batch 8 allows up to 8\)") as info:
        search_pass(table, space)
    assert info.value.micro_batches == 4
    search_pass(table, dataclasses.replace(space, micro_batches=(4,)))


@pytest.mark.parametrize("seed", range(4))
def test_smallest_world_size_is_exact_for_monotone_tables(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(6):
        B, W, G = int(rng.integers(2, 7)), int(rng.integers(1, 4)), 16
        space = SearchSpace(world_size=W, global_batch=G, memory_budget=1.0, link_bandwidth=1.0,
                            micro_batches=(1, 2))
        table = random_table(rng, B, tuple(range(1, G + 1)), monotone=True)
        static = max(table.param_bytes[b, b + 1] + 3 * table.grad_bytes[b, b + 1] for b in range(B))
        budget = float(static + rng.uniform(0.5, 3) * table.act.max())
        space = dataclasses.replace(space, memory_budget=budget)
        got = outcome(search_pass, table, space)
        if got is not None:
            continue
        with pytest.raises(NoFeasiblePlan) as info:
            search_pass(table, space)
        w = info.value.world_size
        if w is None:  # then nothing up to 64x fits
            assert outcome(search_pass, table, dataclasses.replace(space, world_size=16 * W)) \
                is None
            continue
        assert outcome(search_pass, table, dataclasses.replace(space, world_size=w)) is not None
        if w - 1 > W:
            assert outcome(search_pass, table, dataclasses.replace(space, world_size=w - 1)) \
                is None


def test_no_plan_exists() -> None:
    table = simple_table(3, 8)
    space = SearchSpace(world_size=4, global_batch=8, memory_budget=100 * GiB,
                        link_bandwidth=1.0, micro_batches=(1,), stages=4)
    with pytest.raises(NoFeasiblePlan, match="no plan of 4 ranks exists for 3 blocks"):
        search_pass(table, space)
    with pytest.raises(NoFeasiblePlan):
        brute_force(table, space)


def test_bad_space_is_a_value_error() -> None:
    table = simple_table(3, 8)
    space = SearchSpace(world_size=4, global_batch=8, memory_budget=GiB, link_bandwidth=1.0,
                        micro_batches=(1,))
    with pytest.raises(ValueError, match="sum to the world size 4"):
        search_pass(table, dataclasses.replace(space, replicas=(1, 2)))
    with pytest.raises(ValueError, match="no costs for"):
        search_pass(dataclasses.replace(table, sizes=table.sizes + 100), space)


# -- reproducibility and logging ----------------------------------------------------------------
def test_ties_prefer_fewer_stages_then_fewer_micro_batches() -> None:
    table = simple_table(5, 8)
    table = dataclasses.replace(table, fwd=table.fwd * 0, bwd=table.bwd * 0)
    space = SearchSpace(world_size=4, global_batch=8, memory_budget=100 * GiB,
                        link_bandwidth=1.0, micro_batches=(2, 1, 4))
    res = search_pass(table, space)
    assert res.evaluation.step_s == 0.0
    assert (res.micro_batches, res.stages) == (1, (StageChoice(0, 5, 4),))


def test_deterministic_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    space = SearchSpace(world_size=16, global_batch=64, memory_budget=400.0,
                        link_bandwidth=5.0, micro_batches=(1, 2, 4, 8, 16))
    table = transformer_like(48, space, jitter=0.01)
    with caplog.at_level(logging.INFO, logger="rannc_fx"):
        first = search_pass(table, space)
    second = search_pass(table, space)
    assert (first.micro_batches, first.stages) == (second.micro_batches, second.stages)
    check_result(table, space, first)
    line = [r.getMessage() for r in caplog.records if r.name == "rannc_fx"][0]
    assert re.fullmatch(
        r"searched 48 blocks x 16 ranks x 5 micro-batch counts in \d+\.\d s: "
        rf"{len(first.stages)} stages, m={first.micro_batches}, predicted "
        rf"{1e3 * first.evaluation.step_s:.1f} ms", line)
