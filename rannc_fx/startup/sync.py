"""Start every rank from rank 0's model: its parameters and buffers sent to each stage's ranks.

Each rank builds the model itself, so ranks that seed differently (or where only rank 0 loads
pretrained weights) would train replicas that differ, and a pipeline joined from different
ranks' stages. As DDP does at construction and FSDP with ``sync_module_states=True``,
``compile()`` makes rank 0's values the start of training, in two steps:

* ``check_alike``, before placement: one all-gather in which every rank shows the shapes,
  dtypes and meta-ness of the tensors each lane of the plan holds, and rank 0 its seed. Ranks
  that built another model are refused on every rank at once, before any tensor travels; rank
  0's seed is what every rank materializes a meta-device model from (``placement.py``).
* ``sync_stages``, after placement and before ZeRO shards the optimizer: rank 0, which still
  holds the whole model, sends each lane's tensors (parameters, frozen ones too, buffers and
  graph constants; a tensor several of the lane's stages read once) in buckets of at most
  ``BUCKET_BYTES``. Its own lane gets them by a broadcast in the lane's replica group; any
  other lane by a message to its first rank, which broadcasts each bucket on in its group::

      rank 0 ──bcast──▶ ranks of lane 0          (rank 0 is lane 0's first rank)
      rank 0 ──send──▶ first rank of lane 1 ──bcast──▶ the other ranks of lane 1
      rank 0 ──send──▶ first rank of lane 2 ──bcast──▶ ...

  So rank 0 sends each other lane's bytes once (a tied weight once to each lane holding it),
  and the receivers copy them into their placed tensors (in host memory under
  ``host_params``); a bucket that is one contiguous tensor already on the wire's device
  travels in place, without a copy. Tensors on the meta device at rank 0 hold no values to
  send: every rank materializes those from rank 0's seed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import fx

from ..plan.plan import Plan
from ..progress import note
from ..runtime.comm import BUCKET_BYTES, Groups, backend_of, buckets, collective
from ..runtime.p2p import Message, post
from .placement import stage_tensors

__all__ = ["Layout", "Synced", "TensorSpec", "check_alike", "lane_tensors", "sync_stages"]

MiB = 2**20


class TensorSpec(NamedTuple):
    """What a rank's tensor must match in rank 0's to take its values."""

    shape: tuple[int, ...]
    dtype: str
    meta: bool  # on the meta device when compile() began: materialized from the seed, not sent


@dataclass(frozen=True)
class Layout:
    """The tensors each lane of the plan holds, in the order they travel."""

    lanes: tuple[tuple[int, ...], ...]  # the stages of each lane (``Plan.lanes``)
    specs: tuple[tuple[TensorSpec, ...], ...]  # per lane

    @classmethod
    def of(cls, stages: Sequence[fx.GraphModule], plan: Plan) -> Layout:
        """From every stage's GraphModule (each rank splits them all), before placement."""
        lanes = plan.lanes
        specs = tuple(
            tuple(TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.is_meta)
                  for t in lane_tensors(stages, lane))
            for lane in lanes
        )  # fmt: skip
        return cls(lanes, specs)

    def summary(self) -> list[tuple[int, int, int, str]]:
        """Per lane: tensors, bytes, tensors on the meta device, and a digest of the specs."""
        out = []
        for specs in self.specs:
            nbytes = sum(_numel(s.shape) * _itemsize(s.dtype) for s in specs)
            digest = hashlib.sha256(repr(specs).encode()).hexdigest()[:16]
            out.append((len(specs), nbytes, sum(s.meta for s in specs), digest))
        return out


@dataclass
class Synced:
    """What ``sync_stages`` moved on this rank."""

    sent_bytes: int = 0  # rank 0: every lane's bytes, once each
    received_bytes: int = 0
    seconds: float = 0.0


def lane_tensors(stages: Sequence[fx.GraphModule], lane: Sequence[int]) -> list[torch.Tensor]:
    """The tensors the lane's stages read, each once, in stage order: the same order on
    every rank (each splits the same graph), before and after placement replaced them."""
    out: dict[int, torch.Tensor] = {}
    for s in lane:
        for key, t in stage_tensors(stages[s]).items():
            out.setdefault(key, t)
    return list(out.values())


def check_alike(layout: Layout, world: int) -> int:
    """One all-gather: refuse, on every rank, ranks whose lanes hold tensors of other shapes,
    dtypes or meta-ness than rank 0's; returns rank 0's seed (``torch.initial_seed()``)."""
    mine = (torch.initial_seed(), layout.summary())
    if world == 1:
        return int(mine[0])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    seed, want = everyone[0]
    problems = [
        f"rank {r}'s stage(s) {list(lane)} hold {_described(got)}; rank 0's {_described(ref)}"
        for r, (_, theirs) in enumerate(everyone)
        for lane, got, ref in zip(layout.lanes, theirs, want, strict=True)
        if got != ref
    ]
    if problems:
        shown = problems[:8] + ([f"... {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise ValueError(
            "the ranks built different models, so rank 0's tensors do not fit every rank's "
            "stages:\n  " + "\n  ".join(shown) + "\nevery rank must build the same model (class, "
            "configuration, dtypes; on the meta device on every rank or on none)"
        )
    return int(seed)


def sync_stages(
    stages: Sequence[fx.GraphModule],
    plan: Plan,
    layout: Layout,
    groups: Groups,
    *,
    device: torch.device,
    cap: int | None = None,
) -> Synced:
    """Overwrite every rank's placed stage tensors with rank 0's values (see the module
    docstring); every rank calls it at the same point. ``stages`` is every stage's
    GraphModule: on rank 0 they still hold the whole model (placement frees it after this).
    ``cap``: the most bytes a bucket copies (default ``BUCKET_BYTES``)."""
    rank = dist.get_rank()
    cap = BUCKET_BYTES if cap is None else cap
    # NCCL moves device memory only; gloo host memory
    wire = device if backend_of(groups.world) == "nccl" else torch.device("cpu")
    done = Synced()
    started = time.perf_counter()
    with torch.no_grad():
        for lane, specs in zip(layout.lanes, layout.specs, strict=True):
            ranks = plan.stages[lane[0]].ranks
            if ranks == (0,) or (rank != 0 and rank not in ranks):
                continue
            held = zip(lane_tensors(stages, lane), specs, strict=True)
            tensors = [t for t, spec in held if not spec.meta and t.numel()]
            moved = _sync_lane(tensors, lane, ranks, groups, rank=rank, wire=wire, cap=cap)
            if rank == 0:
                done.sent_bytes += moved
            else:
                done.received_bytes += moved
    done.seconds = time.perf_counter() - started
    note("started every stage from rank 0's model: %.1f MiB sent in %.2f s",
         done.sent_bytes / MiB, done.seconds)
    return done


def _sync_lane(
    tensors: list[torch.Tensor], lane: tuple[int, ...], ranks: tuple[int, ...], groups: Groups,
    *, rank: int, wire: torch.device, cap: int,
) -> int:  # fmt: skip
    """One lane's tensors from rank 0 (the sender's or a receiver's side); the bytes moved."""
    hop = 0 not in ranks  # rank 0 -> the lane's first rank, which broadcasts on
    first = ranks[0] if hop else 0
    group = groups.stage[lane[0]]  # the lane's replica group (its stages share one)
    chunks = buckets(tensors, cap)
    moved = 0
    for k, bucket in enumerate(chunks):
        what = f"rank 0's tensors of stage(s) {list(lane)} (bucket {k + 1} of {len(chunks)})"
        buf, offsets = _wire(bucket, wire)
        if rank == 0 and offsets is not None:
            for t, o in zip(bucket, offsets, strict=True):
                _slot(buf, o, t).copy_(t)
        if hop and rank in (0, first):
            op, peer = ("send", first) if rank == 0 else ("recv", 0)
            post([Message(op, buf, peer, what)], groups).wait()
        if len(ranks) > 1 and rank in ranks:
            def start(async_op: bool, buf: torch.Tensor = buf) -> Any:
                return dist.broadcast(buf, first, group=group, async_op=async_op)

            collective(start, f"broadcast of {what}", ranks=ranks, groups=groups,
                       cpu=wire.type == "cpu")
        if rank != 0 and offsets is not None:
            for t, o in zip(bucket, offsets, strict=True):
                t.copy_(_slot(buf, o, t))
        moved += buf.numel()
    return moved


# -- helpers ---------------------------------------------------------------------------------


def _wire(
    bucket: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, list[int] | None]:
    """The bytes a bucket travels in: a lone contiguous tensor's own (on ``device``), else a
    buffer with each tensor's offset (aligned to its element size, so it can be viewed)."""
    if len(bucket) == 1 and bucket[0].is_contiguous() and bucket[0].device == device:
        return bucket[0].detach().view(-1).view(torch.uint8), None
    offsets, size = [], 0
    for t in bucket:
        size = -(-size // t.element_size()) * t.element_size()
        offsets.append(size)
        size += t.numel() * t.element_size()
    return torch.empty(size, dtype=torch.uint8, device=device), offsets


def _slot(buf: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    """``t``'s place in ``buf``, as a tensor of its dtype and shape."""
    return buf[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def _described(lane: tuple[int, int, int, str]) -> str:
    count, nbytes, meta, digest = lane
    return (f"{count} tensor(s), {nbytes / MiB:.2f} MiB, {meta} on the meta device "
            f"(their shapes and dtypes hash to {digest})")
