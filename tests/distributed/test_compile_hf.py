"""``rannc_fx.compile`` on transformers models (export-captured ATen graphs): 5 Adam
steps on forked gloo ranks against the single-process reference, like ``test_compile``."""

from __future__ import annotations

import pytest

from tests.distributed.test_compile import train_zoo_model

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,world,cfg",
    [
        ("gpt2", 2, dict(replicas=(1, 1), micro_batches=2)),
        ("bert", 3, dict(replicas=(2, 1), micro_batches=2)),
        ("resnet", 2, dict(replicas=(1, 1), micro_batches=1)),
    ],
)
def test_hf_trains_like_one_process(name, world, cfg):
    train_zoo_model(name, world, cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,world,cfg",
    [
        ("gpt2", 2, dict(replicas=(1, 1), micro_batches=4, schedule="1f1b", recompute=True)),
        ("bert", 3, dict(replicas=(2, 1), micro_batches=2, schedule="1f1b", recompute=True)),
        ("llama", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b")),
        ("t5", 2, dict(replicas=(1, 1), micro_batches=2, schedule="gpipe", recompute=True)),
        # several stages a rank; GPT-2 and this Llama tie the embedding to the head (ZBV puts
        # both on the first rank), T5 sends the encoder's output to every decoder stage
        ("gpt2", 2, dict(replicas=(1, 1), micro_batches=4, schedule="interleaved")),
        ("gpt2", 3, dict(replicas=(2, 1), micro_batches=2, schedule="zbv")),
        ("tied-llama", 2, dict(replicas=(1, 1), micro_batches=4, schedule="zbv")),
        ("tied-llama", 4, dict(replicas=(2, 2), micro_batches=2, schedule="interleaved",
                               virtual_stages=2, recompute=True)),
        ("t5", 2, dict(replicas=(1, 1), micro_batches=2, schedule="interleaved")),
        # recomputation layer by layer: T5's position bias and encoder output enter every
        # decoder layer, Llama's rotary tables are buffers every layer reads, BERT's mask is
        # made where it is read
        ("t5", 2, dict(replicas=(1, 1), micro_batches=2, schedule="gpipe", recompute=True,
                       recompute_layers=True)),
        ("tied-llama", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b",
                               recompute=True, recompute_layers=True)),
        ("bert", 3, dict(replicas=(2, 1), micro_batches=2, schedule="1f1b", recompute=True,
                         recompute_layers=True)),
        # parameters in host memory, fetched at each use of the exported graphs: the tied
        # Llama's embedding on two stages, BERT's first stage on two replicas, T5's shared
        # embedding and relative position bias
        ("tied-llama", 2, dict(replicas=(1, 1), micro_batches=2, schedule="1f1b",
                               host_params=True)),
        ("bert", 3, dict(replicas=(2, 1), micro_batches=2, schedule="1f1b", recompute=True,
                         host_params=True)),
        ("t5", 2, dict(replicas=(1, 1), micro_batches=2, schedule="gpipe", host_params=True)),
    ],
)
def test_hf_schedules_and_recomputation(name, world, cfg):
    train_zoo_model(name, world, cfg)
