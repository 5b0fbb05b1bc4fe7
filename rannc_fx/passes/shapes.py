"""Infer every value's per-sample shape, batch dimension and integer formula (fake tensors)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils import _pytree as pytree

from ..plan import ValueSpec
from ..progress import Progress
from .capture import CapturedGraph, batch_size_of

__all__ = ["SAMPLE_COUNTS", "dtype_itemsize", "infer_values_pass", "inputs_for_samples"]

log = logging.getLogger("rannc_fx")

# Shape propagation runs at these sample counts: two fit a line, the third checks it. No 1:
# size-1 dimensions broadcast, so they hide which dimension is the batch.
SAMPLE_COUNTS = (2, 3, 5)

# Ops that reinterpret the row-major order of their input; they keep samples contiguous only
# if the batch dimension stays outermost among the dimensions they merge or split.
_RESHAPES = frozenset(
    {"view", "reshape", "_unsafe_view", "view_copy", "_reshape_alias", "flatten", "unflatten",
     "view_as", "reshape_as"}
)
_CONCATS = frozenset({"cat", "concat", "concatenate"})


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``"float32"``."""
    return getattr(torch, dtype).itemsize


def inputs_for_samples(
    flat_inputs: list[torch.Tensor], batch: int, samples: int, *, batch_dim: int = 0, fake: bool = False
) -> list[torch.Tensor]:
    """The model's flat inputs resized from ``batch`` to ``samples`` along ``batch_dim``.

    Tensors whose ``batch_dim`` size is ``batch`` are the batched ones: real inputs are sliced
    (or tiled when ``samples > batch``); with ``fake=True`` they become meta tensors of the new
    shape. Other inputs pass unchanged.
    """
    out = []
    for t in flat_inputs:
        if not isinstance(t, torch.Tensor) or t.dim() <= batch_dim or t.shape[batch_dim] != batch:
            out.append(t)
            continue
        if fake or t.device.type == "meta":
            shape = list(t.shape)
            shape[batch_dim] = samples
            out.append(torch.empty(shape, dtype=t.dtype, device="meta"))
            continue
        reps = -(-samples // batch)
        if reps > 1:
            tile = [1] * t.dim()
            tile[batch_dim] = reps
            t = t.repeat(*tile)
        out.append(t.narrow(batch_dim, 0, samples).clone())
    return out


def infer_values_pass(
    captured: CapturedGraph, flat_inputs: list[torch.Tensor], *, batch_dim: int = 0
) -> dict[str, ValueSpec]:
    """ValueSpec of every placeholder and call node, from shape propagation at 2-3 batch sizes.

    No real compute runs (FakeTensorMode), so a meta-device model works; the one exception is
    a leaf module whose Python branches on tensor values (``nn.TransformerEncoder`` checks its
    mask), which runs on zeros with copies of its real parameters. Raises ValueError naming
    the node when a value's size is not proportional to the sample count (or an integer not
    affine in it), since micro-batching would then change its meaning. A tensor whose samples'
    rows alternate along the batch dimension is marked ``interleaved`` (see ValueSpec).
    """
    gm = captured.gm
    batch = batch_size_of(flat_inputs, batch_dim)
    on_meta = any(t.device.type == "meta" for t in _state(gm))
    mode = FakeTensorMode()
    p = Progress("shapes", total=len(gm.graph.nodes) * len(SAMPLE_COUNTS))
    prop = _FakeProp(gm, mode, p)

    def values_at(samples: int) -> dict[str, Any]:
        resized = inputs_for_samples(flat_inputs, batch, samples, batch_dim=batch_dim, fake=True)
        fakes = [_fake_input(mode, r, orig, on_meta) for r, orig in zip(resized, flat_inputs, strict=True)]
        return prop.values_at(samples, fakes)

    runs: list[dict[str, Any]] = []
    for s in SAMPLE_COUNTS:
        try:
            runs.append(values_at(s))
        except _NodeFailed as e:
            why = _why_failed(e, values_at, batch, captured, on_meta)
            raise ValueError(f"{e}; {why}") from e.__cause__
    specs = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "call_function", "call_method", "call_module"):
            specs[n.name] = _spec(n.name, [r[n.name] for r in runs], SAMPLE_COUNTS)
    for n in gm.graph.nodes:
        inter, blocks = _interleaves(n, specs, gm)
        if inter:
            specs[n.name] = specs[n.name].model_copy(
                update={"interleaved": True, "interleave": blocks}
            )
    batched = sum(1 for v in specs.values() if v.batch_dim is not None)
    p.done(
        "inferred %d values (%d batched tensors) at %s samples%s in %.2f s",
        len(specs), batched, ", ".join(map(str, SAMPLE_COUNTS)), _under_autocast(), p.seconds,
    )
    return specs


def _under_autocast() -> str:
    """Which autocast is on, for the log line: ``compile()`` runs this pass again under each
    autocast state (``amp``), and those lines must not read as the planning one repeated."""
    on = [f"{d}: {str(torch.get_autocast_dtype(d)).removeprefix('torch.')}"
          for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    return f" under autocast({', '.join(on)})" if on else ""


# -- propagation -------------------------------------------------------------------------------


def _state(gm: nn.Module) -> list[torch.Tensor]:
    return [*gm.parameters(), *gm.buffers()]


def _fake_input(mode: FakeTensorMode, t: Any, orig: Any, on_meta: bool) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    device = torch.device("meta") if on_meta else orig.device
    with mode:
        fake = torch.empty(t.shape, dtype=t.dtype, device=device)
    return fake.requires_grad_(orig.requires_grad)


class _NodeFailed(ValueError):
    def __init__(self, node: fx.Node, samples: int, op: str, e: Exception):
        text = str(e).strip().splitlines()
        super().__init__(f"node {node.name} ({op}) does not run at {samples} samples: "
                         f"{type(e).__name__}: {text[0] if text else ''}")
        self.node = node


def _why_failed(e: _NodeFailed, values_at: Callable[[int], Any], batch: int,
                captured: CapturedGraph, on_meta: bool) -> str:
    """What running the graph at the example's own batch size tells about a failure."""
    try:
        values_at(batch)
    except _NodeFailed as at_batch:
        other = "" if at_batch.node is e.node else f" ({at_batch})"
    else:
        return (
            f"it runs at the example's {batch} samples, so the model's code ties a size to that "
            f"batch size: write x.view(x.size(0), -1) rather than x.view({batch}, -1)"
        )
    why = (
        f"it fails at the example's {batch} samples too{other}, so the sample count is not the "
        "cause: the node needs tensor values that shape inference on fake tensors does not "
        "have (Python that reads a value, an output shape that depends on values)"
    )
    if on_meta:
        return why + ", and a model on the meta device has no values at all"
    if captured.tracer == "fx" and captured.checked is None:
        why += (
            "; or torch.fx traced code that is not the model's (its graph could not be checked "
            "against the model): try Config(tracer='export')"
        )
    leaf = "" if e.node.op == "call_module" else "; keep its module whole with Config(leaf_modules=...)"
    return why + leaf


class _FakeProp(fx.Interpreter):
    """Runs the graph on fake tensors; parameters and buffers become fakes, never touched."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, progress: Progress):
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False  # our errors name the node already
        self.mode = mode
        self.progress, self.propagated = progress, 0
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._values: dict[str, Any] = {}
        self._samples = 0

    def values_at(self, samples: int, fake_inputs: list[Any]) -> dict[str, Any]:
        self._values, self._samples = {}, samples
        with self.mode, torch.enable_grad():
            self.run(*fake_inputs)
        return self._values

    def _fake(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in self._fakes:
            self._fakes[id(t)] = (t, self.mode.from_tensor(t, static_shapes=True))
        return self._fakes[id(t)][1]

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except ValueError:
            raise
        except Exception as e:
            raise _NodeFailed(n, self._samples, _op_name(n, self.module), e) from e
        self._values[n.name] = out
        self.propagated += 1
        self.progress.update(self.propagated, "nodes propagated")
        return out

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._fake(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        mod = self.fetch_attr(target)
        named = [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]
        try:
            return torch.func.functional_call(mod, {k: self._fake(t) for k, t in named}, args, kwargs)
        except Exception as e:
            if any(t.device.type == "meta" for _, t in named):
                raise
            # A leaf module whose Python branches on tensor values (nn.TransformerEncoder checks
            # its mask) cannot run on fake tensors: run it on zeros, on copies of its state.
            log.debug("running %s on real zeros: %s", target, e)
            return self._run_real(mod, named, args, kwargs)

    def _run_real(self, mod: nn.Module, named: list[tuple[str, torch.Tensor]], args: Any,
                  kwargs: Any) -> Any:
        def real(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            return torch.zeros(x.shape, dtype=x.dtype, device=x.device).requires_grad_(x.requires_grad)

        with unset_fake_temporarily():
            state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in named}
            out = torch.func.functional_call(
                mod, state, pytree.tree_map(real, args), pytree.tree_map(real, kwargs)
            )
        return pytree.tree_map(
            lambda t: self.mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t,
            out,
        )


# -- fitting -----------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _spec(name: str, vals: list[Any], samples: Sequence[int]) -> ValueSpec:
    v0 = vals[0]
    if isinstance(v0, torch.Tensor):
        bd, shape = _fit_shape(name, [tuple(v.shape) for v in vals], samples)
        return ValueSpec(
            name=name, kind="tensor", dtype=str(v0.dtype).removeprefix("torch."), shape=shape,
            batch_dim=bd, requires_grad=v0.requires_grad,
        )
    if _is_int(v0):
        return ValueSpec(name=name, kind="int", int_coeffs=(_fit_int(name, [int(v) for v in vals], samples),))
    if isinstance(v0, (tuple, list)) and v0 and all(
        isinstance(v, (tuple, list)) and len(v) == len(v0) and all(_is_int(x) for x in v) for v in vals
    ):
        coeffs = tuple(
            _fit_int(f"{name}[{i}]", [int(v[i]) for v in vals], samples) for i in range(len(v0))
        )
        return ValueSpec(name=name, kind="ints", int_coeffs=coeffs)
    if not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v0)):
        if any(not _equal(v, v0) for v in vals[1:]):
            raise ValueError(
                f"node {name} is {vals[0]!r}, {vals[1]!r}, {vals[2]!r} at "
                f"{', '.join(map(str, samples))} samples: a non-integer that depends on the sample "
                "count changes meaning under micro-batching; compute it from tensors instead"
            )
    return ValueSpec(name=name, kind="constant")


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _fit_shape(
    name: str, shapes: list[tuple[int, ...]], samples: Sequence[int]
) -> tuple[int | None, tuple[int, ...]]:
    seen = ", ".join(f"{list(s)} at {n}" for s, n in zip(shapes, samples, strict=True))
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"node {name} changes rank with the sample count ({seen})")
    varying = [d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1]
    if not varying:
        return None, shapes[0]
    if len(varying) > 1:
        raise ValueError(
            f"node {name} has several dimensions {varying} that grow with the sample count "
            f"({seen}; e.g. a batch x batch similarity matrix): micro-batches cannot hold a "
            "slice of it; compute it outside the model or per sample"
        )
    d = varying[0]
    rows = shapes[0][d] // samples[0]
    if rows < 1 or any(s[d] != rows * n for s, n in zip(shapes, samples, strict=True)):
        raise ValueError(
            f"node {name} has dimension {d} that grows with the sample count but not in "
            f"proportion to it ({seen}): a micro-batch would not hold whole samples (e.g. a "
            "fixed row concatenated to the batch); keep per-sample data along the batch dimension"
        )
    shape = list(shapes[0])
    shape[d] = rows
    return d, tuple(shape)


def _fit_int(name: str, vals: list[int], samples: Sequence[int]) -> tuple[int, int]:
    (v0, v1, v2), (s0, s1, s2) = vals, samples
    if (v1 - v0) % (s1 - s0) == 0:
        a = (v1 - v0) // (s1 - s0)
        c = v0 - a * s0
        if v2 == a * s2 + c:
            return a, c
    raise ValueError(
        f"integer {name} is {v0}, {v1}, {v2} at {s0}, {s1}, {s2} samples: not a * samples + c, "
        "so no micro-batch size can be planned for it; compute it from tensor sizes that are"
    )


# -- layout ------------------------------------------------------------------------------------


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
