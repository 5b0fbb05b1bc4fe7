"""What accepting other batch sizes costs a step at the plan's own size.

    torchrun --nproc-per-node 2 benchmarks/batch_sizes_overhead.py

Since ``runtime/batches.py``, each call first agrees with the other ranks on the local batch
sizes and autocast states (one all-gather of two integers a rank) and looks up the executor for
that size. This script times the same compiled model four ways, interleaved step by step
after ``--warmup`` rounds:

- ``checked``: ``model(ids, labels=labels)``, what every call does by default;
- ``unchecked``: the same with ``Config(check_batches=False)`` (no agreement, the lookup stays);
- ``direct``: the plan's executor called directly, as every call did before (no agreement,
  no lookup; the same flattening of inputs and outputs);
- ``again``: ``direct`` once more, so the A/A ratio shows the noise of the run's median.

The overhead is the median of the per-round wall-time ratios minus one; CPU time per step is
given too. Each ``--sizes`` entry is one model (runtime_common.GPT, forced plan of 2 stages).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import GPT, environment, interleave, make_batch, median_ratio, summarize  # noqa: E402

import rannc_fx  # noqa: E402

SIZES = {  # name: (vocab, d_model, heads, layers, seq, local batch)
    "small": (1024, 128, 4, 4, 32, 8),
    "medium": (1024, 256, 4, 8, 32, 16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "medium"],
                   help="models: " + "; ".join(f"{k}={v}" for k, v in SIZES.items()))
    p.add_argument("--micro-batches", type=int, default=4, help="forced (default: 4)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default: 5)")
    p.add_argument("--steps", type=int, default=40, help="timed rounds (default: 40)")
    return p.parse_args(argv)


def run(name: str, args: argparse.Namespace) -> None:
    vocab, d, heads, layers, seq, batch = SIZES[name]
    torch.manual_seed(0)
    model = GPT(vocab, d, heads, layers, seq)
    world = dist.get_world_size()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids, labels = make_batch(vocab, batch, seq, seed=dist.get_rank())
    cfg = rannc_fx.Config(replicas=(1,) * world, micro_batches=args.micro_batches,
                          profile_cache_dir=None, profile_repeats=1)
    cm = rannc_fx.compile(model, opt, cfg, example_args=(ids,), example_kwargs={"labels": labels})
    captured, executor = cm._captured, cm._executor
    assert captured is not None and executor is not None

    def checked() -> None:
        cm(ids, labels=labels).backward()
        opt.step()
        opt.zero_grad()

    def unchecked() -> None:  # Config(check_batches=False): no agreement, the lookup stays
        assert cm._batches is not None
        cm._batches.check = False
        try:
            checked()
        finally:
            cm._batches.check = True

    def direct() -> None:
        flat = captured.flatten_inputs((ids,), {"labels": labels})
        captured.unflatten_outputs(executor.forward(flat)).backward()
        opt.step()
        opt.zero_grad()

    # "again" is "direct" a second time: the A/A ratio is the noise of this run's median
    wall, cpu = interleave({"checked": checked, "unchecked": unchecked, "direct": direct,
                            "again": direct},
                           warmup=args.warmup, steps=args.steps, sync=dist.barrier)
    if dist.get_rank() == 0:
        w = {k: summarize(v)["median"] * 1e3 for k, v in wall.items()}
        c = {k: summarize(v)["median"] * 1e3 for k, v in cpu.items()}
        shape = cm.plan.summary().splitlines()[0].removeprefix("rannc_fx plan: ")
        print(f"| {name} | {shape} | "
              f"{w['direct']:.2f} | {w['checked']:.2f} | "
              f"{100 * (median_ratio(wall['checked'], wall['direct']) - 1):+.2f} % | "
              f"{100 * (median_ratio(wall['unchecked'], wall['direct']) - 1):+.2f} % | "
              f"{100 * (median_ratio(wall['again'], wall['direct']) - 1):+.2f} % | "
              f"{c['direct']:.2f} | {c['checked']:.2f} |", flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        print("| model | plan | direct ms (wall) | checked ms (wall) | overhead (median of "
              "per-round ratios) | check_batches=False | A/A: direct again | direct ms (CPU, "
              "rank 0) | checked ms (CPU, rank 0) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.sizes:
        run(name, args)
    if dist.get_rank() == 0:
        print("\n" + "\n".join(environment()))
        print("- command: torchrun --nproc-per-node", dist.get_world_size(),
              "benchmarks/batch_sizes_overhead.py", " ".join(sys.argv[1:]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
