"""Group a model's submodules into kinds: modules that provably trace to the same graph.

Two modules are of one kind when everything their ``forward`` can see is the same: the class
(hence the code), the training flag, no hooks, the same parameter and buffer names, shapes,
dtypes, devices and ``requires_grad``, the same non-plain attributes (configs, functions,
tensors: the same object), and the same children, recursively. Plain attributes (numbers,
strings, None, tuples of them) may differ, such as the ``layer_idx`` every transformers
attention layer carries: those that differ are *watched*, and ``watch_reads`` records whether
tracing the kind's first instance read any of them. One that was read may shape the graph,
so the kind is then traced instance by instance; one never read cannot.

Only modules with children are grouped (a leaf module is one or two ops, as cheap to trace as
to copy), and only the outermost: the layers of an encoder, not also their sublayers. A
container that cannot be called (``nn.ModuleDict``, ``nn.ModuleList``) is no member: the code
around it reads into it (``self.lora_A[name](x)``, ``name in self.lora_A``), and a stand-in
answers calls only, so an empty shell of it would silently drop what it holds (PEFT's LoRA
layers skip an adapter that is not in the dict).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

__all__ = ["Kind", "find_kinds", "hooked_inside", "watch_reads"]

# nn.Module's own bookkeeping in ``__dict__``: compared below on their own terms, not as attributes.
_MODULE_INTERNALS = frozenset(vars(nn.Module()).keys())
_HOOKS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


@dataclass
class Kind:
    """Modules that trace to one graph, unless the first one's trace reads a ``watched`` attribute.

    ``members`` are the qualified names in the model, in ``named_modules`` order; ``watched``
    holds ``(path inside the member, attribute)`` of the plain attributes whose values differ
    between members.
    """

    members: list[str]
    modules: list[nn.Module]
    watched: set[tuple[str, str]] = field(default_factory=set)


def find_kinds(model: nn.Module) -> list[Kind]:
    """The kinds of ``model``'s outermost repeated submodules (two or more members each);
    none while a global module hook is set (it would run for a stand-in, not inside it)."""
    if _global_hooks():
        return []
    signatures: dict[int, Hashable | None] = {}
    plain: dict[int, dict[tuple[str, str], Any]] = {}
    _signature(model, signatures, plain)
    counts: dict[Hashable, int] = {}
    for name, m in model.named_modules():
        sig = signatures[id(m)]
        if name and sig is not None and next(m.children(), None) is not None:
            counts[sig] = counts.get(sig, 0) + 1
    groups: dict[Hashable, Kind] = {}
    chosen: set[str] = set()
    for name, m in model.named_modules():
        sig = signatures[id(m)]
        if not name or sig is None or counts.get(sig, 0) < 2 or not _callable(m):
            continue
        parts = name.split(".")
        if any(".".join(parts[:i]) in chosen for i in range(1, len(parts))):
            continue  # inside a module that is itself repeated
        chosen.add(name)
        kind = groups.setdefault(sig, Kind([], []))
        kind.members.append(name)
        kind.modules.append(m)
    kinds = [k for k in groups.values() if len(k.members) >= 2]
    for kind in kinds:
        values = [plain[id(m)] for m in kind.modules]
        kind.watched = {key for key in values[0] if any(v[key] != values[0][key] for v in values)}
    return kinds


def _callable(m: nn.Module) -> bool:
    """Whether ``m`` has a forward of its own (containers have nn.Module's, which raises)."""
    return type(m).forward is not nn.Module.forward


def hooked_inside(module: nn.Module) -> bool:
    """Whether a hook would run inside ``module``'s forward (one may be added during a call,
    as transformers does to record each layer's outputs): on a submodule, or a global one."""
    return _global_hooks() or any(
        getattr(m, h, None) for m in module.modules() if m is not module for h in _HOOKS)


def _global_hooks() -> bool:
    return any(getattr(nn_module, f"_global_{h}", None) for h in (
        "forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks"))


def _signature(m: nn.Module, out: dict[int, Hashable | None],
               plain: dict[int, dict[tuple[str, str], Any]]) -> Hashable | None:
    """What ``m``'s forward can see, as a hashable value, or None when ``m`` has hooks.

    Plain attributes are left out of the signature and collected into ``plain[id(m)]``, keyed
    by (path inside ``m``, name), for ``find_kinds`` to compare.
    """
    if id(m) in out:
        return out[id(m)]
    mine: dict[tuple[str, str], Any] = {}
    parts: list[Any] = [type(m), m.training]
    # an instance's own forward is not its class's code (and capture replaces it for a while)
    ok = "forward" not in vars(m) and not any(getattr(m, h, None) for h in _HOOKS)
    for name, value in sorted(vars(m).items(), key=lambda kv: kv[0]):
        if name in _MODULE_INTERNALS:
            continue
        key = _plain_key(value)
        if key is not None:
            mine[("", name)] = key
            parts.append((name, "plain"))  # the value may differ, the attribute must exist
        else:  # a config, a function, a tensor: the very same object, or not the same module
            parts.append((name, "id", id(value)))
    parts.append(tuple(sorted(m._non_persistent_buffers_set)))
    for kind, tensors in (("p", m._parameters), ("b", m._buffers)):
        for name, t in tensors.items():
            parts.append((kind, name, None if t is None else _tensor_key(t)))
    for name, child in m._modules.items():
        if child is None:
            parts.append((name, None))
            continue
        sig = _signature(child, out, plain)
        ok = ok and sig is not None
        parts.append((name, sig))
        for (path, attr), v in plain[id(child)].items():
            mine[(f"{name}.{path}" if path else name, attr)] = v
    sig = tuple(parts) if ok else None
    out[id(m)], plain[id(m)] = sig, mine
    return sig


def _tensor_key(t: torch.Tensor) -> Hashable:
    return (type(t), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad,
            t.layout)


def _plain_key(value: Any) -> Hashable | None:
    """``value`` as a comparable key when it is plain data (numbers, strings, dtypes, tuples of
    them), else None."""
    if isinstance(value, _PLAIN) or isinstance(value, (torch.dtype, torch.device)):
        return (type(value), value)
    if isinstance(value, (tuple, list, frozenset)):
        keys = [_plain_key(v) for v in value]
        return None if any(k is None for k in keys) else (type(value), tuple(keys))
    return None


@contextlib.contextmanager
def watch_reads(module: nn.Module, watched: set[tuple[str, str]]) -> Iterator[set[tuple[str, str]]]:
    """Record which ``watched`` attributes of ``module``'s submodules are read inside the block.

    The attributes leave the instances' ``__dict__`` for the block, so a read falls through to
    the class's ``__getattr__``, which is wrapped for the block to record it and answer the
    value. Assignments inside the block are recorded as reads too (the module changed itself).
    """
    read: set[tuple[str, str]] = set()
    stash: dict[tuple[int, str], tuple[str, Any]] = {}
    classes: dict[type, Any] = {}
    orders: dict[str, list[str]] = {}  # to put the attributes back in their places
    for path, attr in watched:
        sub = module.get_submodule(path)
        orders.setdefault(path, list(sub.__dict__))
        stash[(id(sub), attr)] = (path, sub.__dict__.pop(attr))
        cls = type(sub)
        if cls not in classes:
            classes[cls] = cls.__dict__.get("__getattr__")
            cls.__getattr__ = _recording_getattr(cls.__getattr__, stash, read)  # type: ignore[method-assign]
    try:
        yield read
    finally:
        for cls, own in classes.items():
            if own is None:
                del cls.__getattr__
            else:
                cls.__getattr__ = own  # type: ignore[method-assign]
        for (_, attr), (path, value) in stash.items():
            sub = module.get_submodule(path)
            if attr in sub.__dict__:
                read.add((path, attr))
            sub.__dict__[attr] = value
        for path, order in orders.items():
            d = module.get_submodule(path).__dict__
            items = {k: d[k] for k in order if k in d} | d
            d.clear()
            d.update(items)


def _recording_getattr(original: Any, stash: dict[tuple[int, str], tuple[str, Any]],
                       read: set[tuple[str, str]]) -> Any:
    def __getattr__(self: nn.Module, name: str) -> Any:
        hit = stash.get((id(self), name))
        if hit is None:
            return original(self, name)
        read.add((hit[0], name))
        return hit[1]

    return __getattr__
