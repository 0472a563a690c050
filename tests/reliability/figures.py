"""What the reliability suite did, in numbers: each test records its figures here, and the run ends by
printing them and writing them to $AGENT_SESSIONS_FIGURES (or <prefix>-reliability-figures.json in the temp
dir, named after $AGENT_SESSIONS_TEST_PREFIX so two copies of the suite never write one file), which is
where docs/reliability.md's table comes from. Under pytest-xdist each worker records its own tests' and
the controller, which merges them, writes the file (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tests import servers

RECORDED: dict[str, dict[str, Any]] = {}


def record(test: str, store: str, **figures: Any) -> None:
    RECORDED.setdefault(test, {})[store] = figures


WORKER_OUTPUT = "reliability_figures"
"""The key of a pytest-xdist worker's figures in what it hands the controller (``config.workeroutput``)."""


def merge(recorded: dict[str, dict[str, Any]]) -> None:
    """Add another process's figures (a pytest-xdist worker's) to this one's."""
    for test, by_store in recorded.items():
        RECORDED.setdefault(test, {}).update(by_store)


def path() -> Path:
    default = Path(tempfile.gettempdir()) / f"{servers.PREFIX}-reliability-figures.json"
    return Path(os.environ.get("AGENT_SESSIONS_FIGURES") or default)


def write() -> Path | None:
    if not RECORDED:
        return None
    out = path()
    out.write_text(json.dumps(RECORDED, indent=2, sort_keys=True))
    return out
