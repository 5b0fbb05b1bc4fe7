"""Measure the link between ranks before planning: p2p latency and bandwidth, all-reduce speed.

The cost model charges every cut value and every gradient all-reduce against the link, so a
preset's figure that is off by 10x (gloo over loopback moves ~1.5 GB/s point to point and
all-reduces at ~0.5 GB/s where a CPU preset might assume 5) turns the search towards the wrong
plan. ``measure_link`` ping-pongs between rank 0 and rank 1, and between rank 0 and the last
rank, keeps the slower of the two, then times an all-reduce over every rank: every rank calls
it, at the same point. Launched over several nodes, the pairs are rank 0 and rank 1 (inside
node 0) and rank 0 and the first rank of node 1 (the network), and the all-reduce is node
0's alone: the figures inside a node and the network's apart, as the cost model prices them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..plan.device import DeviceSpec
from ..profile.timing import median_seconds
from ..runtime.comm import CommError, all_reduce_flat

__all__ = ["Link", "measure_link"]

log = logging.getLogger("rannc_fx")

_SMALL = 8  # bytes of the latency message
_LARGE = 1 << 22  # bytes of the bandwidth message (4 MiB)
_REDUCED = 1 << 25  # bytes of the all-reduce (32 MiB: large buffers reduce slower per byte)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one way
    latency: float  # seconds per message
    allreduce_bandwidth: float  # bytes/s of a ring all-reduce's traffic, reduction included
    # between nodes (a launch over several): bytes/s one way and seconds per message
    network_bandwidth: float | None = None
    network_latency: float | None = None

    def applied_to(self, spec: DeviceSpec) -> DeviceSpec:
        """``spec`` with these figures as its link (and its network, where measured)."""
        update: dict[str, float] = {
            "interconnect_bandwidth": self.bandwidth,
            "interconnect_latency": self.latency,
            "allreduce_bandwidth": self.allreduce_bandwidth,
        }
        if self.network_bandwidth is not None and self.network_latency is not None:
            update |= {"network_bandwidth": self.network_bandwidth,
                       "network_latency": self.network_latency}
        return spec.model_copy(update=update)


def measure_link(
    device: torch.device, *, rounds: int = 20, large_rounds: int = 4,
    node: int | None = None,
) -> Link | None:
    """Latency (median one-way time of an 8-byte message) and bandwidth (4 MiB messages, the
    latency taken off) of the slowest probed pair, and the all-reduce bandwidth (32 MiB) over
    every rank as ``search`` prices it (``2 (W - 1) / W`` bytes per byte reduced, ``2 (W - 1)``
    latencies); None on one rank. ``node``: the ranks a node holds, where fewer than the
    world's: the pair inside node 0 and the all-reduce over its ranks give the link, the pair
    from rank 0 to node 1's first rank the network. Collective: every rank calls it, and
    gets rank 0's figures only where it probed a pair (rank 0 always does)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    if node is not None and 1 <= node < world:
        return _measure_nodes(device, node, rounds, large_rounds)
    pairs = sorted({(0, 1), (0, world - 1)})
    small = torch.zeros(_SMALL, dtype=torch.uint8, device=device)
    large = torch.zeros(_LARGE, dtype=torch.uint8, device=device)
    found = [_pair(device, a, b, small, large, rounds, large_rounds)
             for a, b in pairs if rank in (a, b)]
    reduced = _reduce_seconds(device, None)
    if not found:
        return None
    bandwidth, lat = min(bw for bw, _ in found), max(t for _, t in found)
    ring = 2 * (world - 1)
    link = Link(bandwidth, lat, ring / world * _REDUCED / max(reduced - ring * lat, 1e-9))
    log.info("link: %.3g GB/s, %.0f us per message, all-reduce %.3g GB/s (rank %d, pairs %s)",
             link.bandwidth / 1e9, link.latency * 1e6, link.allreduce_bandwidth / 1e9, rank, pairs)
    return link


def _measure_nodes(device: torch.device, node: int, rounds: int, large_rounds: int
                   ) -> Link | None:
    """``measure_link`` over several nodes of ``node`` ranks each."""
    rank = dist.get_rank()
    small = torch.zeros(_SMALL, dtype=torch.uint8, device=device)
    large = torch.zeros(_LARGE, dtype=torch.uint8, device=device)
    inside = _pair(device, 0, 1, small, large, rounds, large_rounds) if (
        node > 1 and rank in (0, 1)) else None
    across = _pair(device, 0, node, small, large, rounds, large_rounds) if (
        rank in (0, node)) else None
    group = dist.new_group(list(range(node)))  # collective: every rank makes it
    reduced = _reduce_seconds(device, group) if rank < node and node > 1 else None
    if rank != 0:
        return None
    assert across is not None
    bandwidth, lat = inside if inside is not None else across
    ring = 2 * (node - 1)
    allreduce = (ring / node * _REDUCED / max(reduced - ring * lat, 1e-9)
                 if reduced is not None else bandwidth)
    link = Link(bandwidth, lat, allreduce, across[0], across[1])
    log.info("link: %.3g GB/s, %.0f us per message, all-reduce %.3g GB/s in a node of %d; "
             "network %.3g GB/s, %.0f us per message", link.bandwidth / 1e9, link.latency * 1e6,
             link.allreduce_bandwidth / 1e9, node, across[0] / 1e9, across[1] * 1e6)
    return link


def _pair(device: torch.device, a: int, b: int, small: torch.Tensor, large: torch.Tensor,
          rounds: int, large_rounds: int) -> tuple[float, float]:
    """(bandwidth, latency) between ranks a and b, timed on both (this rank is one)."""
    rank = dist.get_rank()
    peer = b if rank == a else a
    small_trip = _round_trip(small, peer, first=rank == a)
    large_trip = _round_trip(large, peer, first=rank == a)
    try:
        for _ in range(3):  # connect, and warm up both sizes
            small_trip()
        large_trip()
        lat = median_seconds(small_trip, device, repeats=rounds) / 2
        one_way = median_seconds(large_trip, device, repeats=large_rounds) / 2
    except RuntimeError as e:
        raise CommError(f"rank {rank}: measuring the link to rank {peer} failed: {e}") from e
    return _LARGE / max(one_way - lat, 1e-9), lat


def _reduce_seconds(device: torch.device, group: Any) -> float:
    """The runtime's gradient all-reduce (one flat buffer, then views) of ``_REDUCED`` bytes
    over ``group`` (None: every rank), after one warm-up: its median seconds."""
    grads = [torch.zeros(_REDUCED // 16, dtype=torch.float32, device=device) for _ in range(4)]

    def reduce() -> None:
        all_reduce_flat(grads, group, what="the link probe's all-reduce")

    reduce()
    return median_seconds(reduce, device, repeats=3)


def _round_trip(buf: torch.Tensor, peer: int, *, first: bool) -> Callable[[], None]:
    """``buf`` to ``peer`` and back (``first``: this rank sends first)."""

    def trip() -> None:
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return trip
