"""The cluster's nodes as the search sees them: where a stage's ranks may lie, which of its
messages cross the network, and what its replicas' collectives cost at the links they span.

This module imports numpy only (no torch). Ranks are laid out stage by stage, as ``Plan``
numbers them (stage 0's replicas first), and node k holds ranks k N .. (k + 1) N - 1 (N =
``SearchSpace.devices_per_node``; torchrun numbers ranks node by node). With more ranks than
one node (W > N, W a multiple of N) a stage lies inside one node or over whole nodes (its
first rank a node's first, its replica count a multiple of N), never over part of one: the
layouts a cluster runs, and the ones whose costs are exact:

    node            0                1                2                3
    ranks      0 1 2 3 4 5 6 7  8 ...         15 16 ...                       31
    stages     [ s0  ][  s1   ] [      s2      ] [             s3              ]
                 r=4    r=4          r=8                   r=16: two nodes

A boundary between two stages is a message on NVLink where both lie in one node, on the
network where the rank after the boundary starts a node (s1 -> s2, s2 -> s3 above): a
stage's in-boundary crosses where its first rank o is a node's first (o mod N = 0, o > 0),
its out-boundary where the rank after its last is (w mod N = 0, w < W). A replica group
inside one node all-reduces on the node's links; one over g whole nodes hierarchically, as
NCCL does on such clusters (each device of a node has its own link to the network):

    ar_s = 2 (N - 1) / N G / ar_bw + 2 (N - 1) lat        reduce-scatter, all-gather in a node
         + 2 (g - 1) / g (G / N) / net_bw + 2 (g - 1) net_lat   each device's 1 / N across

and half of each for a reduce-scatter or an all-gather alone (net_lat: the network's
latency, at least the node's own). The DP's states count ranks used, so a stage's class -- whether its boundaries cross (``Moves``) -- is read off the
state it ends in: each class of a stage is an edge of its own, with its own t and u, that
only a state of that class takes (``Moves.ok``). One node (W <= N): one class, no crossing,
the search as without nodes.

Past ``FINE_RANKS`` ranks a stage's replicas are a divisor of a node's devices or k whole
nodes, k a power of two or a divisor of the node count (what clusters are cut into): at 256
devices in nodes of 8, 9 replica counts where every count below a node and every multiple
of one would make 39. On clusters of more than ``FINE_NODES`` nodes (thousands of devices)
the stages take whole nodes only and the states count nodes: at 8,192 devices, 1,025 states
and 11 replica counts where every count of ranks would make 8,193 and 8,192 (``coarse``,
``unit``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .problem import SearchSpace

__all__ = ["FINE_NODES", "FINE_RANKS", "PIPELINES", "Moves", "classes", "coarse", "crossing_at", "collective_s", "crossing_s", "layout_problem",
           "legal", "moves", "multi_node", "network_latency", "stage_moves", "unit",
           "usable_replicas"]


def multi_node(space: SearchSpace) -> bool:
    """Whether the space's ranks span more than one node."""
    n = space.devices_per_node
    return bool(n) and space.world_size > n


def legal(space: SearchSpace, first: np.ndarray | int, r: np.ndarray | int) -> np.ndarray:
    """Whether a stage on ranks [first, first + r) lies inside one node or over whole nodes
    (always, in one node)."""
    first, r = np.asarray(first), np.asarray(r)
    if not multi_node(space):
        return np.ones(np.broadcast(first, r).shape, bool)
    N = space.devices_per_node
    inside = first // N == (first + r - 1) // N
    return inside | ((first % N == 0) & (r % N == 0))


PIPELINES = "pipelines"  # ``SearchSpace.rank_order``: replica k's pipeline on ranks kS .. kS + S - 1

# Up to FINE_RANKS ranks the search places stages anywhere a node allows (every count below a
# node's, every multiple of it); past it, in the counts a cluster is cut into (a divisor of
# the node's devices, or k whole nodes, k a power of two or a divisor of the node count);
# past FINE_NODES nodes (thousands of devices) on whole nodes only
FINE_RANKS = 64
FINE_NODES = 16


def coarse(space: SearchSpace) -> bool:
    """Whether the space has more nodes than ``FINE_NODES`` (and no forced replicas): its
    stages take whole nodes, k of them with k a power of two or a divisor of the node count,
    and the DP counts nodes, not ranks (``unit``)."""
    return (multi_node(space) and space.replicas is None
            and space.world_size // space.devices_per_node > FINE_NODES)


def unit(space: SearchSpace) -> int:
    """The ranks one step of the DP's states counts: a node's where ``coarse``, else 1."""
    return space.devices_per_node if coarse(space) else 1


def usable_replicas(space: SearchSpace) -> tuple[int, ...]:
    """The replica counts a stage may have: the forced ones; any in one node; across nodes up
    to ``FINE_RANKS`` ranks, fewer than a node's devices or a multiple of them; past it, a
    divisor of the node's devices or k whole nodes, k a power of two or a divisor of the node
    count, and past ``FINE_NODES`` nodes the whole nodes alone (``coarse``)."""
    W, N = space.world_size, space.devices_per_node
    if space.replicas is not None:
        return tuple(sorted(set(space.replicas)))
    if not multi_node(space):
        return tuple(range(1, W + 1))
    if W <= FINE_RANKS:
        return tuple(r for r in range(1, W + 1) if r < N or r % N == 0)
    nodes = W // N
    whole = tuple(N * k for k in range(1, nodes + 1) if k & (k - 1) == 0 or nodes % k == 0)
    return whole if coarse(space) else tuple(d for d in range(1, N) if N % d == 0) + whole


def layout_problem(space: SearchSpace) -> str | None:
    """What is wrong with the space's nodes (None: nothing): a world size that is not whole
    nodes, no network, forced replicas over part of a node."""
    N, W = space.devices_per_node, space.world_size
    if not multi_node(space):
        return None
    if W % N:
        return (f"world size {W} is not a whole number of nodes of {N} devices "
                "(devices_per_node); give the devices each node holds")
    net = space.network_bandwidth
    if net is None or net <= 0:
        return (f"{W} ranks on nodes of {N} devices need the network's bandwidth between "
                "nodes (network_bandwidth, bytes/s per device)")
    if space.rank_order == PIPELINES:
        R = space.replicas or ()
        S = len(R)
        if not R or len(set(R)) != 1:
            return ("rank_order='pipelines' lays each replica's whole pipeline on consecutive "
                    "ranks: it needs forced replicas, the same on every stage "
                    f"(replicas={list(R)})")
        if N % S and S % N:
            return (f"rank_order='pipelines' with {S} stages on nodes of {N} devices puts a "
                    "pipeline over part of a node: the stage count must divide the node's "
                    "devices or be a multiple of them")
    elif space.replicas is not None:
        first = 0
        for s, r in enumerate(space.replicas):
            if not legal(space, first, r):
                return (f"replicas={list(space.replicas)} put stage {s} on ranks "
                        f"{first}..{first + r - 1}, over part of a node of {N} devices: a "
                        "stage lies inside one node or over whole nodes (a multiple of "
                        f"{N} replicas starting at a node's first rank)")
            first += r
    return None


def collective_s(space: SearchSpace, nbytes: np.ndarray, reps: np.ndarray,
                 passes: float = 2.0) -> np.ndarray:
    """Seconds of a ring all-reduce (``passes`` 2) or of its half, a reduce-scatter or an
    all-gather (1), of ``nbytes`` over ``reps`` replicas (broadcasting): on the node's links
    inside one node, hierarchically over whole nodes (the module docstring)."""
    r = np.asarray(reps, float)
    bw = space.allreduce_bandwidth or space.link_bandwidth
    if not multi_node(space):
        return passes * ((r - 1) / r * nbytes / bw + (r - 1) * space.link_latency)
    N = float(space.devices_per_node)
    if space.rank_order == PIPELINES:  # a node holds N / S replicas of each stage (or one)
        S = len(space.replicas or (1,))
        local = np.minimum(r, max(1.0, N // S)) if S <= N else np.ones_like(r)
    else:
        local = np.minimum(r, N)
    g = np.maximum(r / local, 1.0)
    net = space.network_bandwidth or bw
    inside = (local - 1) / local * nbytes / bw + (local - 1) * space.link_latency
    across = (g - 1) / g * nbytes / local / net + (g - 1) * network_latency(space)
    return passes * (inside + across)


def crossing_s(space: SearchSpace, nbytes: np.ndarray) -> np.ndarray:
    """What a boundary's messages (its values forward, their gradients back: 2 ``nbytes``)
    take longer on the network than on the node's links: a message between nodes goes no
    faster than one inside a node (the network's bandwidth, at most the link's; its latency,
    at least the link's), so a stage's class never costs less than the class inside a node,
    which the search's bounds count on."""
    if not multi_node(space):
        return np.zeros(np.shape(nbytes))
    net = min(space.network_bandwidth or space.link_bandwidth, space.link_bandwidth)
    return (2 * np.asarray(nbytes, float) * (1 / net - 1 / space.link_bandwidth)
            + 2 * (network_latency(space) - space.link_latency))


def crossing_at(space: SearchSpace, s: int, first: int, r: int, stages: int
                ) -> tuple[bool, bool]:
    """Whether the in- and out-boundary of stage s (of ``stages``, on r replicas from rank
    ``first`` stage by stage) cross nodes: stage by stage, where its first rank starts a node
    and where the rank after its last does; by pipelines, where a pipeline over several
    nodes passes from one to the next (after every N stages), never where it lies in one."""
    if not multi_node(space):
        return False, False
    N = space.devices_per_node
    if space.rank_order == PIPELINES:
        over = stages > N
        return (s > 0 and over and s % N == 0), (s < stages - 1 and over and (s + 1) % N == 0)
    return (s > 0 and first % N == 0), (s < stages - 1 and (first + r) % N == 0)


def stage_moves(space: SearchSpace, mv: Moves) -> list[int]:
    """With forced replicas, the move each stage takes (its class where it lies)."""
    assert space.replicas is not None
    R, out, first = space.replicas, [], 0
    for s, r in enumerate(R):
        cin, cout = crossing_at(space, s, first, r, len(R))
        # the first stage's missing boundary is the class that crosses there, as is the
        # last's (``classes`` keeps only those: the first starts a node, the last ends one)
        cin, cout = cin or s == 0, cout or s == len(R) - 1
        _, ms = mv.of(np.array([r]))
        want = [k for k in ms.tolist() if mv.cin[k] == cin and mv.cout[k] == cout]
        if space.rank_order != PIPELINES:
            want = [k for k in want if mv.ok(np.array(k), (first + r) // mv.unit)]
        out.append(want[0] if want else -1)
        first += r
    return out


def network_latency(space: SearchSpace) -> float:
    """Seconds a message between nodes costs whatever its size: the network's, at least the
    node's own links' (a message never crosses nodes faster than it crosses a node)."""
    return max(space.network_latency, space.link_latency)


def classes(mv: Moves, space: SearchSpace, reps: np.ndarray, start: np.ndarray,
            end: np.ndarray, cut_of: Callable[[int], np.ndarray], num_blocks: int,
            first: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The classes of stages [start, end) on ``reps`` replicas: (which stage each one is,
    its move, the seconds its crossing boundaries add, ``crossing_s``), ``cut_of(r)`` the
    cut bytes at each block boundary for r replicas. A first stage starts a node and a last
    ends one: their other classes are left out. ``first``: one stage at that first rank, its
    one class."""
    reps = np.asarray(reps, np.int64)
    src, move = mv.of(reps)
    lo, hi = np.asarray(start, np.int64)[src], np.asarray(end, np.int64)[src]
    keep = (mv.cin[move] | (lo > 0)) & (mv.cout[move] | (hi < num_blocks))
    if first is not None:  # the one class of a stage at that rank
        keep &= mv.ok(move, (first + reps[src]) // mv.unit)
    src, move, lo, hi = src[keep], move[keep], lo[keep], hi[keep]
    cut = np.zeros((len(src), 2))
    for r in np.unique(reps[src]).tolist():
        at = reps[src] == r
        row = np.asarray(cut_of(r), float)
        cut[at, 0], cut[at, 1] = row[lo[at]], row[hi[at]]
    x = (np.where(mv.cin[move] & (lo > 0), crossing_s(space, cut[:, 0]), 0.0)
         + np.where(mv.cout[move] & (hi < num_blocks), crossing_s(space, cut[:, 1]), 0.0))
    return src, move, x


@dataclass(frozen=True)
class Moves:
    """The classes of a stage by replica count: move k is a stage of ``r[k]`` replicas whose
    in-boundary crosses nodes iff ``cin[k]`` (its first rank a node's first) and whose
    out-boundary iff ``cout[k]`` (the rank after its last a node's first). Fewer replicas
    than a node have three classes (first, inside, last in their node), whole nodes one.
    ``first[r]`` and ``count[r]`` are the moves of r replicas. The DP's states count ranks
    in steps of ``unit`` (``nodes.unit``): move k advances them by ``step[k]``."""

    node: int
    r: np.ndarray
    cin: np.ndarray
    cout: np.ndarray
    first: np.ndarray  # (W + 1,): the first move of each replica count
    count: np.ndarray  # (W + 1,): how many moves it has (0: none)
    unit: int = 1

    @property
    def step(self) -> np.ndarray:
        return self.r // self.unit

    def ok(self, move: np.ndarray, end: np.ndarray | int) -> np.ndarray:
        """Whether a stage of ``move`` may end at state ``end`` (ranks used, in units;
        broadcasting): its ranks lie inside one node or over whole nodes, of its class."""
        return self.table[move, end]

    @functools.cached_property
    def table(self) -> np.ndarray:
        """``ok`` of every move (rows) at every state (columns), once: the DPs read it for
        every stage they try."""
        N, r = self.node, self.r[:, None]
        end = np.arange((len(self.first) - 1) // self.unit + 1)[None, :] * self.unit
        first = end - r
        inside = first // N == (end - 1) // N
        whole = (first % N == 0) & (r % N == 0)
        return ((first >= 0) & (inside | whole) & ((first % N == 0) == self.cin[:, None])
                & ((end % N == 0) == self.cout[:, None]))

    def of(self, reps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every move of each replica count in ``reps``: (index into reps, move), in order."""
        reps = np.asarray(reps, np.int64)
        n = self.count[reps]
        src = np.repeat(np.arange(len(reps)), n)
        within = np.arange(len(src)) - np.repeat(np.cumsum(n) - n, n)
        return src, self.first[reps][src] + within


def moves(space: SearchSpace) -> Moves | None:
    """The moves of a multi-node space (None in one node: a stage's replica count is its
    move)."""
    if not multi_node(space):
        return None
    W, N = space.world_size, space.devices_per_node
    r: list[int] = []
    cin: list[bool] = []
    cout: list[bool] = []
    first, count = np.zeros(W + 1, np.int64), np.zeros(W + 1, np.int64)
    for reps in usable_replicas(space):
        first[reps] = len(r)
        kinds: tuple[tuple[bool, bool], ...] = (
            ((True, False), (False, False), (False, True)) if reps < N else ((True, True),))
        if space.rank_order == PIPELINES:  # by stage position, any of the four
            kinds = ((True, False), (False, False), (False, True), (True, True))
        for a, b in kinds:
            r.append(reps)
            cin.append(a)
            cout.append(b)
        count[reps] = len(kinds)
    return Moves(N, np.array(r, np.int64), np.array(cin), np.array(cout), first, count,
                 unit(space))
