"""``Config(loss_reduction="sum")``: the step's loss is the sum of the micro-batch slices'
losses, each backward seeded with 1, so a summed loss, or one the model divides by a global
count of counted tokens, trains exactly like one process (the default weights slices by their
share of samples, exact for a mean over samples)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.harness import Batch, Run, as_batch, optimizer, train_against_reference
from tests.unit.test_loss_reduction import SEQ, VOCAB, SummedMLP, _batch

LOCAL = 4  # samples per rank
ADAM = optimizer(torch.optim.Adam, lr=0.01)


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


def _inputs(name: str, batch: Batch, rank: int, world: int) -> tuple[Batch, Batch]:
    """This rank's part and the whole batch; the token LM's also get the global batch's count
    of counted tokens, which each rank adds up from every rank's own count."""
    whole = batch[0]
    mine = tuple(t[rank * LOCAL:(rank + 1) * LOCAL] for t in whole)
    if name == "sum":
        return (mine, {}), (whole, {})
    counted = (mine[1] != -100).sum().float()
    dist.all_reduce(counted)  # the recipe: the global count from every rank's own, in one line
    return ((*mine, counted), {}), ((*whole, (whole[1] != -100).sum().float()), {})


def _accumulating(name: str, accumulate: int, run: Run) -> None:
    """3 steps of ``accumulate`` calls each (gradient accumulation), scaled by GradScaler,
    clipped, the norms compared."""
    for step in range(3):
        for k in range(accumulate):
            out, want = run.call(as_batch(_batch(name, LOCAL * run.world, 10 * step + k + 1)))
            run.backward(out, want)
        run.step()


def _summed_plan(run: Run) -> None:
    assert run.cm.plan.loss_reduction == "sum"


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
    model = SummedMLP if name == "sum" else TokenLM
    train_against_reference(
        model, dict(loss_reduction="sum", **cfg), world, optimizer=ADAM,
        data=functools.partial(_batch, name, LOCAL * world),
        split=functools.partial(_inputs, name), scaler=2.0**10, clip=1.0,
        loop=functools.partial(_accumulating, name, accumulate), check=_summed_plan,
        wall_s=180.0)


def _llama_batch(samples: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences of their own lengths: ``-100`` labels and a zero mask there."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (samples, SEQ), generator=g)
    pad = torch.randint(0, SEQ - 2, (samples,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < (SEQ - pad)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def _llama() -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False))


def _llama_split(batch: Batch, rank: int, world: int) -> tuple[Batch, Batch]:
    """This rank's samples and the whole batch, each with the global count of the labels the
    causal LM counts (after the shift): from each rank's own, and from the whole batch."""
    whole = batch[1]
    mine = {k: v[rank * LOCAL:(rank + 1) * LOCAL] for k, v in whole.items()}
    n = (mine["labels"][:, 1:] != -100).sum()
    dist.all_reduce(n)
    counted = (whole["labels"][:, 1:] != -100).sum()
    return ((), {**mine, "num_items_in_batch": n}), ((), {**whole, "num_items_in_batch": counted})


@pytest.mark.parametrize("world,cfg", [
    (2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b")),
    (3, dict(replicas=(2, 1), micro_batches=2, schedule="gpipe")),
])
def test_a_causal_lm_over_counted_tokens_trains_like_one_process(world, cfg):
    pytest.importorskip("transformers")
    train_against_reference(_llama, dict(loss_reduction="sum", **cfg), world, optimizer=ADAM,
                            data=functools.partial(_llama_batch, LOCAL * world),
                            split=_llama_split, wall_s=240.0)
