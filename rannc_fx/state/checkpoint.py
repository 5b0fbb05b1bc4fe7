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
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..plan.device import device_of
from ..runtime.comm import agree
from ..runtime.full_shard import rows_in, rows_of, saved, saved_whole
from ..runtime.zero import paused, steps
from .gather import gather_full

__all__ = ["RankPart", "StateNames", "get_state_dict", "load_local", "set_state_dict"]

_SHOWN = 6


@dataclass
class StateNames:
    """The plain model's state-dict keys, and the tensors this rank holds under them."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]  # every key of the whole model
    local: dict[str, torch.Tensor]  # this rank's keys -> its (live) tensors
    params: dict[str, nn.Parameter]  # this rank's parameters under every name they have
    param_names: frozenset[str]  # every parameter name of the whole model

    @classmethod
    def of(cls, model: nn.Module, held: set[int] | None = None) -> StateNames:
        """``held``: ids of the tensors this rank keeps (``None``: all of them)."""
        sd = model.state_dict(keep_vars=True)
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
        local = {k: v for k, v in sd.items() if held is None or id(v) in held}
        named = dict(model.named_parameters(remove_duplicate=False))
        params = {k: p for k, p in named.items() if held is None or id(p) in held}
        return cls(shapes, local, params, frozenset(named))

    def names_of(self) -> dict[int, list[str]]:
        """id(tensor) -> its keys, for the tensors this rank holds."""
        out: dict[int, list[str]] = {}
        for k, t in self.local.items():
            out.setdefault(id(t), []).append(k)
        for k, p in self.params.items():
            if id(p) in out and k not in out[id(p)]:
                out[id(p)].append(k)
        return out


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
    osd = _optim_flat(optimizer, names, form) if optimizer is not None else {}
    if full:
        return gather_full(msd, osd, device)
    return msd, osd


def _sharded(t: torch.Tensor, param: torch.Tensor) -> Any:
    """``t`` (``param`` or a tensor of its state) as a checkpoint holds it: where ``param``
    holds rows of a fully sharded parameter (ZeRO-3) and ``t`` has their shape, the DTensor
    of the whole tensor (``full_shard.saved``)."""
    rows = rows_of(param)
    if rows is None or not isinstance(t, torch.Tensor) or t.shape != param.shape or not t.dim():
        return t
    return saved(t, rows)


def _whole(t: torch.Tensor, param: torch.Tensor) -> Any:
    """As ``_sharded``, the whole tensor gathered (``full=True``; every replica calls it)."""
    rows = rows_of(param)
    if rows is None or not isinstance(t, torch.Tensor) or t.shape != param.shape or not t.dim():
        return t
    return saved_whole(t, rows)


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
        problems += _check_optim(optimizer, names, optim_state_dict)
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
        _load_optim(optimizer, names, optim_state_dict)


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
            f"{_show(unexpected)} (a checkpoint of another model?)"
        )
    wrong = [
        f"{k}: {tuple(v.shape)} in the state dict, {names.shapes[k][0]} in the model"
        for k, v in sd.items()
        if k in names.shapes and isinstance(v, torch.Tensor) and tuple(v.shape) != names.shapes[k][0]
    ]
    if wrong:
        problems.append(f"model state dict shapes differ: {_show(wrong)}")
    missing = [keys[0] for _, keys in _tensors(names) if not any(k in sd for k in keys)]
    if missing and not sd:
        problems.append(
            f"the model state dict given here is empty but this rank holds {len(missing)} "
            f"tensor(s) ({_show(missing)}): a full=True state dict is on rank 0 only; load the "
            "file on every rank (torch.load(path, mmap=True)), or save with "
            "torch.distributed.checkpoint"
        )
    elif missing:
        problems.append(
            f"model state dict lacks {len(missing)} key(s) this rank holds: {_show(missing)}"
        )
    return problems


# -- the optimizer ---------------------------------------------------------------------------


def _optim_flat(optimizer: torch.optim.Optimizer, names: StateNames,
                form: Any = None) -> dict[str, Any]:
    by_id = names.names_of()
    fresh = _fresh_state(optimizer)
    mine = steps(optimizer)  # ZeRO-1: the state of this replica's share only
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            keys = by_id.get(id(p))
            if keys is None:
                raise ValueError(
                    f"the optimizer holds a {tuple(p.shape)} parameter that is not in this "
                    "rank's part of the model: pass the optimizer given to compile() (made "
                    "over the model's parameters)"
                )
            state = (optimizer.state.get(p) or fresh.get(p, {})) if mine(p) else {}
            if form is not None:
                state = {k: form(v, p) for k, v in state.items()}
            for name in keys:
                out.update({f"state.{name}.{k}": v for k, v in state.items()})
                out.update({f"param_groups.{name}.{k}": v for k, v in settings.items()})
    return out


def _fresh_state(optimizer: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
    """The state a param without any would have after one step, zeroed, for each such param.

    Like torch.distributed.checkpoint: one step with zero gradients and learning rate 0
    makes the state's entries (so a checkpoint can be loaded into them); they are zeroed
    (for Adam, zero moments at step 0 are the fresh state) and the optimizer keeps none.
    """
    mine = steps(optimizer)
    empty = [
        p for g in optimizer.param_groups for p in g["params"]
        if p.requires_grad and not optimizer.state.get(p) and mine(p)
    ]  # fmt: skip
    if not empty:
        return {}
    grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in grads:
            p.grad = None
        for p in empty:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        with paused(optimizer):  # no all-gather: the other replicas take no such step
            optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p, grad in grads.items():
            p.grad = grad
    fresh = {p: optimizer.state.pop(p, {}) for p in empty}
    for state in fresh.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                v.zero_()
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                state[k] = type(v)(0)
    return fresh


@dataclass
class _FlatOptim:
    """A flat optimizer state dict indexed by parameter name."""

    state: dict[str, dict[str, Any]]
    settings: dict[str, dict[str, Any]]
    unexpected: list[str]

    @classmethod
    def of(cls, osd: Mapping[str, Any], known: frozenset[str]) -> _FlatOptim:
        index: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "param_groups": {}}
        unexpected = []
        for key, value in osd.items():
            section, _, rest = key.partition(".")
            name, _, entry = rest.rpartition(".")
            if section in index and name in known:
                index[section].setdefault(name, {})[entry] = value
            else:
                unexpected.append(key)
        return cls(index["state"], index["param_groups"], unexpected)

    def first(self, section: str, keys: list[str]) -> tuple[str | None, dict[str, Any]]:
        """The first of ``keys`` with entries in ``section``, and its entries."""
        table = self.state if section == "state" else self.settings
        for name in keys:
            if name in table:
                return name, table[name]
        return None, {}


def _check_optim(optimizer: torch.optim.Optimizer, names: StateNames,
                 osd: Mapping[str, Any]) -> list[str]:
    problems = []
    flat = _FlatOptim.of(osd, names.param_names)
    if flat.unexpected:
        problems.append(
            f"optimizer state dict has {len(flat.unexpected)} key(s) that name no parameter of "
            f"this model: {_show(flat.unexpected)}"
        )
    fresh = _fresh_state(optimizer)
    by_id = names.names_of()
    mine = steps(optimizer)
    missing, other = [], []
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        if not mine(p):  # another replica keeps its state (ZeRO-1)
            continue
        keys = by_id.get(id(p), [])
        want = set(optimizer.state.get(p) or fresh.get(p, {}))
        name, got = flat.first("state", keys)
        if name is None:
            if want:
                missing.append(keys[0] if keys else f"<{tuple(p.shape)} parameter>")
            continue
        if set(got) != want:
            other.append(f"{name}: {sorted(got)} given, {sorted(want)} kept by "
                         f"{type(optimizer).__name__}")
    if missing:
        problems.append(
            f"optimizer state dict has no state for {len(missing)} parameter(s) this rank "
            f"holds: {_show(missing)}"
        )
    if other:
        problems.append(
            "optimizer state entries differ (a checkpoint of another optimizer class?): "
            + _show(other)
        )
    for gi, group in enumerate(optimizer.param_groups):
        seen: dict[str, tuple[str, Any]] = {}
        clashes: set[str] = set()  # one message per setting and group
        for p in group["params"]:
            name, settings = flat.first("param_groups", by_id.get(id(p), []))
            for k, v in settings.items():
                if k in seen and k not in clashes and not _same(seen[k][1], v):
                    clashes.add(k)
                    problems.append(
                        f"param group {gi} of this rank holds {seen[k][0]!r} and {name!r}, "
                        f"saved with different {k} ({seen[k][1]!r} and {v!r}); give them "
                        "their own param groups"
                    )
                seen.setdefault(k, (str(name), v))
    return problems


def _load_optim(optimizer: torch.optim.Optimizer, names: StateNames,
                osd: Mapping[str, Any]) -> None:
    by_id = names.names_of()
    mine = steps(optimizer)
    flat = _FlatOptim.of(osd, names.param_names)
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        ids = []
        for p in group["params"]:
            keys = by_id.get(id(p), [])
            _, given = flat.first("state", keys)
            if given and mine(p):
                rows = rows_of(p)  # ZeRO-3: the rows of what the checkpoint holds
                state[index] = dict(given) if rows is None else {
                    k: rows_in(v, rows) for k, v in given.items()}
            _, saved = flat.first("param_groups", keys)
            settings.update({k: v for k, v in saved.items() if k in settings})
            ids.append(index)
            index += 1
        groups.append({**settings, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _show(items: list[str]) -> str:
    shown = ", ".join(repr(x) if "'" not in x and ":" not in x else x for x in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b
