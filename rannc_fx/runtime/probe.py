"""Measure the link between ranks before planning: p2p latency and bandwidth, all-reduce speed.

The cost model charges every cut value and every gradient all-reduce against the link, so a
preset's figure that is off by 10x (gloo over loopback moves ~1.5 GB/s point to point and
all-reduces at ~0.5 GB/s where a CPU preset might assume 5) turns the search towards the wrong
plan. ``measure_link`` ping-pongs between rank 0 and rank 1, and between rank 0 and the last
rank (on another node under a multi-node launch), keeps the slower of the two, then times an
all-reduce over every rank: every rank calls it, at the same point.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import CommError, all_reduce_flat

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


def measure_link(
    device: torch.device, *, rounds: int = 20, large_rounds: int = 4
) -> Link | None:
    """Latency (median one-way time of an 8-byte message) and bandwidth (4 MiB messages, the
    latency taken off) of the slowest probed pair, and the all-reduce bandwidth (32 MiB) over every
    rank as ``search`` prices it (``2 (W - 1) / W`` bytes per byte reduced, ``2 (W - 1)``
    latencies); None on one rank. Collective: every rank calls it, and gets rank 0's figures
    only where it probed a pair (rank 0 always does)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    pairs = sorted({(0, 1), (0, world - 1)})
    small = torch.zeros(_SMALL, dtype=torch.uint8, device=device)
    large = torch.zeros(_LARGE, dtype=torch.uint8, device=device)
    found: list[Link] = []
    for a, b in pairs:
        if rank not in (a, b):
            continue
        peer, first = (b, True) if rank == a else (a, False)
        try:
            _ping(small, peer, first, 3)  # connect and warm up both sizes
            _ping(large, peer, first, 1)
            lat = _ping(small, peer, first, rounds) / 2
            one_way = _ping(large, peer, first, large_rounds) / 2
        except RuntimeError as e:
            raise CommError(f"rank {rank}: measuring the link to rank {peer} failed: {e}") from e
        found.append(Link(_LARGE / max(one_way - lat, 1e-9), lat, 0.0))
    grads = [torch.zeros(_REDUCED // 16, dtype=torch.float32, device=device) for _ in range(4)]
    reduced = _all_reduce_s(grads, rounds=3)
    if not found:
        return None
    lat = max(x.latency for x in found)
    ring = 2 * (world - 1)
    ar_bw = ring / world * _REDUCED / max(reduced - ring * lat, 1e-9)
    link = Link(min(x.bandwidth for x in found), lat, ar_bw)
    log.info("link: %.3g GB/s, %.0f us per message, all-reduce %.3g GB/s (rank %d, pairs %s)",
             link.bandwidth / 1e9, link.latency * 1e6, ar_bw / 1e9, rank, pairs)
    return link


def _all_reduce_s(grads: list[torch.Tensor], rounds: int) -> float:
    """Median seconds of the runtime's gradient all-reduce of ``grads`` (``all_reduce_flat``:
    one flat buffer, then views) over every rank, after one warm-up."""
    times = []
    device = grads[0].device
    for _ in range(rounds + 1):
        _sync(device)
        t0 = time.perf_counter()
        all_reduce_flat(grads, None, what="the link probe's all-reduce")
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _ping(buf: torch.Tensor, peer: int, first: bool, rounds: int) -> float:
    """Median round-trip seconds of ``buf`` between this rank and ``peer``."""
    times = []
    for _ in range(rounds):
        _sync(buf.device)
        t0 = time.perf_counter()
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        _sync(buf.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
