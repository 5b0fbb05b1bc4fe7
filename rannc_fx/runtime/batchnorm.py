"""BatchNorm's running statistics over the whole mini-batch, updated once a step.

One process updates a BatchNorm's running mean and variance once per step, from the whole
batch. A pipeline sees the batch as micro-batches on several replicas, and letting each
update them would move the statistics m times a step, differently on each replica. As
torchgpipe's ``DeferredBatchNorm`` does, the forward here normalizes each micro-batch with
its own statistics (as GPipe does; the running statistics are untouched) and keeps its input's
per-channel count, mean and sum of squared deviations (M2), in float64 (``torch.var_mean``:
no sum of squares, which cancels far from zero mean). Micro-batches combine by Chan's
parallel formula; at the end of the step the replicas exchange
theirs (one all-reduce of each replica's row), every replica combines them in replica order
and makes the one update one process would make, in float64, rounded once:

    n = na + nb    d = mb - ma    mean = ma + d nb / n    M2 = M2a + M2b + d² na nb / n
    running_var ← (1 - m) running_var + m M2 / (n - 1)

with ``num_batches_tracked`` + 1 (and ``momentum=None``'s cumulative average from it): the
whole batch's statistics to within a few float64 roundings.

Where a stage has one replica and one micro-batch (``begin(whole=True)``), that micro-batch is
the whole batch: torch's own batch norm updates the running statistics in the forward, as in
one process, so they are one process's bit for bit. A recomputed forward adds nothing and
updates nothing (``recomputing``; whole, it runs the same op with momentum 0, so that
checkpointing sees the tensors the forward saved, and the stage's buffer scope puts back
the statistics around it). ``DeferredBatchNorm.install`` rewrites a stage's graph
once: torch.fx's BatchNorm modules and torch.export's ``aten.batch_norm`` nodes in training
mode become calls of parameterless modules that do the above; the parameters and buffers stay
where they are, under their names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["DeferredBatchNorm"]

_ATEN_BN = torch.ops.aten.batch_norm.default
_MARK = "_rannc_fx_deferred_batch_norm"  # on a stage module: its DeferredBatchNorm


@dataclass
class _Stats:
    """One BatchNorm: its running statistics and the step's count, mean and M2 of its inputs
    (float64, per channel)."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    tracked: torch.Tensor | None  # num_batches_tracked
    momentum: float | None
    count: float = 0.0
    mean: torch.Tensor | None = None
    m2: torch.Tensor | None = None


class DeferredBatchNorm:
    """The running statistics of one stage replica's BatchNorms, deferred to the step's end."""

    def __init__(self) -> None:
        self.stats: list[_Stats] = []
        self.counting = True  # False while a forward is recomputed
        self.whole = False  # one micro-batch on one replica: torch's own update, in the call

    @classmethod
    def install(cls, gm: fx.GraphModule) -> DeferredBatchNorm:
        """Rewrite ``gm``'s training-mode BatchNorms (once; later calls return the same)."""
        found = getattr(gm, _MARK, None)
        if isinstance(found, DeferredBatchNorm):
            return found
        self = cls()
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op == "call_module":
                mod = gm.get_submodule(str(node.target))
                if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats \
                        and mod.running_mean is not None and mod.running_var is not None:
                    self._replace(gm, node, _ModuleCall(self, len(self.stats), mod))
                    self.stats.append(_Stats(mod.running_mean, mod.running_var,
                                             mod.num_batches_tracked, mod.momentum))
            elif node.op == "call_function" and node.target is _ATEN_BN:
                self._aten(gm, node)
        _drop_counters(gm, {id(s.tracked) for s in self.stats if s.tracked is not None})
        graph.lint()
        gm.recompile()
        object.__setattr__(gm, _MARK, self)  # not a submodule: no new names for state
        return self

    def _aten(self, gm: fx.GraphModule, node: fx.Node) -> None:
        args: list[Any] = list(node.args) + [None] * (9 - len(node.args))
        _, _, _, rm, rv, training, momentum = args[:7]
        if training is not True or not all(isinstance(a, fx.Node) and a.op == "get_attr"
                                           for a in (rm, rv)):
            return  # eval mode, or statistics that are not the module's buffers: as traced
        mean, var = gm.get_buffer(str(rm.target)), gm.get_buffer(str(rv.target))
        prefix = str(rm.target).rpartition(".")[0]
        tracked = _buffer(gm, f"{prefix}.num_batches_tracked" if prefix else "num_batches_tracked")
        self._replace(gm, node, _AtenCall(self, len(self.stats)))
        self.stats.append(_Stats(mean, var, tracked, momentum))

    @staticmethod
    def _replace(gm: fx.GraphModule, node: fx.Node, call: nn.Module) -> None:
        name = f"rannc_fx_batch_norm_{sum(1 for n, _ in gm.named_children() if n.startswith('rannc_fx_batch_norm_'))}"
        gm.add_submodule(name, call)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)

    @staticmethod
    def of(gm: fx.GraphModule) -> DeferredBatchNorm | None:
        """The one ``install`` made on ``gm``, if any."""
        found = getattr(gm, _MARK, None)
        return found if isinstance(found, DeferredBatchNorm) else None

    # -- a step ------------------------------------------------------------------------------
    def begin(self, *, whole: bool = False) -> None:
        """A step starts; ``whole``: its one micro-batch is the whole batch, on one replica."""
        self.whole = whole
        for s in self.stats:
            s.count, s.mean, s.m2 = 0.0, None, None

    def add(self, i: int, x: torch.Tensor) -> None:
        """Micro-batch input ``x`` of BatchNorm ``i`` (channels in dimension 1)."""
        if not self.counting:
            return
        s = self.stats[i]
        with torch.no_grad():
            dims = [d for d in range(x.dim()) if d != 1]
            var, mean = torch.var_mean(x.detach().to(torch.float64), dim=dims, correction=0)
            n = float(x.numel() // x.shape[1])
            s.count, s.mean, s.m2 = _chan((s.count, s.mean, s.m2), (n, mean, var * n))

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def sums(self, slot: int = 0, slots: int = 1) -> list[torch.Tensor]:
        """What the replicas exchange: each BatchNorm's [count, mean, M2] in row ``slot`` of
        ``slots`` rows of zeros, so that summing over the replicas stacks their rows."""
        out = []
        for s in self.stats:
            c = s.running_mean.numel()
            rows = torch.zeros(slots, 2 * c + 1, dtype=torch.float64,
                               device=s.running_mean.device)
            if s.mean is not None and s.m2 is not None:
                rows[slot, 0] = s.count
                rows[slot, 1:c + 1] = s.mean
                rows[slot, c + 1:] = s.m2
            out.append(rows.flatten())
        return out

    def commit(self, summed: list[torch.Tensor]) -> None:
        """The step's one update of every running statistic, from the replicas' rows combined
        in replica order (every replica the same)."""
        with torch.no_grad():
            for s, v in zip(self.stats, summed, strict=True):
                c = s.running_mean.numel()
                got: tuple[float, torch.Tensor | None, torch.Tensor | None] = (0.0, None, None)
                for row in v.view(-1, 2 * c + 1):
                    if float(row[0]) > 0:
                        got = _chan(got, (float(row[0]), row[1:c + 1], row[c + 1:]))
                n, mean, m2 = got
                if mean is None or m2 is None:
                    continue  # not run in training mode this step (or by torch, whole)
                if s.tracked is not None:
                    s.tracked.add_(1)
                m: float = 0.0
                if s.momentum is not None:
                    m = float(s.momentum)
                elif s.tracked is not None:  # a cumulative moving average
                    m = 1.0 / float(s.tracked)
                _update(s.running_mean, mean, m)
                _update(s.running_var, m2 / max(n - 1, 1), m)
        self.begin(whole=self.whole)

    @property
    def updates_itself(self) -> bool:
        """Whether a BatchNorm's call updates its running statistics itself: the step's one
        micro-batch on one replica, in a forward that is not recomputed."""
        return self.whole and self.counting


def _chan(a: tuple[float, torch.Tensor | None, torch.Tensor | None],
          b: tuple[float, torch.Tensor, torch.Tensor]
          ) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Count, mean and M2 of two parts together (Chan et al.'s parallel formula)."""
    na, ma, m2a = a
    nb, mb, m2b = b
    if ma is None or m2a is None or na == 0:
        return nb, mb, m2b
    n = na + nb
    delta = mb - ma
    return n, ma + delta * (nb / n), m2a + m2b + delta * delta * (na * nb / n)


def _update(buf: torch.Tensor, value: torch.Tensor, momentum: float) -> None:
    """``buf ← (1 - m) buf + m value`` in float64, rounded once, in place, without bumping
    the version counter (a pending backward of a recomputed BatchNorm saved the buffer)."""
    new = buf.detach().to(torch.float64) * (1 - momentum) + value * momentum
    buf.data.copy_(new.to(buf.dtype))


class _ModuleCall(nn.Module):
    """A torch.fx BatchNorm module's call: batch statistics, the running ones deferred."""

    owner: DeferredBatchNorm
    bn: nn.Module

    def __init__(self, owner: DeferredBatchNorm, index: int, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # plain attributes: no parameter is renamed
        object.__setattr__(self, "bn", module)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn: Any = self.bn
        if not bn.training or self.owner.updates_itself:
            return bn(x)  # eval, or the whole batch: the module's own update, as one process
        if self.owner.whole:  # recomputed: the same op (checkpoint counts what it saves)
            return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True,
                                0.0, bn.eps)
        self.owner.add(self.index, x)
        return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)


class _AtenCall(nn.Module):
    """A torch.export ``aten.batch_norm`` in training mode, as ``_ModuleCall``."""

    owner: DeferredBatchNorm

    def __init__(self, owner: DeferredBatchNorm, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.index = index

    def forward(self, x: torch.Tensor, weight: Any, bias: Any, running_mean: Any,
                running_var: Any, training: bool, momentum: Any, eps: float,
                cudnn_enabled: bool = False) -> torch.Tensor:
        if self.owner.whole:  # the whole batch: the update one process makes
            tracked = self.owner.stats[self.index].tracked
            if not self.owner.counting:  # recomputed: the same op, updating nothing
                momentum = 0.0
            elif tracked is not None:
                tracked.add_(1)  # the graph's own count was dropped (``_drop_counters``)
            return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var,
                                                     True, momentum, eps, cudnn_enabled)
        self.owner.add(self.index, x)
        return torch.ops.aten.batch_norm.default(x, weight, bias, None, None, True, 0.0, eps,
                                                 cudnn_enabled)


def _buffer(gm: fx.GraphModule, name: str) -> torch.Tensor | None:
    try:
        return gm.get_buffer(name)
    except AttributeError:
        return None


def _drop_counters(gm: fx.GraphModule, counters: set[int]) -> None:
    """torch.export's ``num_batches_tracked.add_(1)`` of the deferred BatchNorms: the step's
    end counts instead."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.add_.Tensor:
            continue
        target = node.args[0]
        if isinstance(target, fx.Node) and target.op == "get_attr" and id(
            _buffer(gm, str(target.target))
        ) in counters:
            node.replace_all_uses_with(target)
            gm.graph.erase_node(node)
