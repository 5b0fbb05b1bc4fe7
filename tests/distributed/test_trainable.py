"""Trainability follows the model (``runtime/trainable.py``): a head unfrozen after one step
(``requires_grad_(True)`` and ``optimizer.add_param_group``) trains like one process on 1
stage x 2 replicas, 2 stages x 1 and ZeRO-1/2 (every loss, every gradient, every parameter),
a layer frozen again stops being summed, and the optimizer's groups hold only the stage's
own parameters; ZeRO's owners stay put. A change the plan cannot follow (a stage whose
outputs it sends without a gradient), replicas that change differently, and a change
inside ``no_sync()`` are refused on every rank, and the job goes on once undone."""

from __future__ import annotations

import copy
import functools
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import rannc_fx
from examples.models import MLP
from rannc_fx.runtime.zero import shard_of
from tests.dist_utils import run_ranks
from tests.harness import LINK, Run, test_config, train_against_reference

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 4  # samples per rank


CASES = {
    "1x2": dict(replicas=(2,), schedule="gpipe"),
    "2x1": dict(replicas=(1, 1), schedule="1f1b"),
    "1x2-zero1": dict(replicas=(2,), schedule="1f1b", zero=1),
    "1x2-zero2": dict(replicas=(2,), schedule="gpipe", zero=2),
}


def _batch(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 32, generator=g), torch.randint(0, 10, (samples,), generator=g)


def _frozen_mlp(frozen: tuple[str, ...]) -> nn.Module:
    """Hidden 256: two stages split it, the head on the second; ``frozen`` frozen at first."""
    model = MLP(hidden=256, depth=4)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen))
    return model


def _trainable_adam(model: nn.Module) -> torch.optim.Optimizer:
    """Adam over what trains at first (eps: no 1e-7 noise)."""
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01,
                            eps=1e-4)


def _config(case: dict[str, Any]) -> dict[str, Any]:
    return dict(replicas=case["replicas"], micro_batches=2, schedule=case["schedule"],
                zero=case.get("zero", 0), tracer=case.get("tracer", "fx"),
                cost_model="analytic", link_bandwidth=1e9, link_latency=2e-5)


def _compiled(rank: int, world: int, case: dict[str, Any], frozen: tuple[str, ...]
              ) -> tuple[rannc_fx.CompiledModel, nn.Module, nn.Module, Any, Any]:
    """The compiled model, the model, its reference and both Adams over what trains at
    first."""
    torch.manual_seed(0)
    model = _frozen_mlp(frozen)
    ref = copy.deepcopy(model)
    opt, ref_opt = _trainable_adam(model), _trainable_adam(ref)
    x, y = _batch(LOCAL * world, 0)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    cm = rannc_fx.compile(model, opt, test_config(**{**LINK, **_config(case)}, timeout_s=30.0),
                          example_args=(x[mine], y[mine]))
    return cm, model, ref, opt, ref_opt


def _step(cm: rannc_fx.CompiledModel, ref: nn.Module, rank: int, world: int, seed: int,
          opts: tuple[Any, Any], *, check: Any = None) -> None:
    x, y = _batch(LOCAL * world, seed)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    loss, want = cm(x[mine], y[mine]), ref(x, y)
    assert_close(loss, want, **TOL)
    loss.backward()
    want.backward()
    if check is not None:
        check()
    for o in opts:
        o.step()
        o.zero_grad()


def _assert_grads_like(cm: rannc_fx.CompiledModel, ref: nn.Module) -> int:
    """Every gradient of this rank's stage is one process's (or None on a ZeRO-2 replica
    that does not own it; None where one process has none); how many it holds."""
    held = 0
    for gm in cm.stages:
        for name, p in gm.named_parameters():
            want = ref.get_parameter(name).grad
            if want is None:
                assert p.grad is None, f"{name}: a frozen parameter got a gradient"
            elif p.grad is not None:
                assert_close(p.grad, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
                held += 1
    return held


HEAD = ("layers.3.", "head.")  # the last two layers: unfrozen, they move a ZeRO owner in LPT


def _unfreeze(case: dict[str, Any], run: Run) -> dict[str, Any]:
    """A step with the head frozen, two with it unfrozen (every gradient compared at the
    second), one with the first layer frozen again; what the head's owners and optimizer
    hold."""
    cm, model, ref, opt, ref_opt = run.cm, run.model, run.ref, run.opt, run.ref_opt
    me = cm.plan.stages_of_rank(run.rank)[0]
    assert me.zero == case.get("zero", 0) and me.replicas == case["replicas"][0]

    def step(seed: int, check: Any = None) -> None:
        out, want = run.call(run.batch(seed))
        run.backward(out, want)
        if check is not None:
            check()
        run.step()

    step(1)
    # fine-tuning's next phase: the head trains too, at its own learning rate
    for m, o in ((model, opt), (ref, ref_opt)):
        head = [p for n, p in m.named_parameters() if n.startswith(HEAD)]
        for p in head:
            p.requires_grad_(True)
        o.add_param_group({"params": head, "lr": 0.005})
    step(2)
    step(3, check=lambda: _assert_grads_like(cm, ref))
    # and the first layer is frozen again: no gradient, no sum over the replicas
    for m in (model, ref):
        m.layers[0].requires_grad_(False)
    grads: list[int] = []
    step(4, check=lambda: grads.append(_assert_grads_like(cm, ref)))
    own = {id(p) for gm in cm.stages for p in gm.parameters()}
    groups = [[(tuple(p.shape), id(p) in own) for p in g["params"]] for g in opt.param_groups]
    assert all(mine and shape != (0,) for g in groups for shape, mine in g), groups
    assert opt.param_groups[-1]["lr"] == 0.005
    head = [p for gm in cm.stages for n, p in gm.named_parameters() if n.startswith(HEAD)]
    shard = shard_of(opt)
    return {"stage": me.index, "head": len(head), "head_state": sum(bool(opt.state.get(p))
                                                                    for p in head),
            "owners": None if shard is None else sorted(shard.owner[id(p)] for p in head),
            "grads": grads[0]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_head_unfrozen_after_a_step_trains_like_one_process(name):
    case = CASES[name]
    world = sum(case["replicas"])
    # every loss and, after the steps, every parameter (moved) against one process's
    got = [t.extra for t in train_against_reference(
        functools.partial(_frozen_mlp, HEAD), _config(case), world,
        data=functools.partial(_batch, LOCAL * world), optimizer=_trainable_adam, moved=True,
        loop=functools.partial(_unfreeze, case), timeout_s=30.0, wall_s=240.0)]
    holders = [g for g in got if g["head"]]
    assert holders and all(g["head"] == 4 for g in holders)  # 2 weights, 2 biases
    if case.get("zero"):  # the head's Adam state on its owner only, the same owner everywhere
        assert sum(g["head_state"] for g in holders) == 4
        assert len({tuple(g["owners"]) for g in holders}) == 1
    else:
        assert all(g["head_state"] == 4 for g in holders)
    if case.get("zero") == 2:  # each gradient on its owner alone, all of them somewhere
        assert sum(g["grads"] for g in got) == 8  # layers 1-3 and the head, 2 tensors each


def _refused(cm: rannc_fx.CompiledModel, rank: int, world: int, seed: int, *words: str,
             inside: bool = False) -> None:
    x, y = _batch(LOCAL * world, seed)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    with cm.no_sync() if inside else nullcontext(), pytest.raises(ValueError) as err:
        cm(x[mine], y[mine])
    for w in words:
        assert w in str(err.value), str(err.value)


def _unroutable(rank: int, world: int, tracer: str) -> str:
    case = dict(replicas=(1, 1), schedule="1f1b", tracer=tracer)
    cm, model, ref, opt, ref_opt = _compiled(rank, world, case, frozen=("layers.0.",
                                                                       "layers.1.", "layers.2."))
    assert [cv.spec.requires_grad for cv in cm.plan.cut_values] == [False]  # stage 0 frozen
    _step(cm, ref, rank, world, 1, (opt, ref_opt))
    model.layers[1].requires_grad_(True)  # on every rank: stage 0's ranks alone hold it
    _refused(cm, rank, world, 2, "'layers.1.", "stage 0", "without a gradient",
             "Compile the model again")
    _refused(cm, rank, world, 3, "'layers.1.")  # until it is undone
    model.layers[1].requires_grad_(False)
    _step(cm, ref, rank, world, 4, (opt, ref_opt))
    return "refused"


@pytest.mark.slow
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_parameter_no_backward_reaches_is_refused_on_every_rank(tracer):
    got = run_ranks(_unroutable, 2, tracer, timeout_s=30.0, wall_s=240.0)
    assert got == ["refused"] * 2


def _apart(rank: int, world: int) -> str:
    case = dict(replicas=(2,), schedule="gpipe")
    cm, model, ref, opt, ref_opt = _compiled(rank, world, case, frozen=("head.",))
    _step(cm, ref, rank, world, 1, (opt, ref_opt))
    if rank == 0:  # one replica alone
        model.head.requires_grad_(True)
    _refused(cm, rank, world, 2, "set requires_grad on its parameters differently",
             "rank 0: 10", "rank 1: 8")
    model.head.requires_grad_(False)
    # accumulating: a change before the sum of the local gradients is refused
    with cm.no_sync():
        x, y = _batch(LOCAL * world, 3)
        mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
        cm(x[mine], y[mine]).backward()
        ref(x, y).backward()
    for m in (model, ref):
        m.head.requires_grad_(True)
    _refused(cm, rank, world, 4, "while gradients accumulated under model.no_sync()",
             inside=True)
    for m in (model, ref):
        m.head.requires_grad_(False)
    _step(cm, ref, rank, world, 4, (opt, ref_opt))  # sums both calls' gradients
    return "refused"


@pytest.mark.slow
def test_replicas_that_change_apart_or_inside_no_sync_are_refused_on_every_rank():
    assert run_ranks(_apart, 2, timeout_s=30.0, wall_s=240.0) == ["refused"] * 2
