"""The values torch.export found for a graph's nodes (fake tensors whose sizes are formulas in
the inputs' sizes), written down to travel with the graph and made again on arrival.

torch.export leaves each node's value in ``node.meta["val"]``: a fake tensor with SymInt
sizes (``s0``, ``512*s0``) from one shape environment. The shape pass reads its formulas
from them (``shapes/symbolic.py``); a graph without them takes one symbolic run on fake
tensors instead, many times the cost (1.05 s against 0.15 s to make them and read them for
the GPT example, 3.9 s against 0.28 s for a two-layer T5). ``write`` turns the values into
plain data: every size and stride as its formula (sympy, with what the environment learned
substituted), dtype, device, requires_grad, and each symbol's example size. ``made`` makes a
fresh shape environment with one symbol for each (renamed one to one: a name is the
environment's counter) and fake tensors of those sizes (one for values alike), so the graph
holds values as its sender's did. A fake tensor with symbolic sizes is not cheap to make, so
the receiver keeps the values written (``CapturedGraph.values``) until its shape pass asks:
a rank that plans nothing never makes them.

A graph whose values are not all of that kind (a size that depends on tensor values, a
symbolic float or bool, something else) travels without values: the receiver's shape
pass runs as it would for a torch.fx graph.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from .graph import CapturedGraph

__all__ = ["Values", "made", "moved", "write"]

log = logging.getLogger("rannc_fx")

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format,
          torch.layout)


@dataclass(frozen=True)
class _Tensor:
    """A fake tensor: sizes and strides as ints or formulas."""

    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class _Int:
    """A SymInt: its formula."""

    expr: sympy.Expr


@dataclass(frozen=True)
class Values:
    """Every node's value as formulas (node name -> a tree of ``_Tensor``, ``_Int`` and plain
    values), and each symbol's size in the example."""

    nodes: dict[str, Any]
    hints: dict[sympy.Symbol, int]


class _Unwritable(Exception):
    pass


def write(graph: fx.Graph) -> Values | None:
    """The graph's node values as plain data; None where a node has none (a torch.fx graph)
    or one that is not a fake tensor, SymInt or plain value."""
    hints: dict[sympy.Symbol, int] = {}

    def table(env: ShapeEnv) -> Any:  # the example sizes (a newer name on newer torch)
        backed = getattr(env, "backed_var_to_val", None)
        return env.var_to_val if backed is None else backed

    def formula(x: Any) -> Any:
        if not isinstance(x, torch.SymInt):
            return int(x)
        env = x.node.shape_env
        expr = x.node.expr if env is None else env.replace(x.node.expr)
        if expr.is_number:
            return int(expr)
        for sym in expr.free_symbols:
            hint = None if env is None else table(env).get(sym)
            if hint is None:  # an unbacked size: it depends on tensor values
                raise _Unwritable(f"{sym} has no example size")
            hints[sym] = int(hint)
        return expr

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _Tensor(tuple(map(formula, x.shape)), tuple(map(formula, x.stride())),
                           x.dtype, x.device, x.requires_grad)
        if isinstance(x, torch.SymInt):
            return _Int(formula(x))
        if isinstance(x, _PLAIN):
            return x
        raise _Unwritable(f"a value of type {type(x).__name__}")

    nodes: dict[str, Any] = {}
    try:
        for n in graph.nodes:
            if n.op == "output":
                continue
            if "val" not in n.meta:
                if n.op in ("placeholder", "call_function", "call_method", "call_module"):
                    return None
                continue
            nodes[n.name] = pytree.tree_map(leaf, n.meta["val"])
    except _Unwritable as e:
        log.debug("the graph's node values stay behind: %s", e)
        return None
    return Values(nodes, hints)


def moved(values: Values | None, there: torch.device, here: torch.device) -> Values | None:
    """``values`` with their tensors on ``here`` where they were on ``there``."""
    if values is None:
        return None

    def move(x: Any) -> Any:
        if isinstance(x, _Tensor) and x.device == there:
            return dataclasses.replace(x, device=here)
        return x

    return Values({name: pytree.tree_map(move, tree) for name, tree in values.nodes.items()},
                  values.hints)


def made(captured: CapturedGraph) -> None:
    """Each node's ``meta["val"]`` made from ``captured.values``, once (then None); where
    that fails, no node gets one (the shape pass then runs, as for a torch.fx graph)."""
    values, captured.values = captured.values, None
    if values is None:
        return
    try:
        vals = _make(values)
    except Exception as e:  # a torch whose fake tensors refuse a formula: the slow path
        log.debug("the graph's node values could not be made here (%s: %s)",
                  type(e).__name__, e)
        return
    for n in captured.gm.graph.nodes:
        if n.name in vals:
            n.meta["val"] = vals[n.name]


def _make(values: Values) -> dict[str, Any]:
    from torch._dynamo.source import ConstantSource  # here: importing torch._dynamo takes 2 s

    env = ShapeEnv(duck_shape=False)  # equal sizes are not the same dimension
    mode = FakeTensorMode(shape_env=env)
    renamed: dict[sympy.Symbol, sympy.Expr] = {}
    for sym in sorted(values.hints, key=str):
        new = env.create_symbol(values.hints[sym], source=ConstantSource(str(sym)),
                                dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True)
        if not isinstance(new, sympy.Symbol):
            raise ValueError(f"{sym} became {new}")
        renamed[sym] = new
    hints = {renamed[sym]: size for sym, size in values.hints.items()}
    ints: dict[sympy.Expr, Any] = {}

    def size(x: Any) -> Any:
        if isinstance(x, int):
            return x
        if x not in ints:
            expr = x.xreplace(renamed)
            ints[x] = env.create_symintnode(expr, hint=int(expr.xreplace(hints)))
        return ints[x]

    tensors: dict[_Tensor, torch.Tensor] = {}

    def make(x: Any) -> Any:
        if isinstance(x, _Int):
            return size(x.expr)
        if not isinstance(x, _Tensor):
            return x
        if x not in tensors:  # one for values alike: the shape pass reads no storage
            with mode:
                t = torch.empty_strided([size(d) for d in x.shape], [size(d) for d in x.stride],
                                        dtype=x.dtype, device=x.device)
            tensors[x] = t.requires_grad_(x.requires_grad) if x.requires_grad else t
        return tensors[x]

    return {name: pytree.tree_map(make, tree) for name, tree in values.nodes.items()}
