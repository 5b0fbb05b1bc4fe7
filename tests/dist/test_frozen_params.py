"""Frozen parameters (``requires_grad=False``, a LoRA model's base): held by their stage, but
no gradient, no optimizer state, no all-reduce, and none of them in the plan's gradient or
optimizer memory. Tier 0: the plan's memory against the stage modules' bytes and the bytes
their forwards save for backward; tier 1: 2 ranks train a PEFT LoRA Llama like one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import rannc_fx
from rannc_fx.compile import compile as rannc_compile
from rannc_fx.config import Config

from tests.dist_utils import local_part, run_ranks
from tests.hf_models import lora_llama_example

pytest.importorskip("peft")

TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 2  # samples per rank


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
    cfg = Config(profile_cache_dir=None, profile_repeats=1, stages=2, replicas=(1, 1),
                 micro_batches=1, optimizer_state_factor=2.0)
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
