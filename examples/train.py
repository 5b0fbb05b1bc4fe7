"""Train the built-in Transformer LM on synthetic data: a single-device script plus one line.

    python examples/train.py                         # one process
    torchrun --nproc-per-node 2 examples/train.py    # rannc_fx splits it over 2 ranks

By default each device is taken to hold only 28 MiB (``--device-memory-mib``), less than this
model needs on one rank with Adam even with one micro-batch in flight, so that on 2 ranks the
plan must pipeline it rather than replicate it; pass ``--device-memory-mib 0`` for the
device's real size.

The line marked below is the only change a single-device script needs: ``rannc_fx.compile``
plans the model on its first call (stages, replicas, micro-batches), then each rank runs its
stage. Every rank feeds its own local batch, as with a DistributedSampler, and gets the loss
of the whole global batch back.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import rannc_fx
from rannc_fx.models import TransformerLM


def synthetic_lm_data(samples: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    """Sequences that count up from a random start by a random stride (mod vocab): the next
    token follows from the last two, so an LM can learn it and the loss falls."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=g)
    stride = torch.randint(1, 8, (samples, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step (local batch)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--d-model", type=int, default=128, help="hidden size")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    p.add_argument("--device-memory-mib", type=int, default=28,
                   help="memory per device the plan must fit (0: the device's real size)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--stages", type=int, default=None, help="force the stage count (default: searched)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="force the micro-batch count (default: searched)")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--verbose", action="store_true", help="log every compiler pass")
    return p.parse_args()


def config(args: argparse.Namespace) -> rannc_fx.Config:
    """The options this script exposes; everything else keeps its default (README: Options)."""
    memory = args.device_memory_mib * 2**20 or None
    return rannc_fx.Config(stages=args.stages, micro_batches=args.micro_batches,
                           device_memory=memory)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)  # the same initial weights on every rank

    data = synthetic_lm_data(64 * args.batch * world, args.seq, args.vocab)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    model = TransformerLM(args.vocab, args.d_model, layers=args.layers, seq=args.seq)
    torch.nn.init.normal_(model.embed.weight, std=0.02)  # GPT-2's init for the tied embedding
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model = rannc_fx.compile(model, optimizer, config(args))  # <- the one added line

    step, epoch, t0 = 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for input_ids, labels in loader:
            loss = model(input_ids, labels=labels)["loss"]
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
