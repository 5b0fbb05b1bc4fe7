"""Run graph nodes one at a time for the profile: real tensors on a device, or fake ones.

A :class:`NodeRunner` turns a node and its input values into an ``OpCall`` and profiles it
(``opcost.measure_op`` / ``count_op``) or just runs it for its outputs. Node outputs become
the next nodes' inputs as leaves (detached, ``requires_grad`` kept), so each node's backward
covers that node alone. The runner's ``session`` keeps the model as it was: analytic runs see
fake twins of the parameters and buffers; measured runs restore buffers (BatchNorm running
statistics) and the RNG state afterwards. A model whose tensors are not on the device it is
measured on (a meta-device model, or one built elsewhere) runs on fakes as an analytic one
does, and each op it profiles is made real on the device and timed there (``materialize``).

Fake tensors all carry one device, the graph's *home* device (:func:`home_device`): the
model's, or ``meta`` for a meta model. The captured graph bakes that device into ops that make
tensors (``arange(..., device=cpu)``, ``to(cpu)``), so a fake on any other device would meet a
fake on the home device in some op and fail with a device mismatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.graph import inputs_for_samples
from ..plan.device import DeviceSpec
from .cache import device_name, qualname
from .fakes import computes_as, fake_device, retarget
from .instruments import differentiable, storage_id
from .materialize import Materializer, ModuleCall, measure_real
from .opcost import OpCall, OpCost, count_op, measure_op, run_op
from .opcost_bw import weight_held

__all__ = ["NodeRunner", "ZeroScalars", "as_leaf", "home_device", "measure_device"]

log = logging.getLogger("rannc_fx")


class ZeroScalars(TorchDispatchMode):
    """Reads every tensor value Python asks for (``bool(t)``, ``t.item()``) as 0 / False.

    Fake tensors have no values, so a module that branches on one (``nn.TransformerEncoder``
    compares its mask with a causal one) cannot run on them; with this mode it takes the
    branch a zero would take, which is the general, value-independent path.
    """

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return False if t.dtype == torch.bool else 0 if not t.is_floating_point() else 0.0
        return func(*args, **(kwargs or {}))


_T = TypeVar("_T")


def measure_device(
    gm: fx.GraphModule, device: torch.device | None, cost_model: str
) -> torch.device | None:
    """Where measured costs come from: ``device``, else where the parameters are (a model
    whose tensors are elsewhere, or on the meta device, has its ops made real there)."""
    if cost_model == "analytic":
        return None
    param_devs = {t.device for t in [*gm.parameters(), *gm.buffers()]}
    dev = torch.device(device) if device is not None else next(iter(param_devs), torch.device("cpu"))
    if dev.type == "meta":
        raise ValueError(
            "cost_model='measured' needs a device to time the ops on, but the model is on the "
            "meta device; pass device=<a torch device> to measure there, or use "
            "cost_model='analytic' with a DeviceSpec preset"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def home_device(gm: fx.GraphModule, flat_inputs: list[Any]) -> torch.device:
    """Where the graph was captured: the device its constants name.

    ``meta`` when any parameter or buffer is on meta (the model was captured on meta: its
    example inputs went there too), else the device of the model's state, else that of its
    first input tensor, else the CPU. Fakes carry another (``fakes``).
    """
    devs = [t.device for t in [*gm.parameters(), *gm.buffers()]]
    devs += [t.device for t in flat_inputs if isinstance(t, torch.Tensor)]
    if any(d.type == "meta" for d in devs):
        return torch.device("meta")
    return devs[0] if devs else torch.device("cpu")


# -- running nodes ---------------------------------------------------------------------------


class NodeRunner:
    """How nodes run: real tensors timed on a device, or fake tensors counted."""

    def __init__(
        self, gm: fx.GraphModule, cost_model: str, device: torch.device | None, repeats: int,
        *, home: torch.device | None = None, source: torch.device | None = None,
        spec: DeviceSpec | None = None,
    ) -> None:
        self.gm, self.device, self.repeats = gm, device, repeats
        self.analytic = cost_model == "analytic"
        # the device fakes carry (``fakes``), the graph's constants name ``source``; measured
        # runs put real tensors on `device`
        self.source = source if source is not None else home_device(gm, [])
        # measured elsewhere than the model's tensors are: fakes of the device's type, each
        # profiled op made real on the device (``materialize``), else priced with ``spec``
        self.materializer: Materializer | None = None
        self.spec = spec or (DeviceSpec.of(device) if device is not None else None)
        if not self.analytic and device is not None and _elsewhere(gm, device):
            self.materializer, home = Materializer(device), fake_device(device.type)
        self.fakes = self.analytic or self.materializer is not None
        self.home = computes_as(self.source, home)
        # analytic costs depend on the kernels the fakes' device type dispatches to
        self.device_name = f"fake {self.home.type}" if self.analytic else device_name(device)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if self.fakes else None
        self._fakes: dict[int, torch.Tensor] = {}
        self.module_memo: dict[int, str] = {}
        self.excluded: frozenset[int] = frozenset()
        self.warned: set[str] = set()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """On fakes: inside FakeTensorMode. Measured: the model's buffers (on fakes, never
        written) and the RNG state as they were afterwards."""
        with self._rng_kept(), self.fake_mode or contextlib.nullcontext():
            self.excluded = self._persistent()
            if self.fakes:
                yield
                return
            buffers = {k: b.detach().clone()
                       for k, b in self.gm.named_buffers(remove_duplicate=False)}
            try:
                yield
            finally:
                with torch.no_grad():
                    for k, b in self.gm.named_buffers(remove_duplicate=False):
                        b.copy_(buffers[k])

    @contextlib.contextmanager
    def _rng_kept(self) -> Iterator[None]:
        """Measured ops draw from the RNG (dropout): leave it as it was."""
        if self.analytic:
            yield
            return
        rng = torch.random.get_rng_state()
        dev = self.device
        cuda_rng = torch.cuda.get_rng_state(dev) if dev is not None and dev.type == "cuda" else None
        try:
            yield
        finally:
            torch.random.set_rng_state(rng)
            if cuda_rng is not None and dev is not None:
                torch.cuda.set_rng_state(cuda_rng, dev)

    def _persistent(self) -> frozenset[int]:
        """Storages of parameters, buffers and constants: state, never activations."""
        held = list(_state(self.gm).values())
        held += [a for n in self.gm.graph.nodes if n.op == "get_attr"
                 for a in [attrgetter(str(n.target))(self.gm)] if isinstance(a, torch.Tensor)]
        if self.fakes:
            held = [self.fake(t) for t in held]
        return frozenset(storage_id(t) for t in held)

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        """The fake twin of a model tensor (one per tensor, so tied weights stay tied)."""
        if id(t) not in self._fakes:
            self._fakes[id(t)] = self._to_fake(t)
        return self._fakes[id(t)]

    def _to_fake(self, t: torch.Tensor) -> torch.Tensor:
        assert self.fake_mode is not None
        with unset_fake_temporarily():
            meta = t.detach().to("meta")
        f = self.fake_mode.fake_tensor_converter.from_meta_and_device(
            self.fake_mode, meta, self.home
        )
        if t.requires_grad and differentiable(f):
            f.requires_grad_(True)
        return f

    def inputs(self, flat: list[Any], batch: int, samples: int, batch_dim: int) -> list[Any]:
        """The graph inputs for ``samples`` samples: fake, or real on the device."""
        with unset_fake_temporarily():
            sized = inputs_for_samples(flat, batch, samples, batch_dim=batch_dim, fake=self.fakes)

        def leaf(t: Any, orig: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if self.fakes:
                return _leaf(self._to_fake(t), orig.requires_grad)
            return _leaf(t.to(self.device), orig.requires_grad)

        return [leaf(t, orig) for t, orig in zip(sized, flat, strict=True)]

    def attr(self, target: str) -> Any:
        obj = attrgetter(target)(self.gm)
        return self.fake(obj) if self.fakes and isinstance(obj, torch.Tensor) else obj

    def call(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any],
             state: Sequence[torch.Tensor] = ()) -> OpCall:
        """``node``'s op on these inputs, of which ``state`` are the model's (fakes built
        apart from the parameter they view: ``SymbolicValues.fake_args``)."""
        params: tuple[torch.Tensor, ...] = ()
        fn: Any
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            fn, params = self._module_fn(mod)
            mutates = bool(getattr(mod, "inplace", False))
            op = qualname(type(mod))
        elif node.op == "call_method":
            fn = _method(str(node.target))
            mutates = _mutates_name(str(node.target), kwargs)
            op = f"Tensor.{node.target}"
        else:
            fn = node.target
            mutates = _mutates_fn(node.target, kwargs)
            op = qualname(fn)
            _check_batch_norm(fn, args, kwargs)
        if self.fakes:
            args, kwargs = retarget(args, kwargs, self.source, self.home)
        excluded = self.excluded | {storage_id(t) for t in state}
        return OpCall(fn, args, kwargs, params, mutates, excluded, f"node {node.name} ({op})")

    def _module_fn(self, mod: nn.Module) -> tuple[Any, tuple[torch.Tensor, ...]]:
        real = [p for p in mod.parameters() if p.requires_grad]
        if not self.fakes:
            return mod, tuple(real)
        state = {k: self.fake(t) for k, t in _state(mod).items()}
        return ModuleCall(mod, state), tuple(self.fake(p) for p in real)

    def profile(self, call: OpCall) -> tuple[Any, OpCost]:
        """The op's outputs and costs, with what it holds between a split backward's B and
        W (``opcost_bw``)."""
        if self.analytic:
            out, cost = _robust(count_op, call, self._warn)
        elif self.materializer is not None:
            # the fakes first: an op that raises at this size (one value per channel) raises
            # as the real one would; then its real twin, timed on the device
            out = self.run(call)
            assert self.spec is not None
            cost = measure_real(call, self.materializer, repeats=self.repeats, spec=self.spec,
                                warn=self._warn)
        else:
            dev, reps = self.device, self.repeats
            assert dev is not None
            out, cost = _robust(lambda c: measure_op(c, device=dev, repeats=reps), call,
                                self._warn)
        w = _robust(weight_held, call, self._warn)
        return out, dataclasses.replace(cost, w_inputs=w.inputs, w_outputs=w.outputs,
                                        w_internal=w.internal, w_grads=w.grads)

    def run(self, call: OpCall, *, grad: bool = True) -> Any:
        return _robust(lambda c: run_op(c, grad=grad), call, self._warn)

    def _warn(self, what: str) -> None:
        if what not in self.warned:
            self.warned.add(what)
            log.warning("%s", what)


def _robust(fn: Callable[[OpCall], _T], call: OpCall, warn: Callable[[str], None]) -> _T:
    """``fn(call)``; again on clones when the op writes to an input autograd forbids writing,
    and with tensor values read as zero when fake tensors meet a data-dependent branch."""
    try:
        return fn(call)
    except DataDependentOutputException:  # a RuntimeError too: catch it first
        warn(
            f"{call.name} branches on tensor values, which fake tensors lack; "
            "its analytic cost assumes each such value is 0 / False"
        )
        with ZeroScalars():
            return _robust(fn, call, warn)
    except RuntimeError as e:
        if call.mutates or "in-place" not in str(e):
            raise
    return fn(dataclasses.replace(call, mutates=True))


def _elsewhere(gm: fx.GraphModule, device: torch.device) -> bool:
    """Whether a tensor of the model's state is not on ``device`` (on meta, or another)."""
    return any(t.device != device for t in [*gm.parameters(), *gm.buffers()])


def _check_batch_norm(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The check ``F.batch_norm`` makes before a batch norm in training mode (one value per
    channel cannot be normalized: ValueError), for an exported graph's ATen batch norms,
    which torch.export traced below it: a size the model's own code refuses is refused
    under either capture."""
    if not isinstance(fn, torch._ops.OpOverload) or "batch_norm" not in fn._schema.name:
        return
    names = [a.name for a in fn._schema.arguments]
    given = dict(zip(names, args, strict=False)) | kwargs
    x = given.get("input")
    training = given.get("training") is True or fn._schema.name.endswith("_batch_norm_with_update")
    if isinstance(x, torch.Tensor) and training:
        F._verify_batch_size(list(x.shape))  # type: ignore[attr-defined]  # torch's own


def _state(mod: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(mod.named_parameters(remove_duplicate=False)),
        **dict(mod.named_buffers(remove_duplicate=False)),
    }


def _method(name: str) -> Any:
    return lambda self, *a, **k: getattr(self, name)(*a, **k)


# Python's augmented assignments and item assignment write to their first argument.
_INPLACE_OPERATORS = {
    "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
    "ixor", "ilshift", "irshift", "setitem",
}


def _mutates_name(name: str, kwargs: dict[str, Any]) -> bool:
    """``add_``, ``__iadd__``, ``operator.iadd``, ``setitem`` or an ``inplace=True`` call."""
    bare = name.strip("_")
    trailing = name.endswith("_") and not name.endswith("__")
    return trailing or bare in _INPLACE_OPERATORS or kwargs.get("inplace") is True


def _mutates_fn(fn: Any, kwargs: dict[str, Any]) -> bool:
    if isinstance(fn, torch._ops.OpOverload):
        return bool(fn._schema.is_mutable)
    return _mutates_name(getattr(fn, "__name__", ""), kwargs)


def as_leaf(t: torch.Tensor) -> torch.Tensor:
    """An op's output as the next op's input: itself when it is a leaf already."""
    return t if t.grad_fn is None else _leaf(t, t.requires_grad)


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A detached tensor on the same storage, needing grad when ``requires_grad`` allows it."""
    d = t.detach()
    if requires_grad and differentiable(d):
        d.requires_grad_(True)
    return d
