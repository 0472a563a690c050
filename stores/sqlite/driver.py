"""Running the store's prebuilt statements straight on the sqlite3 cursor.

On SQLite a statement takes microseconds, so SQLAlchemy's execution machinery (contexts, result
objects, parameter processing) was most of a save: about 0.25 ms of the ~0.6 ms it took beside a raw
INSERT + COMMIT. Each statement is compiled by SQLAlchemy once, for this dialect; the transaction is
still SQLAlchemy's (its BEGIN IMMEDIATE, its COMMIT), and the rows come back as tuples.

When anything listens for cursor events on the engine (tracing, the test suite's statement checks),
statements go through SQLAlchemy as usual, so instrumentation sees every one of them.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import Connection, Executable
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

from .._sql.store import Rows


class Compiled:
    __slots__ = ("defaults", "names", "sql")

    def __init__(self, statement: Executable, dialect: Dialect, keys: tuple[str, ...]) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=list(keys))  # type: ignore[attr-defined]
        self.sql: str = compiled.string
        self.names: tuple[str, ...] = tuple(compiled.positiontup or ())
        self.defaults: dict[str, Any] = dict(compiled.params)

    def values(self, params: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(params[n] if n in params else self.defaults[n] for n in self.names)


class Result:
    """The part of SQLAlchemy's result the store uses."""

    __slots__ = ("cursor", "rowcount")

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.cursor = cursor
        self.rowcount = cursor.rowcount

    def first(self) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self.cursor.fetchone()
        return row

    def all(self) -> list[tuple[Any, ...]]:
        return self.cursor.fetchall()

    def scalar(self) -> Any:
        row = self.cursor.fetchone()
        return None if row is None else row[0]


class Driver:
    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._compiled: dict[tuple[int, tuple[str, ...]], Compiled] = {}

    def run(self, conn: Connection, statement: Executable, params: dict[str, Any] | list[dict[str, Any]]) -> Rows:
        if conn.dispatch.before_cursor_execute or conn.dispatch.after_cursor_execute:
            return conn.execute(statement, params)
        first = params[0] if isinstance(params, list) else params
        key = (id(statement), tuple(first))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = Compiled(statement, self.dialect, key[1])
        cursor: sqlite3.Cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            if isinstance(params, list):
                cursor.executemany(compiled.sql, [compiled.values(p) for p in params])
            else:
                cursor.execute(compiled.sql, compiled.values(params))
        except sqlite3.Error as exc:
            raise DBAPIError.instance(compiled.sql, params, exc, sqlite3.Error) from exc
        return Result(cursor)
