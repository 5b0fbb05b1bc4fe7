"""The bubble each schedule leaves, measured from a traced step against the simulator's.

Run with torchrun (gloo on CPU, one thread per rank):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/schedule_bubble.py \
        --schedules gpipe 1f1b zbh1 interleaved zbv

The GPT of ``runtime_common`` on a forced split (one replica a lane, ``--micro-batches``,
every layer a leaf), one compiled model per schedule, trained with Adam; steps
``--trace-steps`` are traced (``Config.trace_dir``), and the trace's summary
(``runtime/tracefile.py``) gives each rank's share of the step that it waited (bubble), and
the same share of the plan's simulated step. Per schedule and rank: measured and predicted
bubble, the measured and the simulated step.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import GPT, add_model_args, environment, make_batch  # noqa: E402

import rannc_fx  # noqa: E402
from rannc_fx import Config  # noqa: E402
from rannc_fx.runtime.tracefile import summarize  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches (default: 4)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved", "zbv"],
                   choices=("gpipe", "1f1b", "zbh1", "interleaved", "zbv"))
    p.add_argument("--trace-steps", default="6-8", help="traced steps (default: 6-8)")
    return p.parse_args(argv)


def run(schedule: str, args: argparse.Namespace, base: GPT, ids: torch.Tensor,
        labels: torch.Tensor, out: Path) -> dict[str, Any] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = ids.shape[0] // world
    mine = slice(rank * local, (rank + 1) * local)
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cfg = Config(replicas=(1,) * world, micro_batches=args.micro_batches, schedule=schedule,
                 leaf_modules=("Block",), profile_cache_dir=None, trace_dir=out / schedule,
                 trace_steps=args.trace_steps)
    cm = rannc_fx.compile(model, opt, cfg)
    last = int(args.trace_steps.split("-")[-1])
    for _ in range(last):
        cm(ids[mine], labels[mine]).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    if rank != 0:
        return None
    s = summarize(json.loads((out / schedule / "trace.json").read_text()))
    return {"schedule": schedule, "stages": len(cm.plan.stages), "step_ms": s.step_ms,
            "predicted_ms": s.predicted_ms,
            "rows": [(st.stage, st.ranks, st.measured["bubble"],
                      st.predicted["bubble"] if st.predicted else None) for st in s.stages]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq)
    ids, labels = make_batch(args.vocab, args.batch, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(s, args, base, ids, labels, Path(tmp)) for s in args.schedules]
    if dist.get_rank() == 0:
        print(f"\ntraced steps {args.trace_steps}, m={args.micro_batches}, "
              f"{dist.get_world_size()} ranks\n")
        print("| schedule | stages | rank | measured bubble | predicted bubble | measured step "
              "ms | simulated step ms |\n|---|---:|---:|---:|---:|---:|---:|")
        for r in results:
            assert r is not None
            for _, ranks, got, pred in sorted(r["rows"], key=lambda row: row[1]):
                print(f"| {r['schedule']} | {r['stages']} | {','.join(map(str, ranks))} | "
                      f"{100 * got:.1f} % | "
                      f"{'-' if pred is None else f'{100 * pred:.1f} %'} | {r['step_ms']:.1f} | "
                      f"{r['predicted_ms']:.1f} |")
        print("\n".join(environment()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
