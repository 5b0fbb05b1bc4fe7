"""What a run of one op is watched with: its tensors' storages, the tensors autograd saves,
the bytes its aten ops move and allocate, and the CUDA allocator's peak.

``opcost`` runs an op inside these (``SavedLog`` as ``saved_tensors_hooks``, ``OpTracker`` as
a dispatch mode, ``CudaPeak`` around it) and reads the op's memory and bytes from them; the
helpers on tensors and storages (``tensors``, ``storage_id``, ``differentiable``,
``first_positions``) are shared by the profile's passes.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan import selective
from . import flops

__all__ = ["CudaPeak", "OpTracker", "SavedLog", "differentiable", "first_positions",
           "storage_id", "tensors"]


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of a pytree, in order."""
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def storage_id(t: torch.Tensor) -> int:
    """An id shared by all views of one storage (the StorageImpl address)."""
    return int(t.untyped_storage()._cdata)


def differentiable(t: torch.Tensor) -> bool:
    """Whether autograd can track ``t`` (floating point or complex)."""
    return t.is_floating_point() or t.is_complex()


class SavedLog:
    """saved_tensors_hooks that note each saved storage (and keep the tensor as it is)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            self.storages[int(st._cdata)] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): by size
            self.storages[id(t)] = t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def classify(
        self, ins: list[torch.Tensor], outs: list[torch.Tensor], excluded: frozenset[int]
    ) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        in_ids, out_ids = [storage_id(t) for t in ins], [storage_id(t) for t in outs]
        saved = {s: n for s, n in self.storages.items() if s not in excluded}
        in_pos = first_positions(in_ids, saved)
        out_pos = first_positions(out_ids, {s: n for s, n in saved.items() if s not in in_ids})
        internal = sum(n for s, n in saved.items() if s not in in_ids and s not in out_ids)
        return internal, in_pos, out_pos


def first_positions(ids: list[int], wanted: Container[int]) -> tuple[int, ...]:
    """The first position in ``ids`` of each storage id in ``wanted``, in order."""
    first: dict[int, int] = {}
    for i, s in enumerate(ids):
        if s in wanted:
            first.setdefault(s, i)
    return tuple(sorted(first.values()))


# Ops that move no data (metadata, aliasing) and allocate nothing worth counting.
_NO_DATA = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default",
            "aten._assert_tensor_metadata.default", "prim.device.default"}


_TO_COPY = torch.ops.aten._to_copy.default


class OpTracker(TorchDispatchMode):
    """Sums the bytes every aten op reads and writes, and the peak of storages allocated;
    and, of the ops selective recomputation keeps (``selective.kept``), their outputs'
    bytes, FLOPs and bytes moved."""

    def __init__(self, known: set[int], params: Container[int] = ()) -> None:
        super().__init__()
        self.known = known
        # autocast's copies of ``params`` (storages of parameters needing a gradient) in
        # another dtype: storage -> bytes (the cache keeps one a step, whatever the calls)
        self.params = params
        self.casts: dict[int, int] = {}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0
        self.moved = 0
        self.kept: dict[int, int] = {}  # storage -> bytes
        # every storage a kept op made, once: a freed one's address comes back for the next
        self._kept_refs: dict[int, StorageWeakRef] = {}
        self.kept_bytes = self.kept_flops = self.kept_moved = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False) or str(func) in _NO_DATA:
            return out
        self._sweep()
        outs = tensors(out)
        moved = sum(t.numel() * t.element_size() for t in [*tensors((args, kwargs)), *outs])
        self.moved += moved
        if func is _TO_COPY and self._cast_of_param(args[0], outs):
            self.casts[storage_id(outs[0])] = outs[0].untyped_storage().nbytes()
        if selective.kept(func):
            self.kept_moved += moved
            self.kept_flops += flops.count(func, args, kwargs or {}, out)
            for t in outs:
                sid = storage_id(t)
                if sid not in self.known:
                    st = t.untyped_storage()
                    ref = self._kept_refs.get(sid)
                    if ref is None or ref.expired():
                        self._kept_refs[sid] = StorageWeakRef(st)
                        self.kept_bytes += st.nbytes()
                    self.kept[sid] = st.nbytes()
        for t in outs:
            sid = storage_id(t)
            if sid not in self.known and sid not in self.live:
                st = t.untyped_storage()
                self.live[sid] = (StorageWeakRef(st), st.nbytes())
                self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        return out

    def _cast_of_param(self, x: Any, outs: list[torch.Tensor]) -> bool:
        """Whether a copy made ``outs`` from a parameter needing a gradient, in another
        dtype (autocast's cast of a weight before a matrix product)."""
        return (isinstance(x, torch.Tensor) and x.requires_grad and len(outs) == 1
                and outs[0].dtype != x.dtype and storage_id(x) in self.params)

    def _sweep(self) -> None:
        for sid in [s for s, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(sid)[1]


class CudaPeak:
    """Peak bytes the CUDA caching allocator hands out over a region, above its start."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak, self.base = device, 0, 0

    def __enter__(self) -> CudaPeak:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
