"""Watching what SQL a store sends, and making the database fail a statement, on the path production takes.

Every SQL store runs its statements through SQLAlchemy, so its cursor events see each one (with the rows of
an executemany), and its connection events each COMMIT; faults are injected in the database (a trigger).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event

from agent_sessions.backed import BackedStore as SQLStore

INJECTED = "injected: the server went away"
_LOCK = threading.Lock()


@contextmanager
def statements_of(store: SQLStore) -> Iterator[list[tuple[str, int]]]:
    """The statements ``store`` sends, in order, with the rows of each (executemany's count), and a
    ``COMMIT`` for each commit (SQLite's BEGIN is a statement of the store's)."""
    seen: list[tuple[str, int]] = []
    engine: Engine = store.engine  # type: ignore[attr-defined]

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        with _LOCK:
            seen.append((" ".join(statement.split()), len(parameters) if executemany else 1))

    def commit(conn: Any) -> None:
        with _LOCK:
            seen.append(("COMMIT", 1))

    event.listen(engine, "before_cursor_execute", record)
    event.listen(engine, "commit", commit)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)
        event.remove(engine, "commit", commit)


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
