"""Overhead of rannc_fx on one rank against a plain eager training step of the same model.

    OMP_NUM_THREADS=1 python benchmarks/runtime_overhead.py

Both contenders train a deep copy of the same GPT (``runtime_common.GPT``) with Adam on the
same batch: ``eager`` runs ``loss = model(ids, labels); loss.backward(); opt.step();
opt.zero_grad()``; ``rannc_fx`` runs the same four lines on ``rannc_fx.compile(model, opt)``
(world size 1, a one-process group, the plan rannc_fx picks). When that plan is one stage and
one micro-batch, a third contender, ``stage alone``, calls the compiled stage GraphModule
directly (same parameters, same optimizer): it separates what the generated code costs from
what the executor around it costs. Steps are interleaved (eager, rannc_fx, stage alone, eager,
...) after ``--warmup`` rounds; an overhead is the median of the per-round ratios minus one. Each ``--sizes`` entry is one model; small models show the fixed
cost per step, large ones the cost that grows with the model.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import GPT, environment, interleave, make_batch, median_ratio, summarize  # noqa: E402

import rannc_fx  # noqa: E402
from rannc_fx import Config  # noqa: E402

SIZES = {  # name: (vocab, d_model, heads, layers, seq, batch)
    "tiny": (256, 64, 4, 2, 16, 4),
    "small": (1024, 128, 4, 4, 32, 8),
    "medium": (1024, 256, 4, 8, 32, 16),
    "large-vocab": (32768, 256, 4, 8, 32, 16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        choices=sorted(SIZES),
        default=["tiny", "small", "medium"],
        help="models to run, each (vocab, d_model, heads, layers, seq, batch): "
        + "; ".join(f"{k}={v}" for k, v in SIZES.items())
        + " (default: tiny small medium)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="force rannc_fx's micro-batch count (default: the plan's own choice)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default: 5)")
    p.add_argument("--steps", type=int, default=50, help="timed rounds per model (default: 50)")
    p.add_argument(
        "--profile-cache",
        action="store_true",
        help="let rannc_fx reuse profiles from its disk cache (default: profile afresh)",
    )
    return p.parse_args(argv)


def run(name: str, args: argparse.Namespace) -> str:
    vocab, d, h, layers, seq, batch = SIZES[name]
    torch.manual_seed(0)
    base = GPT(vocab, d, h, layers, seq)
    ids, labels = make_batch(vocab, batch, seq)

    eager = copy.deepcopy(base)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-4)
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cfg = Config(
        micro_batches=args.micro_batches,
        **({} if args.profile_cache else {"profile_cache_dir": None}),
    )
    compiled = rannc_fx.compile(model, opt, cfg)

    def eager_step() -> None:
        loss = eager(ids, labels)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()

    def rannc_step() -> None:
        loss = compiled(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()

    t0 = time.perf_counter()
    rannc_step()  # plans, then runs the first step
    setup = time.perf_counter() - t0
    plan = compiled.plan
    contenders = {"eager": eager_step, "rannc_fx": rannc_step}
    if len(plan.stages) == 1 and plan.micro_batches == 1:
        # the stage GraphModule called directly (same parameters and optimizer as rannc_fx):
        # what the generated code costs without the executor around it
        stage = compiled.stages[0]
        flat = compiled._captured.flatten_inputs((ids, labels), {})  # private: the flat inputs

        def stage_step() -> None:
            loss = stage(*flat)[0]
            loss.backward()
            opt.step()
            opt.zero_grad()

        contenders["stage alone"] = stage_step
    times, _ = interleave(contenders, warmup=args.warmup, steps=args.steps)
    e, r = summarize(times["eager"]), summarize(times["rannc_fx"])
    ratio = median_ratio(times["rannc_fx"], times["eager"])
    if "stage alone" in times:
        st = summarize(times["stage alone"])
        alone = (
            f"{1e3 * st['median']:.2f} | "
            f"{100 * (median_ratio(times['stage alone'], times['eager']) - 1):+.1f}% | "
            f"{100 * (median_ratio(times['rannc_fx'], times['stage alone']) - 1):+.1f}%"
        )
    else:
        alone = "n/a | n/a | n/a"
    params = sum(p.numel() for p in base.parameters())
    return (
        f"| {name} | {params / 1e6:.2f} M | {plan.micro_batches} | {1e3 * e['median']:.2f} | "
        f"{1e3 * r['median']:.2f} | {1e3 * (r['median'] - e['median']):+.2f} | "
        f"**{100 * (ratio - 1):+.1f}%** | {alone} | {plan.predicted_step_ms:.2f} | {setup:.1f} |"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    for k in [k for k in os.environ if k in ("RANK", "WORLD_SIZE")]:
        raise SystemExit(f"{k} is set: run this without torchrun (it measures world size 1)")
    rows = [run(name, args) for name in args.sizes]
    print(
        "| model | params | m | eager ms | rannc_fx ms | difference ms | rannc_fx overhead "
        "(median of round ratios) | stage alone ms | stage alone vs eager | rannc_fx vs stage "
        "alone | predicted ms | setup s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\n".join(environment()))


if __name__ == "__main__":
    main()
