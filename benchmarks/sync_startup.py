"""What starting every stage from rank 0's model adds to ``compile()``'s start-up.

    torchrun --nproc-per-node 2 benchmarks/sync_startup.py --replicas 2
    torchrun --nproc-per-node 2 benchmarks/sync_startup.py --replicas 2 --no-sync
    torchrun --nproc-per-node 4 benchmarks/sync_startup.py --replicas 2,2

Every rank seeds by its rank, builds a stack of ``--layers`` Linear layers of ``--width``
(16 x 4096: 1.0 GiB of float32 parameters) on the CPU and calls ``rannc_fx.compile(model,
optimizer, example_args=...)`` under a forced plan (``--replicas``: one replica count a stage;
the analytic cost model and fixed link figures, so no probe or per-op timing runs). With the
transfer on (the default, ``Config(sync_module_states=True)``) rank 0 sends every stage's
tensors to its ranks; ``--no-sync`` skips it. Rank 0 prints one line a rank: seconds to build
the model, seconds in ``compile()``, seconds in the transfer (``sync_stages``, wrapped here),
peak resident memory; then whether every stage's replicas hold the same parameters (a float64
checksum a stage), which they do only with the transfer.

``--ddp`` is the peer: the same model wrapped in ``DistributedDataParallel`` instead (one
replica a rank, gloo), whose construction broadcasts rank 0's parameters and buffers; its
seconds stand in both the compile and the transfer column.

    torchrun --nproc-per-node 2 benchmarks/sync_startup.py --ddp
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import rannc_fx
import rannc_fx.startup.rank as startup_rank
from rannc_fx import Config
from rannc_fx.runtime import init_distributed

MiB = 2**20
SYNC_SECONDS: list[float] = []


class Stack(nn.Module):
    """``layers`` Linear(width, width) + ReLU; the mean square of the output is the loss."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.square().mean()


def _timed_sync() -> None:
    """Time every ``sync_stages`` call of the start-up (it is what the transfer costs)."""
    inner = startup_rank.sync_stages

    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SYNC_SECONDS.append(time.perf_counter() - t0)

    startup_rank.sync_stages = run  # type: ignore[assignment]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="Linear layers (default: 16)")
    p.add_argument("--width", type=int, default=4096,
                   help="features in and out of each layer (default: 4096: 64 MiB a weight)")
    p.add_argument("--replicas", default="2",
                   help="replica count of each stage, comma-separated, summing to the world "
                   "size (default: 2, one stage on two ranks)")
    p.add_argument("--batch", type=int, default=2, help="samples per rank (default: 2)")
    p.add_argument("--no-sync", action="store_true",
                   help="Config(sync_module_states=False): skip the transfer")
    p.add_argument("--ddp", action="store_true",
                   help="wrap the model in DistributedDataParallel instead of compile() "
                   "(the peer; --replicas is then ignored: one replica a rank)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="process-group timeout in seconds (default: 600)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    replicas = tuple(int(r) for r in args.replicas.split(","))
    torch.set_num_threads(1)
    cfg = Config(
        replicas=replicas, micro_batches=1, tracer="fx", cost_model="analytic",
        link_bandwidth=1e9, link_latency=1e-5, allreduce_bandwidth=1e9,
        device_memory=1 << 40, profile_cache_dir=None, timeout_s=args.timeout,
        sync_module_states=not args.no_sync,
    )  # fmt: skip
    init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    _timed_sync()
    torch.manual_seed(rank)  # each rank draws its own model: the transfer must make them one
    t0 = time.perf_counter()
    model = Stack(args.layers, args.width)
    built = time.perf_counter() - t0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    dist.barrier()
    t0 = time.perf_counter()
    if args.ddp:
        DistributedDataParallel(model)
        compiled = time.perf_counter() - t0
        stages, params, moving = (0,), list(model.parameters()), compiled
    else:
        cm = rannc_fx.compile(model, optimizer, cfg, example_args=(x,))
        compiled = time.perf_counter() - t0
        stages = tuple(st.index for st in cm.plan.stages_of_rank(rank))
        params = [p for g in cm.stages for p in g.parameters()]
        moving = sum(SYNC_SECONDS)
    checksum = sum(float(p.detach().double().sum()) for p in params)
    held = sum(p.nbytes for p in params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = (rank, stages, built, compiled, moving, held, peak, checksum)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with torch.device("meta"):
            total = sum(p.nbytes for p in Stack(args.layers, args.width).parameters())
        how = ("DistributedDataParallel(model)" if args.ddp else
               f"compile, replicas {list(replicas)}, transfer {'off' if args.no_sync else 'on'}")
        print(f"model: {args.layers} x Linear({args.width}, {args.width}), about "
              f"{total / MiB:.0f} MiB of float32; {how}")
        print("| rank | stages | build s | compile s | transfer s | stage MiB | peak RSS MiB |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for r, st, b, c, s, h, pk, _ in rows:
            print(f"| {r} | {list(st)} | {b:.2f} | {c:.2f} | {s:.2f} | {h / MiB:.0f} | "
                  f"{pk / MiB:.0f} |")
        by_stage: dict[tuple[int, ...], set[float]] = {}
        for _, st, *_, ck in rows:
            by_stage.setdefault(st, set()).add(ck)
        alike = all(len(v) == 1 for v in by_stage.values())
        print(f"every stage's replicas hold the same parameters: {'yes' if alike else 'no'}")
        print(f"compile s, max over ranks: {max(r[3] for r in rows):.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
