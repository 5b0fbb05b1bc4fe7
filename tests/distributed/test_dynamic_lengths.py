"""Calls of any sequence length up to the plan's train like one process on several ranks
(dynamic padding: every step its own length); a length over the plan's, or lengths that
differ between the ranks in one call, fail on every rank at once with the way out."""

from __future__ import annotations

import functools
import re

import pytest
import torch

import rannc_fx
from examples.models import gpt_example
from tests.dist_utils import run_ranks
from tests.harness import LINK, Run, test_config, train_against_reference

LOCAL = 4  # samples per rank
LONGEST = 24  # the example's length: the plan's largest


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return gpt_example(batch=2, seq=LONGEST, layers=2)[0]
    import transformers

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    if name == "bert-cls":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            **common, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **common, num_key_value_heads=2, use_cache=False))


def _batch(name: str, samples: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """A padded batch of ``length`` tokens: each sample's own length, padding on the right."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (samples, length), generator=g)
    if name == "gpt":
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    pad = torch.zeros(samples, dtype=torch.long)
    if name == "bert-cls":  # any padding: the loss is a mean over samples
        pad = torch.randint(0, length - 1, (samples,), generator=g)
    else:
        # -100 on the padding: the loss is a mean over counted tokens, which micro-batches
        # weight by samples; every other sample padded alike keeps each slice's count equal
        # (weighting by tokens instead is Config(loss_reduction=...)'s, not this test's)
        pad[1::2] = min(5, length - 2)
    mask = (torch.arange(length)[None, :] < (length - pad)[:, None]).long()
    ids = ids * mask
    if name == "bert-cls":
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.randint(0, 3, (samples,), generator=g)}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _step_batch(name: str, world: int, lengths: tuple[int, ...], step: int
                ) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch: ``lengths[step - 1]`` tokens (step 0, the example: the longest)."""
    length = LONGEST if step == 0 else lengths[step - 1]
    return _batch(name, LOCAL * world, length, seed=step)


def _every_length(name: str, lengths: tuple[int, ...], run: Run) -> None:
    assert [d.size for d in run.cm.plan.dynamic_dims] and all(
        d.size == LONGEST for d in run.cm.plan.dynamic_dims)
    for step, length in enumerate(lengths, 1):
        out, want = run.call(run.batch(step))
        assert out["logits"].shape[:2] == (LOCAL, length) or name == "bert-cls"
        run.backward(out, want)
        run.step()


@pytest.mark.parametrize(
    "name,world,cfg",
    [
        ("gpt", 3, dict(replicas=(2, 1), micro_batches=2, schedule="1f1b")),
        ("bert-cls", 2, dict(replicas=(1, 1), micro_batches=2)),
        ("llama", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b")),
    ],
)
def test_every_length_up_to_the_plan_s_trains_like_one_process(name, world, cfg):
    lengths = (LONGEST, 13, 2, 19, LONGEST, 13)  # 13 twice: its executor is kept
    train_against_reference(functools.partial(_model, name), cfg, world,
                            data=functools.partial(_step_batch, name, world, lengths),
                            loop=functools.partial(_every_length, name, lengths),
                            timeout_s=30.0, wall_s=240.0)


def _refused(rank: int, world: int, what: str) -> tuple[str, float]:
    model = _model("gpt")
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    batch = {k: v[mine] for k, v in _batch("gpt", LOCAL * world, LONGEST, seed=0).items()}
    cfg = test_config(**LINK, timeout_s=90.0, micro_batches=2,
                      replicas=(2, 1) if world == 3 else (1, 1),
                      dynamic_dims="batch" if what == "batch only" else "auto")
    cm = rannc_fx.compile(model, None, cfg, example_kwargs=batch)
    if what == "longer":
        bad = {k: torch.cat([v, v[:, :8]], dim=1) for k, v in batch.items()}
    else:  # the last rank passes half the length
        short = rank == world - 1
        bad = {k: v[:, : LONGEST // 2] if short else v for k, v in batch.items()}
    try:
        cm(**bad)
        message = "ran"
    except ValueError as e:
        message = str(e)
    return message, float(cm(**batch)["loss"])  # the next call, as planned, runs


@pytest.mark.parametrize(
    "what,world,expected",
    [
        ("one shorter", 3, r"the ranks passed input 0 \('input_ids'\) dimension 1 \(input_ids.1\) "
                           r"of different sizes \(rank 0: 24, rank 1: 24, rank 2: 12\); every rank "
                           r"must pass the same length"),
        ("longer", 2, r"input 0 \('input_ids'\) dimension 1 \(input_ids.1\) is 32 on every rank, outside the "
                      r"sizes 2..24 the plan covers .* plan with an example of the longest length"),
        ("batch only", 2, r"rank 0: as planned; rank 1: input 0 \('input_ids'\) has shape "
                          r"\(4, 12\) and dtype int64\); .*expects 'input_ids' \(4, 24\) int64"
                          r".*only the batch dimension"),
    ],
)
def test_lengths_the_plan_cannot_take_fail_on_every_rank_at_once(what, world, expected):
    # wall_s far below the 90 s timeout: no rank waits for one whose input was refused
    results = run_ranks(_refused, world, what, timeout_s=90.0, wall_s=25.0)
    for message, loss in results:
        assert re.search(expected, message), message
        assert loss == results[0][1] and loss == loss  # every rank has the same finite loss
