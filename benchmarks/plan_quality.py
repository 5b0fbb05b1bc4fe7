"""Predicted step time of rannc_fx's plan against the partitioners users have today.

Every plan is scored by the same cost model (``rannc_fx.search.evaluate``) on the same
cost table, built once per setting from a meta-device model with the analytic cost model, so
the ratios isolate the partitioning decision. The peers:

- even layer split: the repeated layers (GPT2Block, ResNetBottleNeckLayer, ...) divided
  evenly among stages, the embedding with the first and the head with the last stage; what
  torch.distributed.pipelining users write by hand (``split_spec`` / ``pipe_split()``);
- parameter balance: DeepSpeed's default (``PipelineModule(partition_method="parameters")``):
  the least largest parameter count per stage, each stage filled greedily up to it;
- torchgpipe balance_by_time: torchgpipe's ``blockpartition.solve`` heuristic (Barany et al.,
  "Block partitions of sequences") on per-block forward+backward microseconds;
- min-max time (exact): the partition minimising the largest stage time, solved exactly (what
  the torchgpipe heuristic approximates).

The peers replicate every stage equally (S stages x W/S replicas). Each gets its best stage
count S (a divisor of W, at least 2) and micro-batch count m that fit the memory budget, with
block times taken at the per-replica micro-batch size of that (S, m); the partitioners
themselves never see the budget. "pure data parallel" is the S = 1 plan (its best m), and
"rannc_fx search, replicas forced equal" is the search restricted to S x W/S plans. rannc_fx
searches stage boundaries, a replica count per stage and m; as it is the exact optimum of the
cost model, every ratio is >= 1.00.

    python benchmarks/plan_quality.py --model gpt2-large --world-sizes 16 --batches 16 \\
        --memory-gib 32 24 22 20
    python benchmarks/plan_quality.py --model resnet50 --world-sizes 32 64 --batches 64 \\
        --link-gbs 12.5
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from rannc_fx import Config, DeviceSpec
from rannc_fx.planner.analyze import Analysis, analyze
from rannc_fx.search import (
    Evaluation,
    NoFeasiblePlan,
    StageChoice,
    evaluate,
    samples_per_replica,
    search_pass,
)

GiB = 1024**3

# (a, stages, m, replicas) -> block index where stages 1.. begin, or None when impossible
Split = Callable[[Analysis, int, int, int], list[int] | None]


# -- models (meta device: no weights are allocated) -------------------------------------------
GPT2_SIZES = {  # n_embd, n_layer, n_head
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
    "gpt2-xl": (1600, 48, 25),
}


def gpt2(name: str, seq: int) -> tuple:
    """GPT2LMHeadModel with the 50257-token vocabulary (embedding tied to the LM head)."""
    import transformers

    h, n, a = GPT2_SIZES[name]
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=max(1024, seq), n_embd=h,
                                  n_layer=n, n_head=a, use_cache=False, bos_token_id=0,
                                  eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.zeros(2, seq, dtype=torch.long)
    return model, (ids,), {"labels": ids}


def resnet50(image: int) -> tuple:
    """HF ResNetForImageClassification in the resnet-50 shape (25.6 M parameters)."""
    import transformers

    cfg = transformers.ResNetConfig(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048],
                                    layer_type="bottleneck", num_labels=1000)
    with torch.device("meta"):
        model = transformers.ResNetForImageClassification(cfg)
    x = torch.zeros(2, 3, image, image)
    return model, (), {"pixel_values": x, "labels": torch.zeros(2, dtype=torch.long)}


MODELS = [*GPT2_SIZES, "resnet50"]


def build(name: str, seq: int, image: int) -> tuple:
    return resnet50(image) if name == "resnet50" else gpt2(name, seq)


# -- the peers' partitioners ------------------------------------------------------------------
def layer_starts(a: Analysis) -> list[int]:
    """First block of each repeated layer, in graph order.

    The repeated layers are the instances of one module class that occurs as a numbered
    child (``h.0``, ``layers.3``): the class whose instances cover the most nodes, then the one
    with most instances (ResNet: its 16 bottlenecks, not its 4 stages, which cover the same
    nodes, nor the 48 conv layers inside the bottlenecks, which miss the residual adds).
    """
    node_block = {n: b for b, nodes in enumerate(a.blocks.blocks) for n in nodes}
    first: dict[str, int] = {}  # module path -> first block
    covered: dict[str, set[str]] = {}  # class name -> nodes inside its numbered instances
    instances: dict[str, list[str]] = {}  # class name -> module paths
    for node in a.captured.gm.graph.nodes:
        if node.name not in node_block:
            continue
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            if not path.rpartition(".")[2].isdigit():
                continue
            name = str(getattr(cls, "__name__", cls))
            covered.setdefault(name, set()).add(node.name)
            if path not in first:
                first[path] = node_block[node.name]
                instances.setdefault(name, []).append(path)
    if not instances:
        raise ValueError("no repeated layers (numbered child modules) found to split evenly")
    best = max(instances, key=lambda c: (len(covered[c]), len(instances[c])))
    return sorted(first[p] for p in instances[best])


def even_layer_split(a: Analysis, stages: int, m: int, r: int) -> list[int] | None:
    starts = layer_starts(a)
    if stages > len(starts):
        return None
    bounds = [starts[round(k * len(starts) / stages)] for k in range(1, stages)]
    ok = len(set(bounds)) == len(bounds) and all(b > 0 for b in bounds)
    return bounds if ok else None


def _min_max(weights: np.ndarray, stages: int) -> float:
    """The least possible largest part when ``weights`` is cut into ``stages`` contiguous parts."""
    n = len(weights)
    pre = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for _ in range(stages):
        nxt = np.full(n + 1, np.inf)
        for j in range(1, n + 1):
            nxt[j] = np.min(np.maximum(best[:j], pre[j] - pre[:j]))
        best = nxt
    return float(best[n])


def _greedy_fill(weights: np.ndarray, stages: int, cap: float) -> list[int] | None:
    """Each part takes items while its sum stays within ``cap``; a part is never left empty."""
    n, bounds, acc, start = len(weights), [], 0.0, 0
    for k, w in enumerate(weights):
        left = stages - 1 - len(bounds)  # parts still to open after this one
        if k > start and (acc + w > cap * (1 + 1e-9) or n - k == left) and left > 0:
            bounds.append(k)
            acc, start = 0.0, k
        acc += w
    return bounds if len(bounds) == stages - 1 else None


def min_max_split(weights: np.ndarray, stages: int) -> list[int] | None:
    """Contiguous parts with the least largest weight; ties filled front first."""
    if stages > len(weights):
        return None
    return _greedy_fill(weights, stages, _min_max(weights, stages))


def blockpartition_solve(sequence: Sequence[int], partitions: int) -> list[int] | None:
    """torchgpipe's ``balance.blockpartition.solve``: the Barany et al. heuristic.

    Returns the indices where parts 1.. begin. Values are normalised to [0, 1] by
    (x - min) / (max - min); starting from equal-length parts, a smallest part q nearest to a
    largest part p takes one element from its neighbour on p's side, until the largest part
    exceeds the smallest by at most 1 (one largest element). Not optimal; kept as written.
    """
    n = len(sequence)
    if partitions < 1 or n < partitions:
        return None
    lo, span = min(sequence), max(sequence) - min(sequence)
    norm = [0.0] * n if span == 0 else [(x - lo) / span for x in sequence]
    splits = [n // partitions * (k + 1) for k in range(partitions - 1)] + [n]

    def size(i: int) -> float:
        return sum(norm[(splits[i - 1] if i else 0):splits[i]])

    while True:
        largest, p = max((size(i), i) for i in range(partitions))
        while True:
            smallest, q = min((size(i), i) for i in range(partitions))
            if largest <= smallest + 1:
                return splits[:-1]
            if p < q:  # move the last element of block q-1 into q
                h = q - 1
                splits[h] -= 1
            else:  # move the first element of block q+1 into q
                h = q + 1
                splits[q] += 1
            if p == h:
                break


def _block_times(a: Analysis, m: int, r: int) -> np.ndarray:
    t = a.table
    q = samples_per_replica(a.space.global_batch, m, r)
    k = int(np.flatnonzero(t.sizes == q)[0])
    return t.fwd[k] + t.bwd[k]


def param_balance(a: Analysis, stages: int, m: int, r: int) -> list[int] | None:
    t = a.table
    return min_max_split(np.array([t.param_bytes[b, b + 1] for b in range(t.num_blocks)]),
                         stages)


def torchgpipe_balance(a: Analysis, stages: int, m: int, r: int) -> list[int] | None:
    us = [int(x * 1e6) for x in _block_times(a, m, r)]  # torchgpipe profiles integer µs
    return blockpartition_solve(us, stages)


def exact_time_balance(a: Analysis, stages: int, m: int, r: int) -> list[int] | None:
    return min_max_split(_block_times(a, m, r), stages)


PEERS: list[tuple[str, Split]] = [
    ("even layer split", even_layer_split),
    ("parameter balance (DeepSpeed)", param_balance),
    ("torchgpipe balance_by_time", torchgpipe_balance),
    ("min-max time (exact)", exact_time_balance),
]


# -- scoring ----------------------------------------------------------------------------------
@dataclass
class Scored:
    method: str
    stages: tuple[StageChoice, ...]
    micro_batches: int
    evaluation: Evaluation


def best_uniform(a: Analysis, method: str, split: Split, counts: Sequence[int]) -> Scored | None:
    """The fastest fitting plan of ``split`` over stage counts ``counts`` and every m."""
    best: Scored | None = None
    w, t = a.space.world_size, a.table
    for stages in counts:
        r = w // stages
        for m in a.space.micro_batches:
            if m * r > a.space.global_batch:
                continue
            bounds = split(a, stages, m, r)
            if bounds is None:
                continue
            edges = [0, *bounds, t.num_blocks]
            if any(j <= i for i, j in zip(edges, edges[1:], strict=False)):
                continue  # an empty stage (blockpartition can leave one)
            choice = tuple(StageChoice(i, j, r) for i, j in zip(edges, edges[1:], strict=False))
            ev = evaluate(t, a.space, choice, m)
            if ev.fits and (best is None or ev.step_s < best.evaluation.step_s):
                best = Scored(method, choice, m, ev)
    return best


def _shape(stages: Sequence[StageChoice]) -> str:
    """Blocks x replicas of each stage: ``12b×4 11b×4``."""
    return " ".join(f"{s.end - s.start}b×{s.replicas}" for s in stages)


def device_spec(args: argparse.Namespace) -> DeviceSpec:
    spec = DeviceSpec.preset(args.device)
    if args.link_gbs:
        spec = spec.model_copy(update={"interconnect_bandwidth": args.link_gbs * 1e9})
    return spec


def best_uniform_search(a: Analysis, counts: Sequence[int]) -> Scored | None:
    """rannc_fx's search with the replicas forced equal (S x W/S), best over ``counts``."""
    best: Scored | None = None
    w = a.space.world_size
    for stages in counts:
        space = replace(a.space, replicas=(w // stages,) * stages, stages=None)
        try:
            res = search_pass(a.table, space)
        except NoFeasiblePlan:
            continue
        if best is None or res.evaluation.step_s < best.evaluation.step_s:
            best = Scored("uniform", res.stages, res.micro_batches, res.evaluation)
    return best


def run_setting(model: str, world: int, batch: int, memories: Sequence[float | None],
                args: argparse.Namespace) -> list[str]:
    """One analysis (capture, profile, group, costs) at (W, batch); one table per memory size."""
    m, ex_args, ex_kwargs = build(model, args.seq, args.image)
    cfg = Config(profile_cache_dir=None, max_blocks=args.max_blocks)
    spec = device_spec(args)
    t0 = time.perf_counter()
    a = analyze(m, ex_args, ex_kwargs, world_size=world, device=spec, config=cfg,
                global_batch=batch)
    analyze_s = time.perf_counter() - t0
    rows: list[str] = []
    for mem in memories:
        budget = (mem * GiB if mem else a.spec.memory_bytes) * (1 - a.config.memory_margin)
        sa = replace(a, space=replace(a.space, memory_budget=int(budget)))
        rows += score(sa, f"**{model}**, W={world}, global batch {batch}, "
                          f"{mem or a.spec.memory_bytes / GiB:g} GiB devices "
                          f"(budget {budget / GiB:.1f} GiB)", analyze_s)
    return rows


def score(a: Analysis, title: str, analyze_s: float) -> list[str]:
    """The searched plan and each peer's best plan on ``a``'s table, as a markdown table."""
    t, world = a.table, a.space.world_size
    k_full = int(np.flatnonzero(t.sizes == t.sizes.max())[0])
    share = (t.fwd[k_full] + t.bwd[k_full]) / (t.fwd[k_full] + t.bwd[k_full]).sum()
    layers = layer_starts(a)
    head = (f"{title}: {t.num_blocks} blocks, {len(layers)} repeated layers, largest block "
            f"{100 * share.max():.1f} % of the time; analyze {analyze_s:.0f} s")
    t0 = time.perf_counter()
    try:
        res = search_pass(a.table, a.space)
    except NoFeasiblePlan as e:
        print(f"{head}. No plan fits: {e}\n", flush=True)
        return [f"{head}. No plan fits: {e}", ""]
    head += f", search {time.perf_counter() - t0:.2f} s"
    scored: list[tuple[str, Scored | None]] = [
        ("rannc_fx (searched)", Scored("rannc_fx", res.stages, res.micro_batches, res.evaluation))]
    counts = [d for d in range(2, world + 1) if world % d == 0 and d <= t.num_blocks]
    scored.append(("pure data parallel", best_uniform(a, "dp", even_layer_split, [1])))
    for name, fn in PEERS:
        scored.append((name, best_uniform(a, name, fn, counts)))
    scored.append(("rannc_fx search, replicas forced equal", best_uniform_search(a, counts)))
    ours = res.evaluation.step_s
    rows = [head, "",
            "| method | S | m | stages (blocks×replicas) | step ms | vs rannc_fx "
            "| slowest stage ms | peak memory / budget |",
            "|---|---:|---:|---|---:|---:|---:|---:|"]
    for name, sc in scored:
        if sc is None:
            rows.append(f"| {name} | - | - | nothing fits | - | - | - | - |")
            continue
        ev = sc.evaluation
        slow = max(c.time_s for c in ev.stages)
        mem = max(c.memory.total for c in ev.stages) / a.space.memory_budget
        rows.append(f"| {name} | {len(sc.stages)} | {sc.micro_batches} | {_shape(sc.stages)} "
                    f"| {1e3 * ev.step_s:.1f} | {ev.step_s / ours:.2f} | {1e3 * slow:.1f} "
                    f"| {100 * mem:.0f} % |")
    rows.append("")
    print("\n".join(rows), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="gpt2-large",
                   help="model to plan (GPT-2 sizes use the 50257-token vocabulary)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[16], help="world sizes W")
    p.add_argument("--batches", type=int, nargs="+", default=[32],
                   help="global batches (samples per step); each is run at each W")
    p.add_argument("--seq", type=int, default=1024, help="GPT-2 sequence length (tokens)")
    p.add_argument("--image", type=int, default=224, help="ResNet image side (pixels)")
    p.add_argument("--device", default="v100-32gb", choices=DeviceSpec.presets(),
                   help="DeviceSpec preset the analytic cost model uses")
    p.add_argument("--link-gbs", type=float, default=0.0,
                   help="interconnect GB/s per device (0: the preset's; 12.5 = 100 Gb/s IB)")
    p.add_argument("--memory-gib", type=float, nargs="+", default=[0.0],
                   help="device memory in GiB (0: the preset's); the budget is 90 %% of it")
    p.add_argument("--max-blocks", type=int, default=Config().max_blocks,
                   help="blocks the grouping pass coarsens the graph to")
    p.add_argument("--out", default=None, help="append the markdown tables to this file")
    args = p.parse_args(argv)
    logging.getLogger("rannc_fx").setLevel(logging.WARNING)
    rows = [r for w in args.world_sizes for b in args.batches
            for r in run_setting(args.model, w, b, [g or None for g in args.memory_gib], args)]
    if args.out:
        spec = device_spec(args)
        cmd = "python benchmarks/plan_quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
        env = (f"torch {torch.__version__}, transformers {_version('transformers')}, Python "
               f"{platform.python_version()}; analytic cost model against `{args.device}` "
               f"({spec.memory_bytes / GiB:.0f} GiB, {spec.flops_for('float32') / 1e12:.1f} "
               f"TFLOP/s fp32 x efficiency {spec.efficiency}, links "
               f"{spec.interconnect_bandwidth / 1e9:g} GB/s)")
        with open(args.out, "a") as f:
            f.write(f"Command:\n\n    {cmd}\n\n{env}.\n\n" + "\n".join(rows) + "\n")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)

if __name__ == "__main__":
    main()
