"""What tracing costs a step: nothing measurable when it is off.

    torchrun --nproc-per-node 2 benchmarks/trace_overhead.py

The tracing hooks (``runtime/trace.py``) leave two tests in the untraced path: one per
``_run`` of the executor and one per wait for received messages. This script times the same
compiled model (``Config.trace_dir`` unset) four ways, interleaved step by step after
``--warmup`` rounds:

- ``off``: the code as it is, tracing off;
- ``no hooks``: the executor's loop and the stage's waits replaced by the code before
  tracing (no tests at all);
- ``again``: ``no hooks`` once more, so the A/A ratio shows the noise of the run's median;
- ``recording``: every step recorded (a recorder that never writes; its events are dropped
  after each step), what a traced step pays.

The ratios are medians of per-round wall-time ratios to ``no hooks``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import GPT, environment, interleave, make_batch, median_ratio, summarize  # noqa: E402

import rannc_fx  # noqa: E402
from rannc_fx.runtime.executor import StageExecutor  # noqa: E402
from rannc_fx.runtime.trace import Recorder  # noqa: E402

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
    p.add_argument("--steps", type=int, default=100, help="timed rounds (default: 100)")
    return p.parse_args(argv)


def _untraced_run(executor: StageExecutor) -> Any:
    """The executor's loop as it was before tracing."""
    def run(step: Any, actions: list[Any]) -> None:
        dispatch = executor._dispatch
        for a in actions:
            dispatch[a.kind](step, a.microbatch)
    return run


def run(name: str, args: argparse.Namespace) -> None:
    vocab, d, heads, layers, seq, batch = SIZES[name]
    torch.manual_seed(0)
    model = GPT(vocab, d, heads, layers, seq)
    world, rank = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids, labels = make_batch(vocab, batch, seq, seed=rank)
    cfg = rannc_fx.Config(replicas=(1,) * world, micro_batches=args.micro_batches,
                          profile_cache_dir=None, profile_repeats=1)
    cm = rannc_fx.compile(model, opt, cfg, example_args=(ids,), example_kwargs={"labels": labels})
    ex = cm._executor
    assert isinstance(ex, StageExecutor) and cm._batches is not None
    hooked_run, hooked_wait = ex._run, ex.runner._wait
    plain_run = _untraced_run(ex)
    recorder = Recorder(range(1, 1 << 30), Path("unused"), rank=rank, world=world,
                        stage=ex.stage.index, replica=ex.replica, device=ex.device)

    def step() -> None:
        cm(ids, labels=labels).backward()
        opt.step()
        opt.zero_grad()

    def off() -> None:
        step()

    def no_hooks() -> None:
        ex._run = plain_run  # type: ignore[method-assign]
        ex.runner._wait = lambda pending, match, i: pending.wait()  # type: ignore[method-assign]
        try:
            step()
        finally:
            ex._run, ex.runner._wait = hooked_run, hooked_wait  # type: ignore[method-assign]

    def recording() -> None:
        cm._trace = recorder
        cm._batches.set_trace(recorder)  # type: ignore[union-attr]
        try:
            step()
        finally:
            recorder.events.clear()
            recorder.starts.clear()
            recorder.plans.clear()
            recorder.on = False
            cm._trace = None
            ex.set_trace(None)
            cm._batches.trace = None  # type: ignore[union-attr]

    recorder.clock = {"offset_ns": {}}  # no alignment: it would be a collective per contender
    wall, cpu = interleave(
        {"off": off, "no hooks": no_hooks, "again": no_hooks, "recording": recording},
        warmup=args.warmup, steps=args.steps, sync=dist.barrier,
    )
    if rank == 0:
        w = {k: summarize(v)["median"] * 1e3 for k, v in wall.items()}
        shape = cm.plan.summary().splitlines()[0].removeprefix("rannc_fx plan: ")

        def vs(k: str) -> str:
            return f"{100 * (median_ratio(wall[k], wall['no hooks']) - 1):+.2f} %"

        print(f"| {name} | {shape} | {w['no hooks']:.2f} | {w['off']:.2f} | {vs('off')} | "
              f"{vs('again')} | {w['recording']:.2f} | {vs('recording')} |", flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        print("| model | plan | no hooks ms | off ms | off vs no hooks | A/A: no hooks again | "
              "recording ms | recording vs no hooks |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.sizes:
        run(name, args)
    if dist.get_rank() == 0:
        print("\n" + "\n".join(environment()))
        print("- command: torchrun --nproc-per-node", dist.get_world_size(),
              "benchmarks/trace_overhead.py", " ".join(sys.argv[1:]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
