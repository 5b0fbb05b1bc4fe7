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

from rannc_fx.capture.capture import CapturedGraph, capture_pass
from rannc_fx.planner import captured

from .captures import SHARED, share_traces, traced
from .harness import ZOO  # name -> (module, factory); the transformers ones need transformers

Captured = tuple[Any, tuple[Any, ...], dict[str, Any], CapturedGraph]


# tests/unit: one process, no ranks; tests/distributed: gloo ranks, torchrun agents, scripts
# (not "dist": pytest and ruff skip folders of that name unless told otherwise)
UNIT, DIST = Path(__file__).parent / "unit", Path(__file__).parent / "distributed"


def pytest_sessionstart(session: pytest.Session) -> None:
    """The folder of what the session shares (``captures.py``), which this process's plans
    use for their captures and the ranks find in the environment they are given; and the
    fork server ``run_ranks`` forks its workers from, started before any test runs a torch
    op (``dist_utils.run_ranks`` says why), except for a run of the unit tier alone."""
    from .dist_utils import start_fork_server

    if getattr(session.config.option, "dist", "no") != "no" and not hasattr(
            session.config, "workerinput"):
        return  # pytest-xdist's controller: its workers run the tests
    os.environ[SHARED] = tempfile.mkdtemp(prefix="rannc_fx-captures-")
    share_traces()
    paths = [Path(a.split("::")[0]).resolve() for a in session.config.args]
    if not (paths and all(p == UNIT or UNIT in p.parents for p in paths)):
        start_fork_server()


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.pop(SHARED, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier of each test, as its folder says: ``-m unit`` or ``-m "not dist"`` selects the
    tests that start no process.

    Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) the distributed tier is one
    group, run on one worker in turn: its ranks use both cores, and two of its cases side by
    side would wait on each other's ranks past their timeouts. The unit tier shares the
    workers."""
    for item in items:
        path = Path(item.path)
        if DIST in path.parents:
            item.add_marker(pytest.mark.dist)
            item.add_marker(pytest.mark.xdist_group("ranks"))
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
