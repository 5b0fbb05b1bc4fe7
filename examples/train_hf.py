"""Train a Hugging Face GPT-2 (random weights from a config, no download) on synthetic data.

    python examples/train_hf.py
    torchrun --nproc-per-node 2 examples/train_hf.py

The same single-device script as ``train.py`` with the same one added line: an HF model is
captured with ``torch.export`` and called as usual, ``model(input_ids, labels=labels)``
returning a ``CausalLMOutput`` whose ``loss`` is the global batch's.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import rannc_fx


def synthetic_lm_data(samples: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    """Sequences that count up from a random start by a random stride (mod vocab); GPT-2
    shifts the labels itself, so they are the input ids."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=g)
    stride = torch.randint(1, 8, (samples, 1), generator=g)
    tokens = (start + stride * torch.arange(seq)) % vocab
    return TensorDataset(tokens, tokens.clone())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step (local batch)")
    p.add_argument("--layers", type=int, default=2, help="GPT-2 blocks (n_layer)")
    p.add_argument("--d-model", type=int, default=64, help="hidden size (n_embd)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (n_head)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sample")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--stages", type=int, default=None, help="force the stage count (default: searched)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="force the micro-batch count (default: searched)")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--verbose", action="store_true", help="log every compiler pass")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)  # the same initial weights on every rank

    data = synthetic_lm_data(64 * args.batch * world, args.seq, args.vocab)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    cfg = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.d_model, n_layer=args.layers,
        n_head=args.heads, use_cache=False, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model = rannc_fx.compile(  # <- the one added line
        model, optimizer, rannc_fx.Config(stages=args.stages, micro_batches=args.micro_batches)
    )

    step, epoch, t0 = 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for input_ids, labels in loader:
            loss = model(input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0 and step == 0:
                print(model.plan.summary(), flush=True)
            if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step:3d}  loss {loss.item():.4f}  "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
            step += 1
            if step == args.steps:
                break
        epoch += 1
    dist.destroy_process_group()  # as torch.distributed recommends: no abort at exit


if __name__ == "__main__":
    main()
