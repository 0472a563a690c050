from __future__ import annotations

import json
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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    out = figures.write()
    if out is not None:
        terminalreporter.write_sep("-", f"reliability figures (also in {out})")
        terminalreporter.write_line(json.dumps(figures.RECORDED, sort_keys=True))


def pytest_sessionfinish(session: pytest.Session) -> None:
    figures.write()


