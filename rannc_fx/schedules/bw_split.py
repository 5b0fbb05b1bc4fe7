"""What a backward split in two (``B``, the input gradients, then ``W``, the weight gradients)
costs over one: one definition for the simulator (``schedules/simulate.py``), which times the
split schedules' actions, and the search (``search/terms.py``), which costs ZB-H1.

Imports numpy only (the search imports no torch).
"""

from __future__ import annotations

import numpy as np

__all__ = ["SPLIT_NODE_MS", "SPLIT_OVERHEAD", "weight_share"]

# Measured on one CPU thread: a share of the backward (B + W against one backward on 4 GPT
# layers of width 256: 36.8-36.9 ms against 34.7-36.3 ms), and per node of the stage's graph,
# for B's walk of the autograd graph and W's calls (2 encoder layers of width 128, 72 nodes of
# the exported graph, micro-batches of 2 x 64 tokens: 3.19 against 2.71 ms, of which 4 % is
# the share)
SPLIT_OVERHEAD = 0.04
SPLIT_NODE_MS = 0.0052


def weight_share(grads: np.ndarray | float, params: np.ndarray | float) -> np.ndarray:
    """The share of a stage's backward that its weight gradients take (``W``): half (the
    input and the weight side of a matmul cost alike), times the share of its parameter
    bytes that train (a LoRA stage's frozen base has no weight gradient to defer)."""
    p, g = np.asarray(params, float), np.asarray(grads, float)
    return np.where(p > 0, 0.5 * np.minimum(1.0, g / np.where(p > 0, p, 1.0)), 0.5)
