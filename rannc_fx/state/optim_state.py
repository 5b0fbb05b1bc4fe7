"""The optimizer's part of a checkpoint: torch's flattened form under the parameters' names
(``state.<name>.<entry>``, ``param_groups.<name>.<hyperparameter>``), this rank's part of it,
checked against the optimizer before anything loads.

Where a stage shards its optimizer state (ZeRO-1, ``runtime/zero.py``) each replica writes
and loads the state of its own share; where it is fully sharded (ZeRO-3,
``runtime/full_shard.py``) each state tensor of a parameter's rows travels as the caller's
``form`` makes it (a DTensor of the whole, or the whole gathered) and loads back as the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.full_shard import rows_in, rows_of
from ..runtime.zero import paused, steps
from .names import StateNames

__all__ = ["check_optim", "load_optim", "optim_flat", "show"]

_SHOWN = 6


def optim_flat(optimizer: torch.optim.Optimizer, names: StateNames,
               form: Callable[[Any, torch.Tensor], Any] | None = None) -> dict[str, Any]:
    """This rank's optimizer state and settings by parameter name (``form``: what a state
    tensor of a parameter travels as)."""
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


def check_optim(optimizer: torch.optim.Optimizer, names: StateNames,
                 osd: Mapping[str, Any]) -> list[str]:
    problems = []
    flat = _FlatOptim.of(osd, names.param_names)
    if flat.unexpected:
        problems.append(
            f"optimizer state dict has {len(flat.unexpected)} key(s) that name no parameter of "
            f"this model: {show(flat.unexpected)}"
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
            f"holds: {show(missing)}"
        )
    if other:
        problems.append(
            "optimizer state entries differ (a checkpoint of another optimizer class?): "
            + show(other)
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


def load_optim(optimizer: torch.optim.Optimizer, names: StateNames,
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


def show(items: list[str]) -> str:
    shown = ", ".join(repr(x) if "'" not in x and ":" not in x else x for x in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b
