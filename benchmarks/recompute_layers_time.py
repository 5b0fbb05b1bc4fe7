"""What recomputation costs in step time, whole stages against layer by layer and selective,
measured on CPU ranks beside the plan's prediction.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/recompute_layers_time.py

The GPT of ``runtime_common`` (its Blocks as leaf modules) on a forced split (one replica a
stage), ``--schedule`` and ``--micro-batches`` forced, compiled four times: no
recomputation, every stage recomputing whole (``Config(recompute=True,
recompute_layers=False, recompute_selective=False)``), every stage layer by layer
(``recompute_layers=True``) and every stage selectively (``recompute_selective=True``). They
run round-robin (``runtime_common.interleave``: each round's steps moments apart under
the same load); per variant the median step on rank 0 between barriers, the plan's simulated
step, and the ratios to no recomputation, measured per round and predicted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import (  # noqa: E402
    add_model_args,
    compiled_step,
    environment,
    interleave,
    median_ratio,
    start_ranks,
    summarize,
)

from rannc_fx import Config  # noqa: E402

VARIANTS = {"none": dict(recompute=False),
            "whole stages": dict(recompute=True, recompute_layers=False,
                                 recompute_selective=False),
            "layer by layer": dict(recompute=True, recompute_layers=True),
            "selective": dict(recompute=True, recompute_selective=True)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    rank, world, base, (ids, labels) = start_ranks(a)
    steps: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    for name, options in VARIANTS.items():
        cfg = Config(profile_cache_dir=None, leaf_modules=("Block",), replicas=(1,) * world,
                     micro_batches=a.micro_batches, schedule=a.schedule, **options)
        steps[name], cm = compiled_step(base, cfg, ids, labels)
        plans[name] = cm.plan
    wall, _ = interleave(steps, warmup=a.warmup, steps=a.steps, sync=dist.barrier)
    if rank == 0:
        print("| variant | checkpoints a stage | simulated step ms | measured median ms (p10–p90) "
              "| predicted / none | measured / none (per round) |\n|---|---|---:|---:|---:|---:|")
        base_sim = plans["none"].simulated_step_ms or plans["none"].predicted_step_ms
        for name, plan in plans.items():
            sim = plan.simulated_step_ms or plan.predicted_step_ms
            s = summarize([1e3 * x for x in wall[name]])
            print(f"| {name} | {'/'.join(str(len(st.checkpoints)) for st in plan.stages)} | "
                  f"{sim:.2f} | {s['median']:.2f} ({s['p10']:.2f}–{s['p90']:.2f}) | "
                  f"{sim / base_sim:.3f} | {median_ratio(wall[name], wall['none']):.3f} |")
        print("\n" + "\n".join(environment()))
        print(f"- command: torchrun --nproc-per-node {world} benchmarks/recompute_layers_time.py "
              + " ".join(sys.argv[1:]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
