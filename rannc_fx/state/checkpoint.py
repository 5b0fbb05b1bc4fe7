"""Checkpoints under the original model's names, on any plan and world size.

    msd, osd = rannc_fx.get_state_dict(model, optimizer)            # this rank's part
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)      # every rank
    ...                                                             # any plan, any world size
    msd, osd = rannc_fx.get_state_dict(model, optimizer)            # what this rank must load
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    rannc_fx.set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

The functions mirror ``torch.distributed.checkpoint.state_dict``'s of the same names. Keys
are the plain model's ``state_dict()`` keys (a tied weight under each of its names, one
tensor); the optimizer dict is torch's flattened form (``flatten_optimizer_state_dict=True``):
``state.<name>.<entry>`` and ``param_groups.<name>.<hyperparameter>``, so each parameter's
state and group settings travel with its name, whichever stage holds it on load.

Each rank holds only its stage, so each rank's dicts hold only that. Replicas of a stage,
and every stage holding a shared weight, return the same keys; torch.distributed.checkpoint
writes each key once. Where a stage shards its optimizer state (ZeRO-1, ``runtime/zero.py``)
each replica returns the state of its own share, so the replicas' keys are disjoint and
their union is the stage's; loading gives each replica its share. ``full=True`` gathers everything to rank 0 on the CPU instead
(``gather.py``). ``get_state_dict`` and ``set_state_dict`` also take a plain ``nn.Module``,
which holds everything: the single-process model saves and loads the same checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..plan.device import device_of
from ..runtime.comm import agree
from ..runtime.full_shard import rows_in, rows_of, saved, saved_whole
from .gather import gather_full
from .names import StateNames
from .optim_state import check_optim, load_optim, optim_flat, show

__all__ = ["RankPart", "StateNames", "get_state_dict", "load_local", "set_state_dict"]


@runtime_checkable
class RankPart(Protocol):
    """A model that holds only this rank's part (``CompiledModel``): it names its tensors
    under the original model's keys, and the other ranks take part in loading."""

    device: torch.device

    def state_names(self) -> StateNames: ...


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, full: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict) of what this rank holds, under original names.

    The tensors are the live ones (``torch.distributed.checkpoint.load`` fills them in
    place). ``full=True`` gathers the whole model and optimizer to rank 0 as CPU copies, one
    copy of each tensor, loadable into the plain model with ``load_state_dict``; the other
    ranks get two empty dicts. Every rank must call it then.
    """
    names, device = _view(model)
    form = _whole if full else _sharded
    msd = {k: form(t.detach(), t) for k, t in names.local.items()}
    osd = optim_flat(optimizer, names, form) if optimizer is not None else {}
    if full:
        return gather_full(msd, osd, device)
    return msd, osd


def _sharded(t: torch.Tensor, param: torch.Tensor) -> Any:
    """``t`` (``param`` or a tensor of its state) as a checkpoint holds it: where ``param``
    holds rows of a fully sharded parameter (ZeRO-3) and ``t`` has their shape, the DTensor
    of the whole tensor (``full_shard.saved``)."""
    rows = _rows(t, param)
    return t if rows is None else saved(t, rows)


def _whole(t: torch.Tensor, param: torch.Tensor) -> Any:
    """As ``_sharded``, the whole tensor gathered (``full=True``; every replica calls it)."""
    rows = _rows(t, param)
    return t if rows is None else saved_whole(t, rows)


def _rows(t: Any, param: torch.Tensor) -> Any:
    """The rows ``param`` holds where ``t`` is a tensor of theirs (not a 0-d step count)."""
    rows = rows_of(param)
    if rows is None or not isinstance(t, torch.Tensor) or t.shape != param.shape or not t.dim():
        return None
    return rows


def set_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_state_dict: Mapping[str, Any] | None = None,
    optim_state_dict: Mapping[str, Any] | None = None,
) -> None:
    """Load this rank's part of ``model_state_dict`` and ``optim_state_dict``.

    Either dict may hold more than this rank's part (a full checkpoint, ``torch.load`` on
    every rank): keys of other stages are skipped. Every problem found (a key the model does
    not have, a shape that differs, a held key that is missing, optimizer state of another
    class) is raised on every rank, before any tensor changes.
    """
    names, _ = _view(model)
    problems: list[str] = []
    if model_state_dict is not None:
        problems += _check_model(names, model_state_dict)
    if optimizer is not None and optim_state_dict is not None:
        problems += check_optim(optimizer, names, optim_state_dict)
    if _is_compiled(model):
        agree(problems, "cannot load the checkpoint")  # every rank raises, none waits
    elif problems:
        raise ValueError("cannot load the checkpoint:\n  " + "\n  ".join(problems))
    with torch.no_grad():
        if model_state_dict is not None:
            loaded = []
            for t, keys in _tensors(names):
                src = next(model_state_dict[k] for k in keys if k in model_state_dict)
                rows = rows_of(t)
                t.copy_(src if rows is None else rows_in(src, rows))
                loaded.append(t)
            _mark_loaded(model, loaded)
    if optimizer is not None and optim_state_dict is not None:
        load_optim(optimizer, names, optim_state_dict)


def load_local(model: nn.Module, sd: Mapping[str, Any], *, strict: bool = True) -> Any:
    """``CompiledModel.load_state_dict``: this rank's part, no collectives; torch's result."""
    names, _ = _view(model)
    problems = _check_model(names, sd)
    if strict and problems:
        raise RuntimeError("error(s) in loading state_dict for CompiledModel:\n  "
                           + "\n  ".join(problems))
    missing, loaded = [], []
    with torch.no_grad():
        for t, keys in _tensors(names):
            key = next((k for k in keys if k in sd), None)
            if key is None:
                missing.extend(keys)
            elif tuple(sd[key].shape) == names.shapes[key][0]:
                rows = rows_of(t)
                t.copy_(sd[key] if rows is None else rows_in(sd[key], rows))
                loaded.append(t)
    _mark_loaded(model, loaded)
    unexpected = [k for k in sd if k not in names.shapes]
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _mark_loaded(model: nn.Module, tensors: list[torch.Tensor]) -> None:
    placement = getattr(model, "placement", None)
    if placement is not None:
        placement.loaded(tensors)


# -- the model -------------------------------------------------------------------------------


def _is_compiled(model: nn.Module) -> bool:
    return isinstance(model, RankPart)


def _view(model: nn.Module) -> tuple[StateNames, torch.device]:
    if isinstance(model, RankPart):
        return model.state_names(), model.device
    return StateNames.of(model), device_of(model)


def _tensors(names: StateNames) -> list[tuple[torch.Tensor, list[str]]]:
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for k, t in names.local.items():
        seen.setdefault(id(t), (t, []))[1].append(k)
    return list(seen.values())


def _check_model(names: StateNames, sd: Mapping[str, Any]) -> list[str]:
    problems = []
    unexpected = [k for k in sd if k not in names.shapes]
    if unexpected:
        problems.append(
            f"model state dict has {len(unexpected)} key(s) this model does not: "
            f"{show(unexpected)} (a checkpoint of another model?)"
        )
    wrong = [
        f"{k}: {tuple(v.shape)} in the state dict, {names.shapes[k][0]} in the model"
        for k, v in sd.items()
        if k in names.shapes and isinstance(v, torch.Tensor) and tuple(v.shape) != names.shapes[k][0]
    ]
    if wrong:
        problems.append(f"model state dict shapes differ: {show(wrong)}")
    missing = [keys[0] for _, keys in _tensors(names) if not any(k in sd for k in keys)]
    if missing and not sd:
        problems.append(
            f"the model state dict given here is empty but this rank holds {len(missing)} "
            f"tensor(s) ({show(missing)}): a full=True state dict is on rank 0 only; load the "
            "file on every rank (torch.load(path, mmap=True)), or save with "
            "torch.distributed.checkpoint"
        )
    elif missing:
        problems.append(
            f"model state dict lacks {len(missing)} key(s) this rank holds: {show(missing)}"
        )
    return problems
