"""A store in one SQLite file: the embedded default. Unlike the server stores it creates its tables on
open, since a file has no one else to coordinate a migration with. Every write is one ``BEGIN IMMEDIATE``
transaction (SQLite's write lock is the session's lock, and everyone's), every read a deferred ``BEGIN``
beside the writer; the store's clock is this process's (a file lives on one machine).
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Any

try:
    from sqlalchemy import ColumnElement, Connection, Float, and_, bindparam, create_engine, event, func
    from sqlalchemy.dialects.sqlite import dialect as sqlite_dialect
    from sqlalchemy.engine import Engine
    from sqlalchemy.exc import DBAPIError
except ImportError as exc:  # pragma: no cover - exercised by tests/test_boundary.py in a bare venv
    raise ImportError(
        "stores.sqlite requires SQLAlchemy. Install it with: pip install 'stored-agent-sessions[sqlite]'"
    ) from exc

from agent_sessions import ArgumentError
from agent_sessions.backed import BackedStore
from agent_sessions.backend import Change

from .._sql import SchemaMismatch, SQLBackend, ddl, metadata
from .._sql.tables import SCHEMA_VERSION

SCHEMA: list[str] = [*ddl(sqlite_dialect()), f"PRAGMA user_version = {SCHEMA_VERSION}"]
"""What ``open`` runs in a new file (each ``IF NOT EXISTS``), the schema stamped as the file's user_version."""
BUSY_TIMEOUT_MS = 30_000
POOL_SIZE = 8
"""Connections of the file kept open between operations; more threads at once open more, closed after."""


class Backend(SQLBackend):
    hint = "open the file with stores.sqlite.open, which creates them"
    delete_many = SQLBackend.delete_page  # BatchDeletes: a page of prune is one BEGIN IMMEDIATE

    def begin(self, conn: Connection, write: Change | None) -> None:
        conn.exec_driver_sql("BEGIN" if write is None else "BEGIN IMMEDIATE")

    def clock(self) -> ColumnElement[float]:
        """This machine's clock, read as each statement runs (so a statement built once reads it anew)."""
        return bindparam("clock", callable_=time.time, type_=Float)

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        """SQLite's LIKE ignores ASCII case, so: the first characters equal the prefix (exact, by the
        BINARY collation), and a lower bound the index can start from."""
        return and_(column >= prefix, func.substr(column, 1, len(prefix)) == prefix)

    def retry(self, exc: DBAPIError) -> bool:
        return "database is locked" in str(exc.orig)

    def close(self) -> None:
        self.engine.dispose()

    def __repr__(self) -> str:
        return repr(self.engine.url.database)


class Store(BackedStore):
    """Sessions in one SQLite file (``open``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        with engine.connect() as conn:
            limit = conn.connection.dbapi_connection.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)  # type: ignore[union-attr]
        super().__init__(Backend(engine, "SQLite store"), max_message_bytes=limit, name="SQLite store")

    def __repr__(self) -> str:
        return f"sqlite.open({self.engine.url.database!r})"


def open(path: str | os.PathLike[str], *, synchronous: str = "FULL", watch_cancels: bool = True) -> Store:
    """Open (creating if needed) the store in ``path``. Safe for many threads and many processes on one
    file. ``synchronous``: SQLite's setting (NORMAL: faster commits, not power-loss durable).
    ``watch_cancels`` is accepted for compatibility: a run reads its cancel flag before each idempotent tool.
    A file of another schema raises ``SchemaMismatch``."""
    del watch_cancels
    name = os.fspath(path)
    if not name or name == ":memory:" or name.startswith("file::memory:"):
        raise ArgumentError("sqlite.open needs a file path; for a store in memory use stores.memory.Store()")
    if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ArgumentError(f"sqlite.open(synchronous=) must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
    engine = create_engine(f"sqlite:///{name}", pool_size=POOL_SIZE, max_overflow=-1)
    _configure(engine, synchronous.upper())
    with engine.connect() as conn:  # BEGIN IMMEDIATE: two processes opening one file create it once
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        tables = {r[0] for r in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "agent_sessions" in tables and "agent_store" not in tables:
            engine.dispose()
            raise SchemaMismatch(f"SQLite store: {name} was written by an earlier version of agent-sessions "
                                 f"(no table agent_store); this version reads and writes schema {SCHEMA_VERSION}")
        for statement in SCHEMA:  # as the Django app's migration runs them: the same file either way
            conn.exec_driver_sql(statement)
        conn.commit()
    return Store(engine)


def _configure(engine: Engine, synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver's own BEGIN is deferred; the backend issues its own
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {synchronous}")
        cursor.close()


__all__ = ["Backend", "SchemaMismatch", "Store", "metadata", "open"]
