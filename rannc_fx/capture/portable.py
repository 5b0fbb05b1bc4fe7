"""A captured graph as bytes that leave the model's own state out, bound on arrival to another
copy of the model: ``compile()``'s rank 0 captures once and every other rank takes its graph.

Every rank builds the same model (``startup/sync.py`` checks that they did), so a graph
captured on one rank computes what the others' would: a second capture of it takes each
of them as long as rank 0's own (torch.export's trace is most of the start-up) to find the
same graph. ``pack`` writes rank 0's ``CapturedGraph`` with each of the model's parameters,
buffers, tensor attributes and submodules as its name (a tensor attribute with its value too:
torch.fx sets the constants it traces on the model, which another copy lacks); ``unpack``
reads it against this rank's model, so the graph holds this rank's own objects, as a capture
of its own would, and checks that it is the graph rank 0 had (``CapturedGraph.fingerprint``).

The graph travels as its nodes (op, name, target, arguments, plain metadata), so names and
the metadata later passes read (``OPAQUE``, ``TAIL``, module stacks) arrive as they were;
torch.export's node values (fake tensors with formula sizes, which the shape pass reads)
travel as formulas, made again where the shape pass asks (``fake_values``). Operators travel
by their qualified names. What cannot travel (the pieces of a model's own forward, which
hold code compiled from its source) raises ``NotPortable``: that rank then captures the
model itself.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import sys
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from . import fake_values
from .capture import retarget_device_pass
from .graph import CapturedGraph
from .opaque import OpaqueCall
from .pieces import Piece

__all__ = ["NotPortable", "pack", "unpack"]

# a GraphModule's own attributes that the receiver makes again (``recompile``) or that hold
# hooks of the process that made it
_REMADE = frozenset({
    "_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls", "_tracer_extras",
    "_replace_hooks", "_create_node_hooks", "_erase_node_hooks", "_deepcopy_hooks",
})


class NotPortable(RuntimeError):
    """The graph holds something that cannot be sent to another process."""


def pack(captured: CapturedGraph, model: nn.Module) -> bytes:
    """``captured`` as bytes, with ``model``'s parameters, buffers, tensor attributes and
    submodules by name."""
    out = io.BytesIO()
    try:
        values = fake_values.write(captured.gm.graph) or captured.values  # or as received
        _Pickler(out, model).dump((captured.fingerprint(), captured, values))
    except NotPortable:
        raise
    except Exception as e:  # whatever a value's own pickling raises
        raise NotPortable(f"the captured graph cannot be sent: {type(e).__name__}: {e}") from e
    return out.getvalue()


def unpack(data: bytes, model: nn.Module, *,
           moved: tuple[torch.device, torch.device] | None = None) -> CapturedGraph:
    """The ``CapturedGraph`` ``pack`` wrote, holding ``model``'s own parameters, buffers and
    submodules; with ``moved`` (the sender's model's device, this one's), the devices the
    graph names and the constants it carries moved from the first to the second. Raises
    ``NotPortable`` where ``model`` lacks a name the graph holds, or holds it with another
    shape or dtype, or a submodule of another kind."""
    try:
        fingerprint, captured, values = _Unpickler(io.BytesIO(data), model).load()
    except NotPortable:
        raise
    except Exception as e:  # an operator this process lacks, cut-off bytes: it captures instead
        raise NotPortable(f"rank 0's graph cannot be read here: {type(e).__name__}: {e}") from e
    assert isinstance(captured, CapturedGraph)
    if captured.fingerprint() != fingerprint:
        raise NotPortable("this rank's model differs from rank 0's in the shapes or dtypes of "
                          "the tensors the graph holds, or in its modules: build the same "
                          "model on every rank")
    if moved is not None and moved[0] != moved[1]:
        _move(captured.gm, model, *moved)
        values = fake_values.moved(values, *moved)
    captured.values = values  # made where the shape pass needs them
    return captured


def _move(gm: fx.GraphModule, model: nn.Module, there: torch.device, here: torch.device) -> None:
    """The graph's devices and the constants it carries (its own tensors, not the model's) on
    ``here`` where they were on ``there``."""
    retarget_device_pass(gm, here, only=there)
    own = {id(t) for named in _own_tensors(model).values() for t in named.values()}
    for mod in gm.modules():
        for table in (mod._buffers, mod.__dict__):
            for k, t in list(table.items()):
                if isinstance(t, torch.Tensor) and id(t) not in own and t.device == there:
                    table[k] = t.to(here)


# -- the sender ----------------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, model: nn.Module) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: dict[int, tuple[str, str]] = {}
        for kind, named in _own_tensors(model).items():
            for name, t in named.items():
                self.tensors.setdefault(id(t), (kind, name))
        self.modules = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            kind, name = self.tensors.get(id(obj), ("", ""))
            if kind == "attribute":  # with its value (a copy: the pid itself is pickled
                return (kind, name, obj.detach().clone())  # plainly): torch.fx sets the
                # constants it traces on the model, which another copy lacks
            return (kind, name) if kind else None
        if isinstance(obj, nn.Module) and id(obj) in self.modules:
            return ("module", self.modules[id(obj)])
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, pytree.TreeSpec):  # as its parts: a leaf's class warns when made
            if obj.is_leaf():
                return pytree.treespec_leaf, ()
            return pytree.TreeSpec, (obj.type, obj.context, obj.children())
        if isinstance(obj, torch._ops.OpOverload):
            return _overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _packet, (obj._qualified_op_name,)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, Piece):
            raise NotPortable(f"the model's forward runs in pieces ({obj.where}), whose code "
                              "is compiled from its source")
        if isinstance(obj, OpaqueCall):
            return OpaqueCall, (obj.inner, obj.calls)
        if isinstance(obj, fx.GraphModule):
            state = {k: v for k, v in obj.__dict__.items() if k not in _REMADE}
            state["meta"] = {k: v for k, v in obj.meta.items() if _plain(v)}
            return _graph_module, (type(obj).__name__, state, _nodes(obj.graph),
                                   obj.graph._codegen)
        if isinstance(obj, CapturedGraph):  # its fields, so that the class may grow
            return _captured, ({f.name: getattr(obj, f.name)
                                for f in dataclasses.fields(obj)},)
        return NotImplemented


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node's argument that is an earlier node, by its position in the graph."""

    index: int


def _nodes(graph: fx.Graph) -> list[tuple[Any, ...]]:
    index = {n: i for i, n in enumerate(graph.nodes)}

    def ref(n: fx.Node) -> Any:
        return _Ref(index[n])

    return [(n.op, n.name, n.target, fx.node.map_arg(n.args, ref),
             fx.node.map_arg(n.kwargs, ref), n.type,
             {k: v for k, v in n.meta.items() if _plain(v)}) for n in graph.nodes]


def _plain(x: Any, depth: int = 0) -> bool:
    """Whether a metadata value is plain data (text, numbers, dtypes, importable classes, and
    containers of them): fake tensors, symbols and nodes stay behind."""
    if x is None or isinstance(x, (str, int, float, bool, torch.dtype, torch.device)):
        return True
    if isinstance(x, type):
        owner = sys.modules.get(x.__module__)
        return owner is not None and getattr(owner, x.__qualname__, None) is x
    if depth > 8:
        return False
    if isinstance(x, (list, tuple)):
        return type(x) in (list, tuple) and all(_plain(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
    return False


# -- the receiver --------------------------------------------------------------------------------


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, model: nn.Module) -> None:
        super().__init__(file)
        self.tables: dict[str, dict[str, Any]] = {
            **_own_tensors(model), "module": dict(model.named_modules(remove_duplicate=False))}

    def persistent_load(self, pid: Any) -> Any:
        kind, name, *value = pid
        table = self.tables[kind]
        if kind == "attribute" and name not in table:  # a constant only the sender's holds
            return value[0]
        if name not in table:
            raise NotPortable(f"rank 0's graph holds the {kind} {name!r}, which this rank's "
                              "model lacks: build the same model on every rank")
        return table[name]


def _own_tensors(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor the model holds, by kind and name: its state (parameters and buffers) and
    its plain tensor attributes (constants)."""
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    attributes = {f"{prefix}.{attr}" if prefix else attr: v
                  for prefix, mod in model.named_modules(remove_duplicate=False)
                  for attr, v in vars(mod).items() if isinstance(v, torch.Tensor)}
    return {"tensor": state, "attribute": attributes}


def _overload(namespace: str, name: str, overload: str) -> Any:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _packet(qualified: str) -> Any:
    namespace, _, name = qualified.partition("::")
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


def _captured(fields: dict[str, Any]) -> CapturedGraph:
    return CapturedGraph(**fields)


def _graph_module(class_name: str, state: dict[str, Any], nodes: list[tuple[Any, ...]],
                  codegen: Any) -> fx.GraphModule:
    def arg(x: Any) -> Any:
        return made[x.index] if isinstance(x, _Ref) else x

    graph = fx.Graph()
    graph._codegen = codegen
    made: list[fx.Node] = []
    for op, name, target, args, kwargs, type_expr, meta in nodes:
        n = graph.create_node(op, target, fx.node.map_aggregate(args, arg),
                              fx.node.map_aggregate(kwargs, arg), name=name, type_expr=type_expr)
        if n.name != name:
            raise NotPortable(f"node {name!r} was renamed {n.name!r} on arrival")
        n.meta = meta
        made.append(n)
    gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
    gm.__dict__.update(state)
    gm.graph = graph  # recompiles
    return gm
