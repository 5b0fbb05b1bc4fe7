"""Shared fixtures: the model zoo, captured once per session."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rannc_fx.capture.capture import CapturedGraph, capture_pass
from rannc_fx.planner import captured

from .captures import SHARED, share_traces, traced
from .harness import ZOO  # name -> (module, factory); the transformers ones need transformers

Captured = tuple[Any, tuple[Any, ...], dict[str, Any], CapturedGraph]


# tests/unit: one process, no ranks; tests/distributed: gloo ranks, torchrun agents, scripts
# (not "dist": pytest and ruff skip folders of that name unless told otherwise)
UNIT, DIST = Path(__file__).parent / "unit", Path(__file__).parent / "distributed"


_MADE: list[str] = []  # the session's folder, in the process that made it (and removes it)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The folder of what the session shares (``captures.py``): made by the session's first
    process (pytest-xdist's controller, or the one process of a run without workers) before
    any worker starts, so that every worker and every rank finds the same one in its
    environment. The user's cache of op costs (``Config.profile_cache_dir``'s default, under
    ``XDG_CACHE_HOME``) is a folder of it too: a test never reads or writes the user's."""
    if not os.environ.get(SHARED):
        folder = tempfile.mkdtemp(prefix="rannc_fx-session-")
        _MADE.append(folder)
        os.environ[SHARED] = folder
        os.environ["XDG_CACHE_HOME"] = str(Path(folder) / "cache")
    workers = getattr(session.config, "workerinput", {}).get("workercount")
    if getattr(session.config.option, "dist", "no") != "no" and workers is None:
        return  # pytest-xdist's controller: its workers run the tests
    if workers:  # each worker its share of the cores: more threads than cores spin idle
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    share_traces()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)
        del os.environ[SHARED]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier of each test, as its folder says: ``-m unit`` or ``-m "not dist"`` selects the
    tests that start no process.

    Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) the distributed tier is two
    groups, each run on one worker in turn: the cases on forked gloo ranks (``ranks``), whose
    ranks use both cores and would wait on each other's past their timeouts side by side,
    and those that run whole processes (``scripts``: a script's ranks, torchrun agents),
    which spend most of their time starting Python and torch, beside the first. The unit
    tier shares the workers."""
    for item in items:
        path = Path(item.path)
        if DIST in path.parents:
            item.add_marker(pytest.mark.dist)
            group = "scripts" if item.get_closest_marker("scripts") else "ranks"
            item.add_marker(pytest.mark.xdist_group(group))
        elif UNIT in path.parents:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _own_captures(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``own_captures`` traces its models itself (``captures.share_traces``)."""
    if request.node.get_closest_marker("own_captures") is not None:
        monkeypatch.setattr(captured, "trace_model", traced)


def zoo_example(name: str, **kw: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    module, factory = ZOO[name]
    return getattr(importlib.import_module(module), factory)(**kw)


@pytest.fixture(scope="session")
def zoo() -> Callable[..., Captured]:
    """``zoo(name, tracer)`` -> (model, args, kwargs, captured), built once per session.

    Tests that run the graph share the model with later tests: compare against a
    ``copy.deepcopy(model)`` taken in the test, not against a fresh model.
    """
    cache: dict[tuple[str, str], Captured] = {}

    def get(name: str, tracer: str = "auto") -> Captured:
        if (name, tracer) not in cache:
            model, args, kwargs = zoo_example(name)
            cg = capture_pass(model, args, kwargs, tracer=tracer)  # type: ignore[arg-type]
            cache[name, tracer] = (model, args, kwargs, cg)
        return cache[name, tracer]

    return get
