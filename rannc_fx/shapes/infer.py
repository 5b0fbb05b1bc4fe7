"""Infer every value's per-sample shape, batch dimension and integer formula (fake tensors).

    fit            a ValueSpec fitted to a value seen at several sample counts
    layout         which batched tensors interleave their samples' rows, and how
    infer          ``infer_values_pass``: the graph run on fake tensors at ``SAMPLE_COUNTS``
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils import _pytree as pytree

from ..capture import fake_values
from ..capture.capture import CapturedGraph, batch_size_of
from ..capture.graph import autocast_state, inputs_for_samples, is_batched
from ..plan.values import ValueSpec, dtype_itemsize
from ..profile.fakes import computes_as, fake_of, retarget
from ..profile.noderun import NodeRunner, home_device
from ..progress import Progress
from .fit import _spec
from .layout import _interleaves, _op_name
from .symbolic import NoFormulas, SymbolicValues, batch_symbols, size_symbols

__all__ = ["SAMPLE_COUNTS", "Shapes", "dtype_itemsize", "infer_dtypes_pass", "infer_values_pass",
           "shapes_pass"]

log = logging.getLogger("rannc_fx")

# Shape propagation runs at these sample counts: two fit a line, the third checks it. No 1:
# size-1 dimensions broadcast, so they hide which dimension is the batch.
SAMPLE_COUNTS = (2, 3, 5)


@dataclass
class Shapes:
    """What the shape pass found: every value's ValueSpec and, where the graph's sizes are
    formulas in the sample count, those formulas (the profile costs each distinct op from
    them); ``formulas`` is None where the pass fell back to propagating at several sizes."""

    specs: dict[str, ValueSpec]
    formulas: SymbolicValues | None


def infer_values_pass(
    captured: CapturedGraph, flat_inputs: list[torch.Tensor], *, batch_dim: int = 0,
    device: torch.device | None = None,
) -> dict[str, ValueSpec]:
    """ValueSpec of every placeholder and call node (``shapes_pass(...).specs``)."""
    return shapes_pass(captured, flat_inputs, batch_dim=batch_dim, device=device).specs


def shapes_pass(
    captured: CapturedGraph, flat_inputs: list[torch.Tensor], *, batch_dim: int = 0,
    dynamic: bool = True, device: torch.device | None = None,
) -> Shapes:
    """ValueSpec of every placeholder and call node, from the sizes as formulas in the sample
    count: torch.export's symbolic values where the capture has them, else one FakeTensor run
    with a symbolic batch dimension.

    No real compute runs (FakeTensorMode), so a meta-device model works: its fakes carry
    ``device`` (``profile.fakes``: the kind of device the plan is for; by default where the
    model is, a meta model's the CPU's), whose autocast policy and kernels set the dtypes. Where the sizes are
    not formulas in the sample count alone (a leaf module whose Python branches on tensor
    values, a size tied to the example's batch), the graph runs at each of ``SAMPLE_COUNTS``
    instead, on fake tensors (a leaf that reads tensor values runs on zeros with copies of its
    real parameters), and that run names what cannot be micro-batched. Raises ValueError naming
    the node when a value's size is not proportional to the sample count (or an integer not
    affine in it), since micro-batching would then change its meaning. A tensor whose samples'
    rows alternate along the batch dimension is marked ``interleaved`` (see ValueSpec).

    The specs hold every size at the example's; ``formulas`` holds them in the inputs' sizes:
    the sample count and, with ``dynamic``, the inputs' other dimensions that the capture
    kept symbolic (torch.export's; one run makes them symbols for a torch.fx graph).
    """
    gm = captured.gm
    p = Progress("shapes", total=len(gm.graph.nodes) * len(SAMPLE_COUNTS))
    fakes = computes_as(home_device(gm, flat_inputs), device)
    formulas: SymbolicValues | None
    try:
        formulas = _formulas(captured, flat_inputs, batch_dim, dynamic, fakes, p)
        specs = {name: _spec(name, [formulas.value_at(name, s) for s in SAMPLE_COUNTS], SAMPLE_COUNTS)
                 for name in _valued(gm)}
        how = f"as formulas in the sample count ({formulas.source})"
    except Exception as e:  # not formulas: the run at several sizes says what and where
        log.debug("shapes: no formulas in the sample count (%s: %s); propagating at %s samples",
                  type(e).__name__, e, ", ".join(map(str, SAMPLE_COUNTS)))
        formulas = None
        specs = _propagated(captured, flat_inputs, batch_dim, p, fakes)
        how = f"at {', '.join(map(str, SAMPLE_COUNTS))} samples"
    for n in gm.graph.nodes:
        inter, blocks = _interleaves(n, specs, gm)
        if inter:
            specs[n.name] = specs[n.name].model_copy(
                update={"interleaved": True, "interleave": blocks}
            )
    batched = sum(1 for v in specs.values() if v.batch_dim is not None)
    p.done("inferred %d values (%d batched tensors) %s%s in %.2f s",
           len(specs), batched, how, _under_autocast(), p.seconds)
    return Shapes(specs, formulas)


def infer_dtypes_pass(captured: CapturedGraph, flat_inputs: list[torch.Tensor], *,
                      batch_dim: int = 0, device: torch.device | None = None
                      ) -> dict[str, str | None]:
    """The dtype of every placeholder and call node under the autocast state in force (None
    for a value that is not a tensor): one FakeTensor run at the example's own sizes. What
    ``compile()`` needs of the autocast states it did not plan under (``startup.amp``), at a
    fraction of the shape pass's cost: no symbols, no formulas, no layouts (fakes on
    ``device`` as in ``shapes_pass``)."""
    gm = captured.gm
    source = home_device(gm, flat_inputs)
    on = computes_as(source, device)
    mode = FakeTensorMode()
    fakes = [_fake_input(mode, t, t, on) for t in flat_inputs]
    p = Progress("dtypes", total=len(gm.graph.nodes))
    vals = _FakeProp(gm, mode, p, source, on).values_at(batch_size_of(flat_inputs, batch_dim), fakes)
    return {name: _dtype_of(vals[name]) for name in _valued(gm)}


def _dtype_of(value: Any) -> str | None:
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None


def _valued(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes
            if n.op in ("placeholder", "call_function", "call_method", "call_module")]


def _formulas(captured: CapturedGraph, flat_inputs: list[torch.Tensor], batch_dim: int,
              dynamic: bool, fakes: torch.device, p: Progress) -> SymbolicValues:
    """torch.export's symbolic values where they hold for this autocast state, else one run
    (with the inputs' other dimensions symbolic too where ``dynamic`` and that run works)."""
    gm = captured.gm
    batch = batch_size_of(flat_inputs, batch_dim)
    fake_values.made(captured)  # a received graph's: written down until now
    names = set(_valued(gm))
    meta = {n.name: n.meta.get("val") for n in gm.graph.nodes if n.name in names}
    if captured.tracer == "export" and all(v is not None for v in meta.values()):
        # export's sizes hold on any device; its dtypes where autocast did to the captured
        # tensors what it does to the fakes (nothing to either, or one device type's
        # policy), else each value takes the dtype one run at the example's sizes gives it
        vals, source, hint = meta, "torch.export's", batch
        if captured.autocast != autocast_state(fakes.type):
            vals = _retyped(meta, infer_dtypes_pass(captured, flat_inputs, batch_dim=batch_dim,
                                                    device=fakes))
            source = "torch.export's, in this autocast state's dtypes"
    else:
        hint = max(batch, 2)
        try:
            vals = _symbolic_run(captured, flat_inputs, batch_dim, batch, hint, dynamic, fakes, p)
        except Exception as e:
            if not dynamic:
                raise
            log.debug("shapes: the run with the inputs' other dimensions symbolic failed (%s: "
                      "%s); only the batch dimension is", type(e).__name__, e)
            vals = _symbolic_run(captured, flat_inputs, batch_dim, batch, hint, False, fakes, p)
        source = "one run"
    placeholders = [vals[n.name] for n in gm.graph.nodes if n.op == "placeholder"]
    syms = batch_symbols(placeholders, batch_dim, [is_batched(t, batch, batch_dim) for t in flat_inputs])
    sizes = size_symbols(placeholders, flat_inputs, syms) if dynamic else {}
    runner = NodeRunner(gm, "analytic", None, 1, home=fakes, source=home_device(gm, flat_inputs))
    return SymbolicValues(gm, vals, syms, hint=hint, flat_inputs=flat_inputs, runner=runner,
                          source=source, sizes=sizes)


def _retyped(vals: dict[str, Any], dtypes: dict[str, str | None]) -> dict[str, Any]:
    """``vals`` with each tensor in ``dtypes``' dtype (its sizes and strides kept)."""
    def retype(name: str, v: Any) -> Any:
        want = dtypes.get(name)
        if not isinstance(v, torch.Tensor) or want is None or _dtype_of(v) == want:
            return v
        return v.to(getattr(torch, want))

    return {name: retype(name, v) for name, v in vals.items()}


def _symbolic_run(captured: CapturedGraph, flat_inputs: list[torch.Tensor], batch_dim: int,
                  batch: int, hint: int, dynamic: bool, fakes: torch.device,
                  p: Progress) -> dict[str, Any]:
    """Every node's value from one FakeTensor run whose batch dimension is a symbol (and,
    with ``dynamic``, every other input dimension of size 2 or more: each its own symbol)."""
    from torch._dynamo.source import ConstantSource  # here: importing torch._dynamo takes 2 s

    gm = captured.gm
    env = ShapeEnv(duck_shape=False)  # equal sizes are not the same dimension
    mode = FakeTensorMode(shape_env=env)

    def symbol(size: int, name: str) -> Any:
        sym = env.create_symbol(size, source=ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(sym, hint=size)

    samples = symbol(hint, "samples")
    inputs = []
    for i, t in enumerate(flat_inputs):
        if isinstance(t, torch.Tensor) and (dynamic or is_batched(t, batch, batch_dim)):
            shape: list[Any] = [
                symbol(n, f"input{i}_{d}") if dynamic and n >= 2 and d != batch_dim else n
                for d, n in enumerate(t.shape)
            ]
            if is_batched(t, batch, batch_dim):
                shape[batch_dim] = samples
            with mode:
                f = torch.empty(shape, dtype=t.dtype, device=fakes)
            inputs.append(f.requires_grad_(t.requires_grad))
        else:
            inputs.append(_fake_input(mode, t, t, fakes))
    vals = _FakeProp(gm, mode, p, home_device(gm, flat_inputs), fakes).values_at(hint, inputs)
    fixed = env.replacements.get(samples.node.expr)
    if fixed is not None and not fixed.free_symbols:
        raise NoFormulas(f"the graph fixes the sample count at {fixed}")
    return {name: vals[name] for name in _valued(gm)}


def _propagated(captured: CapturedGraph, flat_inputs: list[torch.Tensor], batch_dim: int,
                p: Progress, fakes: torch.device | None = None) -> dict[str, ValueSpec]:
    """The specs fitted to runs at each of ``SAMPLE_COUNTS`` (with concrete fake tensors on
    ``fakes``, by default where the model computes: ``computes_as``)."""
    gm = captured.gm
    fakes = computes_as(home_device(gm, flat_inputs), fakes)
    batch = batch_size_of(flat_inputs, batch_dim)
    on_meta = any(t.device.type == "meta" for t in _state(gm))
    mode = FakeTensorMode()
    prop = _FakeProp(gm, mode, p, home_device(gm, flat_inputs), fakes)

    def values_at(samples: int) -> dict[str, Any]:
        resized = inputs_for_samples(flat_inputs, batch, samples, batch_dim=batch_dim, fake=True)
        inputs = [_fake_input(mode, r, orig, fakes) for r, orig in zip(resized, flat_inputs, strict=True)]
        return prop.values_at(samples, inputs)

    runs: list[dict[str, Any]] = []
    for s in SAMPLE_COUNTS:
        try:
            runs.append(values_at(s))
        except _NodeFailed as e:
            why = _why_failed(e, values_at, batch, captured, on_meta)
            raise ValueError(f"{e}; {why}") from e.__cause__
    return {name: _spec(name, [r[name] for r in runs], SAMPLE_COUNTS) for name in _valued(gm)}


def _under_autocast() -> str:
    """Which autocast is on, for the log line: ``compile()`` runs this pass again under each
    autocast state (``amp``), and those lines must not read as the planning one repeated."""
    on = [f"{d}: {str(torch.get_autocast_dtype(d)).removeprefix('torch.')}"
          for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    return f" under autocast({', '.join(on)})" if on else ""


# -- propagation -------------------------------------------------------------------------------


def _state(gm: nn.Module) -> list[torch.Tensor]:
    return [*gm.parameters(), *gm.buffers()]


def _fake_input(mode: FakeTensorMode, t: Any, orig: Any, device: torch.device) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
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

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, progress: Progress,
                 source: torch.device | None = None, device: torch.device | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False  # our errors name the node already
        self.mode = mode
        # the capture's device (its graph's constants name it), the fakes'
        self.source = source if source is not None else home_device(gm, [])
        self.device = computes_as(self.source, device)
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
            self._fakes[id(t)] = (t, fake_of(self.mode, t, self.device))
        return self._fakes[id(t)][1]

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_function(target, *retarget(args, kwargs, self.source, self.device))

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_method(target, *retarget(args, kwargs, self.source, self.device))

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
            lambda t: fake_of(self.mode, t, self.device) if isinstance(t, torch.Tensor) else t, out)
