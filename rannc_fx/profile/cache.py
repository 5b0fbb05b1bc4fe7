"""Key ops by what decides their cost, and keep op costs in memory and on disk.

Two nodes with the same key cost the same, so the profile measures each key once: the 96
layers of a transformer share the keys of its first layer. A key is the op (ATen overload,
qualified function name, tensor method, or a module's class with its constructor-relevant
attributes and parameter shapes) plus every argument: tensors by dtype, shape, stride and
``requires_grad``, everything else by value.

The disk cache never misleads a plan: its file is named by everything that changes a cost
beyond the op (the cache format, the device and its thread count, the torch version, the
cost model and the autocast state the op ran under), an entry that is not a cost (negative,
not finite) is dropped with a warning and measured again, and a directory or file another
user owns, or that every user may write, is not read or written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import stat
import tempfile
import types
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..capture.graph import autocast_state
from .opcost import OpCost

__all__ = ["CostCache", "device_name", "op_key", "qualname"]

log = logging.getLogger("rannc_fx")

CACHE_FORMAT = 7  # 3: OpCost.views; 4: OpCost.kept_bytes, kept_flops, kept_moved;
# 5: policy_s, kept_outputs, kept_saved; 6: w_inputs, w_outputs, w_internal, w_grads;
# 7: cast_bytes, FLOPs by kernel dtype, fused attention counted


def qualname(obj: Any) -> str:
    """``aten.mm.default``, ``torch.nn.functional.relu``, ``torch.nn.modules.linear.Linear``."""
    if isinstance(obj, torch._ops.OperatorBase | torch._ops.OpOverloadPacket):
        return str(obj)
    mod = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{mod}.{name}" if mod else str(name)


def _tensor_sig(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"T({dtype},{tuple(t.shape)},{t.stride()},{int(t.requires_grad)})"


def arg_sig(x: Any, modules: dict[int, str] | None = None) -> str:
    """A string that is equal for two arguments exactly when the op would cost the same."""
    if isinstance(x, torch.Tensor):
        return _tensor_sig(x)
    if isinstance(x, list | tuple):
        inner = ",".join(arg_sig(v, modules) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k!r}:{arg_sig(v, modules)}" for k, v in sorted(x.items())) + "}"
    if isinstance(x, nn.Module):
        return "M(" + module_sig(x, modules) + ")"
    if x is None or isinstance(x, bool | int | float | complex | str | slice | torch.dtype | torch.device
                               | torch.memory_format | torch.layout | torch.Size | types.EllipsisType):
        return repr(x)
    if callable(x):
        return qualname(x)
    return f"{type(x).__qualname__}:{x!r}"


def module_sig(m: nn.Module, memo: dict[int, str] | None = None) -> str:
    """Class, plain attributes and parameter/buffer shapes of a module and its children."""
    if memo is not None and id(m) in memo:
        return memo[id(m)]
    parts = []
    for name, sub in m.named_modules(remove_duplicate=False):
        attrs = sorted(
            (k, arg_sig(v)) for k, v in vars(sub).items()
            if not k.startswith("_") and not isinstance(v, nn.Module | torch.Tensor)
        )
        code = sub.code if isinstance(sub, fx.GraphModule) else ""
        parts.append(f"{name}:{qualname(type(sub))}{attrs}{code}")
    for name, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]:
        parts.append(f"{name}={_tensor_sig(t)}")
    sig = ";".join(parts)
    if memo is not None:
        memo[id(m)] = sig
    return sig


def op_key(node: fx.Node, gm: fx.GraphModule, args: Any, kwargs: Any, memo: dict[int, str],
           state: tuple[int, ...] = ()) -> str:
    """The cache key of ``node`` called with these (real or fake) arguments, of which the
    input tensors at ``state`` (positions in ``tensors((args, kwargs))``) are parameters,
    buffers or views of them (what the op saves of them, and what its split backward holds
    for their gradients, is not an activation's)."""
    if node.op == "call_module":
        op = "module:" + module_sig(gm.get_submodule(str(node.target)), memo)
    elif node.op == "call_method":
        op = f"method:{node.target}"
    else:
        op = qualname(node.target)
    text = f"{op}|{arg_sig(args, memo)}|{arg_sig(kwargs, memo)}"
    if state:
        text += f"|state:{state}"
    return hashlib.sha1(text.encode()).hexdigest()


def device_name(device: torch.device | None) -> str:
    """What a measured cost depends on beyond the op: the device model and the thread count."""
    if device is None:
        return "fake"
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu:{_cpu_model()}:{torch.get_num_threads()}threads"
    return str(device)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CostCache:
    """Op costs by key, loaded from and saved to ``cache_dir`` (one JSON file per device,
    torch, cost model and autocast state)."""

    def __init__(self, cache_dir: Path | None, *, device: str, cost_model: str) -> None:
        autocast = ",".join(f"{d}:{t}" for d, t in autocast_state()) or "off"
        self.tag = {"format": CACHE_FORMAT, "device": device, "torch": torch.__version__,
                    "cost_model": cost_model, "autocast": autocast}
        digest = hashlib.sha1(json.dumps(self.tag, sort_keys=True).encode()).hexdigest()[:16]
        self.path = (Path(cache_dir) / f"profile-{cost_model}-{digest}.json"
                     if cache_dir is not None and _private(Path(cache_dir)) else None)
        self.entries: dict[str, OpCost] = {}
        self.new: dict[str, OpCost] = {}
        self.from_disk = 0
        if self.path is not None and self.path.exists() and _private(self.path):
            self.entries = self._read(self.path)
            self.from_disk = len(self.entries)

    def get(self, key: str) -> OpCost | None:
        return self.entries.get(key)

    def put(self, key: str, cost: OpCost) -> None:
        self.entries[key] = cost
        self.new[key] = cost

    def save(self) -> None:
        """Merge the new entries into the file (others may have written it meanwhile)."""
        if self.path is None or not self.new:
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(self.path.parent) or (self.path.exists() and not _private(self.path)):
            return
        merged = self._read(self.path) if self.path.exists() else {}
        merged.update(self.new)
        doc = {**self.tag, "entries": {k: v.to_json() for k, v in merged.items()}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".profile-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)
        self.new = {}

    def _read(self, path: Path) -> dict[str, OpCost]:
        try:
            doc = json.loads(path.read_text())
            if {k: doc.get(k) for k in self.tag} != self.tag:
                return {}
            found = {k: OpCost.from_json(v) for k, v in doc["entries"].items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable profile cache %s (%s)", path, e)
            return {}
        bad = [k for k, c in found.items() if not _valid(c)]
        if bad:
            log.warning("profile cache %s: %d entr%s with negative or non-finite costs ignored "
                        "(measured again)", path, len(bad), "y" if len(bad) == 1 else "ies")
        return {k: c for k, c in found.items() if k not in bad}


def _valid(cost: OpCost) -> bool:
    """Whether every figure of ``cost`` is a finite, non-negative number."""
    for f in dataclasses.fields(cost):
        value = getattr(cost, f.name)
        for x in value if isinstance(value, tuple) else (value,):
            if x is None or isinstance(x, str):
                continue
            if isinstance(x, bool) or not isinstance(x, int | float):
                return False
            if not math.isfinite(x) or x < 0:
                return False
    return True


def _private(path: Path) -> bool:
    """Whether ``path`` (where it exists) is this user's and not writable by every user: a
    cache others can write could feed any plan made from it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not hasattr(os, "getuid"):
        return True
    if st.st_uid != os.getuid() or st.st_mode & stat.S_IWOTH:
        log.warning("not using the profile cache at %s: %s; use a directory of your own "
                    "(Config.profile_cache_dir)", path,
                    "another user owns it" if st.st_uid != os.getuid()
                    else "others may write it")
        return False
    return True
