"""Watching what SQL a store sends, and making the database fail a statement, on the path production takes.

SQLite and MySQL stores run their statements on the DB-API cursor, not through SQLAlchemy (stores/_sql/
driver.py), unless something listens for SQLAlchemy's cursor events, when they switch to SQLAlchemy's
path so a tracer sees them. So these helpers never listen for cursor events there: they watch the driver
itself (SQLite's trace callback, PyMySQL's cursor class) and inject faults in the database (a trigger).
PostgreSQL statements always go through SQLAlchemy, where its cursor events are the production path.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pymysql.cursors
from sqlalchemy import Engine, event

from agent_sessions.backed import BackedStore as SQLStore

INJECTED = "injected: the server went away"
_RECORDING: list[list[tuple[str, int]]] = []
_LOCK = threading.Lock()


class _RecordingCursor(pymysql.cursors.Cursor):
    """PyMySQL's cursor, noting each statement (and rows, for executemany) while a recording is on."""

    def execute(self, query: str, args: object = None) -> int:
        _note(query, 1)
        return super().execute(query, args)  # type: ignore[no-any-return]

    def executemany(self, query: str, args: Any) -> int | None:
        _note(query, len(args))
        with _paused():
            return super().executemany(query, args)  # runs execute per batch: counted once, above


_paused_local = threading.local()


@contextmanager
def _paused() -> Iterator[None]:
    _paused_local.on = True
    try:
        yield
    finally:
        _paused_local.on = False


_LOCK_BOUND = re.compile(r"^\s*SET STATEMENT innodb_lock_wait_timeout=\d+ FOR ", re.IGNORECASE)
"""The MySQL store's per-statement lock bound (``bound_locks``): left out, so a test reads the statement."""


def _note(query: str, rows: int) -> None:
    if getattr(_paused_local, "on", False):
        return
    query = _LOCK_BOUND.sub("", query)
    with _LOCK:
        for seen in _RECORDING:
            seen.append((query.strip(), rows))


@contextmanager
def statements_of(store: SQLStore) -> Iterator[list[tuple[str, int]]]:
    """The statements ``store`` sends, in order, with the rows of each (executemany's count)."""
    seen: list[tuple[str, int]] = []
    engine = store.engine
    if engine.dialect.name == "sqlite":
        driver: sqlite3.Connection = store._held()[1]  # type: ignore[attr-defined]
        driver.set_trace_callback(lambda sql: seen.append((sql.strip(), 1)))
        try:
            yield seen
        finally:
            driver.set_trace_callback(None)
        return
    if engine.dialect.name in ("mysql", "mariadb"):
        def recording(dbapi_connection: Any, record: Any, proxy: Any) -> None:
            dbapi_connection.cursorclass = _RecordingCursor

        event.listen(engine, "checkout", recording)  # a pool event: the store keeps its driver path
        with _LOCK:
            _RECORDING.append(seen)
        try:
            yield seen
        finally:
            with _LOCK:
                _RECORDING.remove(seen)
            event.remove(engine, "checkout", recording)
        return

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append((statement.strip(), len(parameters) if executemany else 1))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


@contextmanager
def failing(engine: Engine, statement_prefix: str) -> Iterator[None]:
    """Make the database fail the statements starting with ``statement_prefix`` ("INSERT INTO
    agent_messages", "DELETE FROM agent_messages"), as a server dying mid-transaction would: a trigger
    raising an error, so the store's own path meets a real database error."""
    verb, table = statement_prefix.split()[0].upper(), statement_prefix.split()[-1]
    name = f"agent_sessions_test_fails_{verb.lower()}"
    dialect = engine.dialect.name
    if dialect == "sqlite":
        create = [f"CREATE TRIGGER {name} BEFORE {verb} ON {table} BEGIN SELECT RAISE(ABORT, '{INJECTED}'); END"]
        drop = [f"DROP TRIGGER IF EXISTS {name}"]
    elif dialect == "postgresql":
        create = [
            f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION '{INJECTED}'; END; "
            "$$ LANGUAGE plpgsql",
            f"CREATE TRIGGER {name} BEFORE {verb} ON {table} FOR EACH ROW EXECUTE FUNCTION {name}()",
        ]
        drop = [f"DROP TRIGGER IF EXISTS {name} ON {table}", f"DROP FUNCTION IF EXISTS {name}()"]
    else:
        create = [f"CREATE TRIGGER {name} BEFORE {verb} ON {table} FOR EACH ROW "
                  f"SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{INJECTED}'"]
        drop = [f"DROP TRIGGER IF EXISTS {name}"]
    with engine.begin() as conn:
        for statement in create:
            conn.exec_driver_sql(statement)
    try:
        yield
    finally:
        with engine.begin() as conn:
            for statement in drop:
                conn.exec_driver_sql(statement)
