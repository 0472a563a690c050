"""What the reliability suite did, in numbers: each test records its figures here, and the run ends by
printing them and writing them to $AGENT_SESSIONS_FIGURES (or <prefix>-reliability-figures.json in the temp
dir, named after $AGENT_SESSIONS_TEST_PREFIX so two copies of the suite never write one file), which is
where docs/reliability.md's table comes from."""

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


def path() -> Path:
    default = Path(tempfile.gettempdir()) / f"{servers.PREFIX}-reliability-figures.json"
    return Path(os.environ.get("AGENT_SESSIONS_FIGURES") or default)


def write() -> Path | None:
    if not RECORDED:
        return None
    out = path()
    out.write_text(json.dumps(RECORDED, indent=2, sort_keys=True))
    return out
