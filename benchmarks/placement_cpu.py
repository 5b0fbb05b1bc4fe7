"""Peak memory per rank of a model built on the meta device against one built on the CPU.

    python benchmarks/placement_cpu.py --nproc 4 --device-memory-mib 800
    python benchmarks/placement_cpu.py --nproc 8 --layers 24 --seq 32 --device-memory-mib 870

Runs ``examples/train.py`` (the main job, with ``--report-memory``) under torchrun twice with
the same model, plan and steps, and once a process that only imports torch and rannc_fx:

- ``--meta``: the model is built under ``with torch.device("meta")``; ``compile(...,
  example_args=...)`` plans at once and each rank allocates and initializes only its stage;
- the CPU-built peer: every rank builds (and initializes) the whole model first, then
  ``compile`` frees what its stage does not use;
- the baseline: ``python -c "import torch, rannc_fx"``, what every rank holds anyway.

Each rank reports its process's peak resident set (``getrusage(RUSAGE_SELF).ru_maxrss``)
twice, right after ``compile`` (building, planning and placing) and at the end (two training
steps with Adam), and the bytes of its stage's own tensors (parameters and buffers of
``model.stages[0]``), beside the plan's ``MemoryEstimate`` of its stage (``params``,
``total``). Both runs use the analytic cost model and the ``cpu`` preset's link figures
(``RANNC_FX_COST_MODEL``, ``RANNC_FX_LINK_*``), so they plan alike without a link probe; the
script checks that the two plans have the same stages, replicas and recomputation.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: examples.models
from runtime_common import environment  # noqa: E402

from examples.models import TransformerLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
MiB = 2**20
# the cpu preset's link (rannc_fx/plan/device.py): no probe, the same plan in both runs
PLAN_ENV = {
    "RANNC_FX_COST_MODEL": "analytic",
    "RANNC_FX_LINK_BANDWIDTH": "1e9",
    "RANNC_FX_LINK_LATENCY": "8e-5",
    "RANNC_FX_ALLREDUCE_BANDWIDTH": "1e9",
    "RANNC_FX_PROFILE_CACHE_DIR": "null",
    "OMP_NUM_THREADS": "1",
}
MEMORY_LINE = re.compile(
    r"^memory (after compile|at the end) rank (\d+) stage (\d+): peak RSS ([\d.]+) MiB, "
    r"stage tensors ([\d.]+) MiB \(plan: params ([\d.]+) MiB, total ([\d.]+) MiB\)", re.M,
)


@dataclass
class Rank:
    """What one rank of one run reported (MiB)."""

    stage: int
    placed_rss: float  # peak RSS up to the end of compile(): building, planning, placing
    end_rss: float  # peak RSS of the whole run, training steps included
    held: float  # the stage's own parameters and buffers
    plan_params: float
    plan_total: float


@dataclass
class Run:
    ranks: dict[int, Rank]
    plan: str  # the plan's summary
    shape: list[str]  # the header line; per stage: index, blocks, replicas, recompute
    losses: list[str]
    wall: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=4, help="ranks (default: 4)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default: 32000)")
    p.add_argument("--d-model", type=int, default=1024, help="hidden size (default: 1024)")
    p.add_argument("--layers", type=int, default=8, help="transformer layers (default: 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample (default: 64)")
    p.add_argument("--batch", type=int, default=2, help="samples per rank (default: 2)")
    p.add_argument("--steps", type=int, default=2, help="training steps (default: 2)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="train.py's optimizer: adam (default) or sgd, which keeps no state")
    p.add_argument("--device-memory-mib", type=int, default=800,
                   help="Config(device_memory=...) per rank in MiB (default: 800)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (default: 600)")
    return p.parse_args(argv)


def full_param_bytes(args: argparse.Namespace) -> int:
    """The whole model's parameter bytes (a tied weight once), counted on the meta device."""
    with torch.device("meta"):
        model = TransformerLM(args.vocab, args.d_model, layers=args.layers, seq=args.seq)
    return sum(p.nbytes for p in model.parameters())


def baseline_rss() -> int:
    code = "import resource, torch, rannc_fx; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) * 1024


def train(args: argparse.Namespace, meta: bool) -> Run:
    """One torchrun of examples/train.py --report-memory."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
        "--standalone", str(TRAIN), "--vocab", str(args.vocab),  # a free port of its own
        "--d-model", str(args.d_model), "--layers", str(args.layers), "--seq", str(args.seq),
        "--batch", str(args.batch), "--steps", str(args.steps), "--log-every", "1",
        "--device-memory-mib", str(args.device_memory_mib), "--report-memory",
        "--optimizer", args.optimizer,
        *(["--meta"] if meta else []),
    ]  # fmt: skip
    env = dict(os.environ, **PLAN_ENV)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{'meta' if meta else 'cpu'} run failed:\n{done.stdout}\n{done.stderr}")
    got: dict[str, dict[int, tuple[float, ...]]] = {"after compile": {}, "at the end": {}}
    for when, *nums in MEMORY_LINE.findall(done.stdout):
        got[when][int(nums[0])] = tuple(float(x) for x in nums[1:])
    if any(len(v) != args.nproc for v in got.values()):
        raise SystemExit(f"expected {args.nproc} memory lines of each kind:\n{done.stdout}")
    ranks = {}
    for r, (stage, rss, held, params, total) in got["after compile"].items():
        ranks[r] = Rank(int(stage), rss, got["at the end"][r][1], held, params, total)
    lines = done.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("rannc_fx plan"))
    last = next(i for i, line in enumerate(lines) if line.startswith("predicted step time"))
    plan = "\n".join(lines[first:last + 1])
    shape = [lines[first]] + [
        " ".join(c[i] for i in (0, 1, 5, 9)) for c in (line.split() for line in lines[first:last])
        if c and c[0].isdigit()
    ]
    losses = re.findall(r"^step +\d+ +loss [\d.]+", done.stdout, re.M)
    return Run(ranks, plan, shape, losses, wall)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # as the ranks run (PLAN_ENV): environment() says so
    torch.set_num_threads(1)
    full = full_param_bytes(args) / MiB
    budget = args.device_memory_mib
    base = baseline_rss() / MiB
    runs = {"meta": train(args, meta=True), "cpu": train(args, meta=False)}
    meta, cpu = runs["meta"], runs["cpu"]

    state, k = ("gradients and Adam's two moments", 4) if args.optimizer == "adam" else (
        "gradients (SGD keeps no state)", 2)
    print(f"- whole model: {full:.1f} MiB of fp32 parameters, {full / budget:.2f}x the "
          f"{budget} MiB of Config(device_memory=...); with {state} "
          f"{k * full:.1f} MiB, {k * full / budget:.2f}x")
    print(f"- baseline (a process that imports torch and rannc_fx): peak RSS {base:.1f} MiB")
    for name, run in runs.items():
        print(f"- {name} run: {run.wall:.0f} s wall; " + "; ".join(run.losses))
    if meta.shape == cpu.shape:
        print("- both runs: the same plan (stages, blocks, replicas, recomputation); the meta "
              "run's:\n")
        print("\n".join("    " + line for line in meta.plan.splitlines()))
    else:
        print("- the runs planned DIFFERENTLY; meta:\n")
        print("\n".join("    " + line for line in meta.plan.splitlines()))
        print("\n  CPU-built:\n")
        print("\n".join("    " + line for line in cpu.plan.splitlines()))
    print("\n| rank | stage | plan params MiB | stage tensors MiB | plan total MiB | peak RSS "
          "after compile: meta | CPU-built | peak RSS at the end: meta | CPU-built |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(meta.ranks):
        m, c = meta.ranks[r], cpu.ranks[r]
        print(f"| {r} | {m.stage} | {m.plan_params:.1f} | {m.held:.1f} | {m.plan_total:.1f} | "
              f"{m.placed_rss:.1f} | {c.placed_rss:.1f} | {m.end_rss:.1f} | {c.end_rss:.1f} |")
    print("\nabove the baseline (MiB):\n")
    print("| rank | stage | stage tensors | after compile: meta | CPU-built | CPU-built / meta "
          "| at the end: meta | CPU-built | CPU-built / meta |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(meta.ranks):
        m, c = meta.ranks[r], cpu.ranks[r]
        mp, cp, me, ce = (x - base for x in (m.placed_rss, c.placed_rss, m.end_rss, c.end_rss))
        print(f"| {r} | {m.stage} | {m.held:.1f} | {mp:.1f} | {cp:.1f} | {cp / mp:.2f} | "
              f"{me:.1f} | {ce:.1f} | {ce / me:.2f} |")
    print("\n" + "\n".join(environment()))
    print("- command: python benchmarks/placement_cpu.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
