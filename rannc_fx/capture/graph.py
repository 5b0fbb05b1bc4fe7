"""The captured graph: a model as one flat fx.GraphModule that holds the model's own tensors."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.fx.node import _get_qualified_name
from torch.utils import _pytree as pytree

__all__ = [
    "CaptureError", "CapturedGraph", "amp_state", "autocast_as", "autocast_state", "batch_size_of", "build_captured",
    "inputs_for_samples", "is_batched", "same_constant", "untouched",
]


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the failing code or op and the ways out."""


@dataclass(frozen=True)
class TailNodes:
    """A graph's tail (``shapes.tail``): its nodes in graph order, where samples first mix,
    and the body's values it reads."""

    nodes: tuple[str, ...]
    mixing: tuple[str, ...]
    reads: tuple[str, ...]


@dataclass
class CapturedGraph:
    """A model as one flat graph.

    ``gm`` takes the tensor leaves of ``(args, kwargs)`` as positional placeholders, in pytree
    order, and returns a flat tuple of tensor leaves (never a pytree). ``in_spec`` /
    ``out_spec`` turn the user's call into that and the flat result back into what the model
    returns (tensor, tuple, dict, HF ModelOutput). Non-tensor leaves of the inputs (``None``,
    bools) are baked into the graph; ``constant_inputs`` records them by leaf index and
    ``flatten_inputs`` checks that a later call passes the same ones. Non-tensor leaves of the
    output are kept likewise in ``constant_outputs``; ``output_leaf_index`` says which output
    leaf each graph output is.

    ``gm``'s parameters and buffers are the model's own objects (same identity), under their
    fully qualified names in the model; a tied parameter is one object reachable under all its
    names (``aliases`` maps every other name to the canonical one).

    The graph is captured in the model's current mode (``model.training``): torch.export bakes
    dropout's and batch norm's training flag into the ops.

    ``copied_calls`` counts the calls of repeated submodules whose nodes torch.export did not
    trace but ``capture/repeat`` copied from the first call of their kind.

    ``checked`` says how a torch.fx graph was compared with the model on the example inputs
    (``"values"``; ``"shapes"`` and dtypes only on the meta device); ``None`` when it was not
    (torch.export runs the model's own code, so its graphs are not compared).
    """

    gm: fx.GraphModule
    tracer: Literal["fx", "export"]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_names: list[str]  # placeholder names, one per tensor leaf, in order
    tensor_leaf_index: list[int]  # leaf index (in the flattened (args, kwargs)) of each placeholder
    constant_inputs: dict[int, Any] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)  # node name producing each output leaf
    aliases: dict[str, str] = field(default_factory=dict)
    output_leaf_index: list[int] = field(default_factory=list)  # out leaf index of each gm output
    constant_outputs: dict[int, Any] = field(default_factory=dict)
    batch_dim: int = 0
    model_name: str = ""
    checked: Literal["values", "shapes"] | None = None
    # the forward's statements [0, pre) and [post, n) run eagerly (``capture/pieces``)
    pieces: tuple[int, int] | None = None
    # where samples mix: the tail that runs on the whole batch (``shapes.tail``), if any
    tail: TailNodes | None = None
    # the autocast state that applied to the captured tensors (none on meta): torch.export's
    # values hold its dtypes
    autocast: tuple[tuple[str, str], ...] = ()
    copied_calls: int = 0  # calls of repeated submodules copied from a first one (export)
    # submodules kept whole and run eagerly, by name: their calls as on the example
    # (``capture/opaque``: a capture of the model's other mode reuses them)
    opaque: dict[str, Any] = field(default_factory=dict)
    # a graph received from another rank: torch.export's node values as formulas
    # (``capture/fake_values``), made into ``node.meta["val"]`` where the shape pass needs them
    values: Any = None

    def flatten_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> list[torch.Tensor]:
        """The tensors ``gm`` takes for the call ``model(*args, **kwargs)``."""
        kwargs = dict(kwargs or {})
        # Keyword order is not meaningful to the caller; put it in the captured order.
        want = self.in_spec.child(1).context if self.in_spec.num_children == 2 else None
        if want is not None and set(want) == set(kwargs):
            kwargs = {k: kwargs[k] for k in want}
        leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.in_spec:
            raise ValueError(
                f"the call's inputs have structure {spec} but the graph was captured for "
                f"{self.in_spec}; call with the same arguments and keywords as the example"
            )
        for i, value in self.constant_inputs.items():
            if not same_constant(leaves[i], value):
                raise ValueError(
                    f"input leaf {i} is {leaves[i]!r} but the graph was captured with {value!r} "
                    "baked in; capture again with this value"
                )
        return [leaves[i] for i in self.tensor_leaf_index]

    def unflatten_outputs(self, flat: list[Any] | tuple[Any, ...]) -> Any:
        """What the model returns, rebuilt from ``gm``'s flat outputs."""
        if len(flat) != len(self.output_leaf_index):
            raise ValueError(
                f"got {len(flat)} outputs but the graph returns {len(self.output_leaf_index)}"
            )
        leaves: list[Any] = [None] * self.out_spec.num_leaves
        for i, v in zip(self.output_leaf_index, flat, strict=True):
            leaves[i] = v
        for i, v in self.constant_outputs.items():
            leaves[i] = v
        return pytree.tree_unflatten(leaves, self.out_spec)

    def fingerprint(self) -> str:
        """A hash of the graph's ops and the parameter/buffer names, shapes and dtypes."""
        index = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        h = hashlib.sha256()
        for n in self.gm.graph.nodes:
            if n.op == "call_module":
                mod = self.gm.get_submodule(n.target)
                target = f"{n.target}:{type(mod).__qualname__}({mod.extra_repr()})"
            elif callable(n.target):
                target = _get_qualified_name(n.target)
            else:
                target = str(n.target)
            args = _stable((n.args, n.kwargs), index)
            h.update(f"{n.op}|{target}|{args}\n".encode())
        h.update(str(self.in_spec).encode() + str(self.out_spec).encode())
        for kind, named in (
            ("param", self.gm.named_parameters(remove_duplicate=False)),
            ("buffer", self.gm.named_buffers(remove_duplicate=False)),
        ):
            for name, t in sorted(named, key=lambda kv: kv[0]):
                h.update(f"{kind}|{name}|{tuple(t.shape)}|{t.dtype}\n".encode())
        return h.hexdigest()

    @property
    def num_nodes(self) -> int:
        return len(self.gm.graph.nodes)


_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def amp_state(device_type: str) -> str | None:
    """The autocast dtype now in force for ``device_type`` ('bfloat16', 'float16'), or None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


@contextlib.contextmanager
def autocast_as(device_type: str, state: str | None) -> Iterator[None]:
    """Run under the autocast ``state`` (None: autocast off), whatever is in force outside."""
    if state is None:
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        with torch.autocast(device_type, dtype=getattr(torch, state)):
            yield


def autocast_state(device_type: str | None = None) -> tuple[tuple[str, str], ...]:
    """(device type, dtype) of every autocast now in force: ``(("cpu", "bfloat16"),)``; with
    ``device_type``, of the one that applies to its tensors (none to meta's)."""
    return tuple((d, str(torch.get_autocast_dtype(d)).removeprefix("torch."))
                 for d in ("cpu", "cuda")
                 if torch.is_autocast_enabled(d) and device_type in (None, d))


def batch_size_of(flat_inputs: list[Any], batch_dim: int = 0) -> int:
    """The example's batch size: ``batch_dim``'s size in the first input tensor that has it."""
    for t in flat_inputs:
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
            return int(t.shape[batch_dim])
    raise ValueError(
        f"no input tensor has a dimension {batch_dim} to split into samples; pass batched "
        "tensors or set Config(batch_dim=...)"
    )


def is_batched(x: Any, batch: int, batch_dim: int = 0) -> bool:
    """Whether ``x`` is a tensor whose ``batch_dim`` holds the example's ``batch`` samples."""
    return isinstance(x, torch.Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == batch


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
        if not is_batched(t, batch, batch_dim):
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


def build_captured(gm: fx.GraphModule, model: nn.Module, tracer: Literal["fx", "export"],
                   in_spec: Any, out_spec: Any, leaves: list[Any], out_idx: list[int],
                   consts: dict[int, Any], batch_dim: int) -> CapturedGraph:
    """A traced graph as a CapturedGraph that holds the model's own parameters and buffers."""
    _share_state(gm, model)
    aliases = _aliases(model)
    _add_aliases(gm, model, aliases)
    gm.graph.lint()
    gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    return CapturedGraph(
        gm=gm,
        tracer=tracer,
        in_spec=in_spec,
        out_spec=out_spec,
        input_names=[n.name for n in placeholders],
        tensor_leaf_index=[i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)],
        constant_inputs={i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)},
        output_names=[n.name for n in out_node.args[0]],
        aliases=aliases,
        output_leaf_index=out_idx,
        constant_outputs=consts,
        batch_dim=batch_dim,
    )


def _share_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make every parameter and buffer of ``gm`` the model's own object, under the same name."""
    model_modules = {id(m) for m in model.modules()}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for kind, own, theirs in (
        ("parameter", params, dict(gm.named_parameters(remove_duplicate=False))),
        ("buffer", buffers, dict(gm.named_buffers(remove_duplicate=False))),
    ):
        for name, t in theirs.items():
            if name not in own or own[name] is t:
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = gm.get_submodule(owner_name)
            if id(owner) in model_modules:
                raise CaptureError(f"captured {kind} {name!r} is not the model's; report this")
            if kind == "parameter":
                owner._parameters[attr] = own[name]  # type: ignore[assignment]
            else:
                owner._buffers[attr] = own[name]
    # Keep buffers that the model does not save in its state_dict out of gm's too.
    for name in buffers:
        owner_name, _, attr = name.rpartition(".")
        try:
            mine, theirs_mod = model.get_submodule(owner_name), gm.get_submodule(owner_name)
        except AttributeError:
            continue
        if attr in mine._non_persistent_buffers_set and id(theirs_mod) not in model_modules:
            theirs_mod._non_persistent_buffers_set.add(attr)


def _add_aliases(gm: fx.GraphModule, model: nn.Module, aliases: dict[str, str]) -> None:
    """Make a tied tensor reachable in ``gm`` under every name it has in the model."""
    model_modules = {id(m) for m in model.modules()}
    params = dict(gm.named_parameters(remove_duplicate=False))
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    for alias, canonical in aliases.items():
        t = params.get(canonical, buffers.get(canonical))
        if t is None or alias in params or alias in buffers:
            continue
        *path, attr = alias.split(".")
        owner: nn.Module = gm
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        if id(owner) in model_modules:
            continue  # the model's own module holds it already
        if canonical in params:
            owner.register_parameter(attr, params[canonical])
        else:
            owner.register_buffer(attr, t)


def _aliases(model: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    out = {}
    for named in (model.named_parameters(remove_duplicate=False),
                  model.named_buffers(remove_duplicate=False)):
        for name, t in named:
            canonical = first.setdefault(id(t), name)
            if canonical != name:
                out[name] = canonical
    return out


def same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _stable(x: Any, index: dict[fx.Node, int]) -> str:
    """Node arguments as text with no ids or addresses in it."""
    if isinstance(x, fx.Node):
        return f"%{index[x]}"
    if isinstance(x, (list, tuple)):
        return "(" + ",".join(_stable(v, index) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_stable(v, index)}" for k, v in sorted(x.items())) + "}"
    if isinstance(x, slice):
        return "slice" + _stable((x.start, x.stop, x.step), index)
    if isinstance(x, torch.device):
        return "device"  # the same model captured on another device is the same model
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.layout,
                                   torch.memory_format)):
        return repr(x)
    if callable(x):
        try:
            return _get_qualified_name(x)
        except Exception:
            pass
    return type(x).__qualname__


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Code that runs the model (profiling, recording calls) gives back the buffers, gradients and random state
    it found, so training starts from exactly the user's initial state on every rank."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {id(p): p.grad for p in model.parameters()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        for p in model.parameters():
            p.grad = grads.get(id(p))
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
