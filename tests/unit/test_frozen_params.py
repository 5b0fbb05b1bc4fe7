"""Frozen parameters (``requires_grad=False``, a LoRA model's base) in the plan: held by their
stage, but none of them in its gradient or optimizer memory; the plan's memory against the
stage modules' bytes and the bytes their forwards save for backward. Training:
``distributed/test_frozen_params.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import rannc_fx
from tests.harness import test_config
from tests.hf_models import lora_llama_example

pytest.importorskip("peft")


def _nbytes(ps: Any) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


def _saved_bytes(gm: torch.fx.GraphModule, inputs: list[Any], skip: set[int]) -> tuple[int, list]:
    """Bytes of the distinct storages a forward of ``gm`` saves for backward (parameters and
    buffers, ``skip``, left out), and its outputs."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = gm(*inputs)
    return sum(saved.values()), list(outs)


def test_plan_counts_gradients_and_optimizer_state_of_trainable_parameters_only():
    model, args, kwargs = lora_llama_example(batch=8, layers=4)
    cfg = test_config(stages=2, replicas=(1, 1),
                      micro_batches=1, optimizer_state_factor=2.0,
                      cost_model="analytic")  # the cut not timed: load-independent
    parted = rannc_fx.partition(model, args, kwargs, world_size=2, config=cfg)
    cg = parted.captured
    env = dict(zip(cg.input_names, cg.flatten_inputs(args, kwargs), strict=True))
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    for st, gm in zip(parted.plan.stages, parted.stages, strict=True):
        trainable = _nbytes(p for p in gm.parameters() if p.requires_grad)
        frozen = _nbytes(p for p in gm.parameters() if not p.requires_grad)
        assert trainable > 0 and frozen > 30 * trainable  # adapters on both stages
        assert st.memory.params == trainable + frozen + _nbytes(gm.buffers())  # all held
        assert st.memory.grads == trainable
        assert st.memory.optimizer_state == 2 * trainable
        # activations: what the stage's forward saves for backward, measured, within 10 %
        inputs = [env[n].detach().requires_grad_(env[n].is_floating_point())
                  if isinstance(env[n], torch.Tensor) else env[n] for n in st.inputs]
        saved, outs = _saved_bytes(gm, inputs, own)
        assert parted.plan.micro_batches == 1 and not st.recompute
        assert abs(st.memory.activations - saved) <= 0.1 * saved, (st.memory, saved)
        env.update(zip(st.outputs, [o.detach() for o in outs], strict=True))
