"""Running the store's prebuilt statements straight on the DB-API cursor (sqlite3, PyMySQL).

On SQLite a statement takes microseconds, and on MySQL a round trip about a tenth of a millisecond, so
SQLAlchemy's execution machinery (contexts, result objects, parameter processing, about 0.1 ms per
statement here) was most of a save beside a raw INSERT + COMMIT. Each statement is compiled by
SQLAlchemy once, for the engine's dialect, with its bind processors kept; the transaction is still
SQLAlchemy's (its BEGIN, its COMMIT), and the rows come back as tuples.

When anything listens for cursor events on the engine (a tracer: OpenTelemetry's SQLAlchemy
instrumentation), statements go through SQLAlchemy as usual, so it sees every one of them. The test suite
watches the driver itself (tests/sql_helpers.py), so what it checks is the path production takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Executable
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError


class Rows(Protocol):
    """What the store reads of a statement's result (SQLAlchemy's, or this driver's)."""

    @property
    def rowcount(self) -> int: ...

    @property
    def lastrowid(self) -> Any: ...

    def first(self) -> Sequence[Any] | None: ...

    def all(self) -> Sequence[Sequence[Any]]: ...

    def scalar(self) -> object: ...


PARAMSTYLES = ("qmark", "format", "pyformat", "named")
"""The paramstyles this driver binds: by position (sqlite3) or by name (PyMySQL's ``%(name)s``)."""


def instrumented(conn: Connection | Engine) -> bool:
    """Does anything listen for cursor events (on a connection, or on every connection of an engine)? Then
    statements go through SQLAlchemy, where it sees them."""
    return bool(conn.dispatch.before_cursor_execute or conn.dispatch.after_cursor_execute)


class Compiled:
    __slots__ = ("names", "pick", "positional", "processors", "sql")

    def __init__(self, statement: Executable, dialect: Dialect, keys: tuple[str, ...]) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=list(keys))  # type: ignore[attr-defined]
        self.sql: str = compiled.string
        self.positional = compiled.positiontup is not None
        defaults: dict[str, Any] = dict(compiled.params)
        bind: dict[str, Callable[[Any], Any]] = compiled._bind_processors
        self.names: tuple[str, ...] = tuple(compiled.positiontup if self.positional else defaults)
        self.processors = tuple((name, bind.get(name), defaults.get(name)) for name in self.names)
        # Positional, several parameters and nothing to convert (SQLite's append): one C call picks them.
        plain = self.positional and len(self.names) > 1 and all(p is None for _, p, _ in self.processors)
        self.pick: Callable[[dict[str, Any]], tuple[Any, ...]] | None = itemgetter(*self.names) if plain else None

    def values(self, params: dict[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        if self.pick is not None:
            try:
                return self.pick(params)
            except KeyError:  # a parameter left to its default
                pass
        values = (
            (params[n] if n in params else default) if p is None else p(params[n] if n in params else default)
            for n, p, default in self.processors
        )
        if self.positional:
            return tuple(values)
        return dict(zip(self.names, values, strict=True))


class Result:
    """The part of SQLAlchemy's result the store uses."""

    __slots__ = ("cursor", "rowcount")

    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor
        self.rowcount: int = cursor.rowcount

    @property
    def lastrowid(self) -> Any:
        """The reply's insert id (sqlite3, PyMySQL; psycopg has none)."""
        return self.cursor.lastrowid

    def first(self) -> Sequence[Any] | None:
        row: Sequence[Any] | None = self.cursor.fetchone()
        return row

    def all(self) -> Sequence[Sequence[Any]]:
        rows: Sequence[Sequence[Any]] = self.cursor.fetchall()
        return rows

    def scalar(self) -> Any:
        row = self.cursor.fetchone()
        return None if row is None else row[0]


class Driver:
    def __init__(self, dialect: Dialect, prepare: bool = False, rewrite: Callable[[str], str] | None = None) -> None:
        """``prepare``: ask the driver to prepare each statement on the server at its first use (psycopg's
        ``execute(prepare=True)``), rather than after its fifth: psycopg forgets every prepared statement at
        each ROLLBACK (a save that raised ``TranscriptConflict``, once per resumed run), and a statement
        planned afresh cost PostgreSQL more than it took to run (the event log's riding save: 0.18 ms of
        planning beside 0.14 ms of execution). A connection whose ``prepare_threshold`` is ``None`` (for
        PgBouncer in transaction mode) prepares nothing, as before."""
        if dialect.paramstyle not in PARAMSTYLES:
            raise ValueError(f"the raw driver path binds {PARAMSTYLES} parameters, not {dialect.paramstyle!r}")
        self.dialect = dialect
        self.rewrite = rewrite
        """Applied to each statement's SQL once, as it is compiled (``SQLBase.bound_locks``)."""
        self.options: dict[str, Any] = {"prepare": True} if prepare else {}
        self.pipelined = dialect.driver == "psycopg"
        """psycopg sends an ``executemany`` in pipeline mode (``_many``)."""
        self._compiled: dict[tuple[int, tuple[str, ...]], Compiled] = {}

    def compiled(self, statement: Executable, params: dict[str, Any]) -> Compiled:
        """``statement`` compiled once for this dialect and these parameter names."""
        key = (id(statement), tuple(params))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = Compiled(statement, self.dialect, key[1])
            if self.rewrite is not None:
                compiled.sql = self.rewrite(compiled.sql)
        return compiled

    def run(self, conn: Connection, statement: Executable, params: dict[str, Any] | list[dict[str, Any]]) -> Rows:
        if instrumented(conn):
            return conn.execute(statement, params)
        compiled = self.compiled(statement, params[0] if isinstance(params, list) else params)
        raw = conn.connection.driver_connection
        cursor = raw.cursor()  # type: ignore[union-attr]
        try:
            if isinstance(params, list):
                rows = [compiled.values(p) for p in params]
                if self.pipelined:
                    _many(raw, cursor, compiled.sql, rows, self.dialect.loaded_dbapi.Error)
                else:
                    cursor.executemany(compiled.sql, rows)
            else:
                cursor.execute(compiled.sql, compiled.values(params), **self.options)
        except self.dialect.loaded_dbapi.Error as exc:
            # As SQLAlchemy would: a dead connection is dropped from the pool, so the next one is fresh. So is
            # one a failure left in pipeline mode (psycopg), where its next statement would not run as sent.
            dead = self.dialect.is_disconnect(exc, raw, cursor) or _pipelining(raw)
            if dead:
                conn.invalidate(exc)
            raise DBAPIError.instance(
                compiled.sql,
                params,
                exc,
                self.dialect.loaded_dbapi.Error,
                connection_invalidated=dead,
                dialect=self.dialect,
            ) from exc
        return Result(cursor)


def _many(raw: Any, cursor: Any, statement: str, rows: list[Any], error: type[Exception]) -> None:
    """psycopg's ``executemany`` in a pipeline of ours. In one of its own, a row that fails while later
    rows are still being sent raises out of the batch, and closing the pipeline then meets those rows'
    "pipeline aborted", which psycopg can only log ("error ignored terminating <psycopg.Pipeline
    [INERROR]>", on stderr where logging is not set up), once per failed batch. Here the batch's error is
    caught inside the pipeline, so it closes cleanly (its Sync collects every result) and reports the
    aborted rows to us; the first error is the one raised."""
    failed: Exception | None = None
    try:
        with raw.pipeline():
            try:
                cursor.executemany(statement, rows)
            except error as exc:
                failed = exc
    except error as exc:
        failed = failed or exc
    if failed is not None:
        raise failed


def _pipelining(raw: Any) -> bool:
    """Is ``raw`` (a DB-API connection) still in pipeline mode? Only psycopg's can be."""
    pgconn = getattr(raw, "pgconn", None)
    return bool(pgconn is not None and pgconn.pipeline_status)
