"""Recording an opaque module's calls on the example, and how its outputs combine over the
samples.

``record_calls`` runs the model once, eagerly and without gradients, and keeps each call of
the modules kept whole as a ``CallRecord`` (``opaque``): its argument structure, constants
and the shapes of what went in and came out. It then asks of a call whose outputs hold no
batch dimension whether they are a mean (or a sum) over the samples: run on parts of the
example's samples, do the parts' outputs, weighted by their samples (or added), give the
whole's? Where they do not (a mean over the tokens ``masked_select`` keeps, a Dice score over
the batch) the call couples the samples (``CallRecord.reduces``), and the tail runs it once a
step on the whole batch (``shapes/tail.py``). A call whose outputs hold the batch couples the
samples where the halves of the batch do not give their rows of the whole's outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .graph import untouched
from .opaque import CallRecord

__all__ = ["record_calls"]

_PARTS_RTOL = 1e-4


def record_calls(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 names: set[str], batch_dim: int) -> dict[str, list[CallRecord]]:
    """Every call of the modules ``names`` in one eager run of ``model`` on the example (no
    gradients; the model's buffers and the random state are left as they were)."""
    modules = dict(model.named_modules())
    found: dict[str, list[CallRecord]] = {n: [] for n in names}
    runs: dict[str, list[tuple[tuple[Any, ...], dict[str, Any], Any]]] = {n: [] for n in names}

    def hook(name: str) -> Any:
        def record(mod: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], out: Any) -> None:
            runs[name].append((a, kw, out))
        return record

    handles = [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in names]
    with untouched(model), torch.no_grad():
        try:
            model(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        batch = _batch(args, kwargs, batch_dim)
        for n, calls in runs.items():
            for a, kw, out in calls:
                rec = _record(a, kw, out)
                rec.reduces = _reduces(modules[n], a, kw, out, batch, batch_dim)
                found[n].append(rec)
    return found


def _record(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> CallRecord:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    out_leaves, out_spec = pytree.tree_flatten(out)
    return CallRecord(
        in_spec=spec,
        in_leaves=[None if isinstance(x, torch.Tensor) else x for x in leaves],
        in_shapes=[tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves],
        out_spec=out_spec,
        out_leaves=[None if isinstance(x, torch.Tensor) else x for x in out_leaves],
        out_meta=[(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None
                  for x in out_leaves],
    )


def _batch(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> int | None:
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.dim() > batch_dim:
            return int(x.shape[batch_dim])
    return None


def _reduces(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
             batch: int | None, batch_dim: int) -> Literal["mean", "sum", "coupled"] | None:
    """How the call's batch-free floating outputs combine over parts of the samples; where
    its outputs hold the batch, "coupled" when a sample's rows depend on the others."""
    outs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    if batch is None or batch < 2 or not outs:
        return None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    cut = [i for i, x in enumerate(leaves)
           if isinstance(x, torch.Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == batch]
    if not cut:
        return None

    def on(parts: list[tuple[int, int]]) -> list[tuple[int, list[torch.Tensor]]] | None:
        got = []
        for lo, hi in parts:
            part = list(leaves)
            for i in cut:
                part[i] = leaves[i].narrow(batch_dim, lo, hi - lo)
            a, kw = pytree.tree_unflatten(part, spec)
            try:
                got.append((hi - lo, [x for x in pytree.tree_leaves(mod(*a, **kw))
                                      if isinstance(x, torch.Tensor)]))
            except Exception:
                return None  # it does not even run on a part of the samples
        return got

    rows = [j for j, x in enumerate(outs) if x.dim() > batch_dim and x.shape[batch_dim] == batch]
    if rows:
        return _rowwise(mod, args, kwargs, outs, rows, batch, batch_dim, on)
    floats = [j for j, x in enumerate(outs) if x.is_floating_point()]
    ways = {"mean", "sum"}
    for parts in _partitions(batch):
        pieces = on(parts)
        if pieces is None:
            return "coupled"
        for j in floats:
            whole = outs[j].double()
            if "mean" in ways and not _close(sum(n / batch * g[j].double() for n, g in pieces),
                                             whole):
                ways.discard("mean")
            if "sum" in ways and not _close(sum(g[j].double() for _, g in pieces), whole):
                ways.discard("sum")
    return "mean" if "mean" in ways else "sum" if "sum" in ways else "coupled"


def _rowwise(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             outs: list[torch.Tensor], rows: list[int], batch: int, batch_dim: int,
             on: Callable[[list[tuple[int, int]]], list[tuple[int, list[torch.Tensor]]] | None],
             ) -> Literal["coupled"] | None:
    """None where the call gives each half of the samples their rows of its outputs on the
    whole batch (run per micro-batch, it computes what it does on the batch), else "coupled"
    (a branch on the batch's sum, batch statistics). A call whose outputs change with the
    random seed (dropout) is not compared."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        again = [x for x in pytree.tree_leaves(mod(*args, **kwargs)) if isinstance(x, torch.Tensor)]
        if len(again) != len(outs) or not all(
                a.shape == x.shape and torch.equal(a, x) for a, x in zip(again, outs, strict=True)):
            return None  # random: no two runs agree
        halves = on([(0, batch // 2), (batch // 2, batch)])
    if halves is None:
        return "coupled"
    for j in rows:
        if any(len(g) != len(outs) for _, g in halves):
            return "coupled"
        joined = torch.cat([g[j] for _, g in halves], batch_dim)
        if not _close(joined.double(), outs[j].double()):
            return "coupled"
    return None


def _partitions(batch: int) -> list[list[tuple[int, int]]]:
    """Splits of ``batch`` samples into runs: halves, thirds, the first samples alone (a mean
    over what a mask keeps shows as soon as two parts keep different shares)."""
    alone = min(batch - 1, 8)  # the first samples alone (each part is one more call)
    out = [[(0, batch // 2), (batch // 2, batch)],
           [(i, i + 1) for i in range(alone)] + [(alone, batch)]]
    if batch >= 3:
        a, b = batch // 3, 2 * batch // 3
        out.append([(0, a), (a, b), (b, batch)])
    return out


def _close(a: Any, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=_PARTS_RTOL, atol=1e-7))
