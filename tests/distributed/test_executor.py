"""StageExecutor on 1-4 forked gloo ranks against a deep-copied single-process reference.

Stage modules are made by hand (``tests/executor_cases.py``: ``symbolic_trace`` of small
wrappers holding the model's own submodules, under the model's attribute names) so the runtime
is tested before the compiler exists. Every rank checks the loss, its outputs, every local
gradient and, after Adam steps, every local parameter (rtol = atol = 1e-5)."""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.testing import assert_close

from rannc_fx.plan.config import Config
from rannc_fx.plan.plan import Plan
from rannc_fx.runtime import CommError, StageExecutor, init_distributed
from rannc_fx.runtime import outputs as outputs_module
from rannc_fx.runtime.comm import all_reduce_flat
from rannc_fx.runtime.outputs import unbatched_peers
from rannc_fx.schedules import routing
from tests.dist_utils import SharedRanks, run_ranks
from tests.executor_cases import CASES, LOCAL, TOL, Case

# -- the worker -----------------------------------------------------------------------------------


def _setup(
    rank: int, case: Case, plan: Plan, timeout_s: float = 10.0
) -> tuple[nn.Module, nn.Module, fx.GraphModule, StageExecutor]:
    torch.manual_seed(0)
    net = case.net()
    ref = copy.deepcopy(net)
    st = plan.stage_of_rank(rank)
    gm = fx.symbolic_trace(case.stages[st.index](net))
    for name, p in gm.named_parameters():
        assert p is net.get_parameter(name)  # the stage trains the model's own parameters
    return net, ref, gm, StageExecutor(plan, gm, timeout_s=timeout_s)


def _local(plan: Plan, rank: int, flat: list[torch.Tensor]) -> list[torch.Tensor]:
    lo, hi = routing.rank_span(plan, rank)
    return [
        t[lo:hi] if s.batch_dim is not None else t for t, s in zip(flat, plan.inputs, strict=True)
    ]


def _train(
    rank: int,
    world: int,
    name: str,
    replicas: tuple[int, ...],
    mbs: int,
    steps: int = 3,
    accumulate: int = 1,
    schedule: str = "gpipe",
    recompute: tuple[bool, ...] | None = None,
) -> list[list[Any]]:
    case = CASES[name]
    plan = case.plan(LOCAL * world, mbs, replicas, schedule=schedule, recompute=recompute)
    _, ref, gm, ex = _setup(rank, case, plan)
    params = list(gm.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    lo, hi = routing.rank_span(plan, rank)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            flat = case.data(plan.global_batch, torch.Generator().manual_seed(10 * step + micro))
            out = ex.forward(_local(plan, rank, flat))
            want = ref(*flat)
            assert len(out) == len(want)
            for j, (o, w) in enumerate(zip(out, want, strict=True)):
                spec = plan.outputs[j].spec
                assert_close(
                    o, w[lo:hi].detach() if spec.batch_dim is not None else w.detach(), **TOL
                )
            case.objective(out).backward()
            case.objective(want).backward()
            unbatched = [o for j, o in enumerate(out) if plan.outputs[j].spec.batch_dim is None]
            losses.append([o.tolist() for o in unbatched])
        for pname, p in gm.named_parameters():
            assert_close(
                p.grad,
                ref.get_parameter(pname).grad,
                **TOL,
                msg=lambda m, n=pname: f"grad {n}: {m}",
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for pname, p in gm.named_parameters():
            assert_close(
                p, ref.get_parameter(pname), **TOL, msg=lambda m, n=pname: f"param {n}: {m}"
            )
    return losses


def _same_everywhere(losses: list[list[list[Any]]]) -> None:
    """Every unbatched output (the loss) of every step is bitwise the same on every rank."""
    assert all(x == losses[0] for x in losses), losses


# -- tier 1: against the single-process reference ------------------------------------------------


# every case of _train (and _bn_buffers) below runs on ranks shared with the others of its
# world size (one launch each: the cases are small, start-up is most of their time)
SHARED = SharedRanks()
ONE_RANK = [1, 2, 3]  # micro-batches
TWO_STAGES = [((1, 1), 1), ((1, 1), 3), ((1, 1), 6), ((2, 1), 2), ((1, 2), 2), ((2, 1), 3),
              ((1, 2), 1), ((2, 2), 2), ((1, 3), 2), ((3, 1), 4)]
PURE_DATA_PARALLEL = [((2,), 1), ((2,), 3)]
SKIP = [((1, 1, 1), 2), ((1, 2, 1), 3), ((2, 1, 1), 2), ((1, 1, 2), 2)]
TIED = [((1, 1), 2), ((2, 1), 2), ((1, 2), 3), ((2, 2), 3)]
TIED_THREE = [((1, 1, 1), 2), ((2, 1, 1), 3)]
ROWS = [((1, 1), 2), ((2, 1), 3), ((1, 2), 2)]
UNBATCHED = [((2, 1), 2), ((1, 2), 3), ((2, 2), 3)]
BN_BUFFERS = [((2, 1), 2, "gpipe", None, per) for per in (False, True)] + [
    ((1, 1), 3, "gpipe", None, per) for per in (False, True)]


@pytest.mark.parametrize("mbs", ONE_RANK)
def test_one_rank(mbs):
    _same_everywhere(SHARED.result(_train, 1, "mlp1", (1,), mbs))


@pytest.mark.parametrize("replicas,mbs", TWO_STAGES)
def test_two_stages(replicas, mbs):
    _same_everywhere(SHARED.result(_train, sum(replicas), "mlp2", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", PURE_DATA_PARALLEL)
def test_pure_data_parallel(replicas, mbs):
    _same_everywhere(SHARED.result(_train, sum(replicas), "mlp1", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", SKIP)
def test_skip_connection_to_two_later_stages(replicas, mbs):
    _same_everywhere(SHARED.result(_train, sum(replicas), "skip3", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", TIED)
def test_tied_embedding_and_batched_output(replicas, mbs):
    _same_everywhere(SHARED.result(_train, sum(replicas), "lm2", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", TIED_THREE)
def test_tied_embedding_in_first_and_last_of_three_stages(replicas, mbs):
    _same_everywhere(SHARED.result(_train, sum(replicas), "lm3", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", ROWS)
def test_rows_per_sample_batch_dim_1_and_integer_cut(replicas, mbs):
    _same_everywhere(SHARED.result(_train, sum(replicas), "flat2", replicas, mbs))


@pytest.mark.parametrize("replicas,mbs", UNBATCHED)
def test_unbatched_outputs_of_two_stages(replicas, mbs):
    """Stage 0 returns an auxiliary loss and an integer count, stage 1 the loss: each stage's
    go to the other's ranks, so two ranks exchange them in both directions."""
    _same_everywhere(SHARED.result(_train, sum(replicas), "aux2", replicas, mbs))


def _loss_collectives(rank: int, world: int, name: str, replicas: tuple[int, ...]) -> None:
    """No collective over every rank for the loss: only a stage with replicas all-reduces it,
    among them; its sends outlive the forward and are finished by the backward."""
    case = CASES[name]
    plan = case.plan(LOCAL * world, 2, replicas)
    _, ref, _, ex = _setup(rank, case, plan)
    calls: list[tuple[int, ...]] = []

    def spy(tensors, group, *, what, ranks=(), **kw):
        calls.append(tuple(ranks))
        return all_reduce_flat(tensors, group, what=what, ranks=ranks, **kw)

    outputs_module.all_reduce_flat = spy  # this forked worker's copy of the module
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(2))
    loss = ex.forward(_local(plan, rank, flat))[0]
    assert_close(loss, ref(*flat)[0], **TOL)
    st = plan.stage_of_rank(rank)
    owner = st.index == plan.outputs[0].stage
    assert calls == ([st.ranks] if owner and st.replicas > 1 else []), calls
    sends_loss = bool(unbatched_peers(plan, rank)[0])
    assert (ex.outputs.sent is not None) == sends_loss
    loss.backward()
    assert ex.outputs.sent is None


@pytest.mark.parametrize(
    "name,replicas", [("mlp2", (1, 1)), ("mlp2", (1, 2)), ("lm3", (1, 1, 2)), ("mlp1", (2,))]
)
def test_loss_needs_no_collective_over_every_rank(name, replicas):
    run_ranks(_loss_collectives, sum(replicas), name, replicas)


def test_gradient_accumulation_over_two_calls():
    _same_everywhere(SHARED.result(_train, 3, "mlp2", (2, 1), 2, 2, 2))


def test_batchnorm_one_microbatch_is_exact():
    _same_everywhere(SHARED.result(_train, 2, "bn2", (1, 1), 1))
    SHARED.result(_bn_buffers, 2, (1, 1), 1)


@pytest.mark.parametrize("per_microbatch", [False, True])
@pytest.mark.parametrize("replicas,mbs", [((2, 1), 2), ((1, 1), 3)])
def test_batchnorm_buffers_with_microbatches(replicas, mbs, per_microbatch):
    SHARED.result(_bn_buffers, sum(replicas), replicas, mbs, "gpipe", None, per_microbatch)


def _sliced_running_var(plan: Plan, ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What stage 0's running_var must be after one step: (1 - momentum) * 1 + momentum *
    sum over micro-batches and replicas of share * (the slice's unbiased variance)."""
    with torch.no_grad():
        h = ref.conv(x)
    acc = torch.zeros(h.shape[1])
    for i in range(plan.micro_batches):
        for k in range(plan.stages[0].replicas):
            a, b = routing.replica_span(plan, 0, k, i)
            acc += (b - a) / plan.global_batch * h[a:b].var(dim=(0, 2, 3), unbiased=True)
    m = ref.bn.momentum
    return (1 - m) * torch.ones_like(acc) + m * acc


def _bn_buffers(
    rank: int,
    world: int,
    replicas: tuple[int, ...],
    mbs: int,
    schedule: str = "gpipe",
    recompute: tuple[bool, ...] | None = None,
    per_microbatch: bool = False,
) -> None:
    """One update per step: from the whole mini-batch's mean and unbiased variance, as
    single-device training makes it (``batch_norm="step"``), or with the sample-weighted mean
    of the slices' statistics (``"micro-batch"``: running_mean is still exact); replicas hold
    equal buffers, and num_batches_tracked counts steps."""
    case = CASES["bn2"]
    plan = case.plan(LOCAL * world, mbs, replicas, schedule=schedule, recompute=recompute)
    if per_microbatch:
        plan = plan.model_copy(update={"batch_norm": "micro-batch"})
    net, ref, gm, ex = _setup(rank, case, plan)
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(0))
    ex.forward(_local(plan, rank, flat))[0].backward()
    ref(*flat)
    if plan.stage_of_rank(rank).index != 0:
        return
    assert net.bn.num_batches_tracked.item() == 1
    assert_close(net.bn.running_mean, ref.bn.running_mean, **TOL)
    exact = (mbs == 1 and replicas[0] == 1) or not per_microbatch
    if exact:
        assert_close(net.bn.running_var, ref.bn.running_var, **TOL)
    else:  # one update with the sample-weighted mean of the slices' unbiased variances
        assert_close(net.bn.running_var, _sliced_running_var(plan, ref, flat[0]), **TOL)
    group = ex.groups.stage[0]
    if group is not None:
        got = [torch.empty_like(net.bn.running_var) for _ in range(replicas[0])]
        torch.distributed.all_gather(got, net.bn.running_var, group=group)
        assert all(torch.equal(g, got[0]) for g in got)


# -- behaviour around the step ----------------------------------------------------------------------


def _protocol(rank: int, world: int) -> None:
    case = CASES["mlp2"]
    plan = case.plan(LOCAL * world, 2, (1, 1))
    _, ref, gm, ex = _setup(rank, case, plan)
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(1))
    local = _local(plan, rank, flat)
    with torch.no_grad():  # evaluation: the loss comes back, nothing is kept for backward
        loss = ex.forward(local)[0]
        assert_close(loss, ref(*flat)[0], **TOL)
    assert not loss.requires_grad and ex._saved is None
    stale = ex.forward(local)[0]
    fresh = ex.forward(local)[0]
    with pytest.raises(RuntimeError, match="once per forward"):
        stale.backward()
    fresh.backward()
    with pytest.raises(RuntimeError, match="once per forward"):
        fresh.backward()
    with pytest.raises(ValueError, match=r"expects \(3, 6\) on each rank"):
        ex.forward([flat[0], flat[1]])


def test_eval_and_misuse_errors():
    run_ranks(_protocol, 2)


def _silent_peer(rank: int, world: int) -> str:
    case = CASES["mlp2"]
    plan = case.plan(LOCAL * world, 1, (1, 1))
    _, _, _, ex = _setup(rank, case, plan, timeout_s=1.5)  # the runtime's own groups' timeout
    if rank == 0:
        time.sleep(3.0)  # never runs its stage: rank 1 waits for its cut value in vain
        return ""
    flat = case.data(plan.global_batch, torch.Generator().manual_seed(1))
    with pytest.raises(CommError) as e:
        ex.forward(_local(plan, rank, flat))
    return str(e.value)


def test_timeout_names_the_peer_and_the_operation():
    msg = run_ranks(_silent_peer, 2, timeout_s=30)[1]
    # rank 1 waits first for the labels rank 0 holds, then for the cut value h
    assert "rank 1: recv of input 'y' of micro-batch 0 from rank 0 failed" in msg, msg
    assert "Timed out" in msg and "check its log" in msg


def _other_plan(rank: int, world: int) -> None:
    plan = CASES["mlp2"].plan(LOCAL * world, 1 + rank, (1, 1))  # micro-batches differ
    with pytest.raises(ValueError, match="holds a different plan"):
        _setup(rank, CASES["mlp2"], plan)


def test_ranks_must_hold_the_same_plan():
    run_ranks(_other_plan, 2)


def _from_torchrun_env(rank: int, world: int) -> list[float]:
    init_distributed(Config(timeout_s=5.0))
    assert torch.distributed.get_backend() == "gloo" and torch.distributed.get_rank() == rank
    a = torch.full((2,), float(rank + 1))
    b = torch.tensor([rank], dtype=torch.int64)
    ra, rb = all_reduce_flat([a, b], None, what="a test")
    assert rb.dtype == torch.int64 and int(rb) == sum(range(world))
    return ra.tolist()


def test_init_from_torchrun_environment_and_flat_all_reduce():
    assert run_ranks(_from_torchrun_env, 2, init=False) == [[3.0, 3.0]] * 2


def _alone(rank: int, world: int) -> int:
    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    init_distributed()
    return torch.distributed.get_world_size()


def test_init_without_torchrun_is_one_process():
    assert run_ranks(_alone, 1, init=False) == [1]


# the shared ranks' cases, all known before the first test asks for one
for _mbs in ONE_RANK:
    SHARED.add(_train, 1, "mlp1", (1,), _mbs)
for _name, _cases in (("mlp2", TWO_STAGES), ("mlp1", PURE_DATA_PARALLEL), ("skip3", SKIP),
                      ("lm2", TIED), ("lm3", TIED_THREE), ("flat2", ROWS), ("aux2", UNBATCHED)):
    for _replicas, _mbs in _cases:
        SHARED.add(_train, sum(_replicas), _name, _replicas, _mbs)
SHARED.add(_train, 3, "mlp2", (2, 1), 2, 2, 2)
SHARED.add(_train, 2, "bn2", (1, 1), 1)
SHARED.add(_bn_buffers, 2, (1, 1), 1)
for _case in BN_BUFFERS:
    SHARED.add(_bn_buffers, sum(_case[0]), *_case)
