"""Copy a traced module's nodes for another module of its kind, in place of a stand-in node.

The template's nodes read three sorts of values from outside: the call's inputs, the
template module's own parameters and buffers (``get_attr`` nodes), and everything else (the
batch size as a SymInt, a constant, a tensor of a module outside). A copy reads the stand-in
call's inputs, the same-named tensors of its own module, and the very same everything-else:

    template   x ──linear(x, layer.0.q.weight)──▶ ... ──▶ out        (traced)
    stand-in   y ──repeated_call([y], 7)──▶ getitem ──▶ users
    copy       y ──linear(y, layer.5.q.weight)──▶ ... ──▶ out' ──▶ users

A SymInt the template computed from nothing of its own (``mul(sym_size_int_1, 5)`` for a
``x.shape[0] * 5`` the first layer needed) is read from the template, not recomputed:
torch.export makes such a node once, where the trace first needs it, and every later layer
reads it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .same import Kind

__all__ = ["RepeatError", "Template", "TemplateCopier"]

_STACK = "nn_module_stack"
_STACK_KEY = "L__self__"  # torch.export's key of a module path in ``nn_module_stack``


@dataclass
class Template:
    """The first call of a kind, as traced."""

    kind: Kind
    member: int
    call_key: Any
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # non-tensor leaves as returned; _Made / _Passed for tensors
    outputs: list[torch.Tensor]  # the tensors it made
    regions: int  # nodes the call added
    inputs: int  # distinct graph nodes it read as inputs
    why_not: str = ""  # why later calls must trace for themselves


class RepeatError(RuntimeError):
    """The graph is not as the capture recorded it; export again without stand-ins."""


@dataclass
class _Plan:
    nodes: list[fx.Node]  # the template's nodes to copy, in graph order (not the shared ones)
    tensors: dict[int, str]  # id of a template tensor -> its path inside the template module


class TemplateCopier:
    """Replaces stand-in nodes of one graph by copies of their templates."""

    def __init__(self, model: nn.Module, graph: fx.Graph) -> None:
        self.graph = graph
        self.tensors: dict[str, torch.Tensor] = {}
        self.names: dict[int, list[str]] = {}  # every name of a tensor, in the model's order
        for name, t in chain(model.named_parameters(remove_duplicate=False),
                             model.named_buffers(remove_duplicate=False)):
            self.tensors[name] = t
            self.names.setdefault(id(t), []).append(name)
        self.getattrs = {str(n.target): n for n in graph.nodes if n.op == "get_attr"}
        self.plans: dict[int, _Plan] = {}

    def copy(self, stand_in: fx.Node, template: Template, member: int, region: list[fx.Node],
             inputs: dict[fx.Node, int], outputs: dict[int, fx.Node]) -> None:
        """Put a copy of ``region`` for module ``member`` of the kind in place of ``stand_in``."""
        kind = template.kind
        plan = self._plan(template, region, inputs)
        mine = _named_tensors(kind.modules[member])
        args: list[fx.Node] = list(stand_in.args[0])  # type: ignore[arg-type]
        env: dict[fx.Node, fx.Node] = {}
        attrs: dict[fx.Node, fx.Node] = {}

        def remap(a: fx.Node) -> fx.Node:
            got = env.get(a)
            if got is not None:
                return got
            i = inputs.get(a)
            if i is not None:
                return args[i]
            if a.op == "get_attr":
                got = attrs.get(a)
                if got is None:
                    got = attrs[a] = self._own_attr(a, plan, mine)
                return got
            return a

        old_path, new_path = kind.members[template.member], kind.members[member]
        outer = _outer_stack(stand_in.meta.get(_STACK), new_path)
        stacks: dict[int, dict[str, Any]] = {}
        with self.graph.inserting_before(stand_in):
            for n in plan.nodes:
                new = self.graph.node_copy(n, remap)
                stack = n.meta.get(_STACK)
                if stack is not None and outer is not None:
                    if id(stack) not in stacks:
                        stacks[id(stack)] = _moved_stack(stack, outer, old_path, new_path)
                    new.meta[_STACK] = dict(stacks[id(stack)])
                env[n] = new
        for user in list(stand_in.users):
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                raise RepeatError(f"{user.name} reads the stand-in {stand_in.name} as a whole")
            user.replace_all_uses_with(remap(outputs[user.args[1]]))
            self.graph.erase_node(user)
        self.graph.erase_node(stand_in)

    def _plan(self, template: Template, region: list[fx.Node], inputs: dict[fx.Node, int]) -> _Plan:
        plan = self.plans.get(id(template))
        if plan is not None:
            return plan
        tensors = {id(t): name for name, t in _named_tensors(template.kind.modules[template.member]).items()}
        own: set[fx.Node] = set()  # nodes that read the template's inputs or tensors
        shared: set[fx.Node] = set()
        for n in region:
            reads = n.all_input_nodes
            if any(a in own or a in inputs or _is_tensor_of(a, tensors, self.tensors) for a in reads):
                own.add(n)
            elif _is_symbolic(n.meta.get("val")):
                shared.add(n)
        plan = self.plans[id(template)] = _Plan([n for n in region if n not in shared], tensors)
        return plan

    def _own_attr(self, a: fx.Node, plan: _Plan, mine: dict[str, torch.Tensor]) -> fx.Node:
        """The get_attr node of this module's tensor where the template read its own."""
        t = self.tensors.get(str(a.target))
        inner = None if t is None else plan.tensors.get(id(t))
        if t is None or inner is None:
            return a  # not the template module's: every copy reads the same
        names, theirs = self.names[id(t)], self.names[id(mine[inner])]
        if len(names) != len(theirs):
            raise RepeatError(f"{a.target} is tied {len(names)} ways, its copy {len(theirs)}")
        # torch.export reads a tied tensor under one of its names: take the same one
        name = theirs[names.index(str(a.target))]
        node = self.getattrs.get(name)
        if node is None:
            raise RepeatError(f"the graph has no get_attr node for {name}")
        return node


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(chain(module.named_parameters(remove_duplicate=False),
                      module.named_buffers(remove_duplicate=False)))


def _is_tensor_of(a: fx.Node, tensors: dict[int, str], model_tensors: dict[str, torch.Tensor]) -> bool:
    if a.op != "get_attr":
        return False
    t = model_tensors.get(str(a.target))
    return t is not None and id(t) in tensors


def _is_symbolic(val: Any) -> bool:
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _outer_stack(stack: dict[str, Any] | None, path: str) -> dict[str, Any] | None:
    """The stand-in's module stack down to (not including) the module it stands for."""
    if stack is None:
        return None
    return {k: v for k, v in stack.items() if not (v[0] == path or v[0].startswith(path + "."))}


def _moved_stack(stack: dict[str, Any], outer: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """A template node's module stack, moved from the template's path to the copy's."""
    moved = dict(outer)
    for path, cls in stack.values():
        if path == old or path.startswith(old + "."):
            path = new + path[len(old):]
            moved[_STACK_KEY + path] = (path, cls)
    return moved
