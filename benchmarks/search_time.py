"""Time the search pass on cost tables over a grid of block counts and world sizes.

Two sources of cost tables:

* ``--model synthetic`` (default): a callable ``(num_blocks, space) -> CostTable``, by default
  a synthetic GPT-like transformer (uniform layers, a large-vocabulary embedding tied to the LM
  head), or any ``--table module:function`` of that signature. Each row also scores the best
  even split (equal blocks and replicas per stage) with the same cost model.
* ``--model bert``: HF ``BertForPreTraining`` built on the meta device for each layer count
  and world size, run through ``rannc_fx.planner.analyze`` (capture, shapes, profile, group,
  costs: each pass's own time is reported) and then ``search_pass`` on ``a.table``/``a.space``.

    python benchmarks/search_time.py --blocks 12 96 192 --sweep-world-sizes 2 64 --out t.md
    python benchmarks/search_time.py --model bert --hidden 1024 --layers 12 96 256 \\
        --world-sizes 32 --max-blocks 96 384
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rannc_fx.search import (
    CostTable,
    NoFeasiblePlan,
    SearchResult,
    SearchSpace,
    StageChoice,
    evaluate,
    needed_sizes,
    search_pass,
)
from rannc_fx.search.candidates import Candidates
from rannc_fx.search.dp_chain import build_states

TableFactory = Callable[[int, SearchSpace], CostTable]
GiB = 1024**3


@dataclass(frozen=True)
class Transformer:
    """A GPT-like model: sizes that set its per-sample costs (fp16 activations, Adam)."""

    layers: int = 96
    hidden: int = 2048
    heads: int = 16
    seq: int = 512
    vocab: int = 50257
    flops: float = 100e12  # sustained FLOP/s of one device
    launch_s: float = 10e-6  # fixed cost of one unit's kernels, per micro-batch
    jitter: float = 0.02  # relative noise on each unit's time, as a profile has
    seed: int = 0


def _units(cfg: Transformer) -> np.ndarray:
    """Rows (params, fwd FLOPs, saved bytes, output bytes, bytes crossing a cut after it), per
    sample, of the finest units: the embedding, 5 per layer, the LM head (tied to the embedding).
    Saved bytes per layer add up to Megatron's 34 s h + 5 a s^2."""
    s, h, v, a = float(cfg.seq), float(cfg.hidden), float(cfg.vocab), float(cfg.heads)
    sh = 2 * s * h  # one fp16 hidden state
    layer = [
        (3 * h * h, 6 * s * h * h, 6 * s * h, 3 * sh, 4 * sh),  # LayerNorm + QKV
        (0.0, 4 * s * s * h, 5 * a * s * s + 8 * s * h, sh, 2 * sh),  # attention scores
        (h * h, 2 * s * h * h, 3 * s * h, sh, sh),  # output projection + residual
        (4 * h * h, 8 * s * h * h, 9 * s * h, 4 * sh, 5 * sh),  # LayerNorm + MLP up + GeLU
        (4 * h * h, 8 * s * h * h, 8 * s * h, sh, sh),  # MLP down + residual
    ]
    embed = (v * h + s * h, 0.0, sh, sh, sh)
    head = (0.0, 2 * s * h * v, 2 * s * v, 4 * s * v, 0.0)
    return np.array([embed, *layer * cfg.layers, head])


def transformer_table(num_blocks: int, space: SearchSpace,
                      cfg: Transformer = Transformer()) -> CostTable:
    """``cfg``'s units grouped into ``num_blocks`` blocks: the embedding, even runs of layer
    units, the head. Times and memory grow linearly with the samples per replica."""
    units = _units(cfg)
    noise = 1 + cfg.jitter * np.random.default_rng(cfg.seed).uniform(-1, 1, len(units))
    body = np.linspace(1, len(units) - 1, num_blocks - 1).round().astype(int)
    starts = np.concatenate(([0], body))  # block b holds units [starts[b], starts[b + 1])
    ends = np.concatenate((body, [len(units)]))

    def per_block(col: np.ndarray, op: Callable[..., np.ndarray] = np.add.reduceat) -> np.ndarray:
        return op(col, starts)

    q = np.array(needed_sizes(space), float)[:, None]
    fixed = per_block(cfg.launch_s * noise)
    flops = per_block(units[:, 1] * noise)
    cut = np.zeros((len(q), num_blocks + 1))
    cut[:, 1:-1] = q * units[ends[:-1] - 1, 4]
    params = 4 * per_block(units[:, 0])  # fp32 weights; grads alike, Adam state x2
    fwd = fixed + q * flops / cfg.flops
    return CostTable(sizes=q[:, 0].astype(np.int64), fwd=fwd, bwd=2 * fwd,
                     act=q * per_block(units[:, 2]),
                     workspace=q * per_block(units[:, 3], np.maximum.reduceat), cut=cut,
                     param_bytes=_tied(params, 4 * cfg.vocab * cfg.hidden),
                     grad_bytes=_tied(params, 4 * cfg.vocab * cfg.hidden))


def _tied(params: np.ndarray, tied: float) -> np.ndarray:
    """Bytes of blocks [i, j): the last block (the head) also reads ``tied`` bytes of block 0."""
    B = len(params)
    pre = np.concatenate(([0.0], np.cumsum(params)))
    i, j = np.arange(B)[:, None], np.arange(B + 1)[None, :]
    out = pre[j] - pre[i] + np.where((j == B) & (i > 0), tied, 0.0)
    return np.where(j > i, out, 0.0)


def even_split(table: CostTable, space: SearchSpace) -> tuple[float, str]:
    """Best step time of the even splits that fit: S stages of equal blocks and replicas, under
    each of the space's schedules, recomputing in no stage or (where allowed) in every one."""
    B, W, best = table.num_blocks, space.world_size, (math.inf, "none fits")
    rhos = (False, True) if space.recompute is None else (space.recompute,)
    for S in range(1, min(B, W) + 1):
        if W % S:
            continue
        b = np.linspace(0, B, S + 1).round().astype(int)
        for m, sched, rho in itertools.product(space.micro_batches, space.schedules, rhos):
            if m * (W // S) > space.global_batch:
                continue
            stages = tuple(StageChoice(int(x), int(y), W // S, rho)
                           for x, y in zip(b[:-1], b[1:], strict=True))
            ev = evaluate(table, space, stages, m, sched)
            if ev.fits and ev.step_s < best[0]:
                best = (ev.step_s, f"{S}x{W // S}, m={m}, {sched}{', recompute' * rho}")
    return best


class _DPCount(logging.Handler):
    """Reads the search's debug line "search ran N DPs"."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.dps = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("search ran"):
            self.dps = int(text.split()[2])


@dataclass(frozen=True)
class Timing:
    wall_s: float
    cpu_s: float
    dps: int
    result: SearchResult | NoFeasiblePlan


def time_search(table: CostTable, space: SearchSpace, repeat: int = 1) -> Timing:
    """The fastest of ``repeat`` searches (wall and CPU seconds), with its DP count and result."""
    log, counter = logging.getLogger("rannc_fx"), _DPCount()
    old = log.level
    log.addHandler(counter)
    log.setLevel(logging.DEBUG)
    best: Timing | None = None
    try:
        for _ in range(repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                result: SearchResult | NoFeasiblePlan = search_pass(table, space)
            except NoFeasiblePlan as e:
                result = e
            t = Timing(time.perf_counter() - w0, time.process_time() - c0, counter.dps, result)
            best = t if best is None or t.wall_s < best.wall_s else best
    finally:
        log.removeHandler(counter)
        log.setLevel(old)
    assert best is not None
    return best


def plain_scan_dps(table: CostTable, space: SearchSpace) -> int:
    """DPs a plain threshold scan of GPipe would run: one per distinct u of a fitting stage,
    per m."""
    cands = Candidates(table, space, build_states(space))
    total = 0
    for m in space.micro_batches:
        e = cands.gpipe(m)
        total += 0 if e is None else len(np.unique(e.u))
    return total


def run_grid(make_table: TableFactory, grid: Sequence[tuple[int, int]], *,
             samples_per_rank: int, micro_batches: tuple[int, ...], memory_gib: float,
             bandwidth: float, repeat: int, schedules: tuple[str, ...] = ("gpipe", "1f1b"),
             recompute: bool | None = None) -> list[str]:
    """One markdown row per (blocks, world size)."""
    rows = []
    for B, W in grid:
        space = SearchSpace(world_size=W, global_batch=samples_per_rank * W,
                            memory_budget=memory_gib * GiB, link_bandwidth=bandwidth,
                            micro_batches=micro_batches, schedules=schedules,
                            recompute=recompute)
        table = make_table(B, space)
        t = time_search(table, space, repeat)
        head = (f"| {table.num_blocks} | {W} | {t.wall_s:.2f} | {t.cpu_s:.2f} | {t.dps} "
                f"| {plain_scan_dps(table, space)} ")
        if isinstance(t.result, NoFeasiblePlan):
            rows.append(head + f"| - | - | {t.result} |")
        else:
            res = t.result
            even, how = even_split(table, space)
            plan = " ".join(f"{s.end - s.start}x{s.replicas}{'r' * s.recompute}"
                            for s in res.stages)
            rows.append(head + f"| {res.evaluation.step_s * 1e3:.1f} | {even * 1e3:.1f} ({how}) "
                        f"| {res.schedule}, m={res.micro_batches}: {plan} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def run_bert(a: argparse.Namespace) -> list[str]:
    """One row per (hidden, layers, world size, max blocks): analyze's passes, then the search."""
    from plan_time import PhaseTimes, bert

    from rannc_fx import Config
    from rannc_fx.planner.analyze import analyze

    grid = [(h, L, W) for h in a.hidden for W in a.world_sizes for L in a.layers]
    grid += [(h, L, W) for h in a.hidden for L in a.sweep_layers for W in a.sweep_world_sizes
             if (h, L, W) not in grid]
    rows = []
    for hidden, layers, W in grid:
        for max_blocks in a.max_blocks:
            model, args, kwargs, _ = bert(layers, hidden, heads=hidden // 64, seq=a.seq)
            params = sum(t.numel() for t in model.parameters())
            cfg = Config(profile_cache_dir=None, max_blocks=max_blocks)
            with PhaseTimes() as phases:
                an = analyze(model, args, kwargs, world_size=W, device=a.device, config=cfg,
                             global_batch=a.samples_per_rank * W)
            t = time_search(an.table, an.space, a.repeat)
            ph = phases.seconds
            nodes = sum(len(b) for b in an.blocks.blocks)
            head = (f"| {hidden} | {layers} | {params / 1e9:.2f} | {W} | {an.space.global_batch} "
                    f"| {nodes} | {an.table.num_blocks} | "
                    + " | ".join(f"{ph.get(k, 0.0):.2f}" for k in
                                 ("capture", "shapes", "profile", "group", "costs"))
                    + f" | **{t.wall_s:.2f}** | {t.cpu_s:.2f} | {t.dps} ")
            if isinstance(t.result, NoFeasiblePlan):
                need = t.result.world_size
                rows.append(head + f"| no plan fits{f' (needs W={need})' if need else ''} "
                                   "| - | - |")
            else:
                res = t.result
                reps = "/".join(str(st.replicas) for st in res.stages)
                mem = max(c.memory.total for c in res.evaluation.stages) / an.space.memory_budget
                rc = sum(st.recompute for st in res.stages)
                rows.append(head + f"| {len(res.stages)} stages, m={res.micro_batches}, "
                                   f"{res.schedule}, {rc} recomputing, replicas {reps} "
                                   f"| {1e3 * res.evaluation.step_s:.0f} "
                                   f"| {100 * mem:.0f} % |")
            print(rows[-1], file=sys.stderr, flush=True)
            del model, args, kwargs, an
    return rows


BERT_HEAD = [
    "| hidden | layers | params (B) | ranks | global batch | nodes | blocks | capture s "
    "| shapes s | profile s | group s | costs s | search wall s | search cpu s | DPs | plan "
    "| predicted ms | peak memory / budget |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
]


_RECOMPUTE = {"search": None, "on": True, "off": False}


def _load(spec: str) -> TableFactory:
    module, _, name = spec.partition(":")
    factory: TableFactory = getattr(importlib.import_module(module), name)
    return factory


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("synthetic", "bert"), default="synthetic",
                   help="where cost tables come from (see above)")
    p.add_argument("--blocks", type=int, nargs="+", default=[12, 24, 48, 96, 128, 192, 256],
                   help="block counts the table is coarsened to (timed at --world-sizes; synthetic)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[32], help="ranks")
    p.add_argument("--sweep-world-sizes", type=int, nargs="*", default=[],
                   help="also time these world sizes at each of --sweep-blocks (bert: --sweep-layers)")
    p.add_argument("--sweep-blocks", type=int, nargs="+", default=[96],
                   help="block counts for --sweep-world-sizes (synthetic)")
    p.add_argument("--samples-per-rank", type=int, default=4,
                   help="global batch = this x world size")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="micro-batch counts the search tries (synthetic)")
    p.add_argument("--memory-gib", type=float, default=72.0, help="memory budget per device (synthetic)")
    p.add_argument("--bandwidth", type=float, default=25e9, help="link bytes/s per device (synthetic)")
    p.add_argument("--repeat", type=int, default=1, help="searches per row; the fastest is kept")
    p.add_argument("--schedules", nargs="+", choices=("gpipe", "1f1b"), default=["gpipe", "1f1b"],
                   help="pipeline schedules the search chooses from (synthetic)")
    p.add_argument("--recompute", choices=tuple(_RECOMPUTE), default="search",
                   help="activation recomputation: per stage where needed, every stage, or none "
                        "(synthetic)")
    p.add_argument("--table", default=None,
                   help="module:function (num_blocks, space) -> CostTable; default synthetic")
    p.add_argument("--jitter", type=float, default=0.02,
                   help="relative noise on the synthetic table's times (synthetic)")
    p.add_argument("--out", default=None, help="write the markdown table here too")
    bert = p.add_argument_group("--model bert")
    bert.add_argument("--hidden", type=int, nargs="+", default=[1024],
                      help="hidden sizes (heads = hidden / 64, intermediate = 4 x hidden)")
    bert.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96, 128, 192, 256],
                      help="encoder layer counts (timed at --world-sizes)")
    bert.add_argument("--sweep-layers", type=int, nargs="+", default=[96],
                      help="layer counts for --sweep-world-sizes")
    bert.add_argument("--max-blocks", type=int, nargs="+", default=[96],
                      help="Config.max_blocks values (blocks the search cuts between)")
    bert.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    bert.add_argument("--device", default="v100-32gb",
                      help="DeviceSpec preset of the analytic cost model")
    a = p.parse_args(argv)
    if a.model == "bert":
        rows = run_bert(a)
        text = "\n".join(BERT_HEAD + rows)
        print(text)
        if a.out:
            with open(a.out, "a") as f:
                f.write(text + "\n")
        return

    def synthetic(b: int, s: SearchSpace) -> CostTable:
        return transformer_table(b, s, Transformer(jitter=a.jitter))

    make = _load(a.table) if a.table else synthetic
    grid = [(b, w) for w in a.world_sizes for b in a.blocks]
    grid += [(b, w) for b in a.sweep_blocks for w in a.sweep_world_sizes if (b, w) not in grid]
    head = [
        "| blocks | ranks | wall s | cpu s | DPs | plain-scan DPs | predicted ms "
        "| best even split ms | plan (blocks x replicas per stage, r: recomputes) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    rows = run_grid(make, grid, samples_per_rank=a.samples_per_rank,
                    micro_batches=tuple(a.micro_batches), memory_gib=a.memory_gib,
                    bandwidth=a.bandwidth, repeat=a.repeat, schedules=tuple(a.schedules),
                    recompute=_RECOMPUTE[a.recompute])
    text = "\n".join(head + rows)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
