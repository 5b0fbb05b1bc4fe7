"""ZeRO-1 inside a stage (``runtime/zero.py``): each replica keeps the optimizer state of its
share and the replicas all-gather the stepped parameters; ZeRO-2 (``runtime/grad_shards.py``)
also reduce-scatters the gradients to their owners; the training is the one process's
(loss and every parameter after several Adam steps), with clipping, recomputation, both
schedules, unequal replica counts and a tied embedding; checkpoints cross between sharded
and unsharded plans."""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.testing import assert_close

import rannc_fx
from examples.models import mlp_example
from rannc_fx.runtime import comm, grad_shards
from rannc_fx.runtime.zero import shard_of
from tests.dist_utils import run_ranks
from tests.distributed.test_checkpoint import _local
from tests.harness import LINK, Run, optimizer, test_config, train_against_reference
from tests.unit.test_checkpoint import _adam, _data  # the tied-embedding LM and its Adam
from tests.unit.test_zero import TOL

STEPS = 3


def _step(model: Any, opt: torch.optim.Optimizer, args: Any, kwargs: Any,
          clip: float | None) -> float:
    loss = model(*args, **kwargs)["loss"]
    loss.backward()
    if clip is not None:
        if isinstance(model, rannc_fx.CompiledModel):
            model.clip_grad_norm_(clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def _compiled(rank: int, world: int, replicas: tuple[int, ...], zero: int, *,
              schedule: str | None = None, recompute: bool | None = None,
              offload: bool | None = False, layers: bool | None = None,
              ) -> tuple[rannc_fx.CompiledModel, torch.optim.Optimizer, Any, Any]:
    model, args, kwargs = _data()
    opt = _adam(model)
    zero_cfg = _zero_config(replicas, zero, schedule, recompute, offload, layers)
    cfg = test_config(timeout_s=30.0, **{**LINK, **zero_cfg})
    largs, lkwargs = _local(rank, world, args, kwargs)
    return (rannc_fx.compile(model, opt, cfg, example_args=largs, example_kwargs=lkwargs),
            opt, largs, lkwargs)


def _zero_config(replicas: tuple[int, ...], zero: int, schedule: str | None = None,
                 recompute: bool | None = None, offload: bool | None = False,
                 layers: bool | None = None) -> dict[str, Any]:
    # the link given, not probed, and the costs counted, not timed: on loaded cores a probe
    # (milliseconds a message) or timed ops can cut the stages so that the replicated one
    # holds no parameter (nothing to shard) or a layered one a single layer (no segment
    # start inside it)
    return dict(replicas=replicas, micro_batches=2, schedule=schedule, recompute=recompute,
                zero=zero, offload=offload, recompute_layers=layers, link_bandwidth=1e9,
                link_latency=2e-5, cost_model="analytic")


def _shares(run: Run) -> dict[str, Any]:
    """What this rank's share of the optimizer state holds, and what the plan says of it."""
    cm, opt = run.cm, run.opt
    me = cm.plan.stages_of_rank(run.rank)[0]
    shard = shard_of(opt)
    kept = {id(p) for p in opt.state}
    ps = list(dict.fromkeys(p for gm in cm.stages for p in gm.parameters()))
    return {
        "stage": me.index, "replicas": me.replicas, "zero": me.zero,
        "sharded": shard is not None,
        "kept": len(kept & {id(p) for p in ps}), "params": len(ps),
        "state_bytes": sum(v.numel() * v.element_size() for p in opt.state
                           for v in opt.state[p].values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0),  # not the step
        "largest": 2 * max(p.numel() * p.element_size() for p in ps),  # Adam: 2 moments
        "predicted": sum(st.memory.optimizer_state for st in cm.plan.stages_of_rank(run.rank)),
        "offload": me.offload, "host_bytes": me.host_bytes, "layers": len(me.checkpoints),
        "host_params": len(shard.host.params) if shard is not None and shard.host else 0,
        "bucketed": shard is not None and shard.host is not None and len(
            comm.buckets(shard.host.params, comm.BUCKET_BYTES)) > 1,
    }


def _train(replicas: tuple[int, ...], schedule: str, recompute: bool, clip: float | None,
           offload: bool = False, layers: bool | None = None, zero: int = 1,
           patches: Any = ()) -> list[dict[str, Any]]:
    """``STEPS`` Adam steps of the tied-embedding LM (clipped at ``clip``) against one
    process: losses, norms, every parameter; each rank's ``_shares``."""
    got = train_against_reference(
        _data, _zero_config(replicas, zero, schedule, recompute, offload, layers),
        sum(replicas), STEPS, clip=clip, check=_shares, timeout_s=30.0, wall_s=180.0,
        patches=patches)
    return [t.extra for t in got]


@pytest.mark.slow
@pytest.mark.parametrize(
    "replicas,schedule,recompute,clip,zero",
    [((2, 1), "gpipe", False, None, 1), ((1, 2), "1f1b", True, 0.5, 1),
     ((2,), "1f1b", False, 0.5, 1), ((2, 1), "interleaved", False, 0.5, 1),
     ((2, 1), "gpipe", True, 0.5, 2), ((1, 2), "1f1b", True, None, 2),
     ((2,), "1f1b", False, 0.5, 2), ((2, 1), "interleaved", False, 0.5, 2),
     ((2, 1), "zbv", False, 0.5, 2)],
    ids=["first-stage-sharded-gpipe", "last-stage-sharded-1f1b-recompute-clip",
         "one-stage-two-replicas-clip", "interleaved-a-lane-of-two-replicas",
         "zero2-first-stage-gpipe-recompute-clip", "zero2-last-stage-1f1b-recompute",
         "zero2-one-stage-two-replicas-clip", "zero2-interleaved-a-lane-of-two-replicas-clip",
         # lane 0 holds stage 0 (the embedding) and stage 3 (the LM head tied to it): its
         # state once, as the plan counts it
         "zero2-zbv-the-tied-weight-s-ends-on-one-lane-clip"],
)
def test_sharded_training_is_the_one_process_training(replicas, schedule, recompute, clip,
                                                     zero):
    # one stage: many all-gathers of a few tensors each
    patches = [(comm.__name__, "BUCKET_BYTES", 4096)] if len(replicas) == 1 else []
    got = _train(replicas, schedule, recompute, clip, False, None, zero, patches)
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for info in got:
        by_stage.setdefault(info["stage"], []).append(info)
    for infos in by_stage.values():
        r = infos[0]["replicas"]
        assert all(i["zero"] == (zero if r > 1 else 0) for i in infos)
        assert all(i["sharded"] == (r > 1) for i in infos)
        if r > 1:
            # each replica keeps the state of a share; together every parameter's once
            assert sum(i["kept"] for i in infos) == infos[0]["params"]
            if infos[0]["params"] >= 4 * r:  # enough tensors that every replica gets some
                assert all(i["kept"] > 0 for i in infos)
            whole = sum(i["state_bytes"] for i in infos)
            assert abs(whole - r * infos[0]["predicted"]) <= r  # the plan: 1/r of it each
            for i in infos:  # an LPT share: within the largest tensor's state of 1/r
                assert i["state_bytes"] <= whole / r + i["largest"]


def _accumulated(zero: int, run: Run) -> dict[str, Any]:
    """Two calls' gradients accumulated, then clipped and stepped, against one process's;
    then 2 clipped steps."""
    cm, ref = run.cm, run.ref
    for _ in range(2):  # accumulation over calls: the second adds to the first's
        run.backward(*run.forward(run.batch(1)))
    shared = {n for sp in cm.plan.shared_params for n in (sp.name, *sp.aliases)}
    shard = shard_of(run.opt)
    kept, dropped = [], []
    for gm in cm.stages:
        for name, p in gm.named_parameters():
            want = ref.get_parameter(name).grad
            if shard is not None and zero == 2 and name not in shared and not shard.steps(p):
                assert p.grad is None, name  # another replica's: reduced to it, gone here
                dropped.append(name)
                continue
            assert p.grad is not None, name
            assert_close(p.grad, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            if name not in shared:  # a shared one's is all-reduced over every holder
                kept.append(name)
    norm = cm.clip_grad_norm_(0.5)
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert_close(norm, want_norm, **TOL)
    for o in (run.opt, run.ref_opt):
        o.step()
        o.zero_grad()
    for _ in range(2):
        run.train_step(1)  # clipped at 0.5
    me = cm.plan.stages_of_rank(run.rank)[0]
    return {"stage": me.index, "zero": me.zero, "kept": kept, "dropped": dropped}


def _gradients(replicas: tuple[int, ...], schedule: str, zero: int, patches: Any = ()
               ) -> list[dict[str, Any]]:
    got = train_against_reference(_data, _zero_config(replicas, zero, schedule), 3, clip=0.5,
                                  loop=functools.partial(_accumulated, zero), timeout_s=30.0,
                                  wall_s=180.0, patches=patches)
    return [t.extra for t in got]


@pytest.mark.slow
@pytest.mark.parametrize("replicas,schedule,zero", [((2, 1), "1f1b", 1), ((2, 1), "1f1b", 2),
                                                    ((1, 2), "gpipe", 2), ((2, 1), "zbv", 2)])
def test_a_sharded_stage_s_gradients_are_one_process_s_on_their_owners(replicas, schedule,
                                                                       zero):
    """ZeRO-1 keeps every gradient on every replica; ZeRO-2 keeps each on its owner only,
    the two calls' sum reduced once; the clipped norm and the steps are one process's."""
    got = _gradients(replicas, schedule, zero)
    two = [info for info in got if info["stage"] == replicas.index(2)]
    assert all(i["zero"] == zero for i in two)
    if zero == 1:
        assert all(not i["dropped"] for i in two)
        return
    # every gradient of the stage on exactly one replica, and each replica holds some
    assert sorted(n for i in two for n in i["kept"]) == sorted(set(two[0]["kept"])
                                                             | set(two[0]["dropped"]))
    assert all(i["kept"] and i["dropped"] for i in two)


@pytest.mark.slow
def _nccl(group: object) -> str:
    return "nccl"


def test_the_reduce_scatter_nccl_runs_gives_the_owners_one_process_s_gradients():
    """Over gloo the rounds are all-reduced (faster there); NCCL's path, a reduce-scatter of
    the same rounds, run here on gloo."""
    got = _gradients((2, 1), "1f1b", 2,
                     patches=[(grad_shards.__name__, "backend_of", _nccl),
                              (comm.__name__, "BUCKET_BYTES", 64 * 1024)])  # several rounds
    assert all(i["kept"] and i["dropped"] for i in got if i["stage"] == 0)


def _inf_on_a_replica(inf_on: int | None, run: Run) -> float:
    """GradScaler over a sharded stage: an inf on one replica skips the step everywhere."""
    if run.cm.plan.stages[0].zero in (1, 2):  # the first stage's two replicas share the state
        assert (shard_of(run.opt) is not None) == (run.rank < 2)
    for step in range(3):
        out, want = run.call(run.batch(1))
        run.backward(out, want)
        if step == 1 and inf_on is not None:
            for m in (run.ref, run.cm) if run.rank == inf_on else (run.ref,):
                # the last parameter with a gradient here (ZeRO-3: rows, maybe none)
                last = [p for p in m.parameters() if p.grad is not None and p.grad.numel()][-1]
                last.grad.view(-1)[0] = float("inf")
        for sc, o in ((run.scaler, run.opt), (run.ref_scaler, run.ref_opt)):
            sc.step(o)  # unscaling there
            sc.update()
            o.zero_grad()
        assert run.scaler.get_scale() == run.ref_scaler.get_scale()
    return run.scaler.get_scale()


@pytest.mark.slow
@pytest.mark.parametrize("inf_on", [None, 1])
def test_grad_scaler_over_a_sharded_stage_steps_like_one_process(inf_on):
    scales = [t.extra for t in train_against_reference(
        functools.partial(mlp_example, batch=4 * 3), dict(replicas=(2, 1), micro_batches=2,
                                                          zero=1), 3,
        optimizer=optimizer(torch.optim.Adam, lr=0.01), scaler=2.0**10,
        loop=functools.partial(_inf_on_a_replica, inf_on), timeout_s=30.0)]
    assert set(scales) == {2.0**10 if inf_on is None else 2.0**9}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sharded_offloaded_and_layered_stages_train_like_one_process(schedule):
    """ZeRO-1, the state offloaded and recomputation layer by layer on every stage at once:
    the last stage's two replicas share its state and step it in buckets, each stage's R
    keeps only its layers' inputs."""
    infos = _train((1, 2), schedule, True, 0.5, True, True,
                   patches=[(comm.__name__, "BUCKET_BYTES", 64 * 1024)])
    assert all(i["layers"] >= 1 and i["offload"] for i in infos)
    assert [i["zero"] for i in infos] == [int(i["replicas"] > 1) for i in infos]
    assert any(i["bucketed"] for i in infos)


@pytest.mark.slow
@pytest.mark.parametrize("replicas,schedule,recompute", [((2, 1), "1f1b", False),
                                                         ((1, 1), "gpipe", True),
                                                         ((1, 2), "gpipe", True)],
                         ids=["sharded-and-offloaded-1f1b", "offloaded-gpipe-recompute",
                              "last-stage-sharded-and-offloaded-gpipe-recompute"])
def test_offloaded_state_steps_in_buckets_like_one_process(replicas, schedule, recompute):
    """Host and device are one memory here: the state's path (bucket by bucket, the user's
    optimizer stepping each bucket) and its numerics are what is tested."""
    got = _train(replicas, schedule, recompute, 0.5, True,
                 patches=[(comm.__name__, "BUCKET_BYTES", 64 * 1024)])  # several buckets a stage
    assert any(info["bucketed"] for info in got)  # a rank that stepped several buckets
    for info in got:
        assert info["offload"] and info["host_params"] > 0
        # the plan's device keeps none of the state; the host this replica's share of it
        assert info["predicted"] == 0 and info["host_bytes"] > 0
        assert abs(info["state_bytes"] - info["host_bytes"]) <= info["largest"]


# -- checkpoints across sharded and unsharded plans --------------------------------------------
def _save(rank: int, world: int, replicas: tuple[int, ...], zero: int, offload: bool,
          path: str) -> list[float]:
    cm, opt, args, kwargs = _compiled(rank, world, replicas, zero, offload=offload)
    losses = [_step(cm, opt, args, kwargs, None) for _ in range(STEPS)]
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


def _resume(rank: int, world: int, replicas: tuple[int, ...], zero: int, offload: bool,
            path: str) -> tuple[list[float], bytes | None]:
    cm, opt, args, kwargs = _compiled(rank, world, replicas, zero, offload=offload)
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    rannc_fx.set_state_dict(cm, opt, model_state_dict=msd, optim_state_dict=osd)
    losses = [_step(cm, opt, args, kwargs, None) for _ in range(STEPS)]
    full = rannc_fx.get_state_dict(cm, opt, full=True)
    if rank != 0:
        return losses, None
    buf = io.BytesIO()  # tensors cross the process boundary as bytes, not shared memory
    torch.save(full[1], buf)
    return losses, buf.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("saved_as,resumed_as", [(((1, 2), 1, False), ((2, 1), 0, False)),
                                                 (((2, 1), 0, False), ((1, 2), 1, True)),
                                                 (((2, 1), 2, True), ((1, 2), 2, False)),
                                                 (((1, 2), 3, False), ((2, 1), 0, False)),
                                                 (((2, 1), 0, False), ((1, 2), 3, False)),
                                                 (((1, 2), 3, False), ((2, 1), 3, False))],
                         ids=["sharded-to-unsharded", "unsharded-to-sharded-offloaded",
                              "zero2-offloaded-to-zero2-on-the-other-stage",
                              "zero3-to-unsharded", "unsharded-to-zero3",
                              "zero3-to-zero3-on-the-other-stage"])
def test_checkpoints_cross_between_sharded_and_unsharded_plans(tmp_path, saved_as, resumed_as):
    ref, args, kwargs = _data()
    ref_opt = _adam(ref)
    want = [_step(ref, ref_opt, args, kwargs, None) for _ in range(2 * STEPS)]
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, 3, *saved_as, path, timeout_s=30.0, wall_s=180.0)
    assert_close(torch.tensor(saved[0]), torch.tensor(want[:STEPS]), **TOL)
    got = run_ranks(_resume, 3, *resumed_as, path, timeout_s=30.0, wall_s=180.0)
    for losses, _ in got:
        assert_close(torch.tensor(losses), torch.tensor(want[STEPS:]), **TOL)
    assert got[0][1] is not None
    full = torch.load(io.BytesIO(got[0][1]))
    _, ref_osd = rannc_fx.get_state_dict(ref, ref_opt)
    assert set(full) == set(ref_osd)  # the shares' union: every parameter's state once
    for k, v in ref_osd.items():
        if isinstance(v, torch.Tensor):
            assert_close(full[k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
