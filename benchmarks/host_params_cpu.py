"""What keeping a stage's parameters in host memory costs on CPU ranks: the step against the
same split with its parameters on the device, the bytes fetched against the plan's count,
and the fetched copies alive at once against the plan's device parameters.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/host_params_cpu.py

The GPT of ``runtime_common`` on a forced split (one replica a stage), ``--schedule``,
``--micro-batches`` and the recomputation forced, compiled twice: ``host_params=False`` and
``host_params=True``. They run round-robin (``runtime_common.interleave``); per variant the
median step on rank 0 between barriers and the ratio to the device variant per round. On the
CPU host and device are one memory: a fetch is a copy within it, so the ratio is the cost of
the mechanism (the copies, the saved-tensor hooks, the host-side accumulation), not of a
host link. The plan's transfers are counted at ``DeviceSpec("cpu")``'s memory bandwidth.

Measured beside the plan on every rank, over one step: the bytes its stage fetched
(``HostParams.fetched_bytes``) against ``fetches(rho) x`` its parameter bytes per
micro-batch, and the peak of the fetched copies alive at once (tracked by weak references
to their storages) against the plan's device parameters (``MemoryEstimate.params``, two
windows).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

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
from rannc_fx.runtime.host_params import HostParams, host_of  # noqa: E402
from rannc_fx.search.terms import fetches  # noqa: E402


def tracked(host: HostParams) -> list[int]:
    """Record the peak bytes of ``host``'s fetched copies alive at once (``[peak]``)."""
    live: list[tuple[StorageWeakRef, int]] = []
    peak = [0]
    made = host._copy

    def copy_(p: torch.Tensor, stream: Any) -> Any:
        out = made(p, stream)
        live.append((StorageWeakRef(out[0].untyped_storage()), out[0].nbytes))
        live[:] = [(r, n) for r, n in live if not r.expired()]
        peak[0] = max(peak[0], sum(n for _, n in live))
        return out

    host._copy = copy_  # type: ignore[method-assign]
    return peak


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--recompute", action="store_true", help="every stage recomputes whole")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    rank, world, base, (ids, labels) = start_ranks(a)
    steps: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    hosts: list[HostParams] = []
    for name, host in (("device", False), ("host", True)):
        cfg = Config(profile_cache_dir=None, replicas=(1,) * world, host_params=host,
                     micro_batches=a.micro_batches, schedule=a.schedule,
                     recompute=a.recompute, recompute_layers=False,
                     recompute_selective=False)
        steps[name], cm = compiled_step(base, cfg, ids, labels)
        plans[name] = cm.plan
        if host:
            hosts = [h for gm in cm.stages if (h := host_of(gm)) is not None]
    # one step counted: bytes fetched and the copies alive at once
    peaks = [tracked(h) for h in hosts]
    for h in hosts:
        h.reset_counts()
    steps["host"]()
    plan = plans["host"]
    st = plan.stages_of_rank(rank)[0]
    rho = 1 if st.recompute else 0
    params = sum(q.nbytes for h in hosts for q in h.params.values())
    want_bytes = plan.micro_batches * fetches(rho) * params
    counted = [(sum(h.fetched_bytes for h in hosts), want_bytes, max(x[0] for x in peaks),
                st.memory.params)]
    got: list[Any] = [None] * world
    dist.all_gather_object(got, counted)
    wall, _ = interleave(steps, warmup=a.warmup, steps=a.steps, sync=dist.barrier)
    if rank == 0:
        print("| variant | simulated step ms | measured median ms (p10–p90) | predicted / device "
              "| measured / device (per round) |\n|---|---:|---:|---:|---:|")
        base_sim = plans["device"].simulated_step_ms or plans["device"].predicted_step_ms
        for name, pl in plans.items():
            sim = pl.simulated_step_ms or pl.predicted_step_ms
            s = summarize([1e3 * x for x in wall[name]])
            print(f"| {name} | {sim:.2f} | {s['median']:.2f} ({s['p10']:.2f}–{s['p90']:.2f}) | "
                  f"{sim / base_sim:.3f} | {median_ratio(wall[name], wall['device']):.3f} |")
        print("\n| rank | bytes fetched in a step | the plan's count | measured / plan | "
              "copies alive at once, peak | the plan's device parameters | measured / plan |"
              "\n|---:|---:|---:|---:|---:|---:|---:|")
        for r, rows in enumerate(got):
            for fetched, want, peak, dev in rows:
                print(f"| {r} | {fetched} | {want} | {fetched / want:.3f} | {peak} | {dev} | "
                      f"{peak / dev:.3f} |")
        print("\n" + plans["host"].summary())
        print("\n" + "\n".join(environment()))
        print(f"- command: torchrun --nproc-per-node {world} benchmarks/host_params_cpu.py "
              + " ".join(sys.argv[1:]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
