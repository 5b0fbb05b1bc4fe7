"""Trace a model into one flat fx.GraphModule: with torch.fx, or with non-strict torch.export."""

from __future__ import annotations

import builtins
import contextlib
import inspect
import logging
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from ..progress import note
from .copy_nodes import RepeatError
from .graph import CapturedGraph, CaptureError, batch_size_of, build_captured, is_batched
from .opaque import CallRecord, export_opaque_pass, exporting, fx_opaque_pass
from .repeat import RepeatedCapture

__all__ = ["opaque_modules", "trace_export", "trace_fx"]

log = logging.getLogger("rannc_fx")

# Nodes that only check what export saw (device, layout, input guards) and pin the graph to it.
_CHECK_ONLY_TARGETS = (torch.ops.aten._assert_tensor_metadata.default,)


# -- torch.fx ----------------------------------------------------------------------------------


class _FlatTracer(fx.Tracer):
    """torch.fx with flat tensor placeholders, class-name leaves and buffers as graph values."""

    def __init__(self, leaf_modules: tuple[str, ...], leaves: list[Any], in_spec: Any,
                 names: list[str], opaque: Mapping[str, Any] | None = None):
        super().__init__()
        self.opaque = set(opaque or ())  # module names kept whole and run eagerly
        self.proxy_buffer_attributes = True  # `self.mask[:s]` with a traced `s` must stay in the graph
        self.leaf_modules = set(leaf_modules)
        self.leaves, self.in_spec, self.names = leaves, in_spec, names
        self.out_leaves: list[Any] = []
        self.out_spec: pytree.TreeSpec | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        cls = type(m)
        if cls.__name__ in self.leaf_modules or f"{cls.__module__}.{cls.__qualname__}" in self.leaf_modules:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        tensor_idx = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]
        placeholders = [
            self.create_proxy("placeholder", self.names[i], (), {}) for i in tensor_idx
        ]

        def flat_fn(*proxies: Any) -> tuple[Any, ...]:
            leaves = list(self.leaves)
            for i, p in zip(tensor_idx, proxies, strict=True):
                leaves[i] = p
            a, kw = pytree.tree_unflatten(leaves, self.in_spec)
            out = root_fn(self.root, *a, **kw)
            self.out_leaves, self.out_spec = pytree.tree_flatten(out)
            return tuple(x for x in self.out_leaves if isinstance(x, (fx.Proxy, torch.Tensor)))

        return flat_fn, placeholders


def trace_fx(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             leaf_modules: tuple[str, ...], batch_dim: int,
             opaque: Mapping[str, list[CallRecord]] | None = None) -> CapturedGraph:
    """``model(*args, **kwargs)`` traced by torch.fx (module level; ``leaf_modules`` kept
    whole; the modules ``opaque`` names run eagerly, ``capture/opaque``)."""
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tracer = _FlatTracer(leaf_modules, leaves, in_spec, _leaf_names(model, args, kwargs), opaque)
    graph = tracer.trace(model)
    assert tracer.out_spec is not None
    out_idx = [i for i, x in enumerate(tracer.out_leaves) if isinstance(x, (fx.Proxy, torch.Tensor))]
    consts = {i: x for i, x in enumerate(tracer.out_leaves) if i not in set(out_idx)}
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    if opaque:
        fx_opaque_pass(gm, model, opaque)
    captured = build_captured(gm, model, "fx", in_spec, tracer.out_spec, leaves, out_idx,
                              consts, batch_dim)
    captured.opaque = dict(opaque or {})
    return captured


def _leaf_names(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """A placeholder name per input leaf: the forward parameter's name, plus the path inside it."""
    params = [
        p.name for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head, first, rest = path[0], path[1], path[2:]
        if head.idx == 0:  # type: ignore[attr-defined]
            i = first.idx  # type: ignore[attr-defined]
            base = params[i] if i < len(params) else f"args_{i}"
        else:
            base = str(first.key)  # type: ignore[attr-defined]
        suffix = "".join(f"_{getattr(k, 'idx', getattr(k, 'key', getattr(k, 'name', '')))}" for k in rest)
        names.append("".join(c if c.isalnum() else "_" for c in base + suffix))
    return names


def opaque_modules(captured: CapturedGraph, leaf_modules: tuple[str, ...]) -> list[tuple[str, str]]:
    """fx ``call_module`` nodes on torch.nn modules that have children (a whole encoder),
    other than the ones the user asked to keep whole."""
    out = []
    for n in captured.gm.graph.nodes:
        if n.op == "call_module":
            mod = captured.gm.get_submodule(n.target)
            cls = type(mod)
            if (
                next(mod.children(), None) is not None
                and cls.__module__.startswith("torch.")
                and cls.__name__ not in leaf_modules
                and f"{cls.__module__}.{cls.__qualname__}" not in leaf_modules
            ):
                out.append((str(n.target), cls.__name__))
    return out


# -- torch.export ------------------------------------------------------------------------------


def trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 batch_dim: int, *, repeated: bool = True, dynamic: bool = True,
                 opaque: Mapping[str, list[CallRecord]] | None = None) -> CapturedGraph:
    """``model(*args, **kwargs)`` exported by non-strict torch.export (ATen level), with the
    batch dimension of every batched input dynamic.

    With ``dynamic``, every other dimension of the tensor inputs (of size 2 or more) is
    ``Dim.AUTO`` too: export keeps it a symbol where the model allows any size (a sequence
    length) and makes it a constant where the model's code ties it to the example's (a
    fixed-size table, a reshape to a number). Where that export fails, only the batch
    dimension is dynamic.

    Export sees the model through ``_FlatInputs`` (its tensor inputs as positional arguments),
    so the dynamic-shapes spec holds for any signature: positional, keyword, ``*args``,
    ``**kwargs``.

    With ``repeated``, each kind of repeated submodule (the layers of an encoder) is traced
    once and its nodes copied for the others (``capture/repeat``): the same graph, in time
    that grows with the kinds of layers rather than their number.

    The modules ``opaque`` names are one node each, run eagerly (``capture/opaque``).
    """
    opaque = dict(opaque or {})
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    batch = batch_size_of(leaves, batch_dim)

    def batched(x: Any) -> bool:
        return is_batched(x, batch, batch_dim)

    if batch < 2:
        raise CaptureError(
            f"torch.export needs an example with at least 2 samples to keep the batch dimension "
            f"dynamic (got {batch}; it treats sizes 0 and 1 as constants); capture with a larger "
            "example batch"
        )
    flat = _FlatInputs(model, leaves, in_spec)
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def dims(x: torch.Tensor, others: bool) -> dict[int, Any] | None:
        out = {d: torch.export.Dim.AUTO for d in range(x.dim())
               if others and d != batch_dim and x.shape[d] >= 2}
        if batched(x):
            out[batch_dim] = torch.export.Dim.AUTO
        return out or None

    def spec(others: bool) -> dict[str, Any]:  # keyed by _FlatInputs.forward's one parameter
        return {"tensors": tuple(dims(x, others) for x in tensors)}

    try:
        ep, gm, copied = _export(model, flat, tensors, spec(dynamic), repeated, opaque)
    except Exception as e:
        if not dynamic or _output_not_tensors(e):  # other sizes dynamic or not, it fails
            raise
        ep, gm, copied = _export(model, flat, tensors, spec(False), repeated, opaque)
        note("capture: torch.export with the inputs' other dimensions dynamic failed "
             "(%s: %s), so only the batch dimension is: every call passes the example's "
             "other sizes", type(e).__name__, str(e).strip().split("\n")[0])
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()

    # Guards and metadata checks pin the graph to the example's devices; drop them.
    for n in list(graph.nodes):
        if (n.op == "call_module" and n.target == "_guards_fn") or n.target in _CHECK_ONLY_TARGETS:
            graph.erase_node(n)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")

    # One placeholder per tensor leaf, in order (``_FlatInputs``); non-tensor leaves are
    # constants of the graph already. Name each after the model's argument it comes from.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = _leaf_names(model, args, kwargs)
    tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for ph, i in zip(placeholders, tensor_idx, strict=True):
        val = ph.meta.get("val")
        if batched(leaves[i]) and isinstance(val, torch.Tensor) and is_concrete_int(
            val.shape[batch_dim]
        ):
            where = _where_fixed(flat, tensors, spec(False), batch_dim)
            raise CaptureError(
                f"torch.export fixed the batch dimension of input {names[i]!r} at {batch}: "
                + (where or f"the model's code ties it to that size (e.g. x.view({batch}, -1) "
                   "or a loop over the batch); compute sizes from x.size(0) or -1, or use "
                   "Config(tracer='fx')")
            )
        with graph.inserting_before(anchor):
            named = graph.placeholder(names[i])
        named.meta = ph.meta
        ph.replace_all_uses_with(named)
        graph.erase_node(ph)

    (out_node,) = [n for n in graph.nodes if n.op == "output"]
    out_leaves = list(out_node.args[0])
    out_idx = [i for i, x in enumerate(out_leaves) if isinstance(x, fx.Node)]
    consts = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, fx.Node)}
    out_node.args = (tuple(out_leaves[i] for i in out_idx),)
    captured = build_captured(gm, model, "export", in_spec, ep.call_spec.out_spec, leaves,
                              out_idx, consts, batch_dim)
    captured.copied_calls = copied
    captured.opaque = opaque
    return captured


def _where_fixed(flat: nn.Module, tensors: tuple[torch.Tensor, ...], spec: dict[str, Any],
                 batch_dim: int) -> str | None:
    """Where the model's code made export fix the batch dimension, from ``draft_export``'s
    report (run again only on this failure path): the line, its tensors, and whether one of
    them holds several batch dimensions (samples mixed, as a contrastive loss mixes them)."""
    # Dim.DYNAMIC, not AUTO: a specialization is then a failure the report locates
    strict = {"tensors": tuple(None if d is None else dict.fromkeys(d, torch.export.Dim.DYNAMIC)
                               for d in spec["tensors"])}
    quiet = logging.getLogger("torch.export._draft_export")  # it prints its report as warnings
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        report = torch.export.draft_export(flat, tensors, strict=False, dynamic_shapes=strict)
        failures = report._report.failures  # type: ignore[attr-defined]  # not public in 2.13
    except Exception as e:  # the diagnosis is a nicety: the plain message still holds
        log.debug("capture: draft_export to find where the batch was fixed failed: %s", e)
        return None
    finally:
        quiet.setLevel(level)
    for f in failures:
        data = getattr(f, "data", {})
        sources = {**data.get("frame_locals", {}).get("symbols", {}),
                   **data.get("symbol_to_sources", {})}
        batch_syms = {s for s, src in sources.items() if src.endswith(f".size()[{batch_dim}]")}
        if "GUARD" not in str(f.failure_type) or not batch_syms or not data.get("user_stack"):
            continue
        frame = data["user_stack"][-1]
        shapes = data.get("frame_locals", {}).get("locals", {})
        mixed = [name for name, vals in shapes.items() for v in vals
                 if isinstance(v, str) and v.startswith("Tensor(")
                 and sum(v.count(f"{sym},") + v.count(f"{sym}]") for sym in batch_syms) >= 2]
        said = (f"at {frame.get('name', '?')}(), line {frame.get('line', '?')}: "
                f"`{frame.get('loc', '').strip()}`")
        if mixed:
            return (f"{said}, where {', '.join(mixed)} is a batch x batch matrix (the model "
                    "mixes its samples there, as a contrastive loss with in-batch negatives "
                    "does): rannc_fx runs that part once a step on the whole batch, but this "
                    "line also ties the batch to one size; compute the size from x.size(0) or "
                    "len(x) instead of an int")
        return (f"{said} ties it to that size; compute sizes from x.size(0) or -1 there, or "
                "use Config(tracer='fx')")
    return None


class _FlatInputs(nn.Module):
    """The model called with its tensor leaves as positional arguments, the rest baked in.

    torch.export matches ``dynamic_shapes`` to the model's signature twice, and not the same
    way: before tracing by ``inspect.signature(forward).bind(...)`` (a ``**kwargs`` parameter
    is one key holding a dict), after tracing with every call keyword as a key of its own
    (torch/export/_trace.py ``_get_range_constraints``). No spec passes both once a keyword
    lands in ``**kwargs`` (``AssertionError: Must provide a tree_name when there might be a
    mismatch``; pytorch issues 150022, 164313). Exporting this module instead gives export one
    signature, ``forward(*tensors)``, whose spec is a tuple with one entry per tensor: it
    holds for any call the model accepts (positional, keyword, ``*args``, ``**kwargs``,
    nested containers), and the model still runs through its own ``__call__`` (its hooks,
    its binding of the arguments).

    The module shares the model's parameter, buffer and submodule tables and its tensor
    attributes, so export sees the model's own names (``layers.0.weight``, not ``model.layers.0.weight``) and its fake
    tensors land where the model reads them.
    """

    __model: nn.Module  # private (mangled) names: an attribute would hide a child's name

    def __init__(self, model: nn.Module, leaves: list[Any], in_spec: pytree.TreeSpec) -> None:
        super().__init__()
        for table in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            self.__dict__[table] = model.__dict__[table]
        # plain tensor attributes too: export names the constants it lifts by where it finds them
        self.__dict__.update({k: v for k, v in vars(model).items() if isinstance(v, torch.Tensor)})
        self.training = model.training  # not .train(): that would set the model's children
        self.__dict__["_FlatInputs__model"] = model  # not a submodule: its children are ours
        self.__leaves, self.__in_spec = leaves, in_spec

    def forward(self, *tensors: torch.Tensor) -> Any:
        given = iter(tensors)
        leaves = [next(given) if isinstance(x, torch.Tensor) else x for x in self.__leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self.__in_spec)
        return self.__model(*args, **kwargs)


def _export(model: nn.Module, flat: _FlatInputs, tensors: tuple[torch.Tensor, ...],
            dynamic: Any, repeated: bool, opaque: Mapping[str, list[CallRecord]],
            ) -> tuple[torch.export.ExportedProgram, fx.GraphModule, int]:
    """The exported program, its graph module, and how many calls of repeated submodules were
    copied rather than traced. (The module is made before the copies: making it compiles the
    graph's code.)"""
    keep: set[str] = set()
    while repeated and not opaque:  # an opaque call's key is its own: never copied
        t0 = time.perf_counter()
        rep = RepeatedCapture(model, keep=set(keep))
        try:
            with rep:
                ep = _run_export(flat, tensors, dynamic)
            gm = _graph_module(ep, model)
            copies = rep.expand(gm)
            if copies:
                log.debug("capture: %d kind(s) of repeated module traced once, %d calls copied, "
                          "in %.2f s", len(rep.templates), copies, time.perf_counter() - t0)
            return ep, gm, copies
        except Exception as e:
            if rep.unshell - keep:  # a shell had to run its own forward: export again with
                # no shells at all, not only that kind's: each export costs the whole model, and
                # kept one kind at a time an encoder-decoder exported once per kind whose
                # decoder members see other lengths than the encoder's (T5: three exports)
                log.debug("capture: %s; exporting again", e)
                keep |= {kind.members[0] for kind in rep.kinds}  # rep.unshell among them
                continue
            if not rep.kinds and not isinstance(e, RepeatError) or _output_not_tensors(e):
                raise  # nothing was stood in for, or its outputs are not made of tensors
                # (a cache object): the model does not export, however its layers are traced
            log.debug("capture: tracing repeated modules once failed (%s: %s); exporting each",
                      type(e).__name__, e)
            break
    with exporting(model, opaque) as seen:
        ep = _run_export(flat, tensors, dynamic)
        gm = _graph_module(ep, model)
        if opaque:
            export_opaque_pass(gm, model, seen, opaque)
    return ep, gm, 0


def _output_not_tensors(e: BaseException) -> bool:
    """Whether torch.export failed on the model's outputs: a class it does not know in them."""
    return isinstance(e, RuntimeError) and re.search(r"Found <class '[\w.]+'> in output",
                                                     str(e)) is not None


def _run_export(flat: nn.Module, tensors: tuple[torch.Tensor, ...],
                dynamic: Any) -> torch.export.ExportedProgram:
    """Non-strict ``torch.export.export``, with ``len()`` kept symbolic (``_sized_len``) and
    without FakeTensor's dispatch cache: export meets each op with its own symbolic sizes
    once, so building and checking cache entries costs more than their hits save (a
    fifth to a third of the capture's time on the transformers models of the tests; the
    cache stays on for the shape pass's runs, where repeated layers hit it)."""
    import torch._dynamo  # here, as torch.export imports it: a rank that never exports saves 2 s

    with _sized_len(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        return torch.export.export(flat, tensors, strict=False, dynamic_shapes=dynamic)


@contextlib.contextmanager
def _sized_len() -> Iterator[None]:
    """``len(t)`` of a tensor is ``t.shape[0]`` while exporting.

    Python's ``len()`` must return an int, so on a tensor whose first dimension is symbolic it
    makes export fix that dimension at the example's size: ``torch.arange(len(logits))`` in a
    contrastive loss, ``batch = len(x)``. ``t.shape[0]`` is the same size kept symbolic; code
    that needs an int from it (``range()``, a list's length) still fixes it, as before.
    """
    builtin = builtins.len

    def sized_len(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0:
            return obj.shape[0]
        return builtin(obj)

    builtins.len = sized_len
    try:
        yield
    finally:
        builtins.len = builtin


def _graph_module(ep: torch.export.ExportedProgram, model: nn.Module) -> fx.GraphModule:
    root = ep.module()
    return fx.GraphModule(root, root.graph, class_name=type(model).__name__)
