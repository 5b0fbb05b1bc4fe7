"""``Config(loss_reduction="sum")``: the step's loss is the sum of the micro-batch slices'
losses, each backward seeded with 1, so a summed loss, or one the model divides by a global
count of counted tokens, trains exactly like one process (the default weights slices by their
share of samples, exact for a mean over samples)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import rannc_fx
from rannc_fx.config import Config

from tests.dist_utils import assert_like_reference, run_ranks, step_each
from tests.unit.test_loss_reduction import SEQ, SummedMLP, VOCAB, _batch


TOL = dict(rtol=1e-5, atol=1e-5)
LOCAL = 4  # samples per rank


class TokenLM(nn.Module):
    """A causal-LM-like loss over the tokens that count (``-100`` on padding), divided by the
    global batch's count of them, which every rank passes (``n_tokens``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor,
                n_tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.mix(self.embed(ids)))
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                reduction="sum")
        return total / n_tokens


def _train(rank: int, world: int, name: str, cfg: dict[str, Any], accumulate: int) -> list[float]:
    torch.manual_seed(0)
    model = SummedMLP() if name == "sum" else TokenLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    scaler = rannc_fx.GradScaler("cpu", init_scale=2.0**10)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)

    def inputs(batch: tuple[torch.Tensor, ...], local: bool) -> tuple[torch.Tensor, ...]:
        cut = tuple(t[mine] for t in batch) if local else batch
        if name == "sum":
            return cut
        counted = (cut[1] != -100).sum().float()
        if local:  # the recipe: the global count from every rank's own count, in one line
            dist.all_reduce(counted)
        return (*cut, counted)

    config = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0,
                    loss_reduction="sum", **cfg)
    cm = rannc_fx.compile(model, opt, config,
                          example_args=inputs(_batch(name, LOCAL * world, 0), local=True))
    assert cm.plan.loss_reduction == "sum"
    losses = []
    for step in range(3):
        for k in range(accumulate):  # gradient accumulation: several calls, one step
            batch = _batch(name, LOCAL * world, 10 * step + k + 1)
            out, want = cm(*inputs(batch, local=True)), ref(*inputs(batch, local=False))
            assert_close(out, want, **TOL)
            scaler.scale(out).backward()
            ref_scaler.scale(want).backward()
            losses.append(out.item())
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.unscale_(o)
        norm = cm.clip_grad_norm_(1.0)
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        assert_close(norm, ref_norm, **TOL)
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
            o.zero_grad()
    assert_like_reference(cm.stages, ref, **TOL)
    return losses


@pytest.mark.parametrize(
    "name,world,cfg,accumulate",
    [
        ("sum", 3, dict(replicas=(2, 1), micro_batches=2, schedule="gpipe"), 1),
        ("sum", 2, dict(replicas=(1, 1), micro_batches=4, schedule="1f1b"), 2),
        ("tokens", 3, dict(replicas=(2, 1), micro_batches=2, schedule="1f1b"), 1),
        ("tokens", 2, dict(replicas=(1, 1), micro_batches=4, schedule="gpipe"), 2),
        ("sum", 3, dict(replicas=(1, 2), micro_batches=2, schedule="zbh1"), 2),
    ],
)
def test_summed_and_globally_counted_losses_train_like_one_process(name, world, cfg,
                                                                   accumulate):
    losses = run_ranks(_train, world, name, cfg, accumulate, timeout_s=60.0, wall_s=180.0)
    assert all(run == losses[0] for run in losses)


def _llama_batch(samples: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences of their own lengths: ``-100`` labels and a zero mask there."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (samples, SEQ), generator=g)
    pad = torch.randint(0, SEQ - 2, (samples,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < (SEQ - pad)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def _llama(rank: int, world: int, cfg: dict[str, Any]) -> list[float]:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False))
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)

    def local(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v[mine] for k, v in batch.items()}
        # the causal LM counts the labels after the shift; the global count, from each rank's
        n = (out["labels"][:, 1:] != -100).sum()
        dist.all_reduce(n)
        return {**out, "num_items_in_batch": n}

    config = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0,
                    loss_reduction="sum", **cfg)
    cm = rannc_fx.compile(model, opt, config, example_kwargs=local(_llama_batch(LOCAL * world, 0)))
    losses = []
    for step in range(3):
        batch = _llama_batch(LOCAL * world, step + 1)
        n = (batch["labels"][:, 1:] != -100).sum()
        out, want = cm(**local(batch)), ref(**batch, num_items_in_batch=n)
        assert_close(out["loss"], want["loss"], **TOL)
        step_each((out["loss"], opt), (want["loss"], ref_opt))
        losses.append(out["loss"].item())
    assert_like_reference(cm.stages, ref, **TOL)
    return losses


@pytest.mark.parametrize("world,cfg", [
    (2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b")),
    (3, dict(replicas=(2, 1), micro_batches=2, schedule="gpipe")),
])
def test_a_causal_lm_over_counted_tokens_trains_like_one_process(world, cfg):
    pytest.importorskip("transformers")
    losses = run_ranks(_llama, world, cfg, timeout_s=60.0, wall_s=240.0)
    assert all(run == losses[0] for run in losses)
