"""One stage with its parameters in host memory, trained on one GPU: the device memory peak
against the plan's, and the step with the fetches overlapped (the plan's window fetched
ahead on a side stream) and without (window 0: each parameter copied when its op needs it),
beside the same stage with its parameters on the device.

    python benchmarks/host_params_gpu.py --layers 8 --d-model 1024 --seq 512 --batch 8

The model is ``runtime_common``'s GPT, built on the CPU; ``rannc_fx.compile`` in one
process (world size 1) places the stage: with ``host_params=True`` its parameters stay in
pinned host memory and its buffers go to the device. Three variants, each a fresh copy of the
model, run ``--steps`` Adam steps after one warm step; per variant the median step and the
peak of ``torch.cuda.max_memory_allocated`` over the steps against the plan's
``MemoryEstimate.total``. ``--device cpu`` runs the same path on the CPU (times only: no
allocator statistics), to check the script where no GPU is.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import GPT, make_batch  # noqa: E402

import rannc_fx  # noqa: E402
from rannc_fx import Config  # noqa: E402
from rannc_fx.plan.plan import Plan  # noqa: E402

MiB = 2**20


def run(base: GPT, ids: torch.Tensor, labels: torch.Tensor, a: argparse.Namespace,
        host: bool, plan: Plan | None = None) -> tuple[Plan, float, int | None]:
    """``--steps`` steps of a fresh copy: the plan, the median step in s, the device peak."""
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cfg = Config(profile_cache_dir=None, device=a.device, host_params=host, recompute=False,
                 micro_batches=a.micro_batches, schedule="gpipe")
    cm = rannc_fx.compile(model, opt, cfg, plan=plan)
    cuda = a.device == "cuda"
    times: list[float] = []
    peak = 0
    for i in range(a.steps + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        cm(ids, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated()) if i else peak
        if i:
            times.append(time.perf_counter() - t0)
    return cm.plan, statistics.median(times), peak if cuda else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --device cpu)")
    torch.manual_seed(0)
    base = GPT(a.vocab, a.d_model, a.heads, a.layers, a.seq)
    ids, labels = make_batch(a.vocab, a.batch, a.seq)
    if a.device == "cuda":
        ids, labels = ids.cuda(), labels.cuda()
    rows = []
    plan, step, peak = run(base, ids, labels, a, host=False)
    rows.append(("parameters on the device", plan, step, peak))
    plan, step, peak = run(base, ids, labels, a, host=True)
    rows.append(("on the host, window fetched ahead", plan, step, peak))
    alone = plan.model_copy(update={"stages": tuple(
        st.model_copy(update={"window_bytes": 0}) for st in plan.stages)})
    _, step, peak = run(base, ids, labels, a, host=True, plan=alone)
    rows.append(("on the host, nothing fetched ahead", alone, step, peak))
    print("| variant | plan's memory MiB | device peak MiB | peak / plan | median step ms | "
          "step / on the device |\n|---|---:|---:|---:|---:|---:|")
    for name, pl, s, pk in rows:
        mem = pl.stages[0].memory.total
        got = f"{pk / MiB:.0f} | {pk / mem:.3f}" if pk is not None else "n/a | n/a"
        print(f"| {name} | {mem / MiB:.0f} | {got} | {1e3 * s:.1f} | {s / rows[0][2]:.3f} |")
    print(f"\n{rows[1][1].summary()}")
    where = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"\n- {where}, torch {torch.__version__}; command: python "
          f"benchmarks/host_params_gpu.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
