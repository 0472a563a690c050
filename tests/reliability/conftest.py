from __future__ import annotations

from typing import Any

import pytest

import storetest.processes

from . import figures
from .backends import STORES, Backend, prepare


@pytest.fixture(scope="module", params=STORES)
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    return prepare(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def processes() -> Any:
    """Children come from a fork server started once: a fresh interpreter (no inherited threads or
    connections) that forks each child, so fifty kills cost seconds, not a minute of interpreter starts
    (what it preloads: tests/conftest.py's PRELOAD)."""
    return storetest.processes.context()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The figures go to the file now (tests/conftest.py prints them); a pytest-xdist worker hands them to the
    controller instead, which merges every worker's and writes them once (tests/conftest.py)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output[figures.WORKER_OUTPUT] = figures.RECORDED
    else:
        figures.write()
