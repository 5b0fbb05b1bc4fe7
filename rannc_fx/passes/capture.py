"""Capture an nn.Module as one flat fx.GraphModule: torch.fx where it traces, else torch.export."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import logging
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.fx.node import _get_qualified_name
from torch.utils import _pytree as pytree

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "batch_size_of",
    "capture_pass",
    "retarget_device_pass",
]

log = logging.getLogger("rannc_fx")

# Nodes that only check what export saw (device, layout, input guards) and pin the graph to it.
_CHECK_ONLY_TARGETS = (torch.ops.aten._assert_tensor_metadata.default,)


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the failing code or op and the ways out."""


@dataclass
class CapturedGraph:
    """A model as one flat graph.

    ``gm`` takes the tensor leaves of ``(args, kwargs)`` as positional placeholders, in pytree
    order, and returns a flat tuple of tensor leaves (never a pytree). ``in_spec`` /
    ``out_spec`` turn the user's call into that and the flat result back into what the model
    returns (tensor, tuple, dict, HF ModelOutput). Non-tensor leaves of the inputs (``None``,
    bools) are baked into the graph; ``constant_inputs`` records them by leaf index and
    ``flatten_inputs`` checks that a later call passes the same ones. Non-tensor leaves of the
    output are kept likewise in ``constant_outputs``; ``output_leaf_index`` says which output
    leaf each graph output is.

    ``gm``'s parameters and buffers are the model's own objects (same identity), under their
    fully qualified names in the model; a tied parameter is one object reachable under all its
    names (``aliases`` maps every other name to the canonical one).

    The graph is captured in the model's current mode (``model.training``): torch.export bakes
    dropout's and batch norm's training flag into the ops.
    """

    gm: fx.GraphModule
    tracer: Literal["fx", "export"]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_names: list[str]  # placeholder names, one per tensor leaf, in order
    tensor_leaf_index: list[int]  # leaf index (in the flattened (args, kwargs)) of each placeholder
    constant_inputs: dict[int, Any] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)  # node name producing each output leaf
    aliases: dict[str, str] = field(default_factory=dict)
    output_leaf_index: list[int] = field(default_factory=list)  # out leaf index of each gm output
    constant_outputs: dict[int, Any] = field(default_factory=dict)
    batch_dim: int = 0
    model_name: str = ""

    def flatten_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> list[torch.Tensor]:
        """The tensors ``gm`` takes for the call ``model(*args, **kwargs)``."""
        kwargs = dict(kwargs or {})
        # Keyword order is not meaningful to the caller; put it in the captured order.
        want = self.in_spec.child(1).context if self.in_spec.num_children == 2 else None
        if want is not None and set(want) == set(kwargs):
            kwargs = {k: kwargs[k] for k in want}
        leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.in_spec:
            raise ValueError(
                f"the call's inputs have structure {spec} but the graph was captured for "
                f"{self.in_spec}; call with the same arguments and keywords as the example"
            )
        for i, value in self.constant_inputs.items():
            if not _same_constant(leaves[i], value):
                raise ValueError(
                    f"input leaf {i} is {leaves[i]!r} but the graph was captured with {value!r} "
                    "baked in; capture again with this value"
                )
        return [leaves[i] for i in self.tensor_leaf_index]

    def unflatten_outputs(self, flat: list[Any] | tuple[Any, ...]) -> Any:
        """What the model returns, rebuilt from ``gm``'s flat outputs."""
        if len(flat) != len(self.output_leaf_index):
            raise ValueError(
                f"got {len(flat)} outputs but the graph returns {len(self.output_leaf_index)}"
            )
        leaves: list[Any] = [None] * self.out_spec.num_leaves
        for i, v in zip(self.output_leaf_index, flat, strict=True):
            leaves[i] = v
        for i, v in self.constant_outputs.items():
            leaves[i] = v
        return pytree.tree_unflatten(leaves, self.out_spec)

    def fingerprint(self) -> str:
        """A hash of the graph's ops and the parameter/buffer names, shapes and dtypes."""
        index = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        h = hashlib.sha256()
        for n in self.gm.graph.nodes:
            if n.op == "call_module":
                mod = self.gm.get_submodule(n.target)
                target = f"{n.target}:{type(mod).__qualname__}({mod.extra_repr()})"
            elif callable(n.target):
                target = _get_qualified_name(n.target)
            else:
                target = str(n.target)
            args = _stable((n.args, n.kwargs), index)
            h.update(f"{n.op}|{target}|{args}\n".encode())
        h.update(str(self.in_spec).encode() + str(self.out_spec).encode())
        for kind, named in (
            ("param", self.gm.named_parameters(remove_duplicate=False)),
            ("buffer", self.gm.named_buffers(remove_duplicate=False)),
        ):
            for name, t in sorted(named, key=lambda kv: kv[0]):
                h.update(f"{kind}|{name}|{tuple(t.shape)}|{t.dtype}\n".encode())
        return h.hexdigest()

    @property
    def num_nodes(self) -> int:
        return len(self.gm.graph.nodes)


def capture_pass(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    tracer: Literal["auto", "fx", "export"] = "auto",
    leaf_modules: tuple[str, ...] = (),
    batch_dim: int = 0,
) -> CapturedGraph:
    """``model(*args, **kwargs)`` as a CapturedGraph.

    ``"auto"`` tries torch.fx first (module-level graph, instant, works on any device); when
    fx fails, or keeps a torch.nn container such as ``nn.TransformerEncoder`` as one opaque
    node, it tries non-strict torch.export (ATen-level graph) and keeps the finer graph.
    ``leaf_modules`` (class names) are kept as single ``call_module`` nodes by torch.fx;
    torch.export always traces through them. With torch.export the batch dimension of every
    input whose ``batch_dim`` has the example's batch size is dynamic, so the graph runs at any
    micro-batch size.
    """
    kwargs = dict(kwargs or {})
    args = tuple(args)
    name = type(model).__name__
    t0 = time.perf_counter()
    errors: dict[str, BaseException] = {}
    captured: CapturedGraph | None = None
    opaque: list[tuple[str, str]] = []
    if tracer in ("auto", "fx"):
        try:
            captured = _capture_fx(model, args, kwargs, leaf_modules, batch_dim)
            opaque = _opaque(captured, leaf_modules)
        except CaptureError:
            raise
        except Exception as e:  # torch.fx raises anything the model's code raises on a Proxy
            errors["torch.fx"] = e
    if tracer == "export" or (tracer == "auto" and (captured is None or opaque)):
        if tracer == "export" and leaf_modules:
            log.info("leaf_modules %s are ignored by torch.export", list(leaf_modules))
        # torch.export prints the partial graph of a failure to stderr; keep it for debugging.
        printed = io.StringIO()
        try:
            with contextlib.redirect_stderr(printed):
                exported = _capture_export(model, args, kwargs, batch_dim)
            sys.stderr.write(printed.getvalue())
            captured, opaque = exported, []
        except Exception as e:
            log.debug("torch.export printed:\n%s", printed.getvalue())
            errors["torch.export"] = e
            if captured is None and isinstance(e, CaptureError):
                raise  # already says what to do
    if captured is None:
        raise CaptureError(_failure_message(model, errors, tracer)) from errors.get(
            "torch.export", errors.get("torch.fx")
        )
    note = ""
    if opaque and "torch.export" in errors:
        note = (
            f"; kept {', '.join(f'{n} ({c})' for n, c in opaque)} as one node each (torch.fx "
            f"does not trace into torch.nn modules and torch.export failed: "
            f"{_first_line(errors['torch.export'])}), so no stage boundary can fall inside"
        )
    captured.model_name = name
    (log.warning if note else log.info)(
        "captured %s with %s: %d nodes in %.2f s%s",
        name,
        "torch.fx" if captured.tracer == "fx" else "torch.export",
        captured.num_nodes,
        time.perf_counter() - t0,
        note,
    )
    return captured


def batch_size_of(flat_inputs: list[Any], batch_dim: int = 0) -> int:
    """The example's batch size: ``batch_dim``'s size in the first input tensor that has it."""
    for t in flat_inputs:
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
            return int(t.shape[batch_dim])
    raise ValueError(
        f"no input tensor has a dimension {batch_dim} to split into samples; pass batched "
        "tensors or set Config(batch_dim=...)"
    )


def retarget_device_pass(gm: fx.GraphModule, device: torch.device | str) -> fx.GraphModule:
    """Point every device the graph names (``arange(..., device=cpu)``) at ``device``, in place.

    torch.export bakes the capture device into factory calls; a graph captured on the CPU or
    on ``meta`` runs elsewhere only after this.
    """
    dev = torch.device(device)

    def swap(x: Any) -> Any:
        return dev if isinstance(x, torch.device) else x

    # nested graphs too: export puts autocast / grad-mode regions in submodule graphs
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            n.args = pytree.tree_map(swap, n.args)
            n.kwargs = pytree.tree_map(swap, n.kwargs)
        sub.graph.lint()
        sub.recompile()
    return gm


# -- torch.fx ----------------------------------------------------------------------------------


class _FlatTracer(fx.Tracer):
    """torch.fx with flat tensor placeholders, class-name leaves and buffers as graph values."""

    def __init__(self, leaf_modules: tuple[str, ...], leaves: list[Any], in_spec: Any,
                 names: list[str]):
        super().__init__()
        self.proxy_buffer_attributes = True  # `self.mask[:s]` with a traced `s` must stay in the graph
        self.leaf_modules = set(leaf_modules)
        self.leaves, self.in_spec, self.names = leaves, in_spec, names
        self.out_leaves: list[Any] = []
        self.out_spec: pytree.TreeSpec | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
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


def _capture_fx(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                leaf_modules: tuple[str, ...], batch_dim: int) -> CapturedGraph:
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tracer = _FlatTracer(leaf_modules, leaves, in_spec, _leaf_names(model, args, kwargs))
    graph = tracer.trace(model)
    assert tracer.out_spec is not None
    out_idx = [i for i, x in enumerate(tracer.out_leaves) if isinstance(x, (fx.Proxy, torch.Tensor))]
    consts = {i: x for i, x in enumerate(tracer.out_leaves) if i not in set(out_idx)}
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    return _finish(gm, model, "fx", in_spec, tracer.out_spec, leaves, out_idx, consts, batch_dim)


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


def _opaque(captured: CapturedGraph, leaf_modules: tuple[str, ...]) -> list[tuple[str, str]]:
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


def _capture_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    batch_dim: int) -> CapturedGraph:
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    batch = batch_size_of(leaves, batch_dim)

    def batched(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == batch

    if batch < 2:
        raise CaptureError(
            f"torch.export needs an example with at least 2 samples to keep the batch dimension "
            f"dynamic (got {batch}; it treats sizes 0 and 1 as constants); capture with a larger "
            "example batch"
        )
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    dynamic = {
        k: pytree.tree_map(lambda x: {batch_dim: torch.export.Dim.AUTO} if batched(x) else None, v)
        for k, v in bound.arguments.items()
    }
    ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic)
    root = ep.module()
    graph = root.graph
    graph._codegen = fx.graph.CodeGen()

    # Guards and metadata checks pin the graph to the example's devices; drop them.
    for n in list(graph.nodes):
        if (n.op == "call_module" and n.target == "_guards_fn") or n.target in _CHECK_ONLY_TARGETS:
            graph.erase_node(n)
    if hasattr(root, "_guards_fn"):
        delattr(root, "_guards_fn")

    # Export placeholders follow its own in_spec, where None is a leaf; match by key path.
    ep_spec = ep.call_spec.in_spec
    ep_paths = [p for p, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(list(range(ep_spec.num_leaves)), ep_spec))[0]]
    user_paths = {p: i for i, (p, _) in enumerate(pytree.tree_flatten_with_path((args, kwargs))[0])}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    ordered: list[tuple[int, fx.Node]] = []
    for ph, path in zip(placeholders, ep_paths, strict=True):
        i = user_paths.get(path)
        if i is not None and isinstance(leaves[i], torch.Tensor):
            ordered.append((i, ph))
            val = ph.meta.get("val")
            if batched(leaves[i]) and isinstance(val, torch.Tensor) and is_concrete_int(
                val.shape[batch_dim]
            ):
                raise CaptureError(
                    f"torch.export fixed the batch dimension of input {ph.name!r} at {batch}: "
                    f"the model's code ties it to that size (e.g. x.view({batch}, -1) or a loop "
                    "over the batch); compute sizes from x.size(0) or -1, or use "
                    "Config(tracer='fx')"
                )
        else:  # a non-tensor input: export specialized it, so bake it in
            value = leaves[i] if i is not None else None
            for user in list(ph.users):
                user.args = pytree.tree_map(lambda a, ph=ph, v=value: v if a is ph else a, user.args)
                user.kwargs = pytree.tree_map(lambda a, ph=ph, v=value: v if a is ph else a, user.kwargs)
            graph.erase_node(ph)
    ordered.sort(key=lambda t: t[0])
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for _, ph in ordered:
        anchor.prepend(ph)

    (out_node,) = [n for n in graph.nodes if n.op == "output"]
    out_leaves = list(out_node.args[0])
    out_idx = [i for i, x in enumerate(out_leaves) if isinstance(x, fx.Node)]
    consts = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, fx.Node)}
    out_node.args = (tuple(out_leaves[i] for i in out_idx),)
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__)
    return _finish(gm, model, "export", in_spec, ep.call_spec.out_spec, leaves, out_idx, consts,
                   batch_dim)


# -- both --------------------------------------------------------------------------------------


def _finish(gm: fx.GraphModule, model: nn.Module, tracer: Literal["fx", "export"],
            in_spec: Any, out_spec: Any, leaves: list[Any], out_idx: list[int],
            consts: dict[int, Any], batch_dim: int) -> CapturedGraph:
    _share_state(gm, model)
    aliases = _aliases(model)
    _add_aliases(gm, model, aliases)
    gm.graph.lint()
    gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    return CapturedGraph(
        gm=gm,
        tracer=tracer,
        in_spec=in_spec,
        out_spec=out_spec,
        input_names=[n.name for n in placeholders],
        tensor_leaf_index=[i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)],
        constant_inputs={i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)},
        output_names=[n.name for n in out_node.args[0]],
        aliases=aliases,
        output_leaf_index=out_idx,
        constant_outputs=consts,
        batch_dim=batch_dim,
    )


def _share_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make every parameter and buffer of ``gm`` the model's own object, under the same name."""
    model_modules = {id(m) for m in model.modules()}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for kind, own, theirs in (
        ("parameter", params, dict(gm.named_parameters(remove_duplicate=False))),
        ("buffer", buffers, dict(gm.named_buffers(remove_duplicate=False))),
    ):
        for name, t in theirs.items():
            if name not in own or own[name] is t:
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = gm.get_submodule(owner_name)
            if id(owner) in model_modules:
                raise CaptureError(f"captured {kind} {name!r} is not the model's; report this")
            if kind == "parameter":
                owner._parameters[attr] = own[name]  # type: ignore[assignment]
            else:
                owner._buffers[attr] = own[name]
    # Keep buffers that the model does not save in its state_dict out of gm's too.
    for name in buffers:
        owner_name, _, attr = name.rpartition(".")
        try:
            mine, theirs_mod = model.get_submodule(owner_name), gm.get_submodule(owner_name)
        except AttributeError:
            continue
        if attr in mine._non_persistent_buffers_set and id(theirs_mod) not in model_modules:
            theirs_mod._non_persistent_buffers_set.add(attr)


def _add_aliases(gm: fx.GraphModule, model: nn.Module, aliases: dict[str, str]) -> None:
    """Make a tied tensor reachable in ``gm`` under every name it has in the model."""
    model_modules = {id(m) for m in model.modules()}
    params = dict(gm.named_parameters(remove_duplicate=False))
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    for alias, canonical in aliases.items():
        t = params.get(canonical, buffers.get(canonical))
        if t is None or alias in params or alias in buffers:
            continue
        *path, attr = alias.split(".")
        owner: nn.Module = gm
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        if id(owner) in model_modules:
            continue  # the model's own module holds it already
        if canonical in params:
            owner.register_parameter(attr, params[canonical])
        else:
            owner.register_buffer(attr, t)


def _aliases(model: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    out = {}
    for named in (model.named_parameters(remove_duplicate=False),
                  model.named_buffers(remove_duplicate=False)):
        for name, t in named:
            canonical = first.setdefault(id(t), name)
            if canonical != name:
                out[name] = canonical
    return out


def _same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _stable(x: Any, index: dict[fx.Node, int]) -> str:
    """Node arguments as text with no ids or addresses in it."""
    if isinstance(x, fx.Node):
        return f"%{index[x]}"
    if isinstance(x, (list, tuple)):
        return "(" + ",".join(_stable(v, index) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_stable(v, index)}" for k, v in sorted(x.items())) + "}"
    if isinstance(x, slice):
        return "slice" + _stable((x.start, x.stop, x.step), index)
    if isinstance(x, torch.device):
        return "device"  # the same model captured on another device is the same model
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.layout,
                                   torch.memory_format)):
        return repr(x)
    if callable(x):
        try:
            return _get_qualified_name(x)
        except Exception:
            pass
    return type(x).__qualname__


# -- errors ------------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def _is_user_file(filename: str) -> bool:
    if filename.startswith(_TORCH_DIR) or filename == __file__ or filename.startswith("<"):
        return False
    return not filename.startswith(_STDLIB_DIR) or "site-packages" in filename


def _user_frame(e: BaseException, modules: dict[int, str]) -> tuple[str, str | None]:
    """``file:line in fn: code`` of the innermost model-code frame, and the innermost submodule
    of the model that was running (``modules`` maps ids to qualified names)."""
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for exc in reversed(chain):
        where, culprit = "", None
        tb: TracebackType | None = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and modules.get(id(owner)):
                culprit = f"{modules[id(owner)]} ({type(owner).__name__})"
            if _is_user_file(frame.f_code.co_filename):
                fs = traceback.FrameSummary(frame.f_code.co_filename, tb.tb_lineno, frame.f_code.co_name)
                path = os.path.relpath(fs.filename)
                path = fs.filename if path.startswith("..") else path
                where = f"{path}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}"
            tb = tb.tb_next
        if where:
            return where, culprit
    return "", None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:300]}"


def _failure_message(model: nn.Module, errors: dict[str, BaseException], tracer: str) -> str:
    modules = {id(m): name for name, m in model.named_modules() if name}
    lines = [f"could not capture {type(model).__name__} as a graph:"]
    culprits = set()
    for who, e in errors.items():
        where, culprit = _user_frame(e, modules)
        lines.append(f"  {who} failed: {_first_line(e)}")
        if where:
            lines.append(f"      at {where}")
        if culprit:
            lines.append(f"      inside module {culprit}")
            culprits.add(culprit.rpartition(" (")[2].rstrip(")"))
    lines.append("ways out:")
    for e in errors.values():
        found = re.search(r"Found <class '([\w.]+)'> in output", str(e))
        if found:
            kind = found.group(1).rpartition(".")[2]
            lines.append(
                f"  - the model returns a {kind}, which is not made of tensors: for training, "
                "turn it off (transformers: use_cache=False in the config or the call), or "
                "register it with torch.utils._pytree.register_pytree_node"
            )
    lines.append(
        "  - a Python `if`/`for` on tensor values cannot become a graph: use torch.where(...) "
        "or torch.cond(pred, true_fn, false_fn, (x,)) so the graph holds both branches"
    )
    names = tuple(sorted(culprits)) or ("ClassName",)
    lines.append(
        f"  - keep the failing module whole as one node: Config(leaf_modules={names!r}) "
        "(torch.fx calls it without tracing inside; torch.export ignores leaf_modules)"
    )
    if tracer != "auto":
        other = "export" if tracer == "fx" else "fx"
        lines.append(f"  - try the other tracer: Config(tracer={other!r}) (or \"auto\" for both)")
    return "\n".join(lines)
