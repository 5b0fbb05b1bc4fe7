"""Small transformers models built from configs with random weights (no download)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
# transformers loads a model's module at its first use: load them here, once, so that ranks
# forked by ``dist_utils.run_ranks`` find them loaded instead of each loading them again.
for _cls in ("BertForPreTraining", "GPT2LMHeadModel", "ResNetForImageClassification",
             "LlamaForCausalLM", "T5ForConditionalGeneration"):
    getattr(transformers, _cls)

Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def bert_example(batch: int = 4, seq: int = 16, layers: int = 2,
                 dropout: float = 0.0) -> Example:
    cfg = transformers.BertConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    kwargs = {
        "labels": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
        "next_sentence_label": torch.randint(0, 2, (batch,), generator=g),
    }
    return model, (ids,), kwargs


def gpt2_example(batch: int = 4, seq: int = 16, layers: int = 2, vocab: int = 512) -> Example:
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=64, n_layer=layers, n_head=4, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return model, (ids,), {"labels": ids.clone()}


def resnet_example(batch: int = 4, image: int = 32) -> Example:
    cfg = transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10,
    )
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, image, image, generator=g)
    return model, (), {"pixel_values": x, "labels": torch.randint(0, 10, (batch,), generator=g)}


def llama_example(batch: int = 4, seq: int = 16, layers: int = 2, use_cache: bool = False,
                  tie: bool = False) -> Example:
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=use_cache, tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return model, (ids,), {"labels": ids.clone()}


def t5_example(batch: int = 4, seq: int = 16, layers: int = 2) -> Example:
    """An encoder-decoder: two token inputs of different lengths."""
    cfg = transformers.T5Config(
        vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_heads=4,
        decoder_start_token_id=0, use_cache=False, dropout_rate=0.0,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq // 2), generator=g)
    return model, (), {"input_ids": ids, "labels": labels}


def lora_llama_example(batch: int = 4, seq: int = 16, layers: int = 2) -> Example:
    """A PEFT LoRA model on a Llama LM: the base frozen, the adapters trainable; its
    ``forward(*args, **kwargs)`` hands every keyword on through ``**kwargs``."""
    peft = pytest.importorskip("peft")
    model, args, kwargs = llama_example(batch, seq, layers)
    torch.manual_seed(2)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    # PEFT starts lora_B at zero (the adapter adds nothing): move it, so that a stage that
    # dropped an adapter would compute another loss.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model, args, kwargs


def tied_llama_example(batch: int = 4, seq: int = 16) -> Example:
    """Llama with its embedding tied to the LM head, four layers (enough for four stages)."""
    return llama_example(batch=batch, seq=seq, layers=4, tie=True)
