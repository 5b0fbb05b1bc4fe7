"""What splitting a stage's backward into B and W costs, against the simulator's constants.

    python benchmarks/split_backward_cost.py

One process, one thread. A stage of ``layers`` GPT layers (``runtime_common.Block``) of width
``d``, captured as rannc_fx captures a stage (``rannc_fx.partition``, one stage: its graph's
node count is what ``simulate.plan_durations`` charges ``SPLIT_NODE_MS`` for), runs each
micro-batch's forward, then either one backward or ``backward_inputs`` + ``backward_weights``
(``runtime/backward_split.py``), the rounds interleaved, ``--rounds`` timed after two untimed.
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
from rannc_fx.config import Config  # noqa: E402
from rannc_fx.runtime.backward_split import backward_inputs, backward_weights  # noqa: E402
from rannc_fx.runtime.simulate import SPLIT_NODE_MS, SPLIT_OVERHEAD  # noqa: E402


class Stack(nn.Module):
    """A middle stage: GPT layers from a hidden state to a hidden state."""

    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def measure(d: int, layers: int, batch: int, seq: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = Stack(d, layers)
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

    def full() -> float:
        x, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.backward([y], [g])
        return time.perf_counter() - t0

    def split() -> float:
        x, y, g = forward()
        t0 = time.perf_counter()
        work = backward_inputs([y], [g], [x], params)
        backward_weights(work)
        return time.perf_counter() - t0

    one, two = [], []
    for r in range(rounds + 2):
        a, b = full(), split()
        for p in params:
            p.grad = None
        if r >= 2:
            one.append(a)
            two.append(b)
    bwd = 1e3 * statistics.median(one)
    both = 1e3 * statistics.median(two)
    return {"d": d, "layers": layers, "tokens": batch * seq, "nodes": nodes, "bwd_ms": bwd,
            "split_ms": both, "model_ms": SPLIT_OVERHEAD * bwd + SPLIT_NODE_MS * nodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per shape (default: 15)")
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes = [(d, layers, batch, seq) for d in (128, 256, 512) for layers in (2, 4)
              for batch, seq in ((2, 32), (4, 64), (8, 128))]
    rows = [measure(*s, rounds=args.rounds) for s in shapes]
    print("| d | layers | tokens | nodes | backward ms | B + W ms | overhead ms | simulator "
          "charges ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['d']} | {r['layers']} | {r['tokens']} | {r['nodes']} | {r['bwd_ms']:.2f} | "
              f"{r['split_ms']:.2f} | {r['split_ms'] - r['bwd_ms']:.2f} | {r['model_ms']:.2f} |")
    # overhead = a * backward + b * nodes, least squares
    a_mat = np.array([[r["bwd_ms"], r["nodes"]] for r in rows])
    y = np.array([r["split_ms"] - r["bwd_ms"] for r in rows])
    (a, b), *_ = np.linalg.lstsq(a_mat, y, rcond=None)
    fit = a_mat @ np.array([a, b])
    print(f"\nfitted: overhead = {a:.3f} x backward + {1e3 * b:.2f} us x nodes "
          f"(constants: {SPLIT_OVERHEAD} and {1e3 * SPLIT_NODE_MS:.1f} us); residuals "
          f"{np.round(y - fit, 2).tolist()} ms")
    print("\n" + "\n".join(environment()))


if __name__ == "__main__":
    main()
