"""``model.no_sync()`` (``runtime/accumulation.py``): 4 calls inside and 1 outside, then
``optimizer.step()``, train like one process over the 5 batches (every call's loss, every
gradient after the 5th call; every parameter after 2 such steps and a third whose window
opens on gradients a call outside summed), with each sum over ranks (the replicas'
all-reduce, a tied weight's over its holders, ZeRO-2's reduce-scatter) run once per call
outside and never inside; across schedules, ZeRO-2, a tied and partly frozen model,
parameters in host memory, both capture paths and ``GradScaler`` with clipping after the
sync call. A step or a clip with unsummed gradients, and ranks that disagree on
``no_sync()``, are refused on every rank."""

from __future__ import annotations

import functools
from collections import Counter
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import rannc_fx
from examples.models import MLP
from rannc_fx.runtime import grad_shards, grads
from tests.harness import Run, optimizer, train_against_reference

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 4  # samples per rank
# per optimizer step, which calls run under no_sync(): 4 inside then 1 outside, twice; then
# a window that opens on gradients a call outside summed (kept on one rank of each group)
STEPS = [(True,) * 4 + (False,)] * 2 + [(False, True, True, True, False)]
VOCAB, SEQ = 40, 6

_SUMS: list[str] = []  # this process's sums over ranks of gradients, by what they sum


class TiedLM(nn.Module):
    """An embedding tied to the LM head (the plan's shared parameter across two stages)
    and a frozen bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
        self.body[0].bias.requires_grad_(False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.body(self.embed(ids)), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch(model: str, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if model == "tied":
        ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
        return ids, torch.roll(ids, -1, dims=1)
    return torch.randn(samples, 32, generator=g), torch.randint(0, 10, (samples,), generator=g)


def _count_sums() -> None:
    """Record in ``_SUMS`` each sum over ranks this rank's gradients go through."""
    real_all_reduce, real_collective = grads.all_reduce_flat, grad_shards.collective

    def all_reduce_flat(tensors: Any, group: Any, *, what: str, **kw: Any) -> Any:
        _SUMS.append(what)
        return real_all_reduce(tensors, group, what=what, **kw)

    def collective(start: Any, what: str, **kw: Any) -> Any:
        _SUMS.append(what)
        return real_collective(start, what, **kw)

    grads.all_reduce_flat = all_reduce_flat  # type: ignore[assignment]  # a worker of its own
    grad_shards.collective = collective  # type: ignore[assignment]


def _model(name: str) -> nn.Module:
    return TiedLM() if name == "tied" else MLP(depth=3)


def _windows(case: dict[str, Any], run: Run) -> dict[str, Any]:
    """The ``STEPS`` windows: each call's loss against one process's, every gradient after a
    window's last call, the sums over ranks each call made (none inside ``no_sync()``); with
    GradScaler, clipping after the sync call (the norms compared)."""
    rank, world, cm, ref = run.rank, run.world, run.cm, run.ref
    scaler, ref_scaler = run.scaler, run.ref_scaler
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    sums = []
    for step, inside in enumerate(STEPS):
        _SUMS.clear()
        for k, quiet in enumerate(inside):
            x, y = _batch(case["model"], LOCAL * world, 10 * step + k + 1)
            summed = len(_SUMS)
            with cm.no_sync() if quiet else nullcontext():
                loss = cm(x[mine], y[mine])
                (scaler.scale(loss) if scaler is not None else loss).backward()
            want = ref(x, y)
            (ref_scaler.scale(want) if ref_scaler is not None else want).backward()
            run.compare(loss, want)
            if quiet:
                assert len(_SUMS) == summed, f"summed inside no_sync(): {_SUMS[summed:]}"
            if case.get("refusals") and step == 0 and k == len(inside) - 2:
                _refused(cm, run.opt)
        sums.append(Counter(_SUMS))
        if scaler is not None:
            for s, o in ((scaler, run.opt), (ref_scaler, run.ref_opt)):
                s.unscale_(o)
        _assert_grads_like(cm, ref, sharded=case.get("zero", 0) == 2)
        if scaler is not None:
            assert_close(cm.clip_grad_norm_(0.5), nn.utils.clip_grad_norm_(ref.parameters(), 0.5),
                         **TOL)
        for s, o in ((scaler, run.opt), (ref_scaler, run.ref_opt)):
            if s is not None:
                s.step(o)
                s.update()
            else:
                o.step()
            o.zero_grad()
    if case.get("refusals"):
        _refused_apart(cm, rank, x[mine], y[mine])
    held = {st.index for st in cm.plan.stages_of_rank(rank)}
    sums_here = any(len(ranks) > 1 for ranks in (
        *(cm.plan.stages[s].ranks for s in held),
        *({r for s in sp.stages for r in cm.plan.stages[s].ranks}
          for sp in cm.plan.shared_params if held & set(sp.stages))))
    return {"sums": sums, "shared": len(cm.plan.shared_params), "losses": run.losses,
            "sums_here": sums_here}


def _refused(cm: rannc_fx.CompiledModel, opt: torch.optim.Optimizer) -> None:
    """A step or a clip with the no_sync() calls' gradients unsummed: refused, nothing moved."""
    kept = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) with gradients accumulated"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_ with gradients accumulated"):
        cm.clip_grad_norm_(1.0)
    for p, q in zip(opt.param_groups[0]["params"], kept, strict=True):
        assert torch.equal(p, q)


def _refused_apart(cm: rannc_fx.CompiledModel, rank: int, x: torch.Tensor,
                   y: torch.Tensor) -> None:
    """Rank 0 inside no_sync(), the others outside: every rank refuses the call."""
    with cm.no_sync() if rank == 0 else nullcontext():
        with pytest.raises(ValueError, match=r"rank 0: inside, rank 1: outside"):
            cm(x, y)


def _assert_grads_like(cm: rannc_fx.CompiledModel, ref: nn.Module, *, sharded: bool) -> None:
    """Every gradient this rank holds equals the one process's after the 5th call (ZeRO-2:
    None on a replica that does not step the parameter, held by some)."""
    held = 0
    for gm in cm.stages:
        for name, p in gm.named_parameters():
            want = ref.get_parameter(name)
            if not p.requires_grad:
                assert p.grad is None and want.grad is None
                continue
            if p.grad is None and sharded:
                continue
            assert p.grad is not None, f"{name}: no gradient"
            assert_close(p.grad, want.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            held += 1
    assert held > 0


CASES = {
    # one stage: the replicas' all-reduce; GradScaler, clipping after the sync call, refusals
    "one-stage-two-replicas-1f1b": dict(model="mlp", replicas=(2,), schedule="1f1b",
                                        scaler=True, refusals=True),
    "one-stage-two-replicas-export-host-params": dict(
        model="mlp", replicas=(2,), schedule="gpipe", tracer="export", host_params=True),
    "two-stages-two-replicas-gpipe": dict(model="mlp", replicas=(2, 2), schedule="gpipe"),
    # the sync call's gradients held until loss.backward(), scaled there by GradScaler's scale
    "two-stages-two-replicas-1f1b": dict(model="mlp", replicas=(2, 2), schedule="1f1b",
                                         scaler=True),
    "zbh1-zero2": dict(model="mlp", replicas=(2, 1), schedule="zbh1", zero=2),
    "one-stage-gpipe-zero2": dict(model="mlp", replicas=(2,), schedule="gpipe", zero=2),
    # the embedding and the LM head on two stages: one sum over all their ranks, and the
    # first stage's replicas' own
    "tied-weight-1f1b": dict(model="tied", replicas=(2, 1), schedule="1f1b"),
    # four stages on two lanes, the tied weight's two stages on the first
    "tied-weight-zbv": dict(model="tied", replicas=(2, 1), schedule="zbv"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_accumulating_under_no_sync_trains_like_one_process(name):
    case = CASES[name]

    world = sum(case["replicas"])
    cfg = dict(replicas=case["replicas"], micro_batches=2, schedule=case["schedule"],
               zero=case.get("zero", 0), host_params=case.get("host_params", False),
               tracer=case.get("tracer", "fx"), cost_model="analytic", link_bandwidth=1e9,
               link_latency=2e-5)
    # every stage's parameters against one process's at the end, and moved (a stage of a
    # lane may hold no trainable one)
    got = [t.extra for t in train_against_reference(
        functools.partial(_model, case["model"]), cfg, world,
        data=functools.partial(_batch, case["model"], LOCAL * world),
        optimizer=optimizer(torch.optim.SGD, lr=0.1, momentum=0.9),
        scaler=2.0**10 if case.get("scaler") else None, moved=True, setup=_count_sums,
        loop=functools.partial(_windows, case), timeout_s=30.0)]
    assert all(r["losses"] == got[0]["losses"] for r in got)
    if case["model"] == "tied":
        assert got[0]["shared"] == 1
    for rank, r in enumerate(got):
        for step, inside in zip(r["sums"], STEPS, strict=True):
            # each sum once per call outside no_sync(), on every rank in a group (replicas,
            # the tied weight's holders)
            assert bool(step) == r["sums_here"], f"rank {rank}: {dict(step)}"
            assert set(step.values()) <= {inside.count(False)}, f"rank {rank}: {dict(step)}"
            if case.get("zero") == 2 and rank < 2:  # the stage with two replicas
                assert any(w.startswith("reduce-scatter") for w in step)
