"""The distributed tier's set-up: the fork server its ranks are forked from."""

from __future__ import annotations

import pytest

from tests.dist_utils import start_fork_server


@pytest.fixture(scope="session", autouse=True)
def _fork_server() -> None:
    """Started before this process's first distributed test, and only where one runs (under
    pytest-xdist, on the worker that runs the tier), outside every test's patches: the server
    imports what it preloads with the environment of the moment."""
    start_fork_server()
