"""The plan's predictions against what the runtime does: step time, per-stage time and memory.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/runtime_prediction.py --mode same-split
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/runtime_prediction.py --mode auto \
        --vocab 32768
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 1 benchmarks/runtime_prediction.py --mode auto

Step time: ``plan.predicted_step_ms`` against the median of ``--steps`` steps (each timed on
rank 0 between barriers). Per stage: the plan's forward and backward ms per micro-batch against
the median time of the stage module's forward (forward hooks) and of each micro-batch's
backward (the executor's ``_backward_one``, timed by wrapping it), wall and thread-CPU time,
taken in separate, instrumented steps; the optimizer step's CPU time against ``optimizer_ms``;
for replicated stages, the gradient all-reduce (``GradSync.finish``) against ``allreduce_ms``.

Memory, per stage, against ``plan.stages[s].memory`` (one step, no instrumentation of time):

- params: bytes of the stage module's parameters (unique storages);
- grads: bytes of their ``.grad`` after ``loss.backward()``;
- optimizer state: bytes of Adam's state tensors for them after ``opt.step()``;
- activations: bytes of every storage autograd saves during the step's forward (all
  micro-batches), counted once per storage with ``torch.autograd.graph.saved_tensors_hooks``,
  parameters excluded;
- cut buffers: storages the executor holds between forward and backward (received cut values,
  the stage's outputs kept to run backward from) that autograd did not already save.

The plan's ``workspace`` (the largest transient of one op) is not measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import (  # noqa: E402
    add_model_args,
    environment,
    start_ranks,
    summarize,
)

import rannc_fx  # noqa: E402
from rannc_fx import Config  # noqa: E402
from rannc_fx.schedules.generators import Kind  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--mode",
        choices=("same-split", "auto"),
        default="same-split",
        help="same-split: one replica per stage, --micro-batches, layers as leaves "
        "(the plan of runtime_vs_pipelining's same-split mode); auto: the plan "
        "rannc_fx picks (default: same-split)",
    )
    add_model_args(p)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="same-split: the forced micro-batch count (default: 4)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (default: 30)")
    p.add_argument(
        "--profile-repeats",
        type=int,
        default=3,
        help="rannc_fx's timed runs per profiled op (Config.profile_repeats; default: 3, "
        "the package default)",
    )
    p.add_argument(
        "--profile-cache",
        action="store_true",
        help="let rannc_fx reuse profiles from its disk cache (default: profile afresh)",
    )
    return p.parse_args(argv)


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """data_ptr -> nbytes of the storage of every tensor (non-tensors skipped)."""
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def measure_memory(
    model: Any, opt: torch.optim.Optimizer, step_args: tuple[Any, ...]
) -> dict[str, int]:
    stage = model.stages[0]
    params = list({id(p): p for p in stage.parameters()}.values())
    param_st = _storages(params)
    buf_st = _storages(stage.buffers())
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # holds saved tensors until counted: no address reuse

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        saved.update(_storages([t]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*step_args)
    acts = {k: v for k, v in saved.items() if k not in param_st and k not in buf_st}
    held = model._executor._saved  # the step the executor keeps for backward (private)
    kept: dict[int, int] = {}
    if held is not None:
        for args in held.args.values():
            kept.update(_storages(args))
        for outs in held.outs.values():
            kept.update(_storages(outs))
    cut = {k: v for k, v in kept.items() if k not in acts and k not in param_st and k not in buf_st}
    keep.clear()
    loss.backward()
    # unique storages: after a replica all-reduce every .grad is a view of one flat buffer
    grads = sum(_storages(p.grad for p in params).values())
    opt.step()
    state = sum(_storages(t for p in params for t in opt.state.get(p, {}).values()).values())
    opt.zero_grad()
    return {
        "params": sum(param_st.values()),
        "grads": grads,
        "optimizer_state": state,
        "activations": sum(acts.values()),
        "comm_buffers": sum(cut.values()),
    }


def measure_stage_times(
    model: Any, opt: torch.optim.Optimizer, step_args: tuple[Any, ...], steps: int
) -> dict[str, float]:
    """Median wall and thread-CPU ms of one micro-batch's stage forward and backward, the
    thread-CPU ms of the optimizer step and the wall ms of the gradient all-reduces."""
    ex = model._executor
    got: dict[str, list[float]] = {
        "fwd": [],
        "bwd": [],
        "fwd_cpu": [],
        "bwd_cpu": [],
        "opt_cpu": [],
        "allreduce": [],
        "step_bwd": [],
        "step_bwd_cpu": [],
    }
    t: list[float] = [0.0, 0.0]

    def pre(*_: Any) -> None:
        t[:] = [time.perf_counter(), time.thread_time()]

    def post(*_: Any) -> None:
        got["fwd"].append(time.perf_counter() - t[0])
        got["fwd_cpu"].append(time.thread_time() - t[1])

    h1 = ex.module.register_forward_pre_hook(pre)
    h2 = ex.module.register_forward_hook(post)
    inner = ex._dispatch[ex.stage.index][Kind.B]  # each micro-batch's backward

    def timed(*a: Any, **k: Any) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        inner(*a, **k)
        got["bwd"].append(time.perf_counter() - t0)
        got["bwd_cpu"].append(time.thread_time() - c0)

    finish = ex.grads.reduce

    def timed_finish() -> None:  # the gradient all-reduces after the backwards
        t0 = time.perf_counter()
        finish()
        got["allreduce"].append(time.perf_counter() - t0)

    ex._dispatch[ex.stage.index][Kind.B] = timed
    ex.grads.reduce = timed_finish  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            loss = model(*step_args)
            t0, c0 = time.perf_counter(), time.thread_time()
            loss.backward()
            got["step_bwd"].append(time.perf_counter() - t0)
            got["step_bwd_cpu"].append(time.thread_time() - c0)
            c0 = time.thread_time()
            opt.step()
            got["opt_cpu"].append(time.thread_time() - c0)
            opt.zero_grad()
    finally:
        h1.remove()
        h2.remove()
        ex._dispatch[ex.stage.index][Kind.B] = inner
        del ex.grads.reduce
    if not got["bwd"]:  # one rank, one micro-batch: plain autograd, no per-micro-batch hook
        got["bwd"], got["bwd_cpu"] = got["step_bwd"], got["step_bwd_cpu"]
    return {k: 1e3 * statistics.median(v) if v else 0.0 for k, v in got.items()}


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%" if meas else "n/a (measured 0)"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world, model, step_args = start_ranks(args)
    cache: dict[str, Any] = {"profile_repeats": args.profile_repeats}
    if not args.profile_cache:
        cache["profile_cache_dir"] = None
    if args.mode == "same-split":
        cfg = Config(
            replicas=(1,) * world,
            micro_batches=args.micro_batches,
            leaf_modules=("Block",),
            **cache,
        )
    else:
        cfg = Config(**cache)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cm = rannc_fx.compile(model, opt, cfg)

    def step() -> None:
        loss = cm(*step_args)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # plans
    plan = cm.plan
    times, cpus = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        c1 = time.process_time()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpus.append(c1 - c0)
    mem = measure_memory(cm, opt, step_args)
    st_times = measure_stage_times(cm, opt, step_args, max(5, args.steps // 3))
    mine = {
        "rank": rank,
        "stage": cm._executor.stage.index,
        "mem": mem,
        **st_times,
        "cpu": 1e3 * statistics.median(cpus),
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        dist.destroy_process_group()
        return

    print(plan.summary())
    s = summarize([1e3 * x for x in times])
    print(
        f"\nstep time: predicted {plan.predicted_step_ms:.1f} ms, measured median {s['median']:.1f} "
        f"ms (p10 {s['p10']:.1f}, p90 {s['p90']:.1f}) over {args.steps} steps: error "
        f"{_err(plan.predicted_step_ms, s['median'])}\n"
    )
    m = plan.micro_batches
    print(
        f"per stage, per micro-batch: the plan's ms against the median wall and thread-CPU ms "
        f"of the stage module's forward and of one micro-batch's backward. Step CPU: this "
        f"rank's process CPU ms per step against m x (fwd + bwd) + (m - 1) x accum + allreduce "
        f"+ optim predicted (m={m}); Adam: the plan's optim ms against the thread CPU of "
        f"opt.step().\n"
    )
    print(
        "| stage (rank) | fwd pred | fwd wall | fwd CPU | err (CPU) | bwd pred | bwd wall | bwd CPU "
        "| err (CPU) | step CPU pred | step CPU meas | err | Adam pred | Adam CPU | err |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in everyone:
        st = plan.stages[r["stage"]]
        busy = (m * (st.fwd_ms + st.bwd_ms) + (m - 1) * st.accumulate_ms + st.allreduce_ms
                + st.optimizer_ms)  # fmt: skip
        print(
            f"| {r['stage']} ({r['rank']}) | {st.fwd_ms:.2f} | {r['fwd']:.2f} | {r['fwd_cpu']:.2f} | "
            f"{_err(st.fwd_ms, r['fwd_cpu'])} | {st.bwd_ms:.2f} | {r['bwd']:.2f} | {r['bwd_cpu']:.2f} | "
            f"{_err(st.bwd_ms, r['bwd_cpu'])} | {busy:.1f} | {r['cpu']:.1f} | {_err(busy, r['cpu'])} "
            f"| {st.optimizer_ms:.1f} | {r['opt_cpu']:.1f} | {_err(st.optimizer_ms, r['opt_cpu'])} |"
        )
    if any(plan.stages[r["stage"]].replicas > 1 for r in everyone):
        print(
            "\n| stage (rank) | gradient all-reduce ms, predicted | measured (wall, median) | err |"
        )
        print("|---|---:|---:|---:|")
        for r in everyone:
            st = plan.stages[r["stage"]]
            print(
                f"| {r['stage']} ({r['rank']}) | {st.allreduce_ms:.1f} | {r['allreduce']:.1f} | "
                f"{_err(st.allreduce_ms, r['allreduce'])} |"
            )
    mib = 1024**2
    print("\n| stage (rank) | component | predicted MiB | measured MiB | error |")
    print("|---|---|---:|---:|---:|")
    for r in everyone:
        est = plan.stages[r["stage"]].memory
        total_p = total_m = 0
        for k in ("params", "grads", "optimizer_state", "activations", "comm_buffers"):
            p, m = getattr(est, k), r["mem"][k]
            total_p, total_m = total_p + p, total_m + m
            err = _err(p, m) if m >= 1024 else "(see below)"
            print(f"| {r['stage']} ({r['rank']}) | {k} | {p / mib:.2f} | {m / mib:.2f} | {err} |")
        p = est.activations + est.comm_buffers
        m = r["mem"]["activations"] + r["mem"]["comm_buffers"]
        print(
            f"| {r['stage']} ({r['rank']}) | activations + comm_buffers | {p / mib:.2f} | {m / mib:.2f} "
            f"| {_err(p, m)} |"
        )
        print(
            f"| {r['stage']} ({r['rank']}) | sum of the above | {total_p / mib:.2f} | {total_m / mib:.2f} "
            f"| {_err(total_p, total_m)} |"
        )
        print(
            f"| {r['stage']} ({r['rank']}) | workspace (not measured) | {est.workspace / mib:.2f} | | |"
        )
    print("\n".join(environment()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
