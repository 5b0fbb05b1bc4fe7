"""Captures (and measured costs) shared by the suite: a model traced once is bound, in later
tests, to their own copy of it (``rannc_fx/capture/portable``), as ``compile()``'s rank 0
sends its graph to the other ranks.

Many distributed cases train the same model under other plans (schedules, replicas,
recomputation), and many unit tests plan the same model under other settings; its capture
(torch.export's trace) was most of their time. ``trace_model`` stands in for
``rannc_fx.planner.captured.trace_model`` in the workers ``run_ranks`` starts (``install``)
and in the test process itself (``share_traces``): it keys a capture by everything the trace
reads (the model's classes, modules and their modes, tensors' names, shapes and dtypes, plain
attributes and configs, the example's structure and tensors' shapes, the tracer's settings,
autocast) and keeps it as bytes in the session's folder (``SHARED``, set by
``conftest.py``). A key it has bound on arrival passes the receiver's fingerprint check
(``unpack``); anything that cannot travel is traced as before. In the ranks, the optimizer
step's and gradient accumulation's measured curves (``parameter_costs``, every rank of every
compile) are shared likewise, per optimizer class and settings, device and world size; and
every process of the session shares the ops' measured and counted costs (``profile_dir``: the
suite's ``test_config`` names it as the profile cache). The tests of capture itself call
``capture_pass``; a unit test that watches the capture pass is marked ``own_captures``, and a
distributed test that counts captures turns sharing off in its ranks (``NOT_SHARED``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from rannc_fx.capture.capture import capture_pass
from rannc_fx.capture.graph import autocast_state
from rannc_fx.capture.portable import NotPortable, pack, unpack
from rannc_fx.plan.config import Config
from rannc_fx.plan.device import device_of
from rannc_fx.planner import analyze, captured
from rannc_fx.profile import optimizer as optimizer_costs
from rannc_fx.shapes.infer import infer_dtypes_pass, shapes_pass
from rannc_fx.startup import rank

__all__ = ["COUNTED", "NOT_SHARED", "PASSES", "SHARED", "install", "profile_dir",
           "share_traces", "traced"]

SHARED = "TESTS_SHARED_CAPTURES"  # the environment variable naming the session's folder
ENABLED = True
# a ``run_ranks`` patch for tests that count or watch captures: every rank 0 traces
NOT_SHARED = (__name__, "ENABLED", False)
traced = captured.trace_model  # the product's own, for tests that watch it (``own_captures``)

PASSES: list[str] = []  # in a rank: the capture and inference passes it ran (``COUNTED``)


def _counted(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    PASSES.append(name)
    return fn(*args, **kwargs)


# ``run_ranks`` patches for tests that count where the graph is captured and its values'
# shapes and the other autocast states' dtypes are found: each rank's ``PASSES`` (every
# capture traced, none shared with other tests)
COUNTED = [NOT_SHARED,
           ("rannc_fx.planner.captured", "capture_pass",
            functools.partial(_counted, "capture", capture_pass)),
           ("rannc_fx.planner.captured", "shapes_pass",
            functools.partial(_counted, "shapes", shapes_pass)),
           ("rannc_fx.startup.amp", "infer_dtypes_pass",
            functools.partial(_counted, "dtypes", infer_dtypes_pass))]


def share_traces() -> None:
    """Share captures in the test process itself (``conftest.py``): the unit tier plans the
    same models again and again through ``partition()``, which traced each of them every time
    (a third of the search tests' time). Its tests of capture call ``capture_pass`` itself."""
    if os.environ.get(SHARED):
        captured.trace_model = trace_model  # type: ignore[assignment]


def install() -> None:
    """Share captures (and the optimizer's measured curves) in this process, where the
    session has a folder for them."""
    if ENABLED and os.environ.get(SHARED):
        captured.trace_model = trace_model  # type: ignore[assignment]
        rank.parameter_costs = parameter_costs  # type: ignore[assignment]
        analyze.parameter_costs = parameter_costs  # type: ignore[assignment]


def profile_dir() -> str | None:
    """The session's op-cost cache (``Config.profile_cache_dir``) for this process's plans:
    the tests of a session profile the same few models, and an op measured or counted once
    serves every later plan (as a user's cache serves their next run), in every worker and
    rank of the session. None outside a session. (A test of profiling itself gives its
    Config no cache, or a folder of its own.)"""
    folder = os.environ.get(SHARED)
    return str(Path(folder) / "profile") if folder else None


def parameter_costs(optimizer: torch.optim.Optimizer | None, device: torch.device | None,
                    spec: Any, factor: float, *, repeats: int = 3) -> optimizer_costs.ParameterCosts:
    """``optimizer_costs.parameter_costs``, measured once a session for each optimizer class
    and settings, device, world size and repeats: the curves of a plain loop over scratch
    tensors, which every compile of the suite measured again (a third of a small case's CPU)."""
    settings = None if optimizer is None else (
        type(optimizer).__qualname__,
        sorted((k, repr(v)) for k, v in optimizer.defaults.items()))
    world = dist.get_world_size() if dist.is_initialized() else 1
    key = hashlib.sha256(repr((settings, str(device), spec.name, factor, repeats, world))
                         .encode()).hexdigest()[:32]
    path = Path(os.environ[SHARED]) / f"{key}.costs"
    if path.exists():
        return pickle.loads(path.read_bytes())  # type: ignore[no-any-return]
    costs = optimizer_costs.parameter_costs(optimizer, device, spec, factor, repeats=repeats)
    part = path.with_suffix(f".{os.getpid()}")
    part.write_bytes(pickle.dumps(costs))
    part.replace(path)
    return costs


def trace_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                config: Config, *, opaque: dict[str, Any] | None = None,
                pieces: tuple[int, int] | None = None) -> captured.Captured:
    """``captured.trace_model``, from the session's folder where the same model was traced."""
    if opaque or pieces:
        return traced(model, args, kwargs, config, opaque=opaque, pieces=pieces)
    path = Path(os.environ[SHARED]) / f"{_key(model, args, kwargs, config)}.graph"
    if device_of(model).type == "meta":
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    if path.exists():
        try:
            graph = unpack(path.read_bytes(), model)
        except NotPortable:
            pass
        else:
            return captured.Captured(graph, graph.flatten_inputs(args, kwargs), {})
    fresh = traced(model, args, kwargs, config)
    try:
        data = pack(fresh.graph, model)
    except NotPortable:
        return fresh
    part = path.with_suffix(f".{os.getpid()}")
    part.write_bytes(data)
    part.replace(path)  # whole, or not there
    return fresh


def _key(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], config: Config) -> str:
    text = [repr(_about(m, 0)) + repr(m.training) + f" {name}"
            for name, m in model.named_modules(remove_duplicate=False)]
    text += [f"{name} {tuple(t.shape)} {t.dtype} {t.device.type} {t.requires_grad}"
             for name, t in (*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False))]
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    text += [str(spec), *(repr(_about(x, 0)) for x in leaves)]
    text += [repr((config.tracer, config.leaf_modules, config.batch_dim, config.dynamic_dims)),
             repr(autocast_state()), repr(torch.is_grad_enabled())]
    return hashlib.sha256("\n".join(text).encode()).hexdigest()[:32]


def _about(x: Any, depth: int) -> Any:
    """What of ``x`` a trace may read: plain values as they are, tensors by shape and dtype,
    functions by where their code is, objects by class and (a few levels down) attributes."""
    if x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return x
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
    if isinstance(x, type):
        return f"{x.__module__}.{x.__qualname__}"
    if isinstance(x, functools.partial):
        return ("partial", _about(x.func, depth), _about(x.args, depth),
                _about(x.keywords, depth))
    if isinstance(x, (types.FunctionType, types.MethodType)):
        code = x.__code__ if isinstance(x, types.FunctionType) else x.__func__.__code__
        return ("function", x.__qualname__, code.co_filename, code.co_firstlineno)
    if callable(x) and not hasattr(x, "__dict__"):
        return ("callable", getattr(x, "__qualname__", type(x).__qualname__))
    if depth > 3:
        return type(x).__qualname__
    if isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x
        return (type(x).__name__, *(_about(v, depth + 1) for v in items))
    if isinstance(x, dict):
        return {str(k): _about(v, depth + 1) for k, v in x.items()}
    if isinstance(x, nn.Module):  # its own attributes: its children are keyed on their own
        return (_about(type(x), depth), {k: _about(v, depth + 1) for k, v in vars(x).items()
                                         if k not in _MODULE_TABLES})
    if hasattr(x, "__dict__"):
        return (_about(type(x), depth), _about(vars(x), depth + 1))
    return repr(x)


# an nn.Module's own tables: its tensors and children are keyed by name, its hooks are empty
_MODULE_TABLES = frozenset(vars(nn.Module()))
