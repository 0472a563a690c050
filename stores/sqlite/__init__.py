"""A store in one SQLite file: the embedded default. Unlike the server stores it creates its tables on
open, since a file has no one else to coordinate a migration with."""

from __future__ import annotations

import os
from typing import Any, ClassVar

try:
    from sqlalchemy import create_engine, event
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert
    from sqlalchemy.engine import Engine
    from sqlalchemy.exc import DBAPIError
except ImportError as exc:  # pragma: no cover - exercised by tests/test_boundary.py in a bare venv
    raise ImportError(
        "stores.sqlite requires SQLAlchemy. Install it with: pip install 'agent-sessions[sqlite]'"
    ) from exc

from agent_sessions import ArgumentError

from .._sql import SQLStore, metadata
from .._sql.tables import sessions

BUSY_TIMEOUT_MS = 30_000


class Store(SQLStore):
    backend = "SQLite"
    schema_hint = "stores.sqlite.open creates the tables; was the file replaced after it was opened?"
    # Reads need no write lock: in WAL mode a deferred transaction reads beside a writer.
    read_options: ClassVar[dict[str, Any]] = {"sqlite_begin": "BEGIN"}

    def upsert_session(self, session: str, version: str, length: int) -> Any:
        stmt = sqlite_insert(sessions).values(session_id=session, version=version, length=length)
        return stmt.on_conflict_do_update(
            index_elements=[sessions.c.session_id], set_={"version": version, "length": length}
        )

    def is_transient(self, exc: DBAPIError) -> bool:
        return "database is locked" in str(exc.orig)

    def close(self) -> None:
        self.engine.dispose()


def open(path: str | os.PathLike[str], *, synchronous: str = "FULL") -> Store:
    """Open (creating if needed) the store in ``path``. Safe for many threads and many processes on one
    file: writes take SQLite's write lock at BEGIN IMMEDIATE, so take_steers is exactly once."""
    name = os.fspath(path)
    if not name or name == ":memory:" or name.startswith("file::memory:"):
        raise ArgumentError("sqlite.open needs a file path; for a store in memory use stores.memory.Store()")
    if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ArgumentError(f"sqlite.open(synchronous=) must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
    engine = create_engine(f"sqlite:///{name}")
    _configure(engine, synchronous.upper())
    with engine.begin() as conn:  # BEGIN IMMEDIATE: two processes opening one new file create it once
        metadata.create_all(conn)
    return Store(engine)


def _configure(engine: Engine, synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver's own BEGIN is deferred; we issue ours
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {synchronous}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def begin(conn: Any) -> None:
        conn.exec_driver_sql(conn.get_execution_options().get("sqlite_begin", "BEGIN IMMEDIATE"))


__all__ = ["Store", "open"]
