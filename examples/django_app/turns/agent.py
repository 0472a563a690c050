"""The session store, built once per process from Django's own DATABASES setting.

Why not hand the store Django's connection? Django keeps one DB-API connection per thread, opened and
closed around requests, with its own autocommit and ``atomic()`` bookkeeping; the store needs a pool it
can check connections out of from any thread (a run's lease heartbeat is a thread of its own) and
transactions of its own. Sharing one connection would interleave the two transaction models. So the
store gets an SQLAlchemy engine over the same database: one per process (SQLAlchemy disposes of the
inherited pool after a fork, so prefork servers are safe).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from django.conf import settings

import agent_sessions as agent

_lock = threading.Lock()
_store: agent.Store | None = None


def store() -> agent.Store:
    global _store
    with _lock:
        if _store is None:
            _store = _from_settings(settings.DATABASES["default"])
        return _store


def _from_settings(db: dict[str, Any]) -> agent.Store:
    engine = db["ENGINE"]
    if engine.endswith("sqlite3"):
        from stores import sqlite

        return sqlite.open(str(db["NAME"]))  # the same file as Django's tables; it creates its own on open
    from sqlalchemy import URL, create_engine

    if engine.endswith("postgresql"):
        from stores import postgres

        url = URL.create("postgresql+psycopg", db["USER"] or None, db["PASSWORD"] or None, db["HOST"] or None,
                         int(db["PORT"]) if db["PORT"] else None, db["NAME"])
        return postgres.Store(create_engine(url, pool_size=5))
    if engine.endswith("mysql"):
        from stores import mysql

        url = URL.create("mysql+pymysql", db["USER"] or None, db["PASSWORD"] or None, db["HOST"] or None,
                         int(db["PORT"]) if db["PORT"] else None, db["NAME"], query={"charset": "utf8mb4"})
        return mysql.Store(create_engine(url, pool_size=5))
    raise agent.ArgumentError(f"no agent-sessions store for the Django database engine {engine!r}")


def endpoint() -> agent.Endpoint:
    return agent.endpoints.OpenAIChat(settings.AGENT_MODEL_URL, settings.AGENT_MODEL)


CODEBASE = Path(__file__).resolve().parents[2] / "sessions" / "codebase"


@agent.tool
def read_file(path: str) -> str:
    """Read a file of the code under review.

    Args:
        path: a file name, e.g. lease.go
    """
    target = (CODEBASE / path).resolve()
    if target.parent != CODEBASE:
        raise agent.ToolError(f"{path!r} is not a file of the code under review")
    return target.read_text()


def spec(session_id: str) -> agent.Spec:
    return agent.Spec(session=agent.open(session_id, store()), max_steps=8, tools=[read_file],
                      system="You are a code reviewer.")
