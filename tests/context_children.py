"""What the compaction concurrency tests (tests/test_context_resume.py) run in other processes, each on the
store named by its kind and where it is (an SQLite file, or a database URL):

    python -m tests.context_children steer KIND WHERE SESSION TEXT
    python -m tests.context_children read KIND WHERE SESSION OUT STOP      # a replica's reads, until STOP exists
    python -m tests.context_children answer KIND WHERE SESSION MODEL_URL   # a run taking the session over
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import agent_sessions as agent
from agent_sessions.context import Window
from agent_sessions.endpoints import OpenAIChat


def store_at(kind: str, where: str) -> Any:
    if kind == "sqlite":
        from stores import sqlite

        return sqlite.open(where)
    from sqlalchemy import create_engine

    from stores import mysql, postgres

    return (postgres.Store if kind == "postgres" else mysql.Store)(create_engine(where, pool_size=2))


def digest(msgs: Sequence[agent.Message]) -> str:
    return hashlib.sha256("\n".join(m.to_json() for m in msgs).encode()).hexdigest()


def read(session: agent.StoreSession, out: Path, stop: Path) -> None:
    """Read the session whole and from the end, over and over, noting what each read saw, until ``stop``
    exists (a minute at most)."""
    deadline = time.monotonic() + 60
    with out.open("a") as f:
        while not stop.exists() and time.monotonic() < deadline:
            whole = session.messages()
            recent = session.messages(recent=True)
            start = recent.start if isinstance(recent, agent.Tail) else 0
            f.write(json.dumps({"length": len(whole), "digest": digest(whole), "start": start,
                                "recent": len(recent), "recent_digest": digest(recent)}) + "\n")
            f.flush()


def main() -> None:
    mode, kind, where, sid, *rest = sys.argv[1:]
    store = store_at(kind, where)
    session = agent.open(sid, store)
    if mode == "steer":
        session.steer(rest[0])
    elif mode == "read":
        read(session, Path(rest[0]), Path(rest[1]))
    elif mode == "answer":
        spec = agent.Spec(session=session, context=Window(3000))
        msgs = session.messages()
        msgs.append(agent.Message.user("B's question"))
        result = agent.Runner().run(spec, msgs, OpenAIChat(rest[0] + "/v1", "m", backoff=0.01))
        print(json.dumps({"length": len(result.messages), "digest": digest(result.messages)}))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
