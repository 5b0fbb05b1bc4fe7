"""Which batched tensors interleave their samples' rows along the batch dimension, and how.

Read from the graph's ops and the fitted ValueSpecs alone, once propagation is done: a reshape
that moves rows in front of the batch dimension, a concatenation along it or a ``repeat`` of it
interleaves, and any other op inherits it from its inputs. An interleaved value cannot be
sliced by sample, so it never crosses a stage boundary (``ValueSpec.interleaved``).
"""

from __future__ import annotations

import math

from torch import fx, nn

from ..plan.values import ValueSpec

__all__: list[str] = []  # private to the shapes pass: _interleaves marks specs, _op_name names ops

# Ops that reinterpret the row-major order of their input; they keep samples contiguous only
# if the batch dimension stays outermost among the dimensions they merge or split.
_RESHAPES = frozenset(
    {"view", "reshape", "_unsafe_view", "view_copy", "_reshape_alias", "flatten", "unflatten",
     "view_as", "reshape_as"}
)
_CONCATS = frozenset({"cat", "concat", "concatenate"})


def _op_name(n: fx.Node, gm: nn.Module) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__.lower()
    if n.op == "call_method":
        return str(n.target)
    packet = getattr(n.target, "overloadpacket", None)
    return getattr(packet or n.target, "__name__", str(n.target))


def _interleaves(
    n: fx.Node, specs: dict[str, ValueSpec], gm: nn.Module
) -> tuple[bool, int | None]:
    """Whether ``n``'s output has rows of different samples alternating along the batch dim,
    and if so its layout: the number of sample-major blocks (``ValueSpec.interleave``), or
    None where the layout is not one this function can name.

    A reshape that moves rows in front of the batch dimension on one side only interleaves
    (``(seq, batch, h) -> (seq * batch, h)``: ``seq`` blocks), or undoes an interleaving of its
    input (the view back to ``(seq, batch, h)``); concatenating k batched tensors along the
    batch dimension (k blocks) and tiling it with ``repeat`` (one block per copy) interleave;
    any other op inherits it from its batched inputs.
    """
    no: tuple[bool, int | None] = (False, None)
    out = specs.get(n.name)
    if out is None or out.kind != "tensor" or out.batch_dim is None:
        return no
    rows = out.shape[out.batch_dim]
    op = _op_name(n, gm)
    batched_in = [
        specs[a.name] for a in n.all_input_nodes
        if a.name in specs and specs[a.name].kind == "tensor" and specs[a.name].batch_dim is not None
    ]
    inter_in = [v for v in batched_in if v.interleaved]
    blocks_in = {v.interleave for v in inter_in}
    inherited = (True, _fits(blocks_in.pop(), rows)) if len(blocks_in) == 1 else (
        (True, None) if inter_in else no
    )
    if op in _RESHAPES and n.args and isinstance(n.args[0], fx.Node):
        src = specs.get(n.args[0].name)
        if src is None or src.kind != "tensor" or src.batch_dim is None:
            return inherited
        before_in = math.prod(src.shape[: src.batch_dim])
        before_out = math.prod(out.shape[: out.batch_dim])
        if before_in == before_out:  # merges or splits after the batch dim: blocks stay
            return (True, _fits(src.interleave, rows)) if src.interleaved else no
        if src.interleaved:
            return no  # a view back (to ``(seq, batch, h)``) undoes the interleaving
        # rows in front of the batch dim merged into it: before_in / before_out blocks
        ok = before_in > before_out and before_in % before_out == 0
        return True, _fits(before_in // before_out, rows) if ok else None
    if op in _CONCATS and n.args and isinstance(n.args[0], (list, tuple)):
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        parts = [specs.get(a.name) for a in n.args[0] if isinstance(a, fx.Node)]
        joined = [p for p in parts if p is not None and p.kind == "tensor" and p.batch_dim is not None]
        if isinstance(dim, int) and dim % len(out.shape) == out.batch_dim and len(joined) > 1:
            plain = len(joined) == len(parts) and not any(p.interleaved for p in joined) and len(
                {p.shape[p.batch_dim] for p in joined if p.batch_dim is not None}
            ) == 1
            return True, _fits(len(joined), rows) if plain else None
    elif op == "repeat" and len(n.args) > 1:
        reps = n.args[1:] if isinstance(n.args[1], int) else n.args[1]
        if isinstance(reps, (list, tuple)) and len(reps) == len(out.shape):
            factor = reps[out.batch_dim]
            if isinstance(factor, int) and factor > 1:
                src = specs.get(n.args[0].name) if isinstance(n.args[0], fx.Node) else None
                inner = 1 if src is not None and not src.interleaved else (
                    src.interleave if src is not None else None
                )
                return True, _fits(factor * inner, rows) if inner is not None else None
    return inherited


def _fits(blocks: int | None, rows: int) -> int | None:
    """``blocks`` where it is a layout of ``rows`` rows per sample, else None (unknown)."""
    return blocks if blocks is not None and blocks >= 2 and rows % blocks == 0 else None
