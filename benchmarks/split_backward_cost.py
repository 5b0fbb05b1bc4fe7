"""What splitting a stage's backward into B and W costs, against the simulator's constants.

    python benchmarks/split_backward_cost.py

One process, one thread. A stage of ``layers`` GPT layers (``runtime_common.Block``) of width
``d``, captured as rannc_fx captures a stage (``rannc_fx.partition``, one stage: its graph's
node count is what ``simulate.plan_durations`` charges ``SPLIT_NODE_MS`` for), runs each
micro-batch's forward, then either one backward or ``backward_inputs`` + ``backward_weights``
(``runtime/backward_split.py``), each from parameters without ``.grad`` (adding into ``.grad``
is a term of its own in the simulator, the same for both), the rounds interleaved,
``--rounds`` timed after two untimed.
Per shape: the median one backward, the median B + W, and what the simulator charges for the
split (``SPLIT_OVERHEAD`` x the backward + ``SPLIT_NODE_MS`` x the nodes); then the two
constants fitted by least squares to every shape's measured overhead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_common import Block, environment  # noqa: E402

import rannc_fx  # noqa: E402
from rannc_fx.plan.config import Config  # noqa: E402
from rannc_fx.runtime.backward_split import backward_inputs, backward_weights  # noqa: E402
from rannc_fx.schedules.simulate import SPLIT_NODE_MS, SPLIT_OVERHEAD  # noqa: E402


class Stack(nn.Module):
    """A middle stage from a hidden state to a hidden state: GPT layers (``"gpt"``), or
    ``nn.TransformerEncoderLayer``s as the built-in LM has them (``"encoder"``, causal)."""

    def __init__(self, arch: str, d: int, layers: int) -> None:
        super().__init__()
        heads = max(1, d // 64)
        self.arch = arch
        self.blocks = nn.ModuleList(
            Block(d, heads) if arch == "gpt" else nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.arch == "gpt":
            for blk in self.blocks:
                x = blk(x)
            return x
        s = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(s, device=x.device, dtype=x.dtype)
        for blk in self.blocks:
            x = blk(x, src_mask=mask, is_causal=True)
        return x


def grad_nodes(y: torch.Tensor) -> int:
    """The autograd nodes one forward made (what B walks), parameters' accumulators aside."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return len(seen)


def measure(arch: str, d: int, layers: int, batch: int, seq: int, rounds: int
            ) -> dict[str, float | str]:
    torch.manual_seed(0)
    model = Stack(arch, d, layers)
    x0 = torch.randn(batch, seq, d)
    part = rannc_fx.partition(model, (x0,), world_size=1,
                              config=Config(profile_cache_dir=None, profile_repeats=1))
    gm = part.stages[0]
    nodes = part.plan.stages[0].num_nodes
    params = [p for p in gm.parameters() if p.requires_grad]

    def forward() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_(True)
        y = gm(x)
        y = y[0] if isinstance(y, (tuple, list)) else y
        return x, y, torch.randn_like(y)

    def fresh() -> None:  # both start from no .grad: accumulation is the simulator's own term
        for p in params:
            p.grad = None

    def full() -> float:
        fresh()
        x, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.backward([y], [g])
        return time.perf_counter() - t0

    def split() -> float:
        fresh()
        x, y, g = forward()
        t0 = time.perf_counter()
        work = backward_inputs([y], [g], [x], params)
        backward_weights(work)
        return time.perf_counter() - t0

    autograd = grad_nodes(forward()[1])
    one, two = [], []
    for r in range(rounds + 2):
        a, b = full(), split()
        if r >= 2:
            one.append(a)
            two.append(b)
    bwd = 1e3 * statistics.median(one)
    both = 1e3 * statistics.median(two)
    return {"arch": arch, "d": d, "layers": layers, "tokens": batch * seq, "nodes": nodes,
            "grad_nodes": autograd, "bwd_ms": bwd,
            "split_ms": both, "model_ms": SPLIT_OVERHEAD * bwd + SPLIT_NODE_MS * nodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per shape (default: 15)")
    p.add_argument("--arch", nargs="+", choices=("gpt", "encoder"), default=["gpt", "encoder"],
                   help="the layers measured (default: both)")
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes = [(arch, d, layers, batch, seq) for arch in args.arch for d in (128, 256, 512)
              for layers in (2, 4) for batch, seq in ((2, 32), (4, 64), (8, 128))]
    rows = [measure(*s, rounds=args.rounds) for s in shapes]
    print("| layer kind | d | layers | tokens | graph nodes | autograd nodes | backward ms | B + W ms "
          "| overhead ms | simulator charges ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
          "---:|")
    for r in rows:
        print(f"| {r['arch']} | {r['d']} | {r['layers']} | {r['tokens']} | {r['nodes']} | "
              f"{r['grad_nodes']} | {r['bwd_ms']:.2f} | {r['split_ms']:.2f} | "
              f"{float(r['split_ms']) - float(r['bwd_ms']):.2f} | {r['model_ms']:.2f} |")
    y = np.array([float(r["split_ms"]) - float(r["bwd_ms"]) for r in rows])
    print()
    for count in ("nodes", "grad_nodes"):  # overhead = a * backward + b * count
        a_mat = np.array([[float(r["bwd_ms"]), float(r[count])] for r in rows])
        (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
        res = y - a_mat @ np.array([a, b])
        print(f"fitted on {count.replace('_', ' ')}: overhead = {a:.4f} x backward + "
              f"{1e3 * b:.2f} us a node; residuals rms {np.sqrt(np.mean(res ** 2)):.2f} ms, "
              f"largest {np.abs(res).max():.2f} ms")
    print(f"(the simulator's constants: {SPLIT_OVERHEAD} and {1e3 * SPLIT_NODE_MS:.1f} us a "
          "graph node)")
    print("\n" + "\n".join(environment()))


if __name__ == "__main__":
    main()
