"""The PostgreSQL backend: every write one call of ``agent_sessions_write`` (write.sql), every read one SELECT
(one snapshot, the messages, steers and queue it asks for as JSON arrays beside the row), each in autocommit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import ColumnElement, Connection, Dialect, Engine, TextClause, select, text
from sqlalchemy.exc import DBAPIError

from agent_sessions.backend import (
    Change,
    Guard,
    Queued,
    Snapshot,
    Steer,
    Want,
    Written,
    change_json,
    guard_json,
    new_incarnation,
)
from agent_sessions.errors import AgentError, SessionLocked, StoreError

from .._sql import SCHEMA_VERSION, SchemaMismatch, SQLBackend
from .._sql.backend import row_of
from .._sql.clock import db_now
from .listener import Listener

_WRITE = text("SELECT agent_sessions_write(:sid, CAST(:guard AS jsonb), CAST(:change AS jsonb), :inc, :lock_wait)")
_NOW = "extract(epoch FROM clock_timestamp())::double precision"
_READ = text(
    "SELECT s.*, " + _NOW + " AS now_, m.start AS start_, "
    "CASE WHEN m.start IS NOT NULL THEN (SELECT json_agg(body ORDER BY idx) FROM agent_messages "
    "  WHERE session_id = s.session_id AND idx >= m.start AND idx < m.stop) END AS messages_, "
    "CASE WHEN :steers THEN (SELECT json_agg(json_build_array(id, body, steer_key) ORDER BY id) "
    "  FROM agent_steers WHERE session_id = s.session_id) END AS steers_, "
    "CASE WHEN :queue THEN (SELECT json_agg(json_build_array(id, queue_key, body) ORDER BY id) "
    "  FROM agent_queue WHERE session_id = s.session_id) END AS queue_ "
    "FROM agent_sessions AS s, LATERAL (SELECT CASE WHEN CAST(:start AS integer) IS NOT NULL "
    "  OR CAST(:last AS integer) IS NOT NULL THEN coalesce(CAST(:start AS integer), greatest(least("
    "  coalesce(CAST(:stop AS integer), s.length), s.length) - CAST(:last AS integer), 0)) END AS start, "
    "  least(coalesce(CAST(:stop AS integer), s.length), s.length) AS stop) AS m "
    "WHERE s.session_id = :sid"
)
_DELETE_MANY = text(
    "SELECT json_agg((agent_sessions_write(x.sid, CAST(x.guard AS jsonb), CAST('{\"delete\": true}' AS jsonb), "
    "'', :lock_wait)->>'done')::boolean ORDER BY x.n) FROM unnest(CAST(:sids AS text[]), CAST(:guards AS text[])) "
    "WITH ORDINALITY AS x(sid, guard, n)"
)
_LAST_SEQ = text("SELECT last_seq FROM agent_sessions WHERE session_id = :sid")
_EARLIER = text("SELECT to_regclass('agent_sessions') IS NOT NULL AND to_regclass('agent_store') IS NULL AS earlier")


class Backend(SQLBackend):
    """``lock_wait``: seconds a write waits for the row's lock."""

    hint = "create the tables by running stores.postgres.SCHEMA in your migration"
    listeners: tuple[Listener, ...] = ()
    """The store's listeners, whose threads and connections a forked child drops (``after_fork``)."""

    def __init__(self, engine: Engine, lock_wait: float | None = None) -> None:
        super().__init__(engine, "PostgreSQL store")
        self.lock_wait = lock_wait
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    def after_fork(self) -> None:
        super().after_fork()
        for listener in self.listeners:
            listener.forget()

    def clock(self) -> ColumnElement[float]:
        """The server's clock, read once per statement (an InitPlan): ``clock_timestamp()`` is volatile, so in
        a condition of its own it would be a filter on every row an index gives, never the index's bound
        (an ``Idle`` listing read every session's entry of ``agent_sessions_updated``)."""
        return select(db_now()).scalar_subquery()

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        """Autocommit: each statement is its own transaction, and a listing or an identity is one
        statement (no BEGIN and COMMIT round trips around it)."""
        with self._autocommit.connect() as conn:
            yield conn

    def refine(self, exc: DBAPIError, what: str) -> AgentError | None:
        if getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_not_available: lock_wait ran out
            return SessionLocked(f"{self.name}: {what}: another transaction held the session's row longer than "
                                 f"lock_wait ({self.lock_wait} s); nothing was written")
        if getattr(exc.orig, "sqlstate", None) == "42703":  # undefined column: another layout's tables
            return StoreError(f"{self.name}: {what} failed: the tables are not those of schema {SCHEMA_VERSION} "
                              f"({str(exc.orig).strip()}); {self.hint}")
        if getattr(exc.orig, "sqlstate", None) == "42883":  # undefined function: the schema's function is missing
            return StoreError(f"{self.name}: function agent_sessions_write does not exist ({what}); {self.hint}")
        return None

    @property
    def identity(self) -> str:
        """``SQLBackend``'s, read once; a database holding an earlier version's tables (``agent_sessions``
        without ``agent_store``) is ``SchemaMismatch``, never taken for one missing its tables."""
        try:
            return super().identity
        except StoreError as exc:
            if isinstance(exc, SchemaMismatch):
                raise
            earlier = self._once("identity", "", lambda conn: self._first(conn, _EARLIER, {}))
            if not (earlier and earlier["earlier"]):
                raise
            raise SchemaMismatch(f"{self.name}: the database holds the tables of an earlier version of "
                                 f"agent-sessions (agent_sessions, and no agent_store); this version reads and "
                                 f"writes schema {SCHEMA_VERSION} only") from exc

    def read(self, session: str, want: Want) -> Snapshot | None:
        params = {"sid": session, "start": want.start, "stop": want.stop, "last": want.last,
                  "steers": want.steers, "queue": want.queue}
        got = self._once("read", session, lambda conn: self._first(conn, _READ, params))
        if got is None:
            return None
        return Snapshot(row_of(got, got["now_"]), got["start_"] or 0, got["messages_"] or [],
                        [Steer(*s) for s in got["steers_"] or ()], [Queued(*q) for q in got["queue_"] or ()])

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        params = {"sid": session, "guard": json.dumps(guard_json(guard)), "change": json.dumps(change_json(change)),
                  "inc": new_incarnation() if change.exist else "", "lock_wait": self.lock_wait}
        got = self._once("write", session, lambda conn: self._first(conn, _WRITE, params, value=True), writes=True)
        row = got["row"]
        return Written(got["done"], None if row is None else row_of(row, got["now"]))

    def delete_many(self, guarded: Sequence[tuple[str, Guard]]) -> list[bool]:
        """``BatchDeletes``: one statement calling ``agent_sessions_write`` for each session, so one
        transaction and one round trip."""
        params = {"sids": [s for s, _ in guarded], "guards": [json.dumps(guard_json(g)) for _, g in guarded],
                  "lock_wait": self.lock_wait}
        got = self._once("prune", "", lambda conn: self._first(conn, _DELETE_MANY, params, value=True), writes=True)
        return [bool(done) for done in got or ()]

    def last_seq(self, session: str) -> int:
        """The session's last event number (0: none): what a follower's wait asks."""
        got = self._once("wait_for_events", session, lambda conn: self._first(conn, _LAST_SEQ, {"sid": session}))
        return 0 if got is None else int(got["last_seq"])

    @contextmanager
    def _statement(self) -> Iterator[Any]:
        """A pooled psycopg connection in autocommit for one statement, then as it was: no ``Connection``, whose
        checkout and isolation-level switch cost a write about 40 µs of client CPU. Through SQLAlchemy while
        anything listens for its cursor events (a tracer), so it sees every statement."""
        pooled = self._pooled()
        if pooled is None:
            with self._connection() as conn:
                yield conn
            return
        driver: Any = pooled.driver_connection
        try:
            before, driver.autocommit = driver.autocommit, True
        except psycopg.Error as exc:  # a connection psycopg knows is closed; nothing was sent
            pooled.invalidate(exc)
            raise DBAPIError.instance("", None, exc, psycopg.Error, connection_invalidated=True) from exc
        try:
            yield pooled
        finally:
            if not driver.closed and driver.autocommit != before:
                driver.autocommit = before
            pooled.close()

    def _first(self, handle: Any, statement: TextClause, params: dict[str, Any], value: bool = False) -> Any:
        """The first row of one of this module's statements, by column name (``value``: its first column's
        value, with no description made, a sixteenth of a write's client CPU). Run on psycopg's cursor, prepared
        on the server at its first use (``prepare_threshold=None`` on the connection, for PgBouncer in
        transaction mode: never): SQLAlchemy's execution path cost a write about 0.6 ms more here, a round
        trip's worth. A driver's error is SQLAlchemy's (the pooled connection invalidated when it broke)."""
        if isinstance(handle, Connection):  # traced
            result = handle.execute(statement, params)
            if value:
                return result.scalar()
            found = result.mappings().first()
            return None if found is None else dict(found)
        sql = _compiled(statement, self.engine.dialect)
        driver: Any = handle.driver_connection
        cursor = driver.cursor()
        try:
            cursor.execute(sql, params, prepare=None if driver.prepare_threshold is None else True)
            row = cursor.fetchone()
            if row is None:
                return None
            return row[0] if value else dict(zip([c.name for c in cursor.description], row, strict=True))
        except psycopg.Error as exc:
            broken = driver.broken or driver.closed
            if broken:
                handle.invalidate(exc)
            raise DBAPIError.instance(sql, params, exc, psycopg.Error, connection_invalidated=broken) from exc
        finally:
            cursor.close()

    def __repr__(self) -> str:
        return f"postgres {self.engine.url.render_as_string(hide_password=True)!r}"


@functools.cache
def _compiled(statement: TextClause, dialect: Dialect) -> str:
    """``statement`` in the driver's own parameter style (one of this module's few, so cached for good)."""
    return str(statement.compile(dialect=dialect))
