"""Empty shells for the later members of a repeated kind, so that export does not lift their tensors.

Non-strict torch.export lifts every parameter and buffer of the model into a graph input,
fakes it, and ``ExportedProgram.module()`` turns each back into an attribute: per tensor work
that grows with the layers even when a layer costs one stand-in node. While export runs, a
member whose calls are all stood in (``capture/repeat``) is replaced in its parent by a
*shell*: an object of its class with its plain attributes and none of its tensors or
children. After export ``add_tensors`` puts the shells' ``get_attr`` nodes where a plain
export puts them (all of the model's tensors at the top, in the model's order) and their
tensors on the graph module.

A member is shelled only when the model reaches it, and its tensors, by one path alone (a
module or a tensor shared with the rest of the model would still be lifted through the other).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import chain

import torch
from torch import fx, nn

__all__ = ["add_tensors", "can_shell", "shells"]


def can_shell(model: nn.Module, paths: list[str]) -> bool:
    """Whether the modules at ``paths`` and their tensors are reachable from ``model`` only there."""
    inside = tuple(p + "." for p in paths)
    owners: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        owners[id(m)] = owners.get(id(m), 0) + 1
    if any(owners[id(model.get_submodule(p))] != 1 for p in paths):
        return False
    seen_inside: set[int] = set()
    seen_outside: set[int] = set()
    for name, t in chain(model.named_parameters(remove_duplicate=False),
                         model.named_buffers(remove_duplicate=False)):
        (seen_inside if name.startswith(inside) else seen_outside).add(id(t))
    return not seen_inside & seen_outside


@contextlib.contextmanager
def shells(model: nn.Module, paths: list[str], forwards: list[object]) -> Iterator[None]:
    """Replace the module at each of ``paths`` by a shell whose ``forward`` is ``forwards[i]``."""
    placed: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for path, forward in zip(paths, forwards, strict=True):
            parent_name, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_name)
            real = parent._modules[name]
            assert real is not None
            shell = object.__new__(type(real))
            shell.__dict__.update(real.__dict__)
            shell.__dict__.update(_parameters={}, _buffers={}, _modules={},
                                  _non_persistent_buffers_set=set(), forward=forward)
            parent._modules[name] = shell
            placed.append((parent, name, real))
        yield
    finally:
        for parent, name, real in reversed(placed):
            parent._modules[name] = real


def add_tensors(graph: fx.Graph, root: nn.Module, model: nn.Module,
                shelled: dict[str, str]) -> None:
    """Give ``graph`` a ``get_attr`` node, and ``root`` the tensor, for every parameter and buffer
    of the shells (``shelled`` maps a shell's path to its kind's traced member's); order the
    model's ``get_attr`` nodes as the model orders them."""
    order: dict[str, int] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name in chain(params, buffers):
        order.setdefault(name, len(order))
    nodes = [n for n in graph.nodes if n.op == "get_attr" and n.target in order]
    if not nodes or not shelled:
        return
    by_name = {str(n.target): n for n in nodes}
    first = nodes[0]
    with graph.inserting_before(first):
        for name in order:
            path = _shell_of(name, shelled)
            if path is None:
                continue
            _register(root, model, name, params.get(name), buffers.get(name))
            node = graph.create_node("get_attr", name)  # registered above
            # the traced member's tensor has the same metadata: share its fake value
            twin = by_name.get(shelled[path] + name[len(path):])
            if twin is not None:
                node.meta.update(twin.meta)
            nodes.append(node)
    nodes.sort(key=lambda n: order[str(n.target)])
    anchor = first.prev
    for n in nodes:
        anchor.append(n)
        anchor = n


def _shell_of(name: str, shelled: dict[str, str]) -> str | None:
    """The shell path that ``name`` lies under, if any."""
    path = name
    while "." in path:
        path = path.rpartition(".")[0]
        if path in shelled:
            return path
    return None


def _register(root: nn.Module, model: nn.Module, name: str, param: torch.Tensor | None,
              buffer: torch.Tensor | None) -> None:
    *path, attr = name.split(".")
    owner = root
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]  # type: ignore[assignment]
    if param is not None:
        owner.register_parameter(attr, param)  # type: ignore[arg-type]
    else:
        model_owner = model.get_submodule(".".join(path))
        persistent = attr not in model_owner._non_persistent_buffers_set
        owner.register_buffer(attr, buffer, persistent=persistent)
