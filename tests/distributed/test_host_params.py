"""Parameters in host memory (``runtime/host_params.py``) on ranks: a plan whose stages keep
their parameters there trains as one process does (recomputation, replicas, clipping and
GradScaler, checkpoints to and from device parameters). In one process:
``unit/test_host_params.py``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.testing import assert_close

import rannc_fx
from rannc_fx.runtime import host_params as hp
from rannc_fx.runtime.host_params import HostParams, host_of
from tests.dist_utils import run_ranks
from tests.gpt_training import (
    STEPS,
    TOL,
    adam,
    gpt,
    local,
    step,
    train_like_one_process,
)
from tests.harness import LINK, Run, test_config, train_against_reference
from tests.unit.test_host_params import _gpt_plan


def _counting_tokens() -> list[int]:
    """Count the saved parameter views the forwards kept as tokens (in the worker)."""
    calls: list[int] = []
    original = HostParams._pack

    def pack(self: HostParams, t: torch.Tensor) -> Any:
        out = original(self, t)
        if isinstance(out, hp._Saved):
            calls.append(1)
        return out

    HostParams._pack = pack  # type: ignore[method-assign]  # a forked worker's own copy
    return calls


@pytest.mark.parametrize("schedule,recompute,selective,replicas,layers", [
    ("1f1b", False, False, (1, 1), False),
    ("gpipe", True, False, (1, 1), False),
    ("1f1b", True, False, (1, 1), True),
    ("1f1b", True, True, (1, 1), False),
    ("gpipe", False, False, (2,), False),
], ids=["1f1b", "gpipe-recompute", "1f1b-layer-by-layer", "1f1b-selective",
        "one-stage-two-replicas"])
def test_host_parameters_train_like_one_process(schedule, recompute, selective, replicas,
                                                 layers):
    plan = _gpt_plan(schedule, recompute, selective, replicas, layers)
    assert all(st.host_params for st in plan.stages), plan.summary()
    assert all(bool(st.checkpoints) == bool(layers) for st in plan.stages)
    counted = train_like_one_process(plan, _counting_tokens)
    if not selective:  # under checkpoint its own hooks hold what the forward saves
        assert all(calls > 0 for calls in counted)


def _fetches_and_eval(run: Run) -> bool:
    """A step, every stage running through its fetches, then an evaluation call; whether the
    user's optimizer stepped exactly this rank's parameters."""
    cm, opt = run.cm, run.opt
    run.train_step(1)
    assert all(host_of(gm) is not None and hp.FETCH in gm.code for gm in cm.stages)
    mine = {id(p) for gm in cm.stages for p in gm.parameters()}
    stepped = {id(p) for p in opt.state}
    (largs, lkw), (args, kwargs) = run.split(run.batch(1))
    with torch.no_grad():
        got, want = cm(*largs, **lkw)["loss"], run.ref(*args, **kwargs)["loss"]
    assert_close(got, want, rtol=TOL["rtol"], atol=TOL["atol"])
    return stepped == mine


def test_the_runtime_fetches_and_an_evaluation_call_is_one_process_s():
    """Under the forced plan every rank's stage runs through its fetches (the runtime
    installed them), the user's optimizer steps exactly the stage's parameters, and an
    evaluation call under ``torch.no_grad`` (fetches without autograd, nothing saved) after a
    step gives one process's loss."""
    plan = _gpt_plan("1f1b")
    got = train_against_reference(functools.partial(gpt, 0.0),
                                  dict(timeout_s=30.0, batch_norm=plan.batch_norm), 2,
                                  optimizer=adam, compile_kw=dict(plan=plan),
                                  loop=_fetches_and_eval, timeout_s=30.0)
    assert all(t.extra for t in got)


def _checkpointed(rank: int, world: int, host: bool, path: str, resume: bool) -> list[float]:
    """STEPS Adam steps of the GPT on 2 ranks (one stage each, parameters on the host or not),
    from the checkpoint at ``path`` (``resume``) or saving one there after them."""
    model, args, kwargs = gpt(0.0)
    opt = adam(model)
    largs, lkwargs = local(rank, args, kwargs)
    cfg = test_config(**LINK, cost_model="analytic", timeout_s=30.0, replicas=(1, 1), micro_batches=2,
                      host_params=host)
    cm = rannc_fx.compile(model, opt, cfg, example_args=largs, example_kwargs=lkwargs)
    assert all(st.host_params == host for st in cm.plan.stages)
    msd, osd = rannc_fx.get_state_dict(cm, opt)
    if resume:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        rannc_fx.set_state_dict(cm, opt, model_state_dict=msd, optim_state_dict=osd)
    losses = [step(cm, opt, largs, lkwargs) for _ in range(STEPS)]
    if not resume:
        msd, osd = rannc_fx.get_state_dict(cm, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return losses


@pytest.mark.parametrize("saved_on_host", [True, False], ids=["host-to-device",
                                                              "device-to-host"])
def test_a_checkpoint_moves_between_host_and_device_parameters(tmp_path, saved_on_host):
    path = str(tmp_path / "ckpt")
    first = run_ranks(_checkpointed, 2, saved_on_host, path, False, timeout_s=30.0,
                      wall_s=120.0)
    then = run_ranks(_checkpointed, 2, not saved_on_host, path, True, timeout_s=30.0,
                     wall_s=120.0)
    model, args, kwargs = gpt(0.0)
    opt = adam(model)
    want = [step(model, opt, args, kwargs) for _ in range(2 * STEPS)]
    for a, b in zip(first, then, strict=True):
        assert_close(torch.tensor(a + b), torch.tensor(want), rtol=TOL["rtol"],
                     atol=TOL["atol"])


def _frozen_position_table() -> tuple[torch.nn.Module, Any, Any]:
    model, args, kwargs = gpt(0.0)
    model.pos.requires_grad_(False)  # fetched like the others, no gradient
    return model, args, kwargs


def _inf_on_one_rank(inf_on: int | None, run: Run) -> float:
    """3 steps with ``GradScaler`` (an inf in step 2 on rank ``inf_on``) and
    ``clip_grad_norm_``, a frozen parameter among those on the host."""
    assert all(st.host_params for st in run.cm.plan.stages)
    for i in range(3):
        out, want = run.call(run.batch(1))
        run.backward(out, want)
        if i == 1 and inf_on is not None:
            for m in (run.ref, run.cm) if run.rank == inf_on else (run.ref,):
                held = [p for p in m.parameters() if p.grad is not None]
                held[-1].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        run.step()  # unscaled, clipped at 0.5 (both norms compared), the scales compared
    return run.scaler.get_scale()


@pytest.mark.parametrize("inf_on", [None, 1], ids=["finite", "inf-on-rank-1"])
def test_clipping_and_the_grad_scaler_over_host_parameters(inf_on):
    scales = [t.extra for t in train_against_reference(
        _frozen_position_table, dict(cost_model="analytic", replicas=(1, 1), micro_batches=2,
                                     host_params=True), 2,
        optimizer=adam, scaler=2.0**10, clip=0.5,
        loop=functools.partial(_inf_on_one_rank, inf_on), timeout_s=30.0)]
    assert set(scales) == {2.0**10 if inf_on is None else 2.0**9}
