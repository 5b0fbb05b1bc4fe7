"""Checkpoints on ranks: saved under one plan and world size, resumed under another (and into
a meta-device model, and into the plain model), continuing the single-process trajectory;
``full=True`` equals the single-process state; bad checkpoints fail on every rank. In one
process: ``unit/test_checkpoint.py``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.testing import assert_close

import rannc_fx
from examples.models import TransformerLM
from tests.dist_utils import run_ranks
from tests.harness import LINK, test_config
from tests.unit.test_checkpoint import GLOBAL, TOL, _adam, _data, _groups, _reference, _step

STEPS = 3  # before and after the checkpoint


def _local(rank: int, world: int, args: Any, kwargs: Any) -> tuple[Any, Any]:
    n = GLOBAL // world
    cut = lambda t: t[rank * n : (rank + 1) * n]  # noqa: E731
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _compiled(rank: int, world: int, replicas: tuple[int, ...], *, meta: bool = False,
              make_opt: Any = None, schedule: str | None = None,
              ) -> tuple[rannc_fx.CompiledModel, torch.optim.Optimizer, Any, Any]:
    model, args, kwargs = _data()
    if meta:
        with torch.device("meta"):
            model = TransformerLM()
    opt = (make_opt or _adam)(model)
    cfg = test_config(**LINK, timeout_s=30.0, replicas=replicas,
                      micro_batches=2, schedule=schedule)
    largs, lkwargs = _local(rank, world, args, kwargs)
    cm = rannc_fx.compile(model, opt, cfg, example_args=largs, example_kwargs=lkwargs)
    return cm, opt, largs, lkwargs


def _save_after(rank: int, world: int, replicas: tuple[int, ...], path: str) -> list[float]:
    cm, opt, args, kwargs = _compiled(rank, world, replicas)
    losses = [_step(cm, opt, args, kwargs) for _ in range(STEPS)]
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


def _resume(rank: int, world: int, replicas: tuple[int, ...], path: str, meta: bool,
            schedule: str | None = None) -> tuple[list[float], bytes | None]:
    cm, opt, args, kwargs = _compiled(rank, world, replicas, meta=meta, schedule=schedule)
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    rannc_fx.set_state_dict(cm, opt, model_state_dict=msd, optim_state_dict=osd)
    losses = [_step(cm, opt, args, kwargs) for _ in range(STEPS)]
    full = rannc_fx.get_state_dict(cm, opt, full=True)
    if rank != 0:
        assert full == ({}, {})
        return losses, None
    buf = io.BytesIO()  # tensors cross the process boundary as bytes, not shared memory
    torch.save({"model": full[0], "optim": full[1]}, buf)
    return losses, buf.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint after STEPS steps on 2 ranks, one stage each."""
    path = str(tmp_path_factory.mktemp("ckpt") / "step3")
    losses = run_ranks(_save_after, 2, (1, 1), path, timeout_s=30.0, wall_s=120.0)
    want, _, _ = _reference(STEPS)
    assert_close(torch.tensor(losses[0]), torch.tensor(want), **TOL)
    return path


@pytest.mark.parametrize(
    "world,replicas,meta,schedule",
    [(3, (2, 1), False, None), (3, (1, 2), True, None), (1, (1,), True, None),
     (3, (2, 1), False, "zbv"), (2, (1, 1), True, "interleaved")],
    ids=["3-ranks-unequal-replicas", "3-ranks-from-meta", "1-rank-from-meta",
         "zbv-lanes-unequal-replicas", "interleaved-from-meta"],
)
def test_resume_on_another_plan_continues_the_single_process_run(saved, world, replicas, meta,
                                                                 schedule):
    want, ref, ref_opt = _reference(2 * STEPS)
    results = run_ranks(_resume, world, replicas, saved, meta, schedule, timeout_s=30.0,
                        wall_s=120.0)
    for losses, _ in results:
        assert_close(torch.tensor(losses), torch.tensor(want[STEPS:]), **TOL)
    assert results[0][1] is not None
    full = torch.load(io.BytesIO(results[0][1]))
    ref_msd, ref_osd = rannc_fx.get_state_dict(ref, ref_opt)
    assert set(full["model"]) == set(ref.state_dict()) == set(ref_msd)
    assert set(full["optim"]) == set(ref_osd)
    for k, v in ref_msd.items():
        assert full["model"][k].device.type == "cpu"
        assert_close(full["model"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
    for k, v in ref_osd.items():
        if isinstance(v, torch.Tensor):
            assert_close(full["optim"][k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert full["optim"][k] == v, k
    # the tied weight is one tensor under both of its names
    assert full["model"]["head.weight"] is full["model"]["embed.weight"]


def test_a_plain_model_loads_the_checkpoint_and_continues(saved):
    want, _, _ = _reference(2 * STEPS)
    model, args, kwargs = _data()
    opt = _adam(model)
    msd, osd = rannc_fx.get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=saved)  # no process group
    rannc_fx.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    losses = [_step(model, opt, args, kwargs) for _ in range(STEPS)]
    assert_close(torch.tensor(losses), torch.tensor(want[STEPS:]), **TOL)


def _gather_and_save(rank: int, world: int, path: str) -> None:
    cm, opt, args, kwargs = _compiled(rank, world, (1, 1))
    for _ in range(STEPS):
        _step(cm, opt, args, kwargs)
    msd, osd = rannc_fx.get_state_dict(cm, opt, full=True)
    # each rank's model state dict: its part under the original names
    local = cm.state_dict()
    assert local and set(local) < set(_data()[0].state_dict())
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, path)


def test_a_gathered_checkpoint_loads_into_the_plain_model(tmp_path):
    path = str(tmp_path / "full.pt")
    run_ranks(_gather_and_save, 2, path, timeout_s=30.0, wall_s=120.0)
    want, _, _ = _reference(2 * STEPS)
    model, args, kwargs = _data()
    opt = _adam(model)
    full = torch.load(path)
    model.load_state_dict(full["model"])  # strict: every key of the plain model, no more
    rannc_fx.set_state_dict(model, opt, optim_state_dict=full["optim"])
    losses = [_step(model, opt, args, kwargs) for _ in range(STEPS)]
    assert_close(torch.tensor(losses), torch.tensor(want[STEPS:]), **TOL)


def _load_full_on_every_rank(rank: int, world: int, path: str) -> list[float]:
    cm, opt, args, kwargs = _compiled(rank, world, (2, 1))
    full = torch.load(path)
    result = cm.load_state_dict(full["model"])  # this rank's part; other keys skipped
    assert not result.missing_keys and not result.unexpected_keys
    rannc_fx.set_state_dict(cm, opt, optim_state_dict=full["optim"])
    return [_step(cm, opt, args, kwargs) for _ in range(STEPS)]


def test_a_full_checkpoint_loaded_on_every_rank_resumes(tmp_path):
    path = str(tmp_path / "full.pt")
    run_ranks(_gather_and_save, 2, path, timeout_s=30.0, wall_s=120.0)
    want, _, _ = _reference(2 * STEPS)
    for losses in run_ranks(_load_full_on_every_rank, 3, path, timeout_s=30.0, wall_s=120.0):
        assert_close(torch.tensor(losses), torch.tensor(want[STEPS:]), **TOL)


def _bad_inputs(rank: int, world: int) -> None:
    cm, opt, _, _ = _compiled(rank, world, (1, 1))
    good, good_optim = rannc_fx.get_state_dict(cm, opt)
    before = {k: v.clone() for k, v in good.items()}

    def fails(match: str, **kw: Any) -> None:
        with pytest.raises(ValueError, match=match):
            rannc_fx.set_state_dict(cm, opt, **kw)

    # another model: keys it does not have, and keys it lacks (on rank 1 only: every rank hears)
    other = dict(good)
    if rank == 1:
        other["decoder.weight"] = torch.zeros(3)
        del other[[k for k in good if k not in ("embed.weight", "head.weight")][-1]]
    fails(r"rank 1: model state dict has 1 key\(s\) this model does not: 'decoder.weight'",
          model_state_dict=other)
    fails(r"rank 1: model state dict lacks 1 key", model_state_dict=other)
    # a shape that differs
    shapes = {**good, "norm.weight": torch.zeros(7)}
    fails(r"norm.weight: \(7,\) in the state dict, \(64,\) in the model", model_state_dict=shapes)
    # a full=True state dict is on rank 0 only
    fails(r"rank 1: the model state dict given here is empty .* full=True state dict is on "
          r"rank 0 only", model_state_dict=good if rank == 0 else {})
    # optimizer state of another class
    sgd = torch.optim.SGD(cm.parameters(), lr=0.1, momentum=0.9)
    _, sgd_state = rannc_fx.get_state_dict(cm, sgd)
    fails(r"another optimizer class.*\['momentum_buffer'\] given, \['exp_avg', 'exp_avg_sq', "
          r"'step'\] kept by Adam", optim_state_dict=sgd_state)
    fails(r"no parameter of this model: 'state.nowhere.exp_avg'",
          optim_state_dict={**good_optim, "state.nowhere.exp_avg": torch.zeros(1)})
    # nothing was changed by the refused loads
    for k, v in rannc_fx.get_state_dict(cm, opt)[0].items():
        assert torch.equal(v, before[k]), k


def test_bad_checkpoints_fail_on_every_rank_and_change_nothing():
    run_ranks(_bad_inputs, 2, timeout_s=30.0, wall_s=120.0)


def test_a_half_written_checkpoint_is_refused_by_load(saved, tmp_path):
    """torch.distributed.checkpoint writes ``.metadata`` last, after every rank's data: a
    directory without it is a save that never finished, and ``load`` refuses it."""
    half = tmp_path / "half"
    half.mkdir()
    for f in Path(saved).iterdir():
        if f.name != ".metadata":
            (half / f.name).write_bytes(f.read_bytes())
    model, _, _ = _data()
    opt = _adam(model)
    msd, osd = rannc_fx.get_state_dict(model, opt)
    before = {k: v.clone() for k, v in msd.items()}
    with pytest.raises(CheckpointException) as e:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(half))
    assert "No such file or directory" in str(e.value.failures[0])
    assert ".metadata" in str(e.value.failures[0])
    assert all(torch.equal(v, before[k]) for k, v in msd.items())


def _sgd(model: torch.nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, dampening=0.1)


LATER_LR = 0.02  # the learning rate after STEPS steps (a schedule would set it so)


def _sgd_reference() -> list[float]:
    model, args, kwargs = _data()
    opt = _sgd(model)
    losses = [_step(model, opt, args, kwargs) for _ in range(STEPS)]
    opt.param_groups[0]["lr"] = LATER_LR
    return losses + [_step(model, opt, args, kwargs) for _ in range(STEPS)]


def _sgd_save(rank: int, world: int, path: str) -> list[float]:
    cm, opt, args, kwargs = _compiled(rank, world, (1, 1), make_opt=_sgd)
    losses = [_step(cm, opt, args, kwargs) for _ in range(STEPS)]
    opt.param_groups[0]["lr"] = LATER_LR
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    assert any(k.endswith(".momentum_buffer") for k in osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


def _sgd_resume(rank: int, world: int, path: str) -> tuple[list[float], dict[str, Any]]:
    # a fresh optimizer with another learning rate: the checkpoint's must win
    cm, opt, args, kwargs = _compiled(rank, world, (2, 1), make_opt=lambda m: _sgd(m, lr=0.1))
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    rannc_fx.set_state_dict(cm, opt, model_state_dict=msd, optim_state_dict=osd)
    (group,) = _groups(opt)
    return [_step(cm, opt, args, kwargs) for _ in range(STEPS)], group


def test_sgd_with_momentum_resumes_on_another_plan(tmp_path):
    """Another optimizer than Adam: SGD's momentum buffers and its (changed) learning rate
    come back from a checkpoint saved on 2 ranks into 3, on the single-process trajectory."""
    want = _sgd_reference()
    saved = run_ranks(_sgd_save, 2, str(tmp_path), timeout_s=30.0, wall_s=120.0)
    assert_close(torch.tensor(saved[0]), torch.tensor(want[:STEPS]), **TOL)
    for losses, group in run_ranks(_sgd_resume, 3, str(tmp_path), timeout_s=30.0, wall_s=120.0):
        assert group["lr"] == LATER_LR and group["momentum"] == 0.9 and group["dampening"] == 0.1
        assert_close(torch.tensor(losses), torch.tensor(want[STEPS:]), **TOL)
