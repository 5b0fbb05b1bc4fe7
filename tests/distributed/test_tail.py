"""Models that mix a batch's samples (a contrastive loss with in-batch negatives) on ranks:
the tail runs once a step on the whole batch, and training is the one-process training:
loss, every gradient, every parameter after Adam steps, outputs. The plan:
``unit/test_tail.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import rannc_fx
from rannc_fx.config import Config
from tests.dist_utils import assert_like_reference, local_part, run_ranks
from tests.unit.test_tail import TOL, BiEncoder, _bi_batch

LOCAL = 4  # samples per rank


def assert_grads_like_reference(stages: Any, ref: nn.Module) -> None:
    """Every parameter's gradient on this rank equals the reference's (Adam would hide a
    gradient counted twice: it is scale-invariant)."""
    for stage in stages:
        for name, p in stage.named_parameters():
            assert_close(p.grad, ref.get_parameter(name).grad, **TOL,
                         msg=lambda m, n=name: f"{n}.grad: {m}")


def _train_bi(rank: int, world: int, cfg: dict[str, Any], amp: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = BiEncoder()
    ref = copy.deepcopy(model)
    # eps=1e-4 as in test_compile: Adam moves an element a full step whatever its gradient's
    # size, so with the default eps a near-zero gradient's rounding (summed in another order)
    # would show as lr-sized differences
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-4)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, eps=1e-4)
    G = LOCAL * world
    config = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0, **cfg)
    cm = rannc_fx.compile(model, opt, config,
                          example_args=local_part(_bi_batch(G, 0), rank, G, LOCAL))
    assert cm.plan.tail is not None and cm.plan.schedule == "gpipe"
    losses = []
    for step, local in enumerate((LOCAL, LOCAL - 1, LOCAL)):  # a smaller batch in between
        G = local * world
        batch = _bi_batch(G, step + 1)
        (loss, logits) = cm(*local_part(batch, rank, G, local))
        (want, want_logits) = ref(*batch)
        assert_close(loss, want, **TOL)
        # the rank's rows of the whole batch's logits
        assert_close(logits, want_logits[rank * local:(rank + 1) * local], **TOL)
        loss.backward()
        want.backward()
        assert_grads_like_reference(cm.stages, ref)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    assert_like_reference(cm.stages, ref, **TOL)
    # the whole model's state on rank 0, under the model's names (the tail's once)
    model_sd, _ = rannc_fx.get_state_dict(cm, opt, full=True)
    if rank == 0:
        assert model_sd.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():
            assert_close(model_sd[k], v, **TOL)
    batch = _bi_batch(G, 9)
    with torch.no_grad():  # evaluation: the tail's forward only
        (loss, logits) = cm(*local_part(batch, rank, G, LOCAL))
        assert_close(loss, ref(*batch)[0], **TOL)
    if amp:  # planned in float32, called under autocast: the tail's inputs move in bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (loss, logits) = cm(*local_part(batch, rank, G, LOCAL))
            (want, want_logits) = ref(*batch)
        assert logits.dtype == want_logits.dtype == torch.bfloat16
        assert_close(loss, want, rtol=2e-2, atol=2e-2)
        loss.backward()
    return losses


@pytest.mark.parametrize(
    "world,cfg,amp",
    [
        (2, dict(replicas=(1, 1), micro_batches=2), False),
        (3, dict(replicas=(1, 2), micro_batches=2), True),
        (3, dict(replicas=(2, 1), micro_batches=4), False),
    ],
)
def test_in_batch_negatives_train_like_one_process(world, cfg, amp):
    losses = run_ranks(_train_bi, world, cfg, amp, timeout_s=60.0, wall_s=180.0)
    assert all(run == losses[0] for run in losses)


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                vocab_size=100, max_position_embeddings=16, bos_token_id=0, eos_token_id=2,
                pad_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=8)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def _clip_batch(samples: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (samples, 7), generator=g)
    ids[:, -1] = 2  # the end-of-text token each caption is pooled at
    return {"input_ids": ids, "pixel_values": torch.randn(samples, 3, 16, 16, generator=g)}


def _train_clip(rank: int, world: int, cfg: dict[str, Any]) -> list[float]:
    torch.manual_seed(0)
    model = _clip()
    for name, p in model.named_parameters():
        # a bias added to every key cannot change a softmax: its gradient is rounding noise,
        # which Adam turns into steps that differ between two summation orders (eps=1e-4, as
        # test_compile uses, still leaves 2e-5 gradient differences after 3 steps here)
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    G = LOCAL * world
    config = Config(profile_cache_dir=None, profile_repeats=1, timeout_s=60.0, **cfg)
    cm = rannc_fx.compile(model, opt, config, example_kwargs={
        **local_part(_clip_batch(G, 0), rank, G, LOCAL), "return_loss": True})
    assert cm.plan.tail is not None
    losses = []
    for step in range(3):
        batch = _clip_batch(G, step + 1)
        out = cm(**local_part(batch, rank, G, LOCAL), return_loss=True)
        want = ref(**batch, return_loss=True)
        assert_close(out.loss, want.loss, **TOL)
        mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
        assert_close(out.logits_per_text, want.logits_per_text[mine], **TOL)
        assert_close(out.logits_per_image, want.logits_per_image[mine], **TOL)
        assert_close(out.text_embeds, want.text_embeds[mine], **TOL)
        out.loss.backward()
        want.loss.backward()
        assert_grads_like_reference(cm.stages, ref)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(out.loss.item())
    assert_like_reference(cm.stages, ref, **TOL)
    return losses


@pytest.mark.parametrize(
    "world,cfg",
    [
        (3, dict(replicas=(2, 1), micro_batches=2)),
        (3, dict(replicas=(1, 2), micro_batches=2, recompute=True)),
    ],
)
def test_clip_with_its_contrastive_loss_trains_like_one_process(world, cfg):
    losses = run_ranks(_train_clip, world, cfg, timeout_s=60.0, wall_s=240.0)
    assert all(run == losses[0] for run in losses)
