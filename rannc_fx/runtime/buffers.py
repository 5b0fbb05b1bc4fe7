"""Buffers a stage updates in its forward (BatchNorm running statistics) under micro-batching.

What single-device training does per step: one BatchNorm update,
``running = (1 - momentum) * running + momentum * stat(global batch)``, and
``num_batches_tracked += 1``. A pipeline runs the stage once per micro-batch on each
replica, so left alone the buffers would take ``micro_batches`` updates per step (a larger
effective momentum) and the replicas would drift apart. Instead, per step:

- every micro-batch starts from the step's initial buffers (they are restored before each
  forward; BatchNorm's training output uses batch statistics, never the running ones);
- floating buffers end as the average of the per-micro-batch, per-replica results weighted
  by sample share, summed over the stage's replicas with an all-reduce; that is exactly one
  update with the sample-weighted mean of the slice statistics, identical on every replica;
- integer buffers (``num_batches_tracked``) end as after one micro-batch: +1 per step.

So ``running_mean`` equals single-device training's exactly (a sample-weighted mean of slice
means is the global mean); ``running_var`` averages the slices' unbiased variances, which
misses the spread between slices' means (close, not equal). The normalization itself uses
each micro-batch slice's statistics (like DDP without SyncBatchNorm), so the forward matches
single-device only for a stage with one replica and one micro-batch.

A stage that recomputes its forward before each backward must not update them again: every
forward of a step saw the step's initial buffers, so ``recompute_scope`` puts those back for the
recomputation and the step's buffers afterwards (``torch.utils.checkpoint`` alone would update
BatchNorm's running statistics twice and count ``num_batches_tracked`` twice).

A buffer counts as updated when its value or version counter changes in the first
micro-batch (BatchNorm's kernel writes running statistics without bumping the version); the
set is found once per train/eval state of the module and cached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .batchnorm import DeferredBatchNorm
from .comm import Groups, all_reduce_flat

__all__ = ["BufferSync"]


class BufferSync:
    """Apply the policy above to the buffers of one stage replica for one step at a time."""

    def __init__(
        self,
        module: nn.Module,
        *,
        micro_batches: int,
        group: dist.ProcessGroup | None,
        ranks: Sequence[int],
        recompute: bool = False,
        groups: Groups | None = None,
        deferred: DeferredBatchNorm | None = None,
    ):
        self.groups = groups  # for the failure board while all-reducing
        self.deferred = deferred  # BatchNorm statistics once a step (batchnorm.py), or None
        self.module = module
        self.recompute = recompute
        self.micro_batches = micro_batches
        self.group = group
        self.ranks = tuple(ranks)
        self._buffers = dict(module.named_buffers())
        self._updated: dict[tuple[bool, ...], tuple[str, ...]] = {}
        self._active = bool(self._buffers) and (
            micro_batches > 1 or len(self.ranks) > 1 or recompute
        )
        self._key: tuple[bool, ...] = ()
        self._versions: dict[str, int] = {}
        self._start: dict[str, torch.Tensor] = {}  # the step's initial values
        self._first: dict[str, torch.Tensor] = {}  # the values after micro-batch 0
        self._acc: dict[str, torch.Tensor] = {}  # share-weighted sums
        self._names: tuple[str, ...] = ()  # the buffers this step updates
        self._seen: dict[str, torch.Tensor] = {}  # what every forward of the step saw

    def begin(self) -> None:
        """Call before the first micro-batch of a step."""
        self._reset()
        self._seen = {}
        if self.deferred is not None:  # one micro-batch on one replica: torch's own update
            self.deferred.begin(whole=self.micro_batches == 1 and len(self.ranks) == 1)
        if not self._active:
            return
        self._key = tuple(m.training for m in self.module.modules())
        known = self._updated.get(self._key)
        candidates = tuple(self._buffers) if known is None else known
        self._versions = {n: self._buffers[n]._version for n in candidates}
        if self.micro_batches > 1 or known is None or self.recompute:
            self._start = {n: self._buffers[n].detach().clone() for n in candidates}

    def before_microbatch(self, i: int) -> None:
        if self._active and i > 0:
            for n in self._names:
                _write(self._buffers[n], self._start[n])

    def after_microbatch(self, i: int, weight: float) -> None:
        """``weight``: this replica's micro-batch share of the global batch."""
        if not self._active:
            return
        if i == 0:
            if self._key in self._updated:
                self._names = self._updated[self._key]
            else:
                self._names = self._updated[self._key] = tuple(
                    n
                    for n, v in self._versions.items()
                    if self._buffers[n]._version != v
                    or not torch.equal(self._buffers[n], self._start[n])
                )
            self._first = {n: self._buffers[n].detach().clone() for n in self._names}
            if self.recompute:
                self._seen = {n: self._start[n] for n in self._names}
        for n in self._names:
            b = self._buffers[n].detach()
            if b.is_floating_point():
                self._acc[n] = self._acc[n] + weight * b if n in self._acc else weight * b

    def finish(self) -> None:
        """Call after the last micro-batch: writes the step's final buffers (collective)."""
        d = self.deferred
        if d is not None and d.stats:
            mine = self.ranks.index(dist.get_rank()) if self.group is not None else 0
            sums = d.sums(mine, len(self.ranks) if self.group is not None else 1)
            if self.group is not None:
                sums = all_reduce_flat(sums, self.group, what="BatchNorm statistics",
                                       ranks=self.ranks, groups=self.groups)
            d.commit(sums)
        if not self._active or not self._names:
            return
        floats = [n for n in self._names if n in self._acc]
        vals = [self._acc[n] for n in floats]
        if self.group is not None and vals:
            vals = all_reduce_flat(vals, self.group, what="updated buffers", ranks=self.ranks,
                                   groups=self.groups)
        for n, v in zip(floats, vals, strict=True):
            _write(self._buffers[n], v)
        for n in self._names:
            if n not in self._acc:
                _write(self._buffers[n], self._first[n])
        self._reset()

    @contextlib.contextmanager
    def recompute_scope(self) -> Iterator[None]:
        """Run a recomputation on the buffers the step's forwards saw; keep the step's."""
        now = {n: self._buffers[n].detach().clone() for n in self._seen}
        for n, v in self._seen.items():
            _write(self._buffers[n], v)
        try:
            with self.deferred.recomputing() if self.deferred else contextlib.nullcontext():
                yield
        finally:
            for n, v in now.items():
                _write(self._buffers[n], v)

    def _reset(self) -> None:
        self._key, self._versions, self._start, self._first = (), {}, {}, {}
        self._acc, self._names = {}, ()


def _write(buf: torch.Tensor, value: torch.Tensor) -> None:
    """Overwrite a buffer without bumping its version counter.

    BatchNorm's backward keeps the running statistics as saved arguments but does not read
    them in training mode; a normal ``copy_`` would make every pending backward of this step
    fail the saved-tensor version check. In eval mode the buffers are never written.
    """
    buf.data.copy_(value)
