"""Dynamic programming over stage boundaries, per-stage replica counts and micro-batch counts.

This module imports numpy only (no torch): the kernel works on a CostTable of arrays.

# INTERFACE (to be implemented)

Cost model (all times in seconds, sizes in bytes). A stage covers blocks [i, j) with r
replicas; with m micro-batches each replica handles q = ceil(global_batch / (m * r)) samples
per micro-batch, and ``k`` is the index of q in ``table.sizes``.

    t_s      = sum(fwd[k, i:j]) + sum(bwd[k, i:j]) + 2 * (cut[k, i] + cut[k, j]) / link_bw
    ar_s     = 2 * (r - 1) / r * grad_bytes[i, j] / link_bw        (ring all-reduce)
    step     = sum_s t_s  +  max_s ((m - 1) * t_s + ar_s)
    memory_s = param_bytes[i, j] + grad_bytes[i, j] * (1 + optimizer_state_factor)
               + m * sum(act[k, i:j]) + m * (cut[k, i] + cut[k, j]) + max(workspace[k, i:j])

``sum_s t_s`` is the pipeline's fill and drain; the max term is the steady state of the
bottleneck stage plus its gradient all-reduce. A plan is feasible when every stage's memory is
within ``memory_budget``, replica counts sum to ``world_size`` and m * r <= global_batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "CostTable",
    "Evaluation",
    "NoFeasiblePlan",
    "SearchResult",
    "SearchSpace",
    "StageChoice",
    "brute_force",
    "evaluate",
    "needed_sizes",
    "samples_per_replica",
    "search_pass",
]


@dataclass(frozen=True)
class CostTable:
    """Per-block costs at each per-replica micro-batch size in ``sizes``.

    Shapes: sizes (Q,); fwd, bwd, act, workspace (Q, B); cut (Q, B + 1) with cut[:, 0] and
    cut[:, B] zero; param_bytes and grad_bytes (B, B + 1), entry [i, j] for the block range
    [i, j) with shared parameters counted once (only i < j is read).
    """

    sizes: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    act: np.ndarray
    workspace: np.ndarray
    cut: np.ndarray
    param_bytes: np.ndarray
    grad_bytes: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.fwd.shape[1])


@dataclass(frozen=True)
class SearchSpace:
    world_size: int
    global_batch: int
    memory_budget: float
    link_bandwidth: float
    optimizer_state_factor: float = 2.0
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)  # candidates; forced = one candidate
    stages: int | None = None  # forced stage count
    replicas: tuple[int, ...] | None = None  # forced replica counts (implies stages)


@dataclass(frozen=True)
class StageChoice:
    start: int
    end: int  # exclusive
    replicas: int


@dataclass(frozen=True)
class StageCost:
    samples: int
    fwd_s: float
    bwd_s: float
    comm_s: float
    allreduce_s: float
    params: int
    grads: int
    optimizer_state: int
    activations: int
    comm_buffers: int
    workspace: int

    @property
    def memory(self) -> int:
        return (self.params + self.grads + self.optimizer_state + self.activations
                + self.comm_buffers + self.workspace)


@dataclass(frozen=True)
class Evaluation:
    step_s: float
    stages: tuple[StageCost, ...]
    fits: bool


@dataclass(frozen=True)
class SearchResult:
    micro_batches: int
    stages: tuple[StageChoice, ...]
    evaluation: Evaluation


class NoFeasiblePlan(ValueError):
    """No plan fits; the message says by how much and what would fit."""


def samples_per_replica(global_batch: int, micro_batches: int, replicas: int) -> int:
    return -(-global_batch // (micro_batches * replicas))


def needed_sizes(space: SearchSpace) -> tuple[int, ...]:
    """Every per-replica micro-batch size the search may look up, ascending."""
    raise NotImplementedError


def evaluate(table: CostTable, space: SearchSpace, stages: tuple[StageChoice, ...], micro_batches: int) -> Evaluation:
    raise NotImplementedError


def search_pass(table: CostTable, space: SearchSpace) -> SearchResult:
    raise NotImplementedError


def brute_force(table: CostTable, space: SearchSpace) -> SearchResult:
    raise NotImplementedError
