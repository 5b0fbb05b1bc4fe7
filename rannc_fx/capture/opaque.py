"""Submodules capture cannot trace, kept as one node each and run eagerly in their stage.

A criterion from a field's library is often data-dependent (``if labels.max() >= n: raise``,
``masked_select``, ``.tolist()``) or calls an op without a fake kernel (``F.ctc_loss``);
neither tracer can turn that into graph ops. Like torch.compile's graph breaks, but at a
module's boundary, such a module becomes one ``call_module`` node of an ``OpaqueCall``: run on
real tensors it calls the module itself (its own code, its autograd), so it trains like the
eager model; run on fake or meta tensors (the shape passes, the analytic profile, torch.export
itself) it tries the module on them and, where that fails, makes outputs of the shapes the
module gave on the example (``CallRecord``), each dimension the size of the input dimension
it equalled there (the batch, a length) or the example's.

Both tracers build the same node, ``call_module(name, (key, *tensors))``: the key says which
call of the module it is (its argument structure and constants are recorded per call).
torch.fx keeps the module as a leaf and the call is rewritten; torch.export calls the custom
op ``rannc_fx::opaque`` in its place (the module's ``forward`` is patched for the export),
whose node is rewritten likewise. The ``OpaqueCall`` holds the module's own parameter, buffer
and child tables, so its state keeps the model's names.

The calls are recorded in one eager run of the model on the example (``record``), which
also says whether a call's batch-free outputs are a mean or a sum over the samples, or couple
them (``CallRecord.reduces``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from .graph import CaptureError

__all__ = [
    "OPAQUE", "CallRecord", "OpaqueCall", "export_opaque_pass", "exporting", "fx_opaque_pass",
]

OPAQUE = "rannc_opaque"  # node.meta key of an opaque call: (module name, key)


@dataclass
class CallRecord:
    """One call of an opaque module, as it ran on the example."""

    in_spec: pytree.TreeSpec  # of (args, kwargs)
    in_leaves: list[Any]  # the non-tensor leaves as given (tensor leaves: None)
    in_shapes: list[tuple[int, ...] | None]  # of each leaf (None: not a tensor)
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # the non-tensor output leaves (tensor leaves: None)
    out_meta: list[tuple[tuple[int, ...], torch.dtype] | None]
    # how its batch-free outputs combine over parts of the samples ("mean", "sum"), or None
    # where they hold a batch dimension or nothing batched goes in; "coupled": neither
    reduces: Literal["mean", "sum", "coupled"] | None = None
    flat_out: bool = False  # the node returns the output's tensor leaves (torch.export)

    def fake_outputs(self, tensors: list[torch.Tensor], grad: bool) -> list[torch.Tensor]:
        """Outputs of the recorded shapes for ``tensors`` (fake), each dimension following the
        input dimension it equalled on the example (the batch, a length)."""
        sizes: dict[int, Any] = {}
        given = iter(tensors)
        for shape in self.in_shapes:
            if shape is None:
                continue
            t = next(given)
            for d, n in enumerate(shape):
                sizes.setdefault(n, t.shape[d])
        like = tensors[0] if tensors else None
        out = []
        for meta in self.out_meta:
            if meta is None:
                continue
            shape, dtype = meta
            t = torch.empty([sizes.get(n, n) if n > 1 else n for n in shape], dtype=dtype,
                            device=like.device if like is not None else "meta")
            out.append(t.requires_grad_(grad and (dtype.is_floating_point or dtype.is_complex)))
        return out

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        given = iter(tensors)
        leaves = [next(given) if s is not None else x
                  for x, s in zip(self.in_leaves, self.in_shapes, strict=True)]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return args, kwargs

    def returned(self, tensor_leaves: list[Any]) -> Any:
        """The module's output as the graph reads it: its tensor leaves, or the whole tree."""
        if self.flat_out:
            return tuple(tensor_leaves)
        given = iter(tensor_leaves)
        leaves = [next(given) if m is not None else x
                  for x, m in zip(self.out_leaves, self.out_meta, strict=True)]
        return pytree.tree_unflatten(leaves, self.out_spec)


class OpaqueCall(nn.Module):
    """One submodule run eagerly as a single node (``forward(key, *tensors)``)."""

    inner: nn.Module

    def __init__(self, inner: nn.Module, calls: list[CallRecord]) -> None:
        super().__init__()
        for table in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            self.__dict__[table] = inner.__dict__[table]  # its state, under its own names
        self.__dict__["inner"] = inner  # not a child: its children are ours
        self.training = inner.training
        self.calls = calls

    def forward(self, key: int, *tensors: torch.Tensor) -> Any:
        rec = self.calls[key]
        if any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors):
            # the shapes it gave on the example: its code may not run on fake tensors at all
            grad = torch.is_grad_enabled() and (any(t.requires_grad for t in tensors) or any(
                p.requires_grad for p in self.inner.parameters()))
            return rec.returned(rec.fake_outputs(list(tensors), grad))
        args, kwargs = rec.rebuild(tensors)
        out = self.inner(*args, **kwargs)
        return rec.returned([x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)])

    def extra_repr(self) -> str:
        return f"{type(self.inner).__name__}, run eagerly ({len(self.calls)} call(s))"


# -- torch.export: the custom op in the module's place ----------------------------------------

_FAKES: dict[int, tuple[CallRecord, nn.Module]] = {}
_KEYS = itertools.count()


@torch.library.custom_op("rannc_fx::opaque", mutates_args=())
def _opaque(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    rec, mod = _FAKES[key]
    args, kwargs = rec.rebuild(tuple(tensors))
    out = mod(*args, **kwargs)
    return [x.clone() for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


@_opaque.register_fake
def _(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    rec, mod = _FAKES[key]
    return rec.fake_outputs(tensors, grad=False)


@dataclass
class Exported:
    """What ``exporting`` saw: op key -> (module name, call index)."""

    calls: dict[int, tuple[str, int]] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)  # calls so far, by module name


@contextlib.contextmanager
def exporting(model: nn.Module, records: Mapping[str, list[CallRecord]]) -> Iterator[Exported]:
    """While torch.export runs: each opaque module's call is the op ``rannc_fx::opaque``."""
    modules = dict(model.named_modules())
    seen = Exported()
    count = seen.count = dict.fromkeys(records, 0)

    def patched(name: str) -> Any:
        mod = modules[name]

        def forward(*args: Any, **kwargs: Any) -> Any:
            index = count[name]
            count[name] += 1
            if index >= len(records[name]):
                raise RuntimeError(f"module {name!r} is called more often than on the example")
            rec = records[name][index]
            key = next(_KEYS)
            _FAKES[key] = (rec, mod)
            seen.calls[key] = (name, index)
            tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            flat = torch.ops.rannc_fx.opaque(key, tensors)
            given = iter(flat)
            leaves = [next(given) if m is not None else x
                      for x, m in zip(rec.out_leaves, rec.out_meta, strict=True)]
            return pytree.tree_unflatten(leaves, rec.out_spec)

        return forward

    for name in records:
        modules[name].forward = patched(name)
    try:
        yield seen
    finally:
        for name in records:
            del modules[name].forward
        for key in seen.calls:
            _FAKES.pop(key, None)


def export_opaque_pass(gm: fx.GraphModule, model: nn.Module, seen: Exported,
                       records: Mapping[str, list[CallRecord]]) -> None:
    """Each ``rannc_fx::opaque`` node of an exported graph as a call of its ``OpaqueCall``."""
    modules = dict(model.named_modules())
    made: dict[str, OpaqueCall] = {}
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.rannc_fx.opaque.default:
            continue
        name, index = seen.calls[n.args[0]]
        if name not in made:
            made[name] = _install(gm, name, modules[name], records[name], flat_out=True)
        n.op, n.target = "call_module", name
        n.args = (index, *n.args[1])
        n.meta[OPAQUE] = (name, index)
    gm.graph.lint()
    gm.recompile()


def fx_opaque_pass(gm: fx.GraphModule, model: nn.Module,
                   records: Mapping[str, list[CallRecord]]) -> None:
    """Each torch.fx leaf call of an opaque module as a call of its ``OpaqueCall``."""
    modules = dict(model.named_modules())
    index = dict.fromkeys(records, 0)
    made: dict[str, OpaqueCall] = {}
    for n in list(gm.graph.nodes):
        if n.op != "call_module" or n.target not in records:
            continue
        name = str(n.target)
        if name not in made:
            made[name] = _install(gm, name, modules[name], records[name], flat_out=False)
        k = index[name]
        index[name] += 1
        leaves = pytree.tree_leaves((n.args, n.kwargs))
        rec = records[name][k] if k < len(records[name]) else None
        if rec is None or [isinstance(x, fx.Node) for x in leaves] != [
                s is not None for s in rec.in_shapes]:
            raise CaptureError(
                f"module {name!r} is kept whole (leaf_modules, or its code cannot be traced), "
                "but torch.fx passes it a traced size or calls it otherwise than the model "
                "does on the example; pass it tensors only, or use Config(tracer='export')"
            )
        n.args, n.kwargs = (k, *(x for x in leaves if isinstance(x, fx.Node))), {}
        n.meta[OPAQUE] = (name, k)
    gm.graph.lint()
    gm.recompile()


def _install(gm: fx.GraphModule, name: str, mod: nn.Module, calls: list[CallRecord], *,
             flat_out: bool) -> OpaqueCall:
    recs = [CallRecord(**{**vars(c), "flat_out": flat_out}) for c in calls]
    op = OpaqueCall(mod, recs)
    *path, leaf = name.split(".")
    owner: nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if leaf in owner._modules:
        owner._modules[leaf] = op
    else:
        owner.add_module(leaf, op)
    return op
