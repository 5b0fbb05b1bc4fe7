"""One compiled model under torch.autocast and without it: each call's cut values move in
the dtypes they have in that call, and the losses follow one process under the same state."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import rannc_fx
from rannc_fx.config import Config
from rannc_fx.models import gpt_example, mlp_example

from tests.dist_utils import assert_moved_alike_in_norm, run_ranks, snapshot

EXACT = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)  # micro-batches round bf16 matmuls over other sums
MOVED = 0.1  # parameters' distance from the reference over a step's move (seen: <= 0.014)
LOCAL = 4
EXAMPLES = {"mlp": mlp_example, "gpt": gpt_example}


def _loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out


# selective recomputation under GPipe runs its backwards (and recomputations) after the call,
# outside its autocast region; under 1F1B inside it
_RECOMPUTE = {None: {}, "whole": dict(recompute=True, recompute_selective=False),
              "selective": dict(recompute=True, recompute_selective=True, schedule="1f1b"),
              "selective-gpipe": dict(recompute=True, recompute_selective=True,
                                      schedule="gpipe")}


def _switching(rank: int, world: int, name: str, planned: str | None,
               recompute: str | None = None) -> list[str]:
    torch.manual_seed(0)
    model, args, kwargs = EXAMPLES[name](batch=LOCAL * world)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    cut = lambda t: t[rank * LOCAL : (rank + 1) * LOCAL]  # noqa: E731
    largs, lkwargs = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
    cfg = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=30.0, replicas=(1,) * world,
                 micro_batches=2, autocast_dtype=planned, **_RECOMPUTE[recompute])
    cm = rannc_fx.compile(model, opt, cfg, example_args=largs, example_kwargs=lkwargs)
    if recompute is not None:  # the recomputation asked for, on every stage
        assert all(st.selective == recompute.startswith("selective") and st.recompute == (
            recompute == "whole") for st in cm.plan.stages), cm.plan.summary()
    planned_dtypes = sorted({str(cv.spec.dtype) for cv in cm.plan.cut_values})
    for step, amp in enumerate(["bfloat16", None, "bfloat16", None]):
        before = snapshot(ref)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None)
        with ctx:
            out, want = cm(*largs, **lkwargs), ref(*args, **kwargs)
        assert _loss(out).dtype == _loss(want).dtype
        assert_close(_loss(out), _loss(want), **(BF16 if amp else EXACT if step == 1 else BF16))
        for loss, o in ((_loss(out), opt), (_loss(want), ref_opt)):
            loss.backward()
            o.step()
            o.zero_grad()
        # the step moved this rank's parameters as it moved the reference's (the losses'
        # tolerance would pass a stage that stopped training)
        assert_moved_alike_in_norm(cm.stages[0], ref, before, rel=MOVED)
    # evaluation without autocast after autocast training: the same parameters give the same loss
    cm.eval()
    ref.eval()
    with torch.no_grad():
        assert_close(_loss(cm(*largs, **lkwargs)), _loss(ref(*args, **kwargs)), **BF16)
    return planned_dtypes


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("planned", [None, "bfloat16"])
def test_training_under_autocast_and_evaluating_without_follows_one_process(name, planned):
    dtypes = run_ranks(_switching, 2, name, planned, timeout_s=30.0, wall_s=120.0)
    # the plan carries the dtypes of the state it was made for (the MLP's cut is a Linear's
    # output: bfloat16 under autocast; the LM's cut falls after a float32 residual add)
    if name == "mlp":
        assert dtypes[0] == (["bfloat16"] if planned else ["float32"]), dtypes[0]


@pytest.mark.parametrize("recompute", ["whole", "selective", "selective-gpipe"])
def test_recomputing_stages_follow_one_process_in_and_out_of_autocast(recompute):
    """A recomputation reruns ops under the autocast state of the forward it repeats
    (whole: ``R`` inside the call's state; selective: the checkpoint's saved state, with
    autocast's weight cache off, so that a second micro-batch's forward, which found its
    casts in the cache, and its recomputation after the call dispatch the same ops)."""
    run_ranks(_switching, 2, "gpt", None, recompute, timeout_s=30.0, wall_s=120.0)


def _scaled(rank: int, world: int, inf_on: int | None) -> list[float]:
    torch.manual_seed(0)
    model, (x, y), _ = mlp_example(batch=LOCAL * world)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cfg = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=30.0, replicas=(1, 1),
                 micro_batches=2)
    cut = lambda t: t[rank * LOCAL : (rank + 1) * LOCAL]  # noqa: E731
    cm = rannc_fx.compile(model, opt, cfg, example_args=(cut(x), cut(y)))
    scaler, ref_scaler = rannc_fx.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler(
        "cpu", init_scale=2.0**10)
    for step in range(3):
        for m, s, o, args in ((cm, scaler, opt, (cut(x), cut(y))), (ref, ref_scaler, ref_opt, (x, y))):
            s.scale(m(*args)).backward()
            if step == 1 and inf_on is not None and (m is ref or rank == inf_on):
                next(iter(m.parameters())).grad.view(-1)[0] = float("inf")
            s.unscale_(o)
            s.step(o)
            s.update()
            o.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
    for pname, p in cm.stages[0].named_parameters():
        assert_close(p, ref.get_parameter(pname), **EXACT)
    return [scaler.get_scale()]


@pytest.mark.parametrize("inf_on", [None, 1])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(inf_on):
    # the inf is on rank 1's stage only; torch's own GradScaler would step on rank 0
    scales = run_ranks(_scaled, 2, inf_on, timeout_s=30.0, wall_s=60.0)
    assert scales[0] == scales[1] == ([2.0**10] if inf_on is None else [2.0**9])
