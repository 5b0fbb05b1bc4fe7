"""``compile()`` start-up per rank on a meta-built BERT: capture, planning, split, placement.

    torchrun --nproc-per-node 2 benchmarks/startup_time.py --layers 64

Every rank builds HF ``BertForPreTraining`` under ``torch.device("meta")`` and calls
``rannc_fx.compile(model, optimizer, example_args=...)``, which plans at once: rank 0 captures,
infers shapes, profiles and searches (analytic cost model, the ``cpu`` preset's link figures so
that no probe runs), every other rank captures and infers shapes itself, then each splits the
graph by the broadcast plan and places its stage. This script times those steps on each rank
by wrapping the functions the start-up calls (the names of this commit or of the layout before
the planner package, whichever the checkout has) and prints one row per rank.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import rannc_fx
from rannc_fx import Config

PHASES = ("capture", "plan", "split", "placement")
# (module, function, phase): the start-up's steps, in both layouts
WRAPPED = (
    ("rannc_fx.startup.rank", "capture_model", "capture"),
    ("rannc_fx.startup.rank", "plan_model", "plan"),
    ("rannc_fx.startup.rank", "split_stages", "split"),
    ("rannc_fx.startup.rank", "place_stage", "placement"),
    ("rannc_fx.setup", "capture_pass", "capture"),
    ("rannc_fx.setup", "infer_values_pass", "capture"),
    ("rannc_fx.setup", "plan_model", "plan"),
    ("rannc_fx.setup", "split_stages", "split"),
    ("rannc_fx.setup", "place_stage", "placement"),
)
SECONDS: dict[str, float] = defaultdict(float)


def _timed(fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[phase] += time.perf_counter() - t0

    return run


def wrap_startup() -> int:
    """Wrap the start-up's steps where this checkout has them; how many were found."""
    found = 0
    for module, name, phase in WRAPPED:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, name):
            setattr(mod, name, _timed(getattr(mod, name), phase))
            found += 1
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=64, help="BERT encoder layers")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (intermediate = 4x)")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    a = p.parse_args()
    import transformers

    found = wrap_startup()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = transformers.BertConfig(hidden_size=a.hidden, num_hidden_layers=a.layers,
                                  num_attention_heads=a.heads, intermediate_size=4 * a.hidden)
    with torch.device("meta"):
        model = transformers.BertForPreTraining(cfg)
    ids = torch.zeros(a.batch, a.seq, dtype=torch.long)
    kwargs = {"labels": ids, "next_sentence_label": torch.zeros(a.batch, dtype=torch.long)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = Config(cost_model="analytic", link_bandwidth=1e9, link_latency=8e-5,
                    allreduce_bandwidth=1e9, profile_cache_dir=None)
    t0 = time.perf_counter()
    rannc_fx.compile(model, optimizer, example_args=(ids,), example_kwargs=kwargs, config=config,
                     init=model._init_weights)
    total = time.perf_counter() - t0
    row = {**{ph: SECONDS.get(ph, 0.0) for ph in PHASES}, "total": total}
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"compile() start-up, {a.layers}-layer meta BERT (hidden {a.hidden}, seq {a.seq}, "
              f"{a.batch} sequences per rank), {world} ranks, {found} steps wrapped, "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| rank | " + " | ".join(f"{ph} s" for ph in PHASES) + " | compile() s |")
        print("|---:|" + "---:|" * (len(PHASES) + 1))
        for r, row in enumerate(rows):
            print(f"| {r} | " + " | ".join(f"{row[ph]:.2f}" for ph in PHASES)
                  + f" | {row['total']:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
