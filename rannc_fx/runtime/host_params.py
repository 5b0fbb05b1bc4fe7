"""Parameters in host memory: a stage's parameters, their gradients and their optimizer state
live on the host; each use in the stage's graph brings a copy of its parameter to the device
just before it runs, and nothing keeps that copy after it.

``HostParams.install`` rewrites the stage's GraphModule (printed, it shows each fetch):

* each use of a parameter read by ``get_attr`` gets its own ``rannc_fetch(param)`` call right
  before it;
* a ``call_module`` of a module that owns parameters (a torch.fx leaf such as ``nn.Linear``)
  becomes a call of ``rannc_fetch_<k>``, which runs that module on fetched copies of its
  parameters (``torch.func.functional_call``).

A fetch is differentiable (``_Fetch``): its backward brings the gradient to the host, where
autograd accumulates it into the host parameter's ``.grad``, so the optimizer steps on the
host (its state is made there). The gradient all-reduce and ``clip_grad_norm_`` read those
host gradients like any others.

Autograd would keep every copy an op saves for its backward (``x @ w.t()`` saves ``w.t()``)
until that backward, for every micro-batch in flight. ``saving()`` (saved-tensor hooks around
the forward and the recomputation) saves a token instead of any tensor that views a fetched
copy (or autocast's cast of one, found on the autograd graph: a ``_to_copy`` of a fetch), and
the backward fetches the parameter again (and casts it) when it unpacks the token. So the device
holds a parameter only from its fetch to the end of the op that uses it, plus the copies
fetched ahead.

Ahead: the stage fetches in one order every micro-batch (its graph's), recorded on the first
forward; each fetch starts the copies of the parameters after it (before it, in a backward)
up to ``window`` bytes, on a side CUDA stream where there is one, so the transfer overlaps
the compute. On the CPU, host and device are one memory: the copies are still made, in the
same order, so the logic and the numerics run (and are tested) everywhere.

A copy fetched ahead and not used by the end of the action is dropped (``release``). A
parameter's copies differ from it in nothing but their memory: the numerics are those of
the stage run on its own parameters, bit for bit.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["HostParams", "fetching", "host_of", "saving"]

FETCH = "rannc_fetch"


class _Saved(NamedTuple):
    """What a saved view of a fetched copy (or of its cast to ``dtype``, autocast's) becomes:
    the parameter, the view's geometry and the cast."""

    param: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype | None = None


class _Fetch(torch.autograd.Function):
    """A device copy of a host parameter; its gradient goes back to the host."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, host: HostParams) -> torch.Tensor:
        ctx.where, ctx.param, ctx.host = p.device, p, host  # the node names its parameter
        return host.copy_of(p, forward=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.host.returned(ctx.param, grad), None


class _FetchOne(nn.Module):
    """``rannc_fetch(param)``: the call a ``get_attr`` use goes through."""

    _host: HostParams

    def __init__(self, host: HostParams):
        super().__init__()
        object.__setattr__(self, "_host", host)  # not a submodule: no second parameter name

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return self._host.fetch(p)


class _FetchCall(nn.Module):
    """A module that owns parameters, called on fetched copies of them."""

    _host: HostParams
    _inner: nn.Module

    def __init__(self, host: HostParams, inner: nn.Module, target: str):
        super().__init__()
        object.__setattr__(self, "_host", host)
        object.__setattr__(self, "_inner", inner)  # its parameters keep their one name
        self.target = target

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner
        fetched = {n: self._host.fetch(p)
                   for n, p in inner.named_parameters(remove_duplicate=False)}
        return functional_call(inner, fetched, args, kwargs, tie_weights=False)

    def extra_repr(self) -> str:
        return f"runs {self.target} on fetched copies of its parameters"


def host_of(module: fx.GraphModule) -> HostParams | None:
    """The ``HostParams`` installed on ``module`` (its ``rannc_fetch`` submodule's), if any."""
    fetch = getattr(module, FETCH, None)
    return fetch._host if isinstance(fetch, _FetchOne) else None


class HostParams:
    """The parameters of one stage's GraphModule, in host memory, fetched at each use."""

    def __init__(self, module: fx.GraphModule, device: torch.device, *, window: int):
        """``window``: the most bytes fetched ahead of their use (the plan's
        ``Stage.window_bytes``); ``device``: where the stage computes."""
        self.module, self.device, self.window = module, device, window
        self.params = {id(p): p for p in module.parameters()}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._order: list[torch.Tensor] = []  # parameters in fetch order, the first forward's
        self._pos: dict[int, int] = {}
        self._recording = True
        self._ahead: OrderedDict[int, tuple[torch.Tensor, Any]] = OrderedDict()
        # the forward's copies by storage address: their parameter, and a weak reference to
        # the storage (alive, no other storage has its address; dead, the entry is stale)
        self._made: dict[int, tuple[torch.Tensor, StorageWeakRef]] = {}
        self.fetched_bytes = 0  # host -> device, since ``reset_counts``
        self.saved_tokens = 0  # saved views of copies the forwards did not keep

    # -- the graph ----------------------------------------------------------------------------
    def install(self) -> fx.GraphModule:
        """Rewrite the stage's graph so every parameter is fetched where it is used."""
        gm = self.module
        if host_of(gm) is not None:  # installed by an earlier executor: fetch here now
            for sub in gm.modules():
                if isinstance(sub, (_FetchOne, _FetchCall)):
                    object.__setattr__(sub, "_host", self)
            return gm
        gm.add_submodule(FETCH, _FetchOne(self))
        wrapped = 0
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and id(
                    operator.attrgetter(str(node.target))(gm)) in self.params:
                for user in list(node.users):
                    with gm.graph.inserting_before(user):
                        fetch = gm.graph.call_module(FETCH, (node,))
                    user.replace_input_with(node, fetch)
            elif node.op == "call_module":
                sub = gm.get_submodule(node.target)
                if isinstance(sub, (_FetchOne, _FetchCall)) or not any(
                        True for _ in sub.parameters()):
                    continue
                target = f"{FETCH}_{wrapped}"
                wrapped += 1
                gm.add_submodule(target, _FetchCall(self, sub, str(node.target)))
                node.target = target
        gm.graph.lint()
        gm.recompile()
        return gm

    # -- fetching -----------------------------------------------------------------------------
    def fetch(self, p: torch.Tensor) -> torch.Tensor:
        """A device copy of ``p`` (fetched ahead, or now) that autograd ties to ``p``."""
        if torch.is_grad_enabled() and p.requires_grad:
            return _Fetch.apply(p, self)
        return self.copy_of(p, forward=True)

    def returned(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of ``p`` from that of a fetched copy: on ``p``'s device (the host)."""
        return grad.to(p.device)

    def copy_of(self, p: torch.Tensor, *, forward: bool) -> torch.Tensor:
        """``p`` on the device, fetched ahead or now; starts the next ones ahead. Outside
        any dispatch mode: selective recomputation's policy (``plan.selective``) counts the
        stage's ops by their order, and whether a copy was fetched ahead differs between a
        forward and its rerun."""
        with _disable_current_modes():
            return self._copy_of(p, forward=forward)

    def _copy_of(self, p: torch.Tensor, *, forward: bool) -> torch.Tensor:
        if self._recording and forward:
            if id(p) not in self._pos:
                self._pos[id(p)] = len(self._order)
                self._order.append(p)
        copy = self._take(p)
        self._ahead_of(p, forward)
        if forward:  # the ops that use it may save a view of it: known by its storage
            storage = copy.untyped_storage()
            self._made[storage.data_ptr()] = (p, StorageWeakRef(storage))
        return copy

    def _take(self, p: torch.Tensor) -> torch.Tensor:
        got = self._ahead.pop(id(p), None)
        if got is None:
            return self._copy(p, None)[0]
        copy, event = got
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            copy.record_stream(torch.cuda.current_stream(self.device))
        return copy

    def _copy(self, p: torch.Tensor, stream: Any) -> tuple[torch.Tensor, Any]:
        self.fetched_bytes += p.nbytes
        with torch.no_grad():
            if stream is None:
                return torch.empty_like(p, device=self.device).copy_(p, non_blocking=True), None
            with torch.cuda.stream(stream):
                copy = torch.empty_like(p, device=self.device).copy_(p, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            return copy, event

    def _ahead_of(self, p: torch.Tensor, forward: bool) -> None:
        """Start the copies of the parameters next in this direction, up to ``window`` bytes
        fetched ahead."""
        pos = self._pos.get(id(p))
        if pos is None or self._recording:
            return
        step = 1 if forward else -1
        held = sum(c.nbytes for c, _ in self._ahead.values())
        k = pos + step
        while 0 <= k < len(self._order):
            q = self._order[k]
            k += step
            if id(q) in self._ahead or id(q) == id(p):
                continue
            if held + q.nbytes > self.window:
                break
            self._ahead[id(q)] = self._copy(q, self._stream)
            held += q.nbytes

    # -- saved tensors ------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Inside: a saved view of a fetched copy is kept as a token (fetched again when the
        backward unpacks it)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.device or t.layout != torch.strided:
            return t
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        made = self._made.get(key)
        geometry = (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
        if made is not None and not made[1].expired() and t.dtype == made[0].dtype:
            self.saved_tokens += 1
            return _Saved(made[0], *geometry)
        p = self._cast_of(t)
        if p is None:
            return t
        self.saved_tokens += 1
        return _Saved(p, *geometry, dtype=t.dtype)

    def _cast_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The parameter whose fetched copy ``t`` is a cast of, or a view of such a cast
        (autocast casts a weight before a matrix product, and the product saves the cast):
        read off the autograd graph, a ``_to_copy`` whose input is one of this stage's
        fetches."""
        base = t._base if t._base is not None else t
        node = base.grad_fn
        if node is None or type(node).__name__ != "ToCopyBackward0":
            return None
        prev = node.next_functions[0][0] if node.next_functions else None
        if getattr(prev, "host", None) is not self:
            return None
        p = prev.param  # type: ignore[union-attr]
        return p if base.shape == self.whole_shape(p) and \
            base.is_contiguous() == p.is_contiguous() else None

    def whole_shape(self, p: torch.Tensor) -> torch.Size:
        """The shape of ``p``'s fetched copies."""
        return p.shape

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        copy = self.copy_of(saved.param, forward=False)
        if saved.dtype is not None:  # autocast's cast, made again: the same values
            copy = copy.to(saved.dtype)
        return copy.as_strided(saved.size, saved.stride, saved.offset)

    # -- between actions ----------------------------------------------------------------------
    def release(self) -> None:
        """After an action: nothing fetched stays on the device; the first forward's order
        is the one every later fetch follows."""
        if self._order:
            self._recording = False
        self._ahead.clear()
        self._made.clear()

    def reset_counts(self) -> None:
        self.fetched_bytes = 0
        self.saved_tokens = 0


@contextlib.contextmanager
def fetching(host: HostParams | None) -> Iterator[None]:
    """Around an action of a stage (``host``: its ``HostParams``, None where its parameters
    are on the device): nothing fetched stays on the device after it."""
    try:
        yield
    finally:
        if host is not None:
            host.release()


def saving(host: HostParams | None) -> contextlib.AbstractContextManager[None]:
    """Around a forward whose activations the backward reads: what it saves of a fetched
    parameter is a token, fetched again by the backward."""
    return host.saving() if host is not None else contextlib.nullcontext()
