"""The whole loop a training script runs, on transformers models against one process: steps
under bfloat16 autocast with gradient clipping, a smaller last batch, an evaluation without
autocast; then the parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

import rannc_fx
from rannc_fx.config import Config

from .dist_utils import run_ranks

EXACT = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=3e-2, atol=3e-2)
LOCAL = 4


def _build(name: str, batch: int):  # type: ignore[no-untyped-def]
    from tests import hf_models

    if name == "llama-tied":
        model, args, kwargs = hf_models.llama_example(batch=batch)
        cfg = copy.deepcopy(model.config)
        cfg.tie_word_embeddings = True
        torch.manual_seed(0)
        model = type(model)(cfg)
        return model, args, kwargs
    return hf_models.gpt2_example(batch=batch)


def _loop(rank: int, world: int, name: str) -> float:
    model, args, kwargs = _build(name, LOCAL * world)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def cut(t: torch.Tensor, n: int) -> torch.Tensor:
        return t[rank * n : (rank + 1) * n]

    cfg = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0, replicas=(1,) * world,
                 micro_batches=2, cost_model="analytic", link_bandwidth=1e9, link_latency=1e-4,
                 allreduce_bandwidth=1e9)
    cm = rannc_fx.compile(model, opt, cfg, example_args=tuple(cut(a, LOCAL) for a in args),
                          example_kwargs={k: cut(v, LOCAL) for k, v in kwargs.items()})
    norms = []
    for step, (n, amp) in enumerate([(LOCAL, True), (LOCAL, True), (3, True), (LOCAL, False)]):
        gargs = tuple(a[: n * world] for a in args)
        gkwargs = {k: v[: n * world] for k, v in kwargs.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = cm(*(cut(a, n) for a in gargs), **{k: cut(v, n) for k, v in gkwargs.items()})
            want = ref(*gargs, **gkwargs)
        assert_close(out.loss, want.loss, **(BF16 if amp or step else EXACT))
        out.loss.backward()
        want.loss.backward()
        norm = cm.clip_grad_norm_(0.5)
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert_close(norm.float(), want_norm.float(), **BF16)
        norms.append(norm.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    cm.eval()
    ref.eval()
    with torch.no_grad():
        out = cm(*(cut(a, LOCAL) for a in args), **{k: cut(v, LOCAL) for k, v in kwargs.items()})
        assert_close(out.loss, ref(*args, **kwargs).loss, **BF16)
    for pname, p in cm.stages[0].named_parameters():
        assert_close(p, ref.get_parameter(pname), **BF16, msg=lambda m, n=pname: f"{n}: {m}")
    return norms[0]


@pytest.mark.slow  # ~5 s each: export capture on every rank
@pytest.mark.parametrize("name", ["gpt2", "llama-tied"])
def test_a_whole_training_loop_on_a_transformers_model_follows_one_process(name):
    norms = run_ranks(_loop, 2, name, timeout_s=60.0, wall_s=240.0)
    assert norms[0] == norms[1]
