"""The harness of the ``*_overhead.py`` benchmarks: one compiled model timed against itself.

Each script times contenders that differ in one mechanism (the per-call batch agreement,
the tracing hooks) on the same compiled ``runtime_common.GPT``, interleaved step by step,
and prints one Markdown row per model size. This module holds what they share: the sizes,
the flags, the compiled model, and the run with its header and environment lines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from runtime_common import GPT, environment, make_batch, median_ratio, summarize

import rannc_fx

__all__ = ["SIZES", "Compiled", "overhead_main", "overhead_parser"]

SIZES = {  # name: (vocab, d_model, heads, layers, seq, local batch)
    "small": (1024, 128, 4, 4, 32, 8),
    "medium": (1024, 256, 4, 8, 32, 16),
}


def overhead_parser(doc: str | None, *, steps: int) -> argparse.ArgumentParser:
    """``--sizes``, ``--micro-batches``, ``--warmup`` and ``--steps`` (default ``steps``)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "medium"],
                   help="models: " + "; ".join(f"{k}={v}" for k, v in SIZES.items()))
    p.add_argument("--micro-batches", type=int, default=4, help="forced (default: 4)")
    p.add_argument("--schedule", default=None,
                   choices=("gpipe", "1f1b", "zbh1", "interleaved", "zbv"),
                   help="forced (default: searched)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default: 5)")
    p.add_argument("--steps", type=int, default=steps, help=f"timed rounds (default: {steps})")
    return p


class Compiled:
    """A GPT of size ``name`` compiled on every rank (forced plan: one lane per rank, the
    schedule searched unless named), with Adam and this rank's batch; ``step()`` is one
    training step."""

    def __init__(self, name: str, micro_batches: int, schedule: str | None = None) -> None:
        vocab, d, heads, layers, seq, batch = SIZES[name]
        torch.manual_seed(0)
        model = GPT(vocab, d, heads, layers, seq)
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        self.ids, self.labels = make_batch(vocab, batch, seq, seed=dist.get_rank())
        cfg = rannc_fx.Config(replicas=(1,) * dist.get_world_size(), micro_batches=micro_batches,
                              schedule=schedule, profile_cache_dir=None, profile_repeats=1)
        self.cm = rannc_fx.compile(model, self.opt, cfg, example_args=(self.ids,),
                                   example_kwargs={"labels": self.labels})

    @property
    def shape(self) -> str:
        return self.cm.plan.summary().splitlines()[0].removeprefix("rannc_fx plan: ")

    def step(self) -> None:
        self.cm(self.ids, labels=self.labels).backward()
        self.opt.step()
        self.opt.zero_grad()



def overhead_main(
    args: argparse.Namespace, script: str, header: list[str],
    run: Callable[[str, argparse.Namespace], Any],
) -> None:  # fmt: skip
    """One gloo process group, one thread per rank; the table's header, ``run`` per size, the
    environment and the command (rank 0 prints)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        print("| " + " | ".join(header) + " |")
        print("|---|---|" + "---:|" * (len(header) - 2))
    for name in args.sizes:
        run(name, args)
    if dist.get_rank() == 0:
        print("\n" + "\n".join(environment()))
        print("- command: torchrun --nproc-per-node", dist.get_world_size(),
              f"benchmarks/{script}", " ".join(sys.argv[1:]))
    dist.destroy_process_group()


def medians_ms(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each variant's median, in milliseconds."""
    return {k: summarize(v)["median"] * 1e3 for k, v in samples.items()}


def overhead_vs(wall: dict[str, list[float]], variant: str, base: str) -> str:
    """``variant``'s overhead over ``base``: the median of the per-round ratios, minus one."""
    return f"{100 * (median_ratio(wall[variant], wall[base]) - 1):+.2f} %"

