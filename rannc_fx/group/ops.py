"""What an op does to its inputs (aliases, writes, random draws) and the state the forward writes.

The grouping, the boundaries and the split all ask these of a node: a view stays with the
value it aliases and an in-place op with the value it writes, a random op is never recomputed,
and a tensor the forward writes (``written_state``) keeps all its readers in one stage, since
every stage holds its own copy of a buffer.
"""

from __future__ import annotations

import inspect
import operator

import torch
from torch import fx, nn

__all__ = [
    "CALL_OPS",
    "is_inplace",
    "is_view",
    "written_state",
]

CALL_OPS = ("call_function", "call_method", "call_module")

# Python-level ops whose result aliases their first argument.
_VIEW_NAMES = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as",
    "t", "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "slice", "chunk",
    "split", "split_with_sizes", "tensor_split", "unbind", "contiguous", "detach", "alias",
    "as_strided", "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "unfold", "real",
    "imag", "view_as_real", "view_as_complex", "to", "type_as", "getitem", "T", "mT", "H",
    "mH", "data",
})
_RANDOM_NAMES = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "poisson", "native_dropout",
})
# aten's batch-norm family updates its running statistics in place though the schemas do not
# say so (``_native_batch_norm_legit`` and ``_batch_norm_with_update`` do: ``Tensor(a!)``)
_RUNNING_STATS_OPS = frozenset({
    "batch_norm", "native_batch_norm", "instance_norm", "_batch_norm_impl_index",
    "cudnn_batch_norm",
})
_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
})


def _op_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if t is getattr and len(node.args) > 1:
        return str(node.args[1])
    return getattr(t, "__name__", str(t))


def is_view(node: fx.Node) -> bool:
    """Whether the node's output may alias its first input (a view, a slice, a no-op cast)."""
    if node.op not in ("call_function", "call_method"):
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        rets = t._schema.returns
        return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write
    return _op_name(node) in _VIEW_NAMES


def _mutated_args(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """The inputs an in-place op writes to (empty for pure ops)."""
    t = node.target
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op == "call_module":
        mod = gm.get_submodule(str(t))
        return first if getattr(mod, "inplace", False) is True else []
    if node.op not in ("call_function", "call_method"):
        return []
    name = _op_name(node)
    if name in _RUNNING_STATS_OPS:
        return _running_stats(node)
    if isinstance(t, torch._ops.OpOverload):
        out = []
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                if isinstance(v, fx.Node):
                    out.append(v)
        return out
    if t in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return first
    if name.endswith("_") and not name.startswith("_"):
        return first
    return []


def _running_stats(node: fx.Node) -> list[fx.Node]:
    """The running statistics a batch-norm-family op updates: none with its training flag
    (``training``, ``use_input_stats``) false."""
    bound = _bound_args(node)
    if bound is None:
        return []
    if bound.get("training", bound.get("use_input_stats", True)) is False:
        return []
    return [v for k in ("running_mean", "running_var") if isinstance(v := bound.get(k), fx.Node)]


def _bound_args(node: fx.Node) -> dict[str, object] | None:
    """The node's arguments by parameter name (defaults filled in), when they can be known."""
    t = node.target
    schema = t._schema if isinstance(t, torch._ops.OpOverload) else None
    if schema is None:
        try:
            sig = inspect.signature(t)  # type: ignore[arg-type]  # F.batch_norm
        except (TypeError, ValueError):  # a builtin (torch.batch_norm): aten's schema
            packet = getattr(torch.ops.aten, _op_name(node), None)
            schema = getattr(getattr(packet, "default", None), "_schema", None)
        else:
            try:
                bound = sig.bind(*node.args, **node.kwargs)
            except TypeError:
                return None
            bound.apply_defaults()
            return dict(bound.arguments)
    if schema is None:
        return None
    out: dict[str, object] = {
        a.name: a.default_value for a in schema.arguments if a.has_default_value()
    }
    out.update(zip((a.name for a in schema.arguments), node.args, strict=False))
    out.update(node.kwargs)
    return out


def is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether the node writes to one of its inputs."""
    return bool(_mutated_args(node, gm))


def _state(node: fx.Node, gm: fx.GraphModule) -> torch.Tensor | None:
    """The parameter, buffer or constant that ``node`` (a get_attr, or a view of one) is."""
    base = _alias_base(node)
    if base.op != "get_attr":
        return None
    t = operator.attrgetter(str(base.target))(gm)
    return t if isinstance(t, torch.Tensor) else None


def _module_writes(node: fx.Node, gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """The buffers a ``call_module`` node's module updates itself: a normalization layer's
    running statistics (torch.fx leaves the training flag to run time, so whenever it tracks
    them)."""
    if node.op != "call_module":
        return []
    mod = gm.get_submodule(str(node.target))
    if not (isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats):
        return []
    return [
        (f"{node.target}.{attr}", t)
        for attr in ("running_mean", "running_var", "num_batches_tracked")
        if isinstance(t := getattr(mod, attr, None), torch.Tensor)
    ]


def written_state(gm: fx.GraphModule) -> dict[int, tuple[str, str]]:
    """Parameters, buffers and constants that the forward writes, by ``id``: (a name of the
    tensor, the first node that writes it). In-place ops on them or their views, the
    batch-norm family's running statistics, normalization modules that track them."""
    out: dict[int, tuple[str, str]] = {}
    for n in gm.graph.nodes:
        if n.op not in CALL_OPS:
            continue
        for name, t in _module_writes(n, gm):
            out.setdefault(id(t), (name, n.name))
        for m in _mutated_args(n, gm):
            state = _state(m, gm)
            if state is not None:
                out.setdefault(id(state), (str(_alias_base(m).target), n.name))
    return out


def _is_random(node: fx.Node) -> bool:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in t.tags
    return _op_name(node) in _RANDOM_NAMES


def _alias_base(node: fx.Node) -> fx.Node:
    while node.op in CALL_OPS and is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node
