"""Every value's shape as a formula in the sample count, from one symbolic propagation.

torch.export propagates symbolic sizes while it traces: each node's ``meta["val"]`` is a fake
tensor whose batch dimension is a SymInt (``s0``) and whose other sizes are ints or formulas in
it (``512*s0`` after a ``view``). For any other graph (torch.fx, or a call under another
autocast state than the capture's) one FakeTensor run with a symbolic batch gives the same
(``shapes``). Either way every size is known at every sample count by evaluating a formula:
nothing runs again per size.

What a fake value from torch.export does not say is found per distinct op, not per node:
whether an op's outputs require grad (export traces below autograd) comes from running each
distinct *signature* (op, argument shapes as formulas, dtypes, which inputs require grad) once
on fake tensors at the example's size. The signature is also the profile's cost key: nodes that
share it cost the same at every size, and which input an output views is part of that cost
(``OpCost.views``), so the storages a node's tensors live in are never read off fake values
(copies of one layer may share their template's; export renames symbols in storage sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..profile.cache import arg_sig, module_sig, qualname
from ..profile.instruments import differentiable, tensors
from ..profile.noderun import NodeRunner

__all__ = ["Label", "Leaf", "NoFormulas", "SymbolicValues", "batch_symbols", "size_symbols"]

Label = tuple[str, int]  # a tensor: (the node that made it, which of its output leaves)
_STATE_REF: Label = ("<state>", 0)  # parameters, buffers and constants: never an activation


class NoFormulas(Exception):
    """The graph's sizes are not formulas in the sample count alone (the caller falls back)."""


@dataclass(frozen=True)
class Leaf:
    """A tensor leaf of a value at one sample count: what the shape fit reads."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class SymbolicValues:
    """The symbolic value of every placeholder and call node, and per call node its signature
    and its outputs' requires_grad; any size evaluated at any sample count.

    ``vals`` maps node names to what propagation produced (fake tensors with SymInt sizes,
    SymInts, tuples of them, constants); ``batch`` are the symbols of the inputs' batch
    dimension, each standing for the sample count; ``sizes`` the symbols of the inputs' other
    dynamic dimensions (a sequence length), each with the example's size and where it is
    read (input index, dimension): costs and memory are evaluated at the example's sizes.
    Built by walking the graph once.
    """

    def __init__(self, gm: fx.GraphModule, vals: dict[str, Any], batch: frozenset[sympy.Symbol],
                 *, hint: int, flat_inputs: list[Any], runner: NodeRunner, source: str,
                 sizes: dict[sympy.Symbol, tuple[int, int, int]] | None = None) -> None:
        self.gm, self.vals, self.batch, self.hint, self.source = gm, vals, batch, hint, source
        self.sizes = dict(sizes or {})
        self._fixed = {sym: size for sym, (size, _, _) in self.sizes.items()}
        self._known = self.batch | frozenset(self.sizes)
        self._ints: dict[tuple[Any, int], int] = {}
        self._texts: dict[Any, str] = {}
        self.signatures: dict[str, str] = {}
        self.requires_grad: dict[str, tuple[bool, ...]] = {}
        self._leaves: dict[Label, torch.Tensor] = {}
        self._modules: dict[int, str] = {}  # module signatures, by id
        self._inputs: dict[str, list[Label]] = {}
        self._walk(flat_inputs, runner)

    # -- evaluating formulas -------------------------------------------------------------------

    def int_at(self, x: Any, samples: int) -> int:
        """An int, or a SymInt's formula evaluated at ``samples`` samples (and the example's
        size of every other dynamic dimension)."""
        if not isinstance(x, torch.SymInt):
            return int(x)
        key = (x.node.expr, samples)
        if key not in self._ints:
            expr = self.expr(x)
            subs = {sym: samples if sym in self.batch else self._fixed[sym]
                    for sym in expr.free_symbols}
            self._ints[key] = int(expr.xreplace(subs))
        return self._ints[key]

    def expr(self, x: torch.SymInt) -> sympy.Expr:
        """A SymInt's formula in the inputs' symbols (NoFormulas where it has others: a size
        that depends on tensor values)."""
        expr = x.node.expr
        if not expr.free_symbols <= self._known:
            expr = simplified(x)
            extra = expr.free_symbols - self._known
            if extra:
                raise NoFormulas(f"size {expr} depends on {sorted(map(str, extra))}, not on the "
                                 "inputs' sizes alone")
        return expr

    def value_at(self, name: str, samples: int) -> Any:
        """Node ``name``'s value at ``samples`` samples: tensors as :class:`Leaf`, sizes as ints."""
        flags = iter(self.requires_grad.get(name, ()))

        def at(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return Leaf(tuple(self.int_at(d, samples) for d in x.shape), x.dtype,
                            next(flags, False))
            if isinstance(x, torch.SymInt):
                return self.int_at(x, samples)
            if isinstance(x, torch.SymFloat | torch.SymBool):
                raise NoFormulas(f"node {name} is a {type(x).__name__} ({x})")
            return x

        val = self.vals[name]
        if isinstance(val, torch.Tensor | torch.SymInt | int):  # most nodes: no pytree walk
            return at(val)
        return pytree.tree_map(at, val)

    def fake_args(self, node: fx.Node, samples: int, runner: NodeRunner) -> tuple[Any, Any]:
        """``node``'s args and kwargs as fake tensors (and ints) at ``samples`` samples."""
        made: dict[fx.Node, Any] = {}

        def build(n: fx.Node) -> Any:
            if n not in made:
                if n.op == "get_attr":
                    made[n] = runner.attr(str(n.target))
                else:
                    flags = iter(self.requires_grad.get(n.name, ()))
                    made[n] = pytree.tree_map(
                        lambda x, flags=flags: self._fake(x, samples, runner, flags), self.vals[n.name]
                    )
            return made[n]

        return fx.node.map_arg((node.args, node.kwargs), build)

    def _fake(self, x: Any, samples: int, runner: NodeRunner, flags: Any) -> Any:
        if isinstance(x, torch.Tensor):
            shape = [self.int_at(d, samples) for d in x.shape]
            stride = [self.int_at(d, samples) for d in x.stride()]
            t = torch.empty_strided(shape, stride, dtype=x.dtype, device=runner.home)
            if next(flags, False) and differentiable(t):
                t.requires_grad_(True)
            return t
        if isinstance(x, torch.SymInt):
            return self.int_at(x, samples)
        return x

    # -- the walk ------------------------------------------------------------------------------

    def _walk(self, flat_inputs: list[Any], runner: NodeRunner) -> None:
        """Signature and requires_grad of every node (each signature runs once), and every
        size checked to be a formula in the sample count."""
        facts: dict[str, tuple[bool, ...]] = {}
        grad = True  # grad mode, as ``_set_grad_enabled`` nodes leave it
        it = iter(flat_inputs)
        with runner.session():
            for node in self.gm.graph.nodes:
                if node.op == "placeholder":
                    t = next(it)
                    self.requires_grad[node.name] = (isinstance(t, torch.Tensor) and t.requires_grad,)
                elif node.op not in ("get_attr", "output"):
                    if node.target is torch._C._set_grad_enabled:
                        grad = bool(node.args[0])
                    sig = self._signature(node, grad)
                    self.signatures[node.name] = sig
                    if sig not in facts:
                        facts[sig] = self._run_once(node, runner, grad)
                    self.requires_grad[node.name] = facts[sig]
                for t in tensors(self.vals.get(node.name)):  # formulas only: NoFormulas now
                    for d in (*t.shape, *t.stride()):
                        self.int_at(d, self.hint)

    def _run_once(self, node: fx.Node, runner: NodeRunner, grad: bool) -> tuple[bool, ...]:
        """Whether each output tensor requires grad, from one run at the example's size."""
        args, kwargs = self.fake_args(node, self.hint, runner)
        out = runner.run(runner.call(node, args, kwargs), grad=grad)
        flags = tuple(t.requires_grad for t in tensors(out))
        produced = tensors(self.vals.get(node.name))
        if len(produced) != len(flags):
            raise NoFormulas(f"node {node.name} returns {len(flags)} tensors run alone but "
                             f"{len(produced)} in the propagated graph")
        return flags

    def inputs_of(self, node: fx.Node) -> list[Label]:
        """The tensor leaf each tensor ``node`` reads comes from, ``(producer, leaf)``, in the
        order of ``tensors((args, kwargs))``; parameters, buffers and constants are state."""
        if node.name not in self._inputs:
            self._inputs[node.name] = self._input_refs(node)
        return self._inputs[node.name]

    def _input_refs(self, node: fx.Node) -> list[Label]:
        def refs(n: fx.Node) -> Any:
            if n.op == "get_attr":
                return [_Ref(_STATE_REF) for _ in tensors(attrgetter(str(n.target))(self.gm))]
            it = iter(range(len(tensors(self.vals[n.name]))))
            return pytree.tree_map(
                lambda x: _Ref((n.name, next(it))) if isinstance(x, torch.Tensor) else None,
                self.vals[n.name],
            )

        tree = fx.node.map_arg((node.args, node.kwargs), refs)
        return [x.ref for x in pytree.tree_leaves(tree) if isinstance(x, _Ref)]

    def nbytes_at(self, ref: Label, samples: int) -> int:
        """Bytes of the storage node ``ref[0]``'s tensor leaf ``ref[1]`` made, at ``samples``:
        what its sizes and strides span (a fake value's own storage size may be written in
        symbols that the export renamed since)."""
        if ref not in self._leaves:
            self._leaves[ref] = tensors(self.vals[ref[0]])[ref[1]]
        t = self._leaves[ref]
        sizes = [self.int_at(d, samples) for d in t.shape]
        if 0 in sizes:
            return 0
        strides = [self.int_at(d, samples) for d in t.stride()]
        return (1 + sum((n - 1) * st for n, st in zip(sizes, strides, strict=True))) * t.element_size()

    @staticmethod
    def is_state(ref: Label) -> bool:
        return ref == _STATE_REF

    # -- signatures ----------------------------------------------------------------------------

    def _signature(self, node: fx.Node, grad: bool) -> str:
        """Equal for two nodes exactly when they run the same op on the same formulas."""
        if node.op == "call_module":
            op = "module:" + module_sig(self.gm.get_submodule(str(node.target)), self._modules)
        elif node.op == "call_method":
            op = f"method:{node.target}"
        else:
            op = qualname(node.target)
        args = self._sig((node.args, node.kwargs))
        return f"{op}|{args}|{'' if grad else 'no_grad'}"

    def _sig(self, x: Any) -> str:
        if isinstance(x, fx.Node):
            if x.op == "get_attr":
                return arg_sig(attrgetter(str(x.target))(self.gm), self._modules)
            flags = iter(self.requires_grad.get(x.name, ()))
            return self._val_sig(self.vals.get(x.name), flags)
        if isinstance(x, list | tuple):
            inner = ",".join(self._sig(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        if isinstance(x, dict):
            return "{" + ",".join(f"{k!r}:{self._sig(v)}" for k, v in sorted(x.items())) + "}"
        return arg_sig(x, self._modules)

    def _val_sig(self, v: Any, flags: Any) -> str:
        if isinstance(v, torch.Tensor):
            dtype = str(v.dtype).removeprefix("torch.")
            return (f"T({dtype},{self._dims(v.shape)},{self._dims(v.stride())},"
                    f"{int(next(flags, False))})")
        if isinstance(v, torch.SymInt):
            return f"I({self._text(v)})"
        if isinstance(v, list | tuple):
            inner = ",".join(self._val_sig(x, flags) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner})"
        return arg_sig(v, self._modules)

    def _dims(self, dims: Any) -> str:
        return "(" + ",".join(self._text(d) for d in dims) + ")"

    def _text(self, d: Any) -> str:
        if not isinstance(d, torch.SymInt):
            return str(d)
        expr = d.node.expr
        if expr not in self._texts:
            self._texts[expr] = str(expr)
        return self._texts[expr]


@dataclass(frozen=True)
class _Ref:
    ref: Label


def size_symbols(vals: list[Any], flat_inputs: list[Any],
                 batch: frozenset[sympy.Symbol]) -> dict[sympy.Symbol, tuple[int, int, int]]:
    """The symbols of the inputs' dimensions other than the batch's: each with the example's
    size and the first (input index, dimension) that has it. A dimension whose size is a
    constant (the capture pinned it) or another formula has none of its own."""
    out: dict[sympy.Symbol, tuple[int, int, int]] = {}
    for i, (v, t) in enumerate(zip(vals, flat_inputs, strict=True)):
        if not isinstance(v, torch.Tensor) or not isinstance(t, torch.Tensor):
            continue
        for d, size in enumerate(v.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = simplified(size)
            if isinstance(expr, sympy.Symbol) and expr not in batch and expr not in out:
                out[expr] = (int(t.shape[d]), i, d)
    return out


def simplified(x: torch.SymInt) -> sympy.Expr:
    """``x``'s formula with what its shape environment learned substituted (``x = y`` from a
    guard); as it is where ``x`` has no environment."""
    env = x.node.shape_env
    return x.node.expr if env is None else env.replace(x.node.expr)


def batch_symbols(vals: list[Any], batch_dim: int, batched: list[bool]) -> frozenset[sympy.Symbol]:
    """The symbols of the batched inputs' batch dimension (``batched[i]``: input i has one)."""
    out: set[sympy.Symbol] = set()
    for i, (v, has) in enumerate(zip(vals, batched, strict=True)):
        if not has or not isinstance(v, torch.Tensor):
            continue
        d = v.shape[batch_dim]
        if not isinstance(d, torch.SymInt) or not isinstance(d.node.expr, sympy.Symbol):
            raise NoFormulas(f"input {i}'s batch dimension is {d}, not a symbol of its own")
        out.add(d.node.expr)
    if not out:
        raise NoFormulas("no input has a symbolic batch dimension")
    return frozenset(out)
