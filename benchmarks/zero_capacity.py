"""What sharding the optimizer state inside a stage's replicas (ZeRO-1), keeping it in host
memory and recomputing layer by layer buy in the plans: the smallest world size that fits a
model, the largest model that fits a world, and the predicted step of a plan, each with
those ``--without`` names forbidden (``Config(zero=0, offload=False,
recompute_layers=False)``, before) and all searched (after), in one process.

The models are HF ``BertForPreTraining`` built on the meta device (``plan_time.bert``),
planned with the analytic cost model of a ``DeviceSpec`` preset; every figure is the plan's
prediction (the searched closed form, and the schedule simulated).

    python benchmarks/zero_capacity.py smallest --layers 128 --hidden 8192 --heads 64 \\
        --seq 512 --global-batch 256 --device a100-80gb --worlds 33 32 24 20 16
    python benchmarks/zero_capacity.py largest --hidden 1024 --heads 16 --seq 512 \\
        --global-batch 256 --device v100-32gb --world-size 32 --layers 1024 1536 2048
    python benchmarks/zero_capacity.py step --layers 512 --hidden 1024 --heads 16 --seq 512 \\
        --global-batch 256 --device v100-32gb --world-size 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import bert, environment  # noqa: E402

import rannc_fx  # noqa: E402
from rannc_fx import Config, DeviceSpec  # noqa: E402
from rannc_fx.plan.plan import Plan  # noqa: E402
from rannc_fx.search import NoFeasiblePlan  # noqa: E402

GiB = 1024**3


FORBID = {"zero": {"zero": 0}, "offload": {"offload": False},
          "layers": {"recompute_layers": False}, "selective": {"recompute_selective": False},
          "host_params": {"host_params": False}}


def plan(layers: int, a: argparse.Namespace, world: int, searched: bool) -> Plan | str:
    """The plan with everything searched (or what ``--without`` names forbidden), or why
    none fits."""
    model, args, kwargs, _ = bert(layers, a.hidden, heads=a.heads, seq=a.seq)
    forbid = {} if searched else {k: v for f in a.without for k, v in FORBID[f].items()}
    asked = {"zero": a.after_zero} if searched and a.after_zero is not None else {}
    cfg = Config(profile_cache_dir=None, **forbid, **asked)
    try:
        return rannc_fx.partition(model, args, kwargs, world_size=world, device=device(a),
                                  config=cfg, global_batch=a.global_batch).plan
    except NoFeasiblePlan as e:
        return f"no plan ({str(e).split(';')[0][:120]})"


def device(a: argparse.Namespace) -> str | DeviceSpec:
    """The preset, with ``--allreduce-bandwidth`` where given (a cluster whose all-reduces
    cross slower links than its point-to-point transfers)."""
    if a.allreduce_bandwidth is None:
        return str(a.device)
    return DeviceSpec.preset(a.device).model_copy(
        update={"allreduce_bandwidth": a.allreduce_bandwidth})


def describe(p: Plan | str) -> str:
    if isinstance(p, str):
        return p
    reps = "/".join(str(s.replicas) for s in p.stages)
    sharded = sum(s.zero > 0 for s in p.stages)
    levels = "/".join(str(z) for z in sorted({s.zero for s in p.stages if s.zero}))
    off = sum(s.offload for s in p.stages)
    hp = sum(s.host_params for s in p.stages)
    host = max(s.host_bytes for s in p.stages) / GiB
    rc = sum(s.recompute for s in p.stages)
    lay = sum(bool(s.checkpoints) for s in p.stages)
    sel = sum(s.selective for s in p.stages)
    worst = max(s.memory.total for s in p.stages) / p.memory_budget
    sim = f" ({p.simulated_step_ms / 1e3:.2f} s simulated)" if p.simulated_step_ms else ""
    return (f"{len(p.stages)} stages (replicas {reps}), {p.schedule}, m={p.micro_batches}, "
            f"recompute {rc}/{len(p.stages)} ({lay} layer by layer), selective {sel}, "
            f"ZeRO {sharded}/{len(p.stages)}" + (f" (level {levels})" if levels else "")
            + f", offload {off}/{len(p.stages)}, parameters on the host {hp}/{len(p.stages)}"
            + (f" (host {host:.1f} GiB a rank at most)" if off or hp else "")
            + ", largest stage "
            f"{100 * worst:.0f} % of budget; step {p.predicted_step_ms / 1e3:.2f} s{sim}")


def row(what: str, before: Plan | str, after: Plan | str, seconds: float) -> str:
    return f"| {what} | {describe(before)} | {describe(after)} | {seconds:.0f} s |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("goal", choices=("smallest", "largest", "step"))
    p.add_argument("--layers", type=int, nargs="+", default=[128])
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--device", default="a100-80gb")
    p.add_argument("--world-size", type=int, default=32)
    p.add_argument("--worlds", type=int, nargs="+", default=[33, 32, 24, 16])
    p.add_argument("--without", nargs="*", choices=tuple(FORBID), default=list(FORBID),
                   help="what the 'before' plans may not use: ZeRO-1 (zero), offloading "
                   "(offload), recomputation layer by layer (layers), selectively "
                   "(selective), parameters in host memory (host_params)")
    p.add_argument("--allreduce-bandwidth", type=float, default=None,
                   help="bytes/s of the presets' all-reduces (default: their link's)")
    p.add_argument("--after-zero", type=int, choices=(1, 2), default=None,
                   help="the 'after' plans with Config(zero=...) (2: ZeRO-2, asked for)")
    a = p.parse_args(argv)
    after = "all searched" + (f", zero={a.after_zero}" if a.after_zero else "")
    print(f"| case | without {', '.join(a.without) or 'nothing'} (before) | {after} (after) | both "
          "planned in |\n|---|---|---|---:|")
    cases: list[tuple[str, int, int]] = []
    if a.goal == "smallest":
        cases = [(f"{a.layers[0]} x {a.hidden} on {w} x {a.device}", a.layers[0], w)
                 for w in a.worlds]
    else:
        cases = [(f"{n} x {a.hidden} on {a.world_size} x {a.device}", n, a.world_size)
                 for n in a.layers]
    for what, layers, world in cases:
        t0 = time.perf_counter()
        before, after = plan(layers, a, world, False), plan(layers, a, world, True)
        print(row(what, before, after, time.perf_counter() - t0), flush=True)
        if a.goal == "step" and isinstance(before, Plan) and isinstance(after, Plan):
            print(f"\nafter / before, predicted step: "
                  f"{after.predicted_step_ms / before.predicted_step_ms:.3f}; simulated: "
                  f"{(after.simulated_step_ms or 0) / (before.simulated_step_ms or 1):.3f}")
            print(after.summary())
    print(f"\nCommand: python benchmarks/zero_capacity.py {' '.join(sys.argv[1:])}\n"
          f"{environment(a.device)}; seq {a.seq}, global batch {a.global_batch}, fp32 Adam")


if __name__ == "__main__":
    main()
