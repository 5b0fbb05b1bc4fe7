"""ZeRO-2 inside a stage: after a step's backwards each replica keeps only the reduced
gradients of the parameters it owns (``zero.owners``: whole tensors), the others' go.

Each replica's gradient is the sum over its micro-batches, so the SUM over the replicas is
the global batch's gradient (``grads``). Under ZeRO-1 that SUM is an all-reduce: every
replica gets every gradient, 2 (r - 1) / r of the stage's gradient bytes over each link, and
steps a share. Here it is a reduce-scatter, (r - 1) / r of them: a replica gets the SUM of the
tensors it owns, which are the ones it steps, and drops the rest. With ZeRO-1's all-gather
of the stepped parameters after the step, a step moves what one all-reduce moves.

The stage's gradients still exist whole from the first backward to the reduce (they
accumulate over the micro-batches), so the peak while the pipeline runs is ZeRO-1's; what
shrinks is the link time and the gradients held from the reduce to ``zero_grad()``: 1/r of
them, beside which the optimizer (and an offloaded share's state) steps.

Rounds: per dtype, round b holds each replica's b-th bucket of the tensors it owns, each
padded to the round's largest so the flat buffer is r equal chunks, chunk q for replica q;
a replica's buckets hold ``comm.BUCKET_BYTES / r``, so the flat copy stays within
``comm.BUCKET_BYTES`` (or one tensor) as the all-reduce's does. Gloo's reduce-scatter was
measured slower than its all-reduce of the whole buffer on 2 CPU ranks (16 MiB: 57 against
18 ms; 64 MiB: 75 against 44 ms), so over gloo the round is all-reduced and each replica
keeps its chunk; NCCL reduce-scatters (the ring's first half).

What still reads every gradient works on the owners' share: ``clip.clip_grad_norm`` counts
each sharded tensor on its owner, the project's ``GradScaler`` all-reduces its inf check over
every rank, checkpoints hold no gradient. A read of ``p.grad`` outside of those sees None on
a replica that does not own ``p``, which is why level 2 is asked for (``Config(zero=2)``),
never chosen by the search on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .comm import Groups, backend_of, buckets, collective

__all__ = ["GradShards", "Round", "rounds"]


class Round(NamedTuple):
    """One collective's worth: ``shares[q]`` is replica q's bucket (empty where it has run
    out), each padded to ``chunk`` elements, all of one dtype on one device."""

    shares: list[list[nn.Parameter]]
    sizes: list[int]  # elements in each replica's bucket
    dtype: torch.dtype
    device: torch.device

    @property
    def chunk(self) -> int:
        return max(self.sizes)


def rounds(params: Sequence[nn.Parameter], owner: dict[int, int], replicas: int, cap: int
           ) -> list[Round]:
    """Per dtype (in first-seen order), round b of each replica's tensors cut into buckets of
    ``cap`` bytes; every replica computes the same from the same ``params`` and ``owner``."""
    out: list[Round] = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        cut = [buckets([p for p in params if p.dtype == dtype and owner[id(p)] == q], cap)
               for q in range(replicas)]
        for b in range(max(len(x) for x in cut)):
            shares = [x[b] if b < len(x) else [] for x in cut]
            first = next(p for share in shares for p in share)
            out.append(Round(shares, [sum(p.numel() for p in s) for s in shares], dtype,
                             first.device))
    return out


class GradShards:
    """The reduce-scatter of a stage's sharded gradients, for this replica of ``replicas``."""

    def __init__(self, params: Sequence[nn.Parameter], owner: dict[int, int], replica: int,
                 replicas: int, stage: int):
        """``params``: the parameters whose gradients are sharded, in one order on every
        replica; ``owner``: the replica that steps each (by ``id``)."""
        self.params, self.owner = list(params), owner
        self.replica, self.replicas, self.stage = replica, replicas, stage
        self._rounds = rounds(self.params, owner, replicas,
                              max(1, comm.BUCKET_BYTES // replicas))

    def owns(self, p: nn.Parameter) -> bool:
        return self.owner[id(p)] == self.replica

    def reduce(self, groups: Groups, *,
               earlier: Mapping[int, torch.Tensor | None] | None = None) -> None:
        """SUM each gradient over the replicas into its owner's ``.grad``; every other
        replica's ``.grad`` of it becomes None (a tensor no backward reached counts as 0).
        ``earlier`` (by ``id``): a local sum of earlier calls (``model.no_sync()``) to add to
        each gradient before the sum."""
        group = groups.stage[self.stage]
        with torch.no_grad():
            for rd in self._rounds:
                self._round(rd, groups, group, earlier or {})

    def _round(self, rd: Round, groups: Groups, group: dist.ProcessGroup | None,
               earlier: Mapping[int, torch.Tensor | None]) -> None:
        chunk, dtype, device = rd.chunk, rd.dtype, rd.device
        flat = torch.zeros(chunk * self.replicas, dtype=dtype, device=device)
        for q, share in enumerate(rd.shares):
            at = q * chunk
            for p in share:
                n = p.numel()
                if p.grad is not None:
                    flat[at : at + n].copy_(p.grad.reshape(-1))
                old = earlier.get(id(p))
                if old is not None:
                    flat[at : at + n].add_(old.reshape(-1))
                at += n
                p.grad = None  # the local sum is in the buffer: its memory goes now
        gloo = backend_of(group) != "nccl"
        mine = flat if gloo else torch.empty(chunk, dtype=dtype, device=device)

        def start(a: bool, flat: torch.Tensor = flat, mine: torch.Tensor = mine) -> Any:
            if gloo:
                return dist.all_reduce(flat, group=group, async_op=a)
            return dist.reduce_scatter_single(mine, flat, group=group, async_op=a)

        collective(start, f"reduce-scatter of the gradients of stage {self.stage}",
                   ranks=groups.stage_ranks[self.stage], groups=groups,
                   cpu=device.type == "cpu")
        if gloo:
            mine = flat[self.replica * chunk : (self.replica + 1) * chunk].clone()
        del flat, start  # the round's buffer goes before the next round's is made
        share = rd.shares[self.replica]
        for p, piece in zip(share, mine[: rd.sizes[self.replica]].split(
                [p.numel() for p in share]), strict=True):
            p.grad = piece.view_as(p)
