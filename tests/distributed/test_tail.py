"""Models that mix a batch's samples (a contrastive loss with in-batch negatives) on ranks:
the tail runs once a step on the whole batch, and training is the one-process training:
loss, every gradient, every parameter after Adam steps, outputs. The plan:
``unit/test_tail.py``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import rannc_fx
from tests.captures import COUNTED, PASSES
from tests.dist_utils import local_part
from tests.harness import Run, optimizer, train_against_reference
from tests.unit.test_tail import TOL, BiEncoder, _bi_batch

LOCAL = 4  # samples per rank


def _bi_step(world: int, step: int) -> tuple[torch.Tensor, ...]:
    """Step ``step``'s batch: a smaller one in between (step 0: the example)."""
    local = (LOCAL, LOCAL, LOCAL - 1, LOCAL)[step]
    return _bi_batch(local * world, step)


def _tail_after_training(amp: bool, run: Run) -> list[str]:
    """The whole model's state on rank 0 under the model's names (the tail's once), an
    evaluation (the tail's forward only), and with ``amp`` a call under autocast; the
    inference passes the rank ran."""
    cm, ref, rank, world = run.cm, run.ref, run.rank, run.world
    assert cm.plan.tail is not None and cm.plan.schedule == "gpipe"
    model_sd, _ = rannc_fx.get_state_dict(cm, run.opt, full=True)
    if rank == 0:
        assert model_sd.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():
            assert_close(model_sd[k], v, **TOL)
    G = LOCAL * world
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
    return list(PASSES)


@pytest.mark.parametrize(
    "world,cfg,amp",
    [
        (2, dict(replicas=(1, 1), micro_batches=2), False),
        (3, dict(replicas=(1, 2), micro_batches=2), True),
        (3, dict(replicas=(2, 1), micro_batches=4), False),
    ],
)
def test_in_batch_negatives_train_like_one_process(world, cfg, amp):
    # the loss and the rank's rows of the whole batch's logits, every gradient (Adam would
    # hide a gradient counted twice: it is scale-invariant), every parameter
    trained = train_against_reference(
        BiEncoder, cfg, world, data=functools.partial(_bi_step, world), outputs=True,
        grads=True, check=functools.partial(_tail_after_training, amp), wall_s=180.0,
        patches=COUNTED)
    # rank 0 captured the model and found the shapes (twice: again with the tail's inputs)
    # and the bfloat16 dtypes; the others took its graph and findings with the plan, so they
    # trained on rank 0's graph, tail and dtypes
    assert trained[0].extra == ["capture", "shapes", "shapes", "dtypes"]
    assert all(t.extra == [] for t in trained[1:]), [t.extra for t in trained]


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


def _frozen_key_biases() -> nn.Module:
    model = _clip()
    for name, p in model.named_parameters():
        # a bias added to every key cannot change a softmax: its gradient is rounding noise,
        # which Adam turns into steps that differ between two summation orders (eps=1e-4, as
        # test_compile uses, still leaves 2e-5 gradient differences after 3 steps here)
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return model


def _clip_step(world: int, step: int) -> dict[str, Any]:
    return {**_clip_batch(LOCAL * world, step), "return_loss": True}


def _clip_outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return out.logits_per_text, out.logits_per_image, out.text_embeds


def _has_a_tail(run: Run) -> None:
    assert run.cm.plan.tail is not None


@pytest.mark.parametrize(
    "world,cfg",
    [
        (3, dict(replicas=(2, 1), micro_batches=2)),
        (3, dict(replicas=(1, 2), micro_batches=2, recompute=True)),
    ],
)
def test_clip_with_its_contrastive_loss_trains_like_one_process(world, cfg):
    train_against_reference(_frozen_key_biases, cfg, world,
                            data=functools.partial(_clip_step, world),
                            optimizer=optimizer(torch.optim.Adam, lr=0.01),
                            outputs=_clip_outputs, grads=True, check=_has_a_tail, wall_s=240.0)
