"""Group nodes into atomic blocks and coarsen them into the chain the search cuts.

    group_ops       what an op does to its inputs (views, in-place writes, random draws) and
                    the state the forward writes
    group_boundary  values recomputed where they are read, the values crossing each cut, the
                    parameters and buffers each block reads
    group_atomic    the atomic groups of the call nodes, in chain order
    group           ``group_pass``: the groups coarsened to at most ``max_blocks`` blocks

Two steps, as in RaNNC:

1. *Atomic grouping* (union-find over nodes). Nodes that must never be cut apart share a
   group: a view or alias with the node producing its input, an in-place op with the value it
   mutates (and with that value's earlier readers, so none of them can run after the write),
   a ``getitem`` with its multi-output op, a parameter-only node (a weight transpose or cast
   that reads only parameters, buffers and sizes) with its first consumer, a node whose value
   is never read (an assert) with its producer, and a value that is neither a tensor nor an
   int with every reader (``ValueSpec.kind == "constant"``: dtypes, devices, tuples of
   tensors), and a tensor without a batch dimension computed from the batch (a partial loss,
   a batch statistic) with every reader: each replica computes its own, but a cut value
   without a batch dimension moves whole from one producer replica (``routing``), so across
   stages with different replica counts the other replicas' parts would be lost. Groups are
   then ordered topologically, in the original node order where the edges allow; groups on a
   cycle of the quotient graph are merged first.

   Some values never cross a stage boundary because the consumer stage recomputes them
   (``recomputed_values``): integers (sizes; from the stage's sample count) and *data-free*
   values (attention masks, position ids: deterministic values computed only from buffers,
   constants, sizes and other such values, never written in place, reading no trainable
   parameter and no tensor the forward writes; the consumer stage runs their chain again).
   They only join their first consumer's group and are not counted at boundaries.

   Every stage that reads a buffer or constant holds its own copy (the same values on every
   stage), so a tensor the forward writes (``written_state``: a BatchNorm's running
   statistics, a counter ``add_``-ed in place) has all its readers in the writer's group: a
   stage boundary between them would leave the other stages' copies stale.

2. *Coarsening*. While there are more than ``max_blocks`` blocks, the adjacent pair whose
   boundary carries the most bytes per second of compute on its smaller side is merged
   (communication-heavy cuts go first), using a heap.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..capture.capture import CapturedGraph
from ..plan.values import ValueSpec
from ..profile.profile import Profile
from ..progress import note
from .atomic import atomic_groups
from .boundary import (
    _cut_bytes,
    block_params,
    crossing_values,
    recompute_chain,
    recomputed_values,
)
from .ops import CALL_OPS, is_inplace, is_view, written_state

__all__ = [
    "CALL_OPS",
    "BlockGraph",
    "atomic_groups",
    "block_params",
    "crossing_values",
    "group_pass",
    "is_inplace",
    "is_view",
    "recompute_chain",
    "recomputed_values",
    "written_state",
]


class BlockGraph(BaseModel):
    """The chain of blocks in topological order.

    A value is produced in a block no later than any block reading it, except a recomputed
    value (``recomputed_values``: sizes, data-free values such as masks), which a reader
    recomputes wherever its producer is.

    Every call node (call_function / call_method / call_module) is in exactly one block;
    placeholders, get_attr and output nodes are in none (a stage takes the graph inputs and
    parameters it uses directly). ``params[b]`` names the parameters and buffers block ``b``
    reads, each under its canonical name (a tied parameter under the name
    ``CapturedGraph.aliases`` maps its other names to). ``boundary[k]`` names the values that
    cross the cut before block ``k`` (produced by a node in a block < k, read by one in a
    block >= k), in node order; ``boundary[0]`` and ``boundary[B]`` are empty. Graph inputs
    never count as crossing: every stage reads them from the data. Integer values never count
    either: the split pass recomputes them where they are read.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocks: tuple[tuple[str, ...], ...]
    params: tuple[tuple[str, ...], ...]
    boundary: tuple[tuple[str, ...], ...]
    # the first node of every atomic group: where a block, or a segment of a stage that
    # recomputes layer by layer (``group/layers.py``), may start
    group_starts: tuple[str, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_of(self) -> dict[str, int]:
        """Node name -> block index."""
        return {n: b for b, names in enumerate(self.blocks) for n in names}


# -- coarsening ------------------------------------------------------------------------------


def _representative(profile: Profile) -> int:
    """Index of the profiled size the grouping costs are read at (the middle one)."""
    return (len(profile.batch_sizes) - 1) // 2


def _group_compute(profile: Profile, groups: Sequence[Sequence[str]]) -> np.ndarray:
    k = _representative(profile)
    out = np.zeros(len(groups))
    for g, names in enumerate(groups):
        for n in names:
            c = profile.nodes.get(n)
            if c is not None:
                out[g] += c.fwd_s[k] + c.bwd_s[k]
    return out


def coarsen(compute: np.ndarray, cut: np.ndarray, max_blocks: int) -> list[int]:
    """Start positions of the merged blocks: at most ``max_blocks`` runs of the chain.

    ``compute[g]`` is group g's time and ``cut[k]`` the bytes crossing the cut before group
    k. The boundary with the highest ``cut / compute of its smaller side`` goes first; a
    boundary's bytes never change as others go, only the compute beside it. Of boundaries
    that score the same (identical layers), the one whose merged block is smallest goes first:
    otherwise the first block absorbs one identical layer after another.
    """
    n = len(compute)
    if n <= max_blocks:
        return list(range(n))
    comp = compute.astype(float).copy()  # by block start
    nxt = list(range(1, n + 1))  # start of the next block (n: none)
    prv = list(range(-1, n - 1))  # start of the previous block
    alive = [True] * n  # a start position still begins a block
    eps = max(float(compute.sum()) * 1e-9, 1e-15)

    def key(k: int) -> tuple[float, float]:
        score = (float(cut[k]) + 1.0) / (min(comp[prv[k]], comp[k]) + eps)
        return -score, comp[prv[k]] + comp[k]

    heap = [(*key(k), k, 0) for k in range(1, n)]
    heapq.heapify(heap)
    version = [0] * (n + 1)
    blocks = n
    while blocks > max_blocks:
        _, _, k, ver = heapq.heappop(heap)
        if not alive[k] or ver != version[k]:
            continue
        left = prv[k]
        comp[left] += comp[k]
        alive[k] = False
        nxt[left] = nxt[k]
        if nxt[k] < n:
            prv[nxt[k]] = left
        blocks -= 1
        for b in (left, nxt[left]):
            if 0 < b < n and alive[b]:
                version[b] += 1
                heapq.heappush(heap, (*key(b), b, version[b]))
    return [k for k in range(n) if alive[k]]


def group_pass(
    captured: CapturedGraph,
    profile: Profile,
    values: dict[str, ValueSpec],
    *,
    max_blocks: int,
) -> BlockGraph:
    """Atomic groups of ``captured.gm``'s call nodes, coarsened to at most ``max_blocks``."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks}: need at least one block")
    t0 = time.perf_counter()
    gm = captured.gm
    recomputed = recomputed_values(gm, values)
    groups = atomic_groups(gm, values, free=recomputed)
    if not groups:
        raise ValueError("the captured graph has no call nodes to group")
    position = {name: g for g, names in enumerate(groups) for name in names}
    samples = profile.batch_sizes[_representative(profile)]
    cut = _cut_bytes(gm, position, len(groups), values, recomputed, samples)
    starts = coarsen(_group_compute(profile, groups), cut, max_blocks)
    ends = [*starts[1:], len(groups)]
    blocks = [tuple(n for g in groups[s:e] for n in g) for s, e in zip(starts, ends, strict=True)]
    block_of = {name: b for b, names in enumerate(blocks) for name in names}
    out = BlockGraph(
        blocks=tuple(blocks),
        params=tuple(tuple(p) for p in block_params(captured, blocks, values,
                                                     recomputed=recomputed)),
        boundary=tuple(tuple(v) for v in crossing_values(gm, block_of, len(blocks), recomputed)),
        group_starts=tuple(g[0] for g in groups),
    )
    note("grouped %d nodes into %d blocks in %.2f s", len(position), len(blocks),
         time.perf_counter() - t0)
    return out
