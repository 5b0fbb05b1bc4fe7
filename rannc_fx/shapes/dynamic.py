"""Which input dimensions a plan lets a call change, and the formulas the runtime sizes with.

The capture keeps an input dimension symbolic where the model allows any size (a sequence
length; ``trace_export``), and every value's sizes are formulas in those symbols
(``SymbolicValues``). The runtime sizes only what crosses a boundary: the model's inputs and
outputs and the cut values between stages, for each call's sizes (``Plan.at_sizes``). So
those values get their formulas as polynomials in the sample count and the dynamic
dimensions (``values.Formula``); each stage's graph computes its other sizes itself.

A dimension stays pinned at the example's size (a call must pass that size, as with a
static capture) where ``Config.dynamic_dims`` leaves it out, or where a boundary value's size
is not a polynomial the runtime can evaluate (``s // 2``), or where the batch dimension of an
interleaved value depends on it (its layout is known only at the example's size).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from ..plan.values import SAMPLES, DynamicDim, Formula, ValueSpec
from ..progress import note
from .symbolic import SymbolicValues

__all__ = ["Dynamic", "dynamic_pass"]

log = logging.getLogger("rannc_fx")


@dataclass
class Dynamic:
    """The plan's dynamic dimensions, and the boundary values' specs with their formulas."""

    dims: tuple[DynamicDim, ...] = ()
    specs: dict[str, ValueSpec] = field(default_factory=dict)
    pinned: dict[str, str] = field(default_factory=dict)  # dimension -> why it is not dynamic


def dynamic_pass(
    formulas: SymbolicValues | None,
    values: dict[str, ValueSpec],
    sized: Iterable[str],
    input_names: list[str],
    *,
    wanted: Literal["auto", "batch"] | tuple[str, ...] = "auto",
) -> Dynamic:
    """The dynamic dimensions of a plan whose runtime sizes the values ``sized`` (inputs,
    cut values, outputs), and those values' specs with formulas where they depend on one.

    ``wanted`` is ``Config.dynamic_dims``; a name it gives that is no dynamic dimension of
    the capture raises ValueError listing the ones there are.
    """
    if formulas is None or not formulas.sizes or wanted == "batch":
        return Dynamic()
    names = {sym: f"{input_names[i]}.{d}" for sym, (_, i, d) in formulas.sizes.items()}
    if wanted != "auto":
        unknown = sorted(set(wanted) - set(names.values()))
        if unknown:
            raise ValueError(
                f"Config(dynamic_dims=...) names {unknown}, which are not dynamic dimensions of "
                f"this capture; it has {sorted(names.values()) or 'none'} (a dimension the "
                "model's code ties to the example's size cannot be dynamic)"
            )
    out = Dynamic()
    keep = {sym for sym, n in names.items() if wanted == "auto" or n in wanted}
    for sym in set(names) - keep:
        out.pinned[names[sym]] = "not in Config(dynamic_dims=...)"
    sized = list(dict.fromkeys(sized))
    while True:  # pinning a dimension can make another value's formula a polynomial
        found: dict[str, tuple[Formula, ...]] = {}
        pin: dict[sympy.Symbol, str] = {}
        for name in sized:
            spec = values[name]
            try:
                fs = _formulas(formulas, spec, formulas.vals.get(name), keep, names)
            except _NotPolynomial as e:
                for sym in e.symbols:
                    pin.setdefault(sym, f"{name}'s size {e.expr} is not a polynomial in it")
                continue
            if fs is not None:
                found[name] = fs
        if not pin:
            break
        for sym, why in pin.items():
            keep.discard(sym)
            out.pinned[names[sym]] = why
    used = {n for fs in found.values() for f in fs for _, ns in f for n in ns} - {SAMPLES}
    out.dims = tuple(
        DynamicDim(name=names[sym], input=i, dim=d, size=size)
        for sym, (size, i, d) in formulas.sizes.items() if sym in keep and names[sym] in used
    )
    out.specs = {name: values[name].model_copy(update={"formulas": fs}) for name, fs in found.items()}
    static = _static_dims(formulas, values, input_names, set(names.values()))
    if out.dims or out.pinned or static:
        note("shapes: dynamic dimension(s) %s%s%s",
             ", ".join(f"{d.name} <= {d.size}" for d in out.dims) or "none",
             "".join(f"; {n} pinned at the example's size ({why})"
                     for n, why in sorted(out.pinned.items())),
             f"; static (the model's code fixes them): {', '.join(static)}" if static else "")
    return out


def _static_dims(formulas: SymbolicValues, values: dict[str, ValueSpec], input_names: list[str],
                 dynamic: set[str]) -> list[str]:
    """The inputs' other dimensions of size 2 or more that are no symbol of their own (the
    capture made them constants), as ``name = size``; those that another's symbol sizes
    (an attention mask's length) are not listed."""
    out = []
    for name in input_names:
        spec, val = values[name], formulas.vals.get(name)
        if spec.kind != "tensor" or not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if d != spec.batch_dim and is_concrete_int(size) and int(size) >= 2 and (
                f"{name}.{d}" not in dynamic
            ):
                out.append(f"{name}.{d} = {int(size)}")
    return out


class _NotPolynomial(Exception):
    def __init__(self, expr: Any, symbols: set[sympy.Symbol]):
        super().__init__(str(expr))
        self.expr, self.symbols = expr, symbols


def _formulas(formulas: SymbolicValues, spec: ValueSpec, val: Any, keep: set[sympy.Symbol],
              names: dict[sympy.Symbol, str]) -> tuple[Formula, ...] | None:
    """The formulas of ``spec``'s sizes, or None where none depends on a kept dimension."""
    if spec.kind == "tensor" and isinstance(val, torch.Tensor):
        sizes: list[Any] = list(val.shape)
    elif spec.kind in ("int", "ints"):
        sizes = [x for x in pytree.tree_leaves(val) if isinstance(x, int | torch.SymInt)]
    else:
        return None
    if len(sizes) != (len(spec.shape) if spec.kind == "tensor" else len(spec.int_coeffs)):
        return None
    exprs = [formulas.expr(x) if isinstance(x, torch.SymInt) else sympy.Integer(x) for x in sizes]
    if not any(e.free_symbols & keep for e in exprs):
        return None
    samples = sympy.Dummy("samples")
    subs = {sym: samples if sym in formulas.batch else sympy.Integer(formulas.sizes[sym][0])
            for e in exprs for sym in e.free_symbols if sym not in keep}
    out = []
    for d, expr in enumerate(exprs):
        e = sympy.expand(expr.xreplace(subs))
        free = e.free_symbols & keep
        gens = [samples, *sorted(free, key=str)]
        try:
            poly = sympy.Poly(e, *gens)
        except sympy.PolynomialError:
            raise _NotPolynomial(expr, free) from None
        terms = []
        for powers, coeff in poly.terms():
            if not coeff.is_integer:
                raise _NotPolynomial(expr, free)
            terms.append((int(coeff), tuple(n for g, k in zip(gens, powers, strict=True)
                                            for n in [SAMPLES if g is samples else names[g]] * k)))
        degree = poly.degree(samples) if terms else 0
        if spec.kind == "tensor":
            batch = d == spec.batch_dim
            # the batch dimension holds whole samples; the others none
            proportional = all(ns.count(SAMPLES) == 1 for _, ns in terms)
            if (batch and not proportional) or (not batch and degree > 0):
                raise _NotPolynomial(expr, free)
            if batch and spec.interleaved and free:
                raise _NotPolynomial(f"{expr} (its samples' rows interleave)", free)
        elif degree > 1:
            raise _NotPolynomial(expr, free)
        out.append(tuple(sorted(terms, key=lambda t: (len(t[1]), t[1]))))
    return tuple(out)
