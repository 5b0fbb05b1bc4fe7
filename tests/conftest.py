"""Shared fixtures: the model zoo, captured once per session."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest

from rannc_fx.capture.capture import CapturedGraph, capture_pass

# name -> (module, factory); the transformers ones skip when transformers is missing.
ZOO = {
    "mlp": ("examples.models", "mlp_example"),
    "cnn": ("examples.models", "cnn_example"),
    "gpt": ("examples.models", "gpt_example"),
    "bert": ("tests.hf_models", "bert_example"),
    "gpt2": ("tests.hf_models", "gpt2_example"),
    "resnet": ("tests.hf_models", "resnet_example"),
    "llama": ("tests.hf_models", "llama_example"),
    "t5": ("tests.hf_models", "t5_example"),
}

Captured = tuple[Any, tuple[Any, ...], dict[str, Any], CapturedGraph]


def pytest_sessionstart(session: pytest.Session) -> None:
    """The fork server ``run_ranks`` forks its workers from, started before any test runs a
    torch op (``dist_utils.run_ranks`` says why)."""
    from .dist_utils import start_fork_server

    start_fork_server()


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
