"""BatchNorm's running statistics, the arithmetic (``runtime/batchnorm.py``): one update a
step from the whole mini-batch, whatever the slices and replicas, as torch makes it. On
ranks: ``distributed/test_batchnorm.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from rannc_fx.runtime.batchnorm import DeferredBatchNorm


# -- the statistics' arithmetic (no processes) ------------------------------------------------
class _Norm(nn.Module):
    def __init__(self, momentum: float | None = 0.3) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


def _installed(tracer: str, model: nn.Module, x: torch.Tensor) -> tuple[Any, DeferredBatchNorm]:
    """``model`` captured as a stage is (its own buffers), its BatchNorms rewritten."""
    gm = (torch.fx.symbolic_trace(model) if tracer == "fx"
          else torch.export.export(model, (x,), strict=False).module())
    return gm, DeferredBatchNorm.install(gm)


# torch.export cannot capture momentum=None (a float made of a buffer)
@pytest.mark.parametrize(("tracer", "momentum"), [("fx", 0.3), ("fx", None), ("export", 0.3)])
def test_the_whole_batch_on_one_replica_updates_the_statistics_as_torch_does(tracer, momentum):
    torch.manual_seed(0)
    model, x = _Norm(momentum), 300 + 20 * torch.randn(32, 6)
    ref = copy.deepcopy(model)
    gm, deferred = _installed(tracer, model, x)
    for step in range(3):
        xs = x + step
        deferred.begin(whole=True)
        out = gm(xs)
        with deferred.recomputing():  # a recomputed forward: the same output, no update
            again = gm(xs)
        deferred.commit(deferred.sums())
        want = ref(xs)
        assert torch.equal(out, want) and torch.equal(again, want)
        for n, b in ref.named_buffers():  # bit for bit, the count once a step
            assert torch.equal(model.get_buffer(n), b), (n, step)


class _Norm2d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4, momentum=1.0)  # the batch's statistics, nothing mixed in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


def _truth(x: torch.Tensor, running: tuple[torch.Tensor, torch.Tensor], m: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One update of (mean, var) from the whole batch ``x``, in float64 arithmetic."""
    y = x.double().transpose(0, 1).flatten(1)
    mean, var = y.mean(1), y.var(1, unbiased=True)
    return (1 - m) * running[0].double() + m * mean, (1 - m) * running[1].double() + m * var


@pytest.mark.parametrize("offset", [3.0, 1e5])
def test_slices_and_replicas_combine_to_the_whole_batch_statistics(offset):
    """Micro-batches of 5, 3 and 8 samples on each of two replicas: the one update from the
    whole batch's mean and variance within 1e-6 of the float64 truth, far from zero mean too
    (where float64 sums of squares lose it: 1.3e-5 off here), and of torch's own update where
    its float arithmetic is that close itself."""
    torch.manual_seed(0)
    x = offset + torch.randn(32, 4, 8, 8) * torch.tensor([1.0, 0.1, 3.0, 10.0])[:, None, None]
    replicas = [_Norm2d() for _ in range(2)]
    replicas[1].load_state_dict(replicas[0].state_dict())
    ref = copy.deepcopy(replicas[0])
    want = _truth(x, (ref.bn.running_mean, ref.bn.running_var), 1.0)
    pieces = [x[:5], x[5:8], x[8:16], x[16:21], x[21:24], x[24:]]
    rows = []
    for k, r in enumerate(replicas):
        gm, deferred = _installed("fx", r, x)
        deferred.begin()
        for piece in pieces[3 * k : 3 * k + 3]:
            gm(piece)
        rows.append((deferred, deferred.sums(k, 2)))
    summed = [a + b for a, b in zip(rows[0][1], rows[1][1], strict=True)]  # the all-reduce
    for (deferred, _), r in zip(rows, replicas, strict=True):
        deferred.commit(summed)
        for g, w in zip((r.bn.running_mean, r.bn.running_var), want, strict=True):
            assert_close(g.double(), w, rtol=1e-6, atol=0)
        assert int(r.bn.num_batches_tracked) == 1
    if offset < 100:  # torch's float kernel is within 1e-6 of the truth here
        ref(x)
        assert_close(replicas[0].bn.running_var, ref.bn.running_var, rtol=1e-6, atol=0)
        assert_close(replicas[0].bn.running_mean, ref.bn.running_mean, rtol=1e-6, atol=1e-7)
