"""Gather every rank's part of a state dict to rank 0 on the CPU, one copy of each tensor.

Each rank announces what it holds (names, shapes, dtypes; small values as they are); the
lowest rank holding a tensor sends it, one tensor at a time, so rank 0 never holds more
than the model once plus one tensor in flight on its device. A tensor held under several
names (a tied weight, an optimizer's state of it) is sent once and appears under each name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_full"]

_MODEL, _OPTIM = "m:", "o:"


def gather_full(
    msd: dict[str, Any], osd: dict[str, Any], device: torch.device
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole (model, optimizer) state dicts on rank 0; two empty dicts elsewhere."""
    flat = {**{_MODEL + k: v for k, v in msd.items()}, **{_OPTIM + k: v for k, v in osd.items()}}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        out = _local_copy(flat)
    else:
        out = _gather(flat, device)
    model = {k[len(_MODEL):]: v for k, v in out.items() if k.startswith(_MODEL)}
    optim = {k[len(_OPTIM):]: v for k, v in out.items() if k.startswith(_OPTIM)}
    return model, optim


def _groups(flat: dict[str, Any]) -> tuple[list[tuple[tuple[str, ...], torch.Tensor]],
                                            dict[str, Any]]:
    """Tensors with all the keys they appear under (same storage = same tensor), and the rest."""
    by_storage: dict[tuple[int, int, tuple[int, ...], torch.dtype], tuple[list[str], torch.Tensor]] = {}
    values: dict[str, Any] = {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            ident = (v.untyped_storage().data_ptr() if v.numel() else id(v),
                     int(v.storage_offset()), tuple(v.shape), v.dtype)
            by_storage.setdefault(ident, ([], v))[0].append(k)
        else:
            values[k] = v
    return [(tuple(keys), t) for keys, t in by_storage.values()], values


def _local_copy(flat: dict[str, Any]) -> dict[str, Any]:
    tensors, out = _groups(flat)
    for keys, t in tensors:
        copy = t.detach().to("cpu", copy=True)
        out.update(dict.fromkeys(keys, copy))
    return out


def _gather(flat: dict[str, Any], device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    tensors, values = _groups(flat)
    mine = [(keys, tuple(t.shape), t.dtype) for keys, t in tensors]
    announced: list[Any] = [None] * world
    dist.all_gather_object(announced, (mine, values if rank != 0 else {}))
    # every rank works out the same order and senders
    source: dict[tuple[str, ...], tuple[int, tuple[int, ...], torch.dtype]] = {}
    out: dict[str, Any] = {}
    for r, (held, vals) in enumerate(announced):
        for keys, shape, dtype in held:
            source.setdefault(keys, (r, shape, dtype))
        for k, v in vals.items():
            out.setdefault(k, v)
    if rank == 0:
        out.update(values)
    local = {keys: t for keys, t in tensors}
    comm = device if device.type != "meta" else torch.device("cpu")
    for keys in sorted(source):
        src, shape, dtype = source[keys]
        if src == 0 and rank == 0:
            out.update(dict.fromkeys(keys, local[keys].detach().to("cpu", copy=True)))
        elif rank == src:
            dist.send(local[keys].detach().contiguous().to(comm), dst=0)
        elif rank == 0:
            buf = torch.empty(shape, dtype=dtype, device=comm)
            dist.recv(buf, src=src)
            out.update(dict.fromkeys(keys, buf.to("cpu")))
    return out if rank == 0 else {}
