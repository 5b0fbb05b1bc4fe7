"""Where the CPU of a 2-rank pipeline step goes, per thread: the compute thread against gloo's.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/runtime_comm_threads.py

rannc_fx and torch.distributed.pipelining's manual frontend run the same forced 2-stage plan as
``runtime_vs_pipelining.py --mode same-split`` in alternating blocks of ``--steps`` steps; per
block, every thread's CPU ms per step (``/proc/self/task/*/schedstat``, ns resolution) and the
wall ms per step.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import GPT, environment, make_batch  # noqa: E402
from runtime_vs_pipelining import PeerStep, RanncStep  # noqa: E402

from rannc_fx import Config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--d-model", type=int, default=128, help="model width (default: 128)")
    p.add_argument("--layers", type=int, default=8, help="transformer layers (default: 8)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches (default: 4)")
    p.add_argument("--steps", type=int, default=100, help="steps per block (default: 100)")
    p.add_argument(
        "--blocks", type=int, default=3, help="alternating blocks per contender (default: 3)"
    )
    return p.parse_args(argv)  # fmt: skip


def thread_cpu() -> dict[str, float]:
    """Thread name:id -> seconds on CPU, for every thread of this process."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[f"{name}:{tid}"] = ns / 1e9
    return out


def _kind(thread: str) -> str:
    name = thread.split(":")[0]
    return name if name.startswith("gloo") or name.startswith("pt_gloo") else "main and others"


def pipeline_blocks(args: argparse.Namespace) -> list[tuple[str, float, dict[str, float]]]:
    torch.manual_seed(0)
    base = GPT(1024, args.d_model, 4, args.layers, 32)
    ids, labels = make_batch(1024, 16, 32)
    cfg = Config(replicas=(1, 1), micro_batches=args.micro_batches, leaf_modules=("Block",),
                 profile_cache_dir=None)  # fmt: skip
    rannc = RanncStep(copy.deepcopy(base), cfg, ids, labels)
    rannc()
    peer = PeerStep(copy.deepcopy(base), [args.layers // 2], args.micro_batches, False, ids, labels)
    contenders: list[tuple[str, Any]] = [("rannc_fx", rannc), ("pipelining-manual", peer)]
    rows = []
    for _ in range(args.blocks):
        for name, step in contenders:
            for _ in range(5):
                step()
            dist.barrier()
            a, t0 = thread_cpu(), time.perf_counter()
            for _ in range(args.steps):
                step()
            dist.barrier()
            wall, b = time.perf_counter() - t0, thread_cpu()
            per: dict[str, float] = {}
            for th, sec in b.items():
                k = _kind(th)
                per[k] = per.get(k, 0.0) + 1e3 * (sec - a.get(th, 0.0)) / args.steps
            rows.append((name, 1e3 * wall / args.steps, per))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = pipeline_blocks(args)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        kinds = sorted({k for r in everyone for _, _, per in r for k in per})
        print(
            "| block | contender | wall ms/step | "
            + " | ".join(f"rank {r} {k} CPU ms/step" for r in range(world) for k in kinds)
            + " |"
        )
        print("|---|---|---:|" + "---:|" * (world * len(kinds)))
        for i, (name, wall, _) in enumerate(everyone[0]):
            cells = [f"{everyone[r][i][2].get(k, 0.0):.2f}" for r in range(world) for k in kinds]
            block = i // 2 + 1
            print(f"| {block} | {name} | {wall:.1f} | " + " | ".join(cells) + " |")
        print("\n".join(environment()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
