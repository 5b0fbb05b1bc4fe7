"""Shared pieces of the runtime benchmarks: the GPT model, timing, environment header.

The model is a GPT-style LM built from plain ops (LayerNorm, Linear, ``scaled_dot_product_attention``
with ``is_causal``, GELU), so ``torch.fx.symbolic_trace`` captures it at the level of torch
functions and rannc_fx's stages run the same kernels as eager PyTorch. Its embedding is NOT tied
to the head: torch.distributed.pipelining has no support for a weight shared by two stages, and
the comparison must run the same model on both sides.

``GPT(ids, labels)`` returns the mean cross-entropy loss alone (no logits: a batched output
would be sent back to the rank that owns the samples, a cost torch.pipelining's
``return_outputs=False`` does not pay); ``GPT(ids)`` returns the logits (the traced frontend
and the manual stages compute the loss in ``loss_fn``).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "Block",
    "environment",
    "lm_loss",
    "load_average",
    "make_batch",
    "interleave",
    "median_ratio",
    "summarize",
]


class Block(nn.Module):
    """Pre-norm transformer layer: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.d, self.h = d_model, heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q, k, v = self.qkv(self.ln1(x)).split(self.d, dim=2)
        q = q.view(b, s, self.h, self.d // self.h).transpose(1, 2)
        k = k.view(b, s, self.h, self.d // self.h).transpose(1, 2)
        v = v.view(b, s, self.h, self.d // self.h).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, self.d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, ``layers`` Blocks, final LayerNorm, untied LM head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids) + self.pos
        for blk in self.blocks:
            h = blk(h)
        logits = self.head(self.ln_f(h))
        if labels is None:
            return logits
        return lm_loss(logits, labels)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make_batch(
    vocab: int, batch: int, seq: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def start_ranks(a: argparse.Namespace) -> tuple[int, int, GPT, tuple[torch.Tensor, torch.Tensor]]:
    """Under torchrun: one thread, the gloo group, the seeded GPT of ``a``'s shape
    (``add_model_args``) and this rank's share of the global batch (ids, labels)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(a.vocab, a.d_model, a.heads, a.layers, a.seq)
    ids, labels = make_batch(a.vocab, a.batch, a.seq)
    mine = slice(rank * (a.batch // world), (rank + 1) * (a.batch // world))
    return rank, world, model, (ids[mine], labels[mine])


def compiled_step(base: GPT, config: Any, ids: torch.Tensor, labels: torch.Tensor
                  ) -> tuple[Callable[[], None], Any]:
    """A copy of ``base`` compiled under ``config`` (a ``rannc_fx.Config``) with Adam, and
    one training step of it on (ids, labels), run once (the plan, and a warm step)."""
    import rannc_fx  # here: the model and the timing helpers need none of it

    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cm = rannc_fx.compile(model, opt, config)

    def step() -> None:
        cm(ids, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return step, cm


# -- timing ----------------------------------------------------------------------------------


def summarize(samples: Sequence[float]) -> dict[str, float]:
    xs = sorted(samples)
    n = len(xs)
    return {
        "median": statistics.median(xs),
        "p10": xs[max(0, int(0.1 * (n - 1)))],
        "p90": xs[min(n - 1, round(0.9 * (n - 1)))],
        "min": xs[0],
    }


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-round ratios a[i] / b[i] (rounds interleave the contenders, so each
    ratio compares two steps taken moments apart under the same load)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def interleave(
    contenders: dict[str, Callable[[], Any]],
    *,
    warmup: int,
    steps: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run the contenders round-robin (A B C A B C ...); per contender, the wall seconds and
    this process's CPU seconds of each timed step. ``sync`` (a barrier) runs before the clock
    starts and before it stops, so a step's wall time on rank 0 covers the whole pipeline on
    every rank. CPU time is the work this rank did (compute, and the CPU the communication
    threads spent); it does not grow when other jobs take the cores, wall time does."""
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    for it in range(warmup + steps):
        for name, step in contenders.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            c1 = time.process_time()
            sync()
            dt = time.perf_counter() - t0
            if it >= warmup:
                wall[name].append(dt)
                cpu[name].append(c1 - c0)
    return wall, cpu


def pin_to_core() -> int:
    """Bind this process, and the threads it starts from now on (gloo's, the runtime's
    waiter), to core ``LOCAL_RANK`` modulo the cores it may use; returns that core.

    On a machine with as many cores as ranks, unpinned ranks' threads migrate between the
    cores as each wakes, and the steps of a contender that wakes more threads read slower
    by an amount that changes from run to run; pinned, each rank keeps its core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


# -- environment -----------------------------------------------------------------------------


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


_START_LOAD = load_average()


def environment() -> list[str]:
    """Lines for a results file's environment header."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return [
        f"- {_cpu_model()}, {os.cpu_count()} cores (shared with other jobs), {mem:.0f} GiB RAM, "
        f"{platform.system()} {platform.release()}, {platform.machine()}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s) per rank "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})",
        f"- load average (1, 5, 15 min): {_START_LOAD} at the start, {load_average()} at the end",
    ]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The GPT's shape and the global batch: flags shared by the runtime benchmarks."""
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default: 1024)")
    p.add_argument("--d-model", type=int, default=256, help="model width (default: 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--layers", type=int, default=8, help="transformer layers (default: 8)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default: 32)")
    p.add_argument(
        "--batch",
        type=int,
        default=16,
        help="global batch in samples, split evenly over the ranks (default: 16)",
    )
