"""One compiled model under torch.autocast and without it: each call's cut values move in
the dtypes they have in that call, and the losses follow one process under the same state."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from examples.models import gpt_example, mlp_example
from tests.dist_utils import assert_moved_alike_in_norm, snapshot
from tests.distributed.test_sync import Net, _every_step, _init, _materialized
from tests.harness import Run, optimizer, train_against_reference

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


def _switching(recompute: str | None, run: Run) -> list[str]:
    """4 SGD steps, under autocast and without it in turn, then an evaluation without; the plan
    carries the dtypes of the state it was made for (returned)."""
    cm, ref = run.cm, run.ref
    if recompute is not None:  # the recomputation asked for, on every stage
        assert all(st.selective == recompute.startswith("selective") and st.recompute == (
            recompute == "whole") for st in cm.plan.stages), cm.plan.summary()
    planned_dtypes = sorted({str(cv.spec.dtype) for cv in cm.plan.cut_values})
    (largs, lkwargs), (args, kwargs) = run.split(run.batch(1))
    for step, amp in enumerate(["bfloat16", None, "bfloat16", None]):
        before = snapshot(ref)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None)
        with ctx:
            out, want = cm(*largs, **lkwargs), ref(*args, **kwargs)
        assert _loss(out).dtype == _loss(want).dtype
        run.compare(out, want, **(BF16 if amp else EXACT if step == 1 else BF16))
        run.backward(out, want)
        run.step()
        # the step moved this rank's parameters as it moved the reference's (the losses'
        # tolerance would pass a stage that stopped training)
        assert_moved_alike_in_norm(cm.stages[0], ref, before, rel=MOVED)
    # evaluation without autocast after autocast training: the same parameters give the same loss
    cm.eval()
    ref.eval()
    with torch.no_grad():
        assert_close(_loss(cm(*largs, **lkwargs)), _loss(ref(*args, **kwargs)), **BF16)
    return planned_dtypes


def _train_switching(name: str, planned: str | None, recompute: str | None = None
                     ) -> list[str]:
    """``_switching`` on 2 ranks (the parameters are compared after each step, in norm); each
    rank's planned dtypes."""
    world = 2
    cfg = dict(replicas=(1,) * world, micro_batches=2, autocast_dtype=planned,
               **_RECOMPUTE[recompute])
    got = train_against_reference(functools.partial(EXAMPLES[name], batch=LOCAL * world), cfg,
                                  world, optimizer=optimizer(torch.optim.SGD, lr=0.05),
                                  params=False, loop=functools.partial(_switching, recompute),
                                  timeout_s=30.0)
    return [t.extra for t in got]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("planned", [None, "bfloat16"])
def test_training_under_autocast_and_evaluating_without_follows_one_process(name, planned):
    dtypes = _train_switching(name, planned)
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
    _train_switching("gpt", None, recompute)


def _inf_on_one_rank(inf_on: int | None, run: Run) -> None:
    """3 steps through GradScaler; at the second, an inf in rank ``inf_on``'s first gradient
    (and in the reference's)."""
    for step in range(3):
        out, want = run.call(run.batch(1))
        run.backward(out, want)
        if step == 1 and inf_on is not None:
            for m in (run.ref, run.cm) if run.rank == inf_on else (run.ref,):
                next(iter(m.parameters())).grad.view(-1)[0] = float("inf")
        run.step()  # both scalers' scales compared


def _final_scale(run: Run) -> list[float]:
    return [run.scaler.get_scale()]


@pytest.mark.parametrize("inf_on", [None, 1])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(inf_on):
    # the inf is on rank 1's stage only; torch's own GradScaler would step on rank 0
    scales = [t.extra for t in train_against_reference(
        functools.partial(mlp_example, batch=LOCAL * 2), dict(replicas=(1, 1), micro_batches=2),
        2, optimizer=optimizer(torch.optim.SGD, lr=0.1), tol=EXACT, scaler=2.0**10,
        loop=functools.partial(_inf_on_one_rank, inf_on), check=_final_scale,
        timeout_s=30.0, wall_s=60.0)]
    assert scales[0] == scales[1] == ([2.0**10] if inf_on is None else [2.0**9])


def _meta_under_autocast(run: Run) -> list[str]:
    """3 Adam steps under bfloat16 autocast; the plan's cut values' dtypes."""
    for step in range(1, 4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, want = run.forward(run.batch(step))
        assert loss.dtype == want.dtype
        run.compare(loss, want, **BF16)
        run.backward(loss, want)
        run.step()
    return sorted({str(cv.spec.dtype) for cv in run.cm.plan.cut_values})


def _meta_net() -> nn.Module:
    torch.manual_seed(torch.distributed.get_rank())  # rank 0's draws are the ones trained
    with torch.device("meta"):
        return Net()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_meta_built_model_planned_under_bfloat16_trains_like_one_process(tracer):
    """Its shapes and dtypes found on fakes of the ranks' kind of device, which autocast
    lowers (meta's are float32 under any autocast: the cut values' bfloat16 did not match)."""
    world = 2
    got = train_against_reference(
        _meta_net,
        dict(replicas=(1, 1), micro_batches=2, tracer=tracer, autocast_dtype="bfloat16",
             cost_model="analytic"),
        world, data=functools.partial(_every_step, world),
        reference=functools.partial(_materialized, seed=0),
        optimizer=optimizer(torch.optim.Adam, lr=0.01), params=False,
        compile_kw=dict(init=_init), loop=_meta_under_autocast, timeout_s=30.0)
    assert [t.extra for t in got] == [["bfloat16"]] * world
