"""Trace each kind of repeated submodule once under torch.export, and copy its nodes for the rest.

torch.export costs time in proportion to the ops it traces, so a 256-layer encoder costs 256
layers. Inside ``RepeatedCapture`` every member of a kind (``capture_same``) answers its
calls through a stand-in ``forward``:

    first call of a kind    the real forward; the nodes it adds are tagged as the kind's
                            template, its inputs and outputs as the template's
    later calls             one node, ``rannc_fx::repeated_call(tensors, call)``, whose fake
                            outputs have the template outputs' metadata, when the call's
                            inputs have the template's metadata (symbolic shapes, dtypes,
                            aliasing) and its plain arguments are equal; else the real forward

The later members of a kind are empty shells while export runs (``capture/shell``), so that
their tensors are not lifted. ``expand`` then replaces each stand-in node by a copy of the
template's nodes reading the call's inputs and its own module's tensors (``capture/copy_nodes``),
so the graph holds the same ops in the same order as a plain export. A template that writes
what it did not make (other than its own tensors), returns a view of an input, reads a
watched attribute or changes its module traces its kind call by call instead (a shell asked
to do so raises RepeatError, and the caller exports again with that kind's members whole);
anything ``expand`` does not find as recorded raises RepeatError, and the caller exports
again without stand-ins.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from .copy_nodes import RepeatError, Template, TemplateCopier
from .graph import autocast_state
from .same import Kind, find_kinds, hooked_inside, watch_reads
from .shell import add_tensors, can_shell, shells

__all__ = ["RepeatedCapture"]

log = logging.getLogger("rannc_fx")

_REGION, _INPUT, _OUTPUT = "rannc_repeat_region", "rannc_repeat_input", "rannc_repeat_output"
_templates_by_call: dict[int, Template] = {}  # what the fake implementation answers, per call
_call_ids = itertools.count()


# Defined without autograd: the op never runs, and an autograd wrapper would cost more than
# the rest of a stand-in call.
torch.library.define("rannc_fx::repeated_call", "(Tensor[] inputs, int call) -> Tensor[]")


@torch.library.register_fake("rannc_fx::repeated_call")
def _(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    out = []
    for t in _templates_by_call[call].outputs:
        # empty_like hits fake tensor's cache; empty_strided with SymInt sizes is slow
        new = torch.empty_like(t)
        if [_sym_key(s) for s in new.stride()] != [_sym_key(s) for s in t.stride()]:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        out.append(new)
    return out


@dataclass(frozen=True)
class _Made:
    """An output leaf: the stand-in's ``index``-th output."""

    index: int


@dataclass(frozen=True)
class _Passed:
    """An output leaf: the call's ``index``-th input tensor, returned as it came."""

    index: int


@dataclass
class _Call:
    template: Template
    member: int


@dataclass
class RepeatedCapture:
    """Stand-ins for the repeated submodules of ``model`` while the block runs (see module doc).

    The later members of a kind are shells (``capture/shell``) unless their kind's first
    member path is in ``keep``. A shell that must run its own forward (its call's inputs
    differ, the template cannot stand in) raises RepeatError and adds its kind to ``unshell``:
    export again with those kept.
    """

    model: nn.Module
    keep: set[str] = field(default_factory=set)
    kinds: list[Kind] = field(default_factory=list)
    templates: dict[int, Template] = field(default_factory=dict)  # by kind index
    calls: dict[int, _Call] = field(default_factory=dict)  # by call id
    shelled: dict[str, str] = field(default_factory=dict)  # shell path -> traced member's
    unshell: set[str] = field(default_factory=set)
    _patched: list[nn.Module] = field(default_factory=list)
    _exit: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> RepeatedCapture:
        self.kinds = find_kinds(self.model)
        forwards: list[object] = []
        for k, kind in enumerate(self.kinds):
            shell = kind.members[0] not in self.keep and can_shell(self.model, kind.members[1:])
            log.debug("capture: %d x %s traced once (%s..)%s; watched %s", len(kind.members),
                      type(kind.modules[0]).__name__, kind.members[0],
                      ", the others shells" if shell else "", sorted(kind.watched))
            for i, m in enumerate(kind.modules):
                if shell and i > 0:
                    self.shelled[kind.members[i]] = kind.members[0]
                    forwards.append(_StandIn(self, k, i, None))
                else:
                    m.forward = _StandIn(self, k, i, m.forward)
                    self._patched.append(m)
        try:
            self._exit.enter_context(shells(self.model, list(self.shelled), forwards))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._exit.close()
        for m in self._patched:
            del m.forward
        for call in self.calls:
            _templates_by_call.pop(call, None)

    # -- during the trace --------------------------------------------------------------------

    def call(self, k: int, i: int, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = get_proxy_mode()
        if mode is None:  # not tracing (a call before or after export)
            if forward is None:
                self.unshell.add(self.kinds[k].members[0])
                raise RepeatError(f"{self.kinds[k].members[i]} was called outside the trace")
            return forward(*args, **kwargs)
        kind = self.kinds[k]
        template = self.templates.get(k)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        why = ("it is called first" if template is None else template.why_not
               or ("a hook is set inside it" if hooked_inside(kind.modules[i]) else "")
               or ("" if _call_key(leaves, spec) == template.call_key
                   else f"its inputs differ from {kind.members[template.member]}'s"))
        if why and forward is None:
            self.unshell.add(kind.members[0])
            raise RepeatError(f"{kind.members[i]} must be traced ({why}) but is a shell")
        if template is None:
            return self._trace_template(k, i, forward, args, kwargs, mode.tracer)
        if why:
            log.debug("capture: %s traced on its own: %s", kind.members[i], why)
            return forward(*args, **kwargs)
        call = next(_call_ids)
        self.calls[call] = _Call(template, i)
        _templates_by_call[call] = template
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        made = torch.ops.rannc_fx.repeated_call(tensors, call)
        return pytree.tree_unflatten(
            [made[x.index] if isinstance(x, _Made) else tensors[x.index]
             if isinstance(x, _Passed) else x for x in template.out_leaves],
            template.out_spec)

    def _trace_template(self, k: int, i: int, forward: Any, args: tuple[Any, ...],
                        kwargs: dict[str, Any], tracer: Any) -> Any:
        kind, module = self.kinds[k], self.kinds[k].modules[i]
        graph: fx.Graph = tracer.graph
        last = graph._root.prev
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = _call_key(leaves, spec)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        # before the call: an op that returns its input (x.to(x.dtype)) moves x's proxy
        in_nodes = [_proxy_node(x, tracer) for x in tensors]
        own_nodes = {_proxy_node(t, tracer) for t in (*module.parameters(), *module.buffers())}
        hooked = hooked_inside(module)
        with watch_reads(module, kind.watched) as read:
            before = _state(module)
            out = forward(*args, **kwargs)
            changed = _state(module) != before
        region = []
        n = last.next
        while n is not graph._root:
            region.append(n)
            n = n.next
        out_leaves, out_spec = pytree.tree_flatten(out)
        passed = {id(x): j for j, x in enumerate(tensors)}
        outputs: list[torch.Tensor] = []
        marked: list[Any] = []
        for x in out_leaves:
            if isinstance(x, torch.Tensor) and id(x) in passed:  # returned as it came
                marked.append(_Passed(passed[id(x)]))
            elif isinstance(x, torch.Tensor):
                marked.append(_Made(len(outputs)))
                outputs.append(x)
            else:
                marked.append(x)
        t = Template(kind, i, key, out_spec, marked, outputs, len(region), len(set(in_nodes)))
        self.templates[k] = t
        t.why_not = (
            "an argument is neither a tensor nor plain data" if key is None
            else "a hook is set inside it" if hooked or hooked_inside(module)
            else f"its forward reads {sorted(read)}, which differ between members" if read
            else "its forward changes the module" if changed
            else "an input is no value of the graph" if None in in_nodes
            else _why_not(region, tensors, outputs, out_leaves, module, own_nodes)
        )
        if t.why_not:
            log.debug("capture: %s traced call by call: %s", kind.members[i], t.why_not)
            return out
        for j, node in enumerate(in_nodes):
            node.meta.setdefault(_INPUT, {}).setdefault(id(t), j)  # type: ignore[union-attr]
        for j, x in enumerate(outputs):
            node = _proxy_node(x, tracer)
            if node is None:
                t.why_not = "an output is no value of the graph"
                return out
            node.meta.setdefault(_OUTPUT, {}).setdefault(id(t), []).append(j)
        for n in region:
            n.meta[_REGION] = id(t)
        return out

    # -- after the trace ---------------------------------------------------------------------

    def expand(self, root: fx.GraphModule) -> int:
        """Replace every stand-in node of ``root``'s graph by a copy of its template's nodes, and
        give it the shells' tensors; the number of copies."""
        graph = root.graph
        add_tensors(graph, root, self.model, self.shelled)
        by_id = {id(t): t for t in self.templates.values()}
        regions: dict[int, list[fx.Node]] = {k: [] for k in by_id}
        inputs: dict[int, dict[fx.Node, int]] = {k: {} for k in by_id}
        outputs: dict[int, dict[int, fx.Node]] = {k: {} for k in by_id}
        stand_ins: list[fx.Node] = []
        for n in graph.nodes:
            if _REGION in n.meta:
                regions[n.meta[_REGION]].append(n)
            for t, idx in n.meta.get(_INPUT, {}).items():
                inputs[t][n] = idx
            for t, idx in n.meta.get(_OUTPUT, {}).items():
                for j in idx:
                    outputs[t][j] = n
            if n.target is torch.ops.rannc_fx.repeated_call.default:
                stand_ins.append(n)
        for key, t in by_id.items():
            # export drops dead nodes (SymInt checks the trace evaluated), nothing else
            if not t.why_not and (len(regions[key]) > t.regions or len(inputs[key]) != t.inputs
                                  or len(outputs[key]) != len(t.outputs)
                                  or any(n.op != "call_function" for n in regions[key])):
                raise RepeatError(
                    f"the template of {t.kind.members[t.member]} lost nodes: {len(regions[key])} "
                    f"of {t.regions} in its region, {len(inputs[key])} of {t.inputs} inputs, "
                    f"{len(outputs[key])} of {len(t.outputs)} outputs")
        copier = TemplateCopier(self.model, graph)
        for node in stand_ins:
            call = self.calls[node.args[1]]  # type: ignore[index]
            t = call.template
            key = id(t)
            copier.copy(node, t, call.member, regions[key], inputs[key], outputs[key])
        for sub in root.modules():  # export moves grad-mode regions into submodules
            if sub is not root and isinstance(sub, fx.GraphModule) and any(
                    n.target is torch.ops.rannc_fx.repeated_call.default for n in sub.graph.nodes):
                raise RepeatError("a stand-in is inside a nested graph")
        for n in graph.nodes:
            for tag in (_REGION, _INPUT, _OUTPUT):
                n.meta.pop(tag, None)
        return len(stand_ins)


class _StandIn:
    """A member's ``forward`` while the capture runs (a class, so that it pickles by name)."""

    def __init__(self, owner: RepeatedCapture, kind: int, member: int, forward: Any) -> None:
        self.owner, self.kind, self.member, self.forward = owner, kind, member, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.call(self.kind, self.member, self.forward, args, kwargs)


def _call_key(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    """What a call's graph depends on besides the module: its inputs' metadata and plain values,
    which inputs are the same tensor, grad mode and autocast; None when an input is neither a
    tensor nor plain data."""
    first: dict[int, int] = {}
    storages: dict[StorageWeakRef, int] = {}
    parts: list[Any] = [spec, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                        autocast_state()]
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            storage = StorageWeakRef(x.untyped_storage())
            parts.append((
                "t", tuple(_sym_key(s) for s in x.shape), tuple(_sym_key(s) for s in x.stride()),
                _sym_key(x.storage_offset()), x.dtype, x.device, x.layout, x.requires_grad,
                type(x), first.setdefault(id(x), i), storages.setdefault(storage, i)))
        elif x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
            parts.append(("v", type(x), x))
        else:  # a SymInt, a cache object: the call may change it or depend on its state
            return None
    return tuple(parts)


def _sym_key(s: Any) -> Any:
    return ("s", s.node.expr) if isinstance(s, torch.SymInt) else int(s)


def _state(module: nn.Module) -> list[Any]:
    """What a forward could change in its module tree, by identity."""
    return [(id(m), [(k, id(v)) for k, v in vars(m).items()],
             [id(v) for v in (*m._parameters.values(), *m._buffers.values(), *m._modules.values())])
            for m in module.modules()]


def _why_not(region: list[fx.Node], inputs: list[torch.Tensor], outputs: list[torch.Tensor],
             out_leaves: list[Any], module: nn.Module, own_nodes: set[fx.Node | None]) -> str:
    """Why the template's nodes cannot stand for later calls, or ''. ``own_nodes`` are the
    graph values of the module's tensors before the call."""
    # A copy may write what it makes and its own module's tensors (batch norm's statistics)
    made = set(region) | own_nodes
    for n in region:
        if n.op != "call_function":
            return f"it traced a {n.op} node ({n.name})"
        target = n.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            return f"it traced {target}"
        if isinstance(target, torch._ops.OpOverload):
            for i, arg in enumerate(target._schema.arguments):
                value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                written = arg.alias_info is not None and arg.alias_info.is_write
                if written and isinstance(value, fx.Node) and value not in made:
                    return f"{n.name} ({target}) writes to {value.name}, made outside it"
        elif not _is_symbolic_function(target):
            return f"it traced a call of {target}"
    own = {StorageWeakRef(x.untyped_storage())
           for x in (*inputs, *module.parameters(), *module.buffers())}
    seen: set[StorageWeakRef] = set()
    for x in outputs:  # the stand-in's outputs are new tensors: these must be too
        storage = StorageWeakRef(x.untyped_storage())
        if storage in own or storage in seen:
            return "an output is a view of an input, a parameter or another output"
        seen.add(storage)
    for x in out_leaves:
        if not (x is None or isinstance(x, (bool, int, float, str, torch.Tensor))):
            return f"it returns a {type(x).__name__}"
    return ""


def _is_symbolic_function(target: object) -> bool:
    """Python arithmetic on SymInts (``operator.mul``, ``math.ceil``, ``torch.sym_max``)."""
    where = getattr(target, "__module__", None)
    return where in ("_operator", "math") or (
        where == "torch" and getattr(target, "__name__", "").startswith("sym_"))


def _proxy_node(x: torch.Tensor, tracer: Any) -> fx.Node | None:
    proxy = get_proxy_slot(x, tracer, None)
    return None if proxy is None else proxy.proxy.node
