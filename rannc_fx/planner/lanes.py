"""Which lanes the schedules with several stages a lane are tried on, and the bounds that skip
the rest.

The search picks ``P`` lanes (its stages), their replica counts and ``m`` for GPipe or 1F1B,
whose bubble, (P - 1) / (m + P - 1) of a step, pushes it towards few lanes. Interleaved 1F1B
and ZBV shrink that bubble, so their best lanes are often more of them, each with fewer
replicas and less to hold: on the 4.9 B BERT on 8 V100s the search's 2 lanes of 4 ranks
give 4816 ms interleaved, 4 lanes of 2 give 4759 under ZBV. ``virtual_variants`` tries
them on

- the searched plan's lanes and ``m``, then
- every equal split of the ranks into ``P`` lanes (``P`` dividing the world size, at least
  two blocks a lane) with every micro-batch count of the space whose micro-batches the
  cost table has costs for, in the order of the step they would take without a bubble
  (``work_s``), so that the likely best come first.

Each is cut into stages (``virtual._variant``: boundaries balanced, sharding, offloading and
recomputation where a lane does not fit); two lower bounds of the simulated step skip what
cannot beat the best plan so far: before the cut, ``work_s`` (the model's forward and
backward at the lanes' micro-batch size, ``m`` times, shared by ``P`` lanes: no lane can do
less than the average), and after it, before the plan is built and simulated, ``step_bound``
(each lane's own forwards, backwards and recomputation, after the first micro-batch's way to
it and, unsplit, before the last one's way back from it).

Where the user forces the stages or their replica counts (``Config.stages``,
``Config.replicas``) only the searched lanes are tried.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..search import SearchResult
from ..search.cost_model import samples_per_replica, size_index
from ..search.nodes import legal, usable_replicas
from ..search.problem import Evaluation
from .analyze import Analysis

__all__ = ["Lanes", "lane_choices", "step_bound", "work_s"]


class Lanes(NamedTuple):
    """Lanes to cut into stages: each one's replica count, and the micro-batch count."""

    replicas: tuple[int, ...]
    m: int


def lane_choices(a: Analysis, result: SearchResult) -> list[Lanes]:
    """The searched plan's lanes, then every equal split of the ranks into lanes of at
    least two blocks each that the cluster's nodes allow (``search.nodes``), by ``work_s``
    (ties: fewer lanes, fewer micro-batches)."""
    searched = Lanes(tuple(st.replicas for st in result.stages), result.micro_batches)
    sp = a.space
    if sp.replicas is not None or sp.stages is not None:
        return [searched]
    kidx = size_index(a.table)
    equal = []
    for P in range(2, sp.world_size + 1):
        r = sp.world_size // P
        if sp.world_size % P or 2 * P > a.table.num_blocks:
            continue
        if r not in usable_replicas(sp) or not legal(sp, np.arange(P) * r, r).all():
            continue  # lanes over part of a node, or of a count the search does not place
        for m in sorted(set(sp.micro_batches)):
            lanes = Lanes((r,) * P, m)
            if m * r <= sp.global_batch and lanes != searched and \
                    samples_per_replica(sp.global_batch, m, r) in kidx:
                equal.append(lanes)
    return [searched] + sorted(equal, key=lambda x: (work_s(a, x), len(x.replicas), x.m))


def work_s(a: Analysis, lanes: Lanes) -> float:
    """A lower bound of the step of any plan on equal ``lanes``: the forward and backward of
    every block at the lanes' micro-batch size, ``m`` times, over the lanes (the busiest
    lane does at least the average; messages, recomputation, the update and the bubble only
    add)."""
    r, P = lanes.replicas[0], len(lanes.replicas)
    q = samples_per_replica(a.space.global_batch, lanes.m, r)
    k = size_index(a.table)[q]
    return lanes.m * float(np.sum(a.table.fwd[k]) + np.sum(a.table.bwd[k])) / P


def step_bound(ev: Evaluation, layout: Sequence[Sequence[int]], m: int, split: bool) -> float:
    """A lower bound of the simulated step of stages costed ``ev`` on the lanes ``layout``
    (each lane's stages in chain order; ``split``: backwards split into B and W): per lane,
    its ``m`` forwards, backwards and recomputations, after the first micro-batch's forwards
    through every stage before its first (it has nothing to run before), and, where no
    backward is split, before that micro-batch's backwards through them (the lane's last
    backward is its first stage's, of the last micro-batch; their recomputation can run
    before it, and with a split its ``W`` beside them). Messages, accumulation, the update
    and idle time only add."""
    st = ev.stages
    f, b = [c.fwd_s for c in st], [c.bwd_s for c in st]
    out = 0.0
    for lane in layout:
        first = min(lane)
        busy = m * sum(f[s] + b[s] + st[s].recompute_s for s in lane)
        # the way back: backwards only (a stage's recomputation runs before its gradient comes)
        out = max(out, sum(f[:first]) + busy + (0.0 if split else sum(b[:first])))
    return out
