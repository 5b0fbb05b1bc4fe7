"""The tail's predicted time against its measured time, and the step with it.

    torchrun --nproc-per-node 2 benchmarks/tail_cost.py --batches 256 1024 2048

A bi-encoder with in-batch negatives (two 2-layer 256-wide encoders, a learned temperature,
a symmetric cross-entropy over the ``(batch, batch)`` logits, or one with ``--loss one``) is compiled for 2 ranks (two
stages, one replica each, 2 micro-batches) at each global batch. Its tail (``Plan.tail``: the
logits and the loss, run once a step on the whole batch) is predicted from the profile at
that batch; rank 0 then times the tail module alone, forward and backward on the whole
batch's inputs (median of ``--repeats``), and every rank times whole training steps
(median of ``--steps`` after ``--warmup``) against the plan's predicted step, which adds the
tail's time to the pipeline's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rannc_fx
from rannc_fx.plan.config import Config


class BiEncoder(nn.Module):
    def __init__(self, width: int = 256, symmetric: bool = True) -> None:
        super().__init__()
        self.symmetric = symmetric
        self.query = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.key = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.log_temp = nn.Parameter(torch.tensor(0.5))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        logits = F.normalize(self.query(q), dim=-1) @ F.normalize(self.key(k), dim=-1).T
        logits = logits * self.log_temp.exp()
        labels = torch.arange(len(logits))
        if not self.symmetric:
            return F.cross_entropy(logits, labels)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _median_ms(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(global_batch: int, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = global_batch // world
    torch.manual_seed(0)
    model = BiEncoder(args.width, symmetric=args.loss == "symmetric")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(local, args.width, generator=g)
    k = torch.randn(local, args.width, generator=g)
    config = Config(stages=world, micro_batches=2, profile_cache_dir=None)
    cm = rannc_fx.compile(model, opt, config, example_args=(q, k))
    plan = cm.plan
    assert plan.tail is not None

    def step() -> None:
        cm(q, k).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    step_ms = _median_ms(step, args.steps)
    if rank == world - 1:  # the tail's stage: its module alone on the whole batch
        tail = cm.stages[-1].get_submodule("tail")
        xs = [torch.randn(v.shape_for(global_batch), requires_grad=True)
              for v in plan.tail.inputs]

        def tail_step() -> None:
            outs = tail(*xs)
            outs[0].backward()

        tail_ms = _median_ms(tail_step, args.repeats)
        predicted = plan.tail.fwd_ms + plan.tail.bwd_ms
        print(f"| {global_batch} | {predicted:.2f} | {tail_ms:.2f} | {tail_ms / predicted:.2f} "
              f"| {plan.predicted_step_ms:.1f} | {step_ms:.1f} | "
              f"{step_ms / plan.predicted_step_ms:.2f} |", flush=True)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--loss", choices=("symmetric", "one"), default="symmetric",
                   help="CLIP's two cross-entropies (one over the transposed logits) or one")
    args = p.parse_args()
    rannc_fx.runtime.init_distributed()
    torch.set_num_threads(1)
    if dist.get_rank() == dist.get_world_size() - 1:
        print("| global batch | tail predicted ms | tail measured ms | ratio | step predicted ms "
              "| step measured ms | ratio |\n|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for b in args.batches:
        run(b, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
