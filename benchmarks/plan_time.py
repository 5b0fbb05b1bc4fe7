"""Wall time of ``rannc_fx.partition`` end to end on a meta-device BERT, pass by pass.

The model is HF ``BertForPreTraining`` built under ``torch.device("meta")`` (no weights are
allocated) and planned with the analytic cost model against a ``DeviceSpec`` preset. The
default is the model of RaNNC's BERT example (hidden 2048, 96 layers, 32 heads, intermediate
8192, vocabulary 30522: 4.9 B parameters) for 32 V100-32GB, the case RaNNC's README says
"may take hours" to partition (its example log shows the first iteration after 4 h 16 min).

Each pass logs one line ending in "in N s"; this script reads those lines, so the phases are
the passes' own timings, and "other" is what ``partition`` spends between them.

    python benchmarks/plan_time.py --layers 96 --hidden 2048 --world-size 32 --seq 128 \\
        --global-batch 256 --device v100-32gb
    python benchmarks/plan_time.py --workload bert-256        # one of WORKLOADS
    python benchmarks/plan_time.py --suite --out results.md   # every workload, one process each

``--suite`` runs each workload of ``WORKLOADS`` in its own process (nothing cached between
them), one after another, and prints one table: each row with the 1-minute load average at
its start and end, and the ratio of the 256-layer to the 32-layer BERT-large.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import rannc_fx
from rannc_fx import Config, DeviceSpec
from rannc_fx.search import NoFeasiblePlan

GiB = 1024**3
PHASES = ("capture", "shapes", "profile", "group", "costs", "search", "split")
_FIRST_WORD = {"captured": "capture", "inferred": "shapes", "profiled": "profile",
               "grouped": "group", "cost": "costs", "searched": "search", "split": "split"}
_SECONDS = re.compile(r" in ([0-9.]+) s\b")

# The workloads planning time is judged on: HF BertForPreTraining on the meta device.
WORKLOADS: dict[str, dict[str, Any]] = {
    "bert-32": dict(layers=32, hidden=1024, heads=16, seq=512, global_batch=256,
                    world_size=32, device="v100-32gb"),
    "bert-256": dict(layers=256, hidden=1024, heads=16, seq=512, global_batch=256,
                     world_size=32, device="v100-32gb"),
    "bert-512": dict(layers=512, hidden=1024, heads=16, seq=512, global_batch=256,
                     world_size=32, device="v100-32gb"),
    "bert-100b": dict(layers=128, hidden=8192, heads=64, seq=512, global_batch=1024,
                      world_size=1024, device="a100-80gb"),
    "bert-256-b8": dict(layers=256, hidden=1024, heads=16, seq=512, global_batch=8,
                        world_size=32, device="v100-32gb"),
    "bert-4.9b": dict(layers=96, hidden=2048, heads=32, seq=128, global_batch=64,
                      world_size=8, device="v100-32gb"),
    "bert-1024": dict(layers=1024, hidden=1024, heads=16, seq=512, global_batch=256,
                      world_size=64, device="v100-32gb"),
}


class PhaseTimes(logging.Handler):
    """Collects the "<pass> ... in N s" lines of the rannc_fx logger, by pass."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        phase = _FIRST_WORD.get(text.split(" ", 1)[0])
        found = _SECONDS.search(text)
        if phase and found:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + float(found.group(1))

    def __enter__(self) -> PhaseTimes:
        log = logging.getLogger("rannc_fx")
        self._old = log.level
        log.addHandler(self)
        log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("rannc_fx")
        log.removeHandler(self)
        log.setLevel(self._old)


def bert(layers: int, hidden: int, *, heads: int, seq: int, dtype: str = "float32",
         vocab: int = 30522) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], float]:
    """A meta-device BertForPreTraining with a 2-sequence example batch; and its build time."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=4 * hidden,
                                  max_position_embeddings=max(512, seq))
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.BertForPreTraining(cfg).to(getattr(torch, dtype))
    built = time.perf_counter() - t0
    ids = torch.zeros(2, seq, dtype=torch.long)
    kwargs = {"labels": ids, "next_sentence_label": torch.zeros(2, dtype=torch.long)}
    return model, (ids,), kwargs, built


def environment(device: str | None) -> str:
    import numpy
    import transformers

    text = (f"torch {torch.__version__}, transformers {transformers.__version__}, numpy "
            f"{numpy.__version__}, Python {platform.python_version()}, {platform.machine()}, "
            f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs")
    if device is None:
        return text + "; cost model: analytic against each workload's device preset"
    spec = DeviceSpec.preset(device)
    return (text + f"; cost model: analytic against `{device}` ({spec.memory_bytes / GiB:.0f} "
            f"GiB, links {spec.interconnect_bandwidth / 1e9:g} GB/s)")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=96, help="BERT encoder layers")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (intermediate = 4x)")
    p.add_argument("--heads", type=int, default=32, help="attention heads")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, default=256, help="sequences per step")
    p.add_argument("--world-size", type=int, default=32, help="devices to plan for")
    p.add_argument("--device", default="v100-32gb", choices=DeviceSpec.presets(),
                   help="DeviceSpec preset of the analytic cost model")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="parameter dtype (float16 with --optimizer-state-factor 6 models "
                        "mixed-precision Adam: 16 bytes per parameter)")
    p.add_argument("--optimizer-state-factor", type=float, default=2.0,
                   help="optimizer state bytes per parameter byte (Adam on fp32: 2)")
    p.add_argument("--max-blocks", type=int, nargs="+", default=[Config().max_blocks],
                   help="block counts to plan with (one partition call each)")
    p.add_argument("--out", default=None, help="append a markdown section to this file")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="take layers, hidden, heads, seq, batch, world size and device from "
                        "this preset (it overrides those flags)")
    p.add_argument("--suite", action="store_true",
                   help="run every preset in WORKLOADS, each in its own process, and print "
                        "one table with the load average of each run")
    a = p.parse_args(argv)
    if a.suite:
        suite(a.out)
        return
    if a.workload:
        for k, v in WORKLOADS[a.workload].items():
            setattr(a, k, v)

    rows, summaries = [], []
    for max_blocks in a.max_blocks:
        model, args, kwargs, built = bert(a.layers, a.hidden, heads=a.heads, seq=a.seq,
                                          dtype=a.dtype)
        params = sum(t.numel() for t in model.parameters())
        cfg = Config(profile_cache_dir=None, max_blocks=max_blocks,
                     optimizer_state_factor=a.optimizer_state_factor)
        with PhaseTimes() as phases:
            t0 = time.perf_counter()
            try:
                parted = rannc_fx.partition(model, args, kwargs, world_size=a.world_size,
                                            device=a.device, config=cfg,
                                            global_batch=a.global_batch)
                outcome = (f"{len(parted.plan.stages)} stages, m={parted.plan.micro_batches}, "
                           f"predicted {parted.plan.predicted_step_ms:.0f} ms")
                summaries.append(parted.plan.summary())
                search_s: float | None = parted.plan.search_seconds  # the log line has 0.1 s
            except NoFeasiblePlan as e:
                outcome = f"no plan fits: {e}"
                search_s = None
            total = time.perf_counter() - t0
        s = phases.seconds
        # a failed search logs nothing: it is what partition() spent after the costs
        s["search"] = search_s if search_s is not None else total - sum(s.values())
        other = total - sum(s.values())
        cells = " | ".join(f"{s.get(ph, 0.0):.2f}" for ph in PHASES)
        rows.append(f"| {a.layers} | {a.hidden} | {params / 1e9:.2f} | {a.world_size} "
                    f"| {max_blocks} | {built:.1f} | {cells} | {other:.2f} | **{total:.1f}** "
                    f"| {100 * s.get('search', 0.0) / total:.1f} % | {outcome} |")
        print(rows[-1], flush=True)
        if summaries:
            print(summaries[-1], flush=True)
        del model, args, kwargs
    head = ("| layers | hidden | params (B) | W | max blocks | build s | "
            + " | ".join(f"{ph} s" for ph in PHASES)
            + " | other s | partition() s | search share | plan |\n|"
            + "---:|" * (len(PHASES) + 9) + "---|")
    table = "\n".join([head, *rows])
    print(table)
    if a.out:
        cmd = "python benchmarks/plan_time.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(a.out, "a") as f:
            f.write(f"Command:\n\n    {cmd}\n\n{environment(a.device)}; seq {a.seq}, global "
                    f"batch {a.global_batch}, {a.dtype}, optimizer_state_factor "
                    f"{a.optimizer_state_factor}.\n\n{table}\n\n")
            for text in summaries:
                f.write("```\n" + text + "\n```\n\n")


def suite(out: str | None) -> None:
    """Each workload in a fresh process; rows with the load average at start and end."""
    head = ("| workload | load start / end | " + " | ".join(f"{ph} s" for ph in PHASES)
            + " | other s | partition() s | plan |\n|---|---|" + "---:|" * (len(PHASES) + 2)
            + "---|")
    rows, totals, summaries = [], {}, []
    for name in WORKLOADS:
        start = os.getloadavg()[0]
        done = subprocess.run([sys.executable, __file__, "--workload", name],
                              capture_output=True, text=True, check=False)
        end = os.getloadavg()[0]
        row = next((line for line in done.stdout.splitlines() if line.startswith("| ")
                    and not line.startswith("| layers")), None)
        if row is None:
            print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
            rows.append(f"| {name} | {start:.2f} / {end:.2f} | failed (exit {done.returncode}) |")
            continue
        lines = done.stdout.splitlines()
        at = lines.index(row)
        plan_lines = [line for line in lines[at + 1:] if not line.startswith("|")]
        summaries.append(f"{name}:\n```\n" + "\n".join(plan_lines) + "\n```")
        cells = [c.strip() for c in row.strip("|").split("|")]
        phases, other, total, plan = cells[6:6 + len(PHASES)], cells[-4], cells[-3], cells[-1]
        totals[name] = float(total.strip("*"))
        rows.append(f"| {name} | {start:.2f} / {end:.2f} | " + " | ".join(phases)
                    + f" | {other} | {total} | {plan} |")
        print(rows[-1], flush=True)
    table = "\n".join([head, *rows])
    if "bert-256" in totals and "bert-32" in totals:
        table += (f"\n\ntime(256 layers) / time(32 layers) = "
                  f"{totals['bert-256'] / totals['bert-32']:.2f}")
    print(table)
    if out:
        with open(out, "a") as f:
            f.write("Command:\n\n    python benchmarks/plan_time.py --suite\n\n"
                    f"{environment(None)}\n\n{table}\n\n" + "\n\n".join(summaries)
                    + "\n\n")


if __name__ == "__main__":
    main()
