"""Frozen parameters (``requires_grad=False``, a LoRA model's base) on ranks: held by their
stage, but no gradient, no optimizer state, no all-reduce; 2 ranks train a PEFT LoRA Llama
like one process. The plan's memory: ``unit/test_frozen_params.py``."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness import Run, train_against_reference
from tests.hf_models import lora_llama_example
from tests.unit.test_frozen_params import _nbytes

pytest.importorskip("peft")

LOCAL = 2  # samples per rank


def _frozen_stay_put(run: Run) -> None:
    """The frozen parameters (all of them in the user's Adam, as many training scripts do):
    no gradient, no optimizer state, never moved; the plan counts the trainable ones' grads."""
    cm, cfg = run.cm, run.spec.config
    named = {n: p for gm in cm.stages for n, p in gm.named_parameters()}  # a lane's stages
    trainable = [(n, p) for n, p in named.items() if p.requires_grad]
    # each rank holds adapters (a lane's stages together may hold none: the head and a norm)
    assert trainable or cfg.get("schedule") == "interleaved", "each stage holds adapters"
    held = cm.plan.stages_of_rank(run.rank)
    assert all(st.replicas == cfg["replicas"][0] for st in held)
    for name, p in named.items():
        if not p.requires_grad:
            assert p.grad is None and not run.opt.state.get(p), name
            assert torch.equal(p, run.before[name]), name  # where it started (the reference's)
    assert sum(st.memory.grads for st in held) == _nbytes(p for _, p in trainable)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    dict(stages=2, replicas=(1, 1), micro_batches=2, schedule="1f1b"),  # a pipeline
    dict(stages=1, replicas=(2,), micro_batches=1),  # replicas: the adapters' all-reduce
    dict(stages=2, replicas=(1, 1), micro_batches=2, schedule="interleaved"),  # 2 a rank
], ids=["pipeline", "replicas", "interleaved"])
def test_lora_trains_like_one_process(cfg):
    pytest.importorskip("peft")

    train_against_reference(functools.partial(lora_llama_example, batch=LOCAL * 2), cfg, 2,
                            example=False, check=_frozen_stay_put, wall_s=180.0)
