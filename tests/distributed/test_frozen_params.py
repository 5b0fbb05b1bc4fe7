"""Frozen parameters (``requires_grad=False``, a LoRA model's base) on ranks: held by their
stage, but no gradient, no optimizer state, no all-reduce; 2 ranks train a PEFT LoRA Llama
like one process. The plan's memory: ``unit/test_frozen_params.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from rannc_fx.compile import compile as rannc_compile
from rannc_fx.config import Config
from tests.dist_utils import local_part, run_ranks
from tests.hf_models import lora_llama_example
from tests.unit.test_frozen_params import _nbytes

pytest.importorskip("peft")

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 2  # samples per rank


def _local(tree: Any, rank: int, global_batch: int) -> Any:
    return local_part(tree, rank, global_batch, LOCAL)


def _train_lora(rank: int, world: int, cfg: dict[str, Any], steps: int = 3) -> float:
    g = LOCAL * world
    model, args, kwargs = lora_llama_example(batch=g)
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    # every parameter goes to Adam, as many training scripts do: frozen ones must stay put
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-4)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, eps=1e-4)
    config = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0, **cfg)
    cm = rannc_compile(model, opt, config)
    largs, lkwargs = _local((args, kwargs), rank, g)
    for _ in range(steps):
        out, want = cm(*largs, **lkwargs), ref(*args, **kwargs)
        assert_close(out.loss, want.loss, **TOL)
        out.loss.backward()
        want.loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    named = {n: p for gm in cm.stages for n, p in gm.named_parameters()}  # a lane's stages
    trainable = [(n, p) for n, p in named.items() if p.requires_grad]
    # each rank holds adapters (a lane's stages together may hold none: the head and a norm)
    assert trainable or cfg.get("schedule") == "interleaved", "each stage holds adapters"
    held = cm.plan.stages_of_rank(rank)
    assert all(st.replicas == cfg["replicas"][0] for st in held)
    for name, p in named.items():
        if p.requires_grad:
            assert_close(p, ref.get_parameter(name), **TOL, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert p.grad is None and not opt.state.get(p), name
            assert torch.equal(p, before[name]), name
    assert sum(st.memory.grads for st in held) == _nbytes(p for _, p in trainable)
    return out.loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    dict(stages=2, replicas=(1, 1), micro_batches=2, schedule="1f1b"),  # a pipeline
    dict(stages=1, replicas=(2,), micro_batches=1),  # replicas: the adapters' all-reduce
    dict(stages=2, replicas=(1, 1), micro_batches=2, schedule="interleaved"),  # 2 a rank
], ids=["pipeline", "replicas", "interleaved"])
def test_lora_trains_like_one_process(cfg):
    pytest.importorskip("peft")

    losses = run_ranks(_train_lora, 2, cfg, timeout_s=60.0, wall_s=180.0)
    assert len(set(losses)) == 1
