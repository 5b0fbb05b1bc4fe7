"""Predicted step time of rannc_fx's plan against the partitioners users have today.

All plans are scored by the same cost model on the same cost table, so the ratios isolate
the partitioning decision:

- even layer split: the repeated layers divided evenly among stages, as users of
  torch.distributed.pipelining write by hand (embedding in the first stage, head in the last);
- parameter balance: contiguous stages with balanced parameter bytes (DeepSpeed's default);
- time balance: contiguous stages minimising the largest forward+backward time (torchgpipe's
  balance_by_time; solved exactly here, so it is at least as good as torchgpipe's heuristic).

The peers replicate every stage equally (S stages x W/S replicas); each baseline gets its best
stage count S (a divisor of W) and micro-batch count under the memory budget.

    python benchmarks/plan_quality.py --out benchmarks/results/plan_quality_cpu_202611.md
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rannc_fx import Config, DeviceSpec
from rannc_fx.partition import Analysis, analyze
from rannc_fx.passes.search import (
    Evaluation,
    StageChoice,
    evaluate,
    samples_per_replica,
    search_pass,
)

Split = Callable[[Analysis, int, int, int], list[int] | None]  # (a, S, m, r) -> boundaries


@dataclass
class Scored:
    method: str
    stages: tuple[StageChoice, ...]
    micro_batches: int
    evaluation: Evaluation


def layer_starts(a: Analysis) -> list[int]:
    """Block index where each repeated layer begins (the longest ModuleList/Sequential)."""
    model_paths: dict[str, int] = {}
    node_block = {n: b for b, nodes in enumerate(a.blocks.blocks) for n in nodes}
    for node in a.captured.gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        for path, _ in stack.values():
            model_paths.setdefault(path, node_block.get(node.name, -1))
    # group "prefix.<int>" paths by prefix; the prefix with most numbered children wins
    groups: dict[str, dict[int, int]] = {}
    for path, block in model_paths.items():
        head, _, tail = path.rpartition(".")
        if tail.isdigit() and block >= 0:
            groups.setdefault(head, {})[int(tail)] = block
    if not groups:
        raise ValueError("no repeated layers found to split evenly")
    layers = max(groups.values(), key=len)
    return [layers[i] for i in sorted(layers)]


def even_layer_split(a: Analysis, stages: int, m: int, r: int) -> list[int] | None:
    starts = layer_starts(a)
    if stages > len(starts):
        return None
    bounds = [starts[round(k * len(starts) / stages)] for k in range(1, stages)]
    return bounds if len(set(bounds)) == len(bounds) and all(b > 0 for b in bounds) else None


def _min_max_split(weights: np.ndarray, stages: int) -> list[int] | None:
    """Boundaries of ``stages`` contiguous parts minimising the largest part's weight."""
    n = len(weights)
    if stages > n:
        return None
    pre = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((stages + 1, n + 1), np.inf)
    arg = np.zeros((stages + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            i = np.arange(s - 1, j)
            cand = np.maximum(best[s - 1, i], pre[j] - pre[i])
            k = int(np.argmin(cand))
            best[s, j], arg[s, j] = cand[k], i[k]
    bounds, j = [], n
    for s in range(stages, 0, -1):
        j = int(arg[s, j])
        bounds.append(j)
    return sorted(bounds)[1:]


def param_balance(a: Analysis, stages: int, m: int, r: int) -> list[int] | None:
    t = a.table
    return _min_max_split(np.array([t.param_bytes[b, b + 1] for b in range(t.num_blocks)]), stages)


def time_balance(a: Analysis, stages: int, m: int, r: int) -> list[int] | None:
    t = a.table
    q = samples_per_replica(a.space.global_batch, m, r)
    k = int(np.searchsorted(t.sizes, q))
    return _min_max_split(t.fwd[k] + t.bwd[k], stages)


def best_uniform(a: Analysis, method: str, split: Split) -> Scored | None:
    best: Scored | None = None
    w, t = a.space.world_size, a.table
    for stages in (s for s in range(1, w + 1) if w % s == 0):
        r = w // stages
        for m in a.space.micro_batches:
            if m * r > a.space.global_batch:
                continue
            bounds = split(a, stages, m, r)
            if bounds is None:
                continue
            edges = [0, *bounds, t.num_blocks]
            choice = tuple(StageChoice(i, j, r) for i, j in zip(edges, edges[1:], strict=False))
            ev = evaluate(t, a.space, choice, m)
            if not ev.fits:
                continue
            if best is None or ev.step_s < best.evaluation.step_s:
                best = Scored(method, choice, m, ev)
    return best


def gpt2_large_vocab(batch: int) -> tuple:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24,
                                  n_head=16, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.zeros(batch, 1024, dtype=torch.long)
    return model, (ids,), {"labels": ids}


def resnet50(batch: int) -> tuple:
    import transformers

    cfg = transformers.ResNetConfig(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048],
                                    layer_type="bottleneck", num_labels=1000)
    with torch.device("meta"):
        model = transformers.ResNetForImageClassification(cfg)
    x = torch.zeros(batch, 3, 224, 224)
    return model, (), {"pixel_values": x, "labels": torch.zeros(batch, dtype=torch.long)}


CASES = {"gpt2-medium-50k-vocab": gpt2_large_vocab, "resnet50": resnet50}


def run_case(name: str, world: int, batch: int, device: str, memory_gib: float | None) -> list[str]:
    model, args, kwargs = CASES[name](batch)
    cfg = Config(profile_cache_dir=None,
                 device_memory=int(memory_gib * 1024**3) if memory_gib else None)
    a = analyze(model, args, kwargs, world_size=world, device=device, config=cfg)
    t0 = time.perf_counter()
    res = search_pass(a.table, a.space)
    search_s = time.perf_counter() - t0
    scored = [Scored("rannc_fx (searched)", res.stages, res.micro_batches, res.evaluation)]
    for method, fn in (("even layer split", even_layer_split),
                       ("parameter balance", param_balance),
                       ("time balance", time_balance)):
        s = best_uniform(a, method, fn)
        if s is not None:
            scored.append(s)
    ours = scored[0].evaluation.step_s
    rows = []
    for s in scored:
        shape = " ".join(f"{c.end - c.start}b×{c.replicas}" for c in s.stages)
        mem = max(st.memory for st in s.evaluation.stages) / a.space.memory_budget
        rows.append(f"| {name} | {world} | {batch} | {s.method} | {len(s.stages)}: {shape} | "
                    f"{s.micro_batches} | {1e3 * s.evaluation.step_s:.1f} | "
                    f"{s.evaluation.step_s / ours:.2f} | {100 * mem:.0f}% |")
    print(f"{name}: {a.table.num_blocks} blocks, search {search_s:.2f} s")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="v100-32gb", help="DeviceSpec preset for the cost model")
    p.add_argument("--world-size", type=int, nargs="+", default=[8, 16], help="world sizes")
    p.add_argument("--batch", type=int, default=64, help="global batch (samples per step)")
    p.add_argument("--memory-gib", type=float, default=None, help="override device memory")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", default=None, help="write a markdown report here")
    args = p.parse_args()
    head = ("| model | W | batch | method | stages: blocks×replicas | m | predicted step ms | "
            "vs rannc_fx | peak memory / budget |\n|---|---|---|---|---|---|---|---|---|")
    rows = [r for c in args.cases for w in args.world_size
            for r in run_case(c, w, args.batch, args.device, args.memory_gib)]
    report = "\n".join([head, *rows])
    print(report)
    if args.out:
        env = (f"- torch {torch.__version__}, Python {platform.python_version()}, "
               f"{platform.machine()}, cost model: analytic against DeviceSpec "
               f"preset `{args.device}` ({DeviceSpec.preset(args.device).memory_bytes / 1024**3:.0f} GiB)")
        cmd = "python benchmarks/plan_quality.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v is not None)
        with open(args.out, "w") as f:
            f.write(f"# Plan quality: rannc_fx against hand and heuristic splits\n\n{env}\n\n"
                    f"Command:\n\n    {cmd}\n\n{report}\n")


if __name__ == "__main__":
    main()
