"""A store in PostgreSQL, over the caller's SQLAlchemy Engine (psycopg 3). It runs no DDL: the caller's
migration runs ``SCHEMA``."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    from sqlalchemy import Connection, Engine, TextClause, text
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.exc import DBAPIError
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.postgres requires SQLAlchemy and psycopg. "
        "Install them with: pip install 'stored-agent-sessions[postgres]'"
    ) from exc

from agent_sessions import validate

from .._known import REMEMBER, REMEMBER_BYTES
from .._sql import SQLStore, ddl, metadata
from .._sql import statements as sql
from .._sql.tables import sessions, tags

SCHEMA: str = ";\n\n".join(ddl(postgresql.dialect())) + ";\n"  # type: ignore[no-untyped-call]
"""The DDL, as one string: ``conn.exec_driver_sql(postgres.SCHEMA)`` in your migration."""

MIGRATIONS: dict[int, list[str]] = {
    2: [
        # 0.1 -> schema 2: the lease and the journal move onto the session's row, where one row lock fences
        # every write of a run. Run with no run in flight (a lease moves with epoch 1, unknown to 0.1's runs).
        "ALTER TABLE agent_sessions ALTER COLUMN version DROP NOT NULL",
        "ALTER TABLE agent_sessions ADD COLUMN journal TEXT, ADD COLUMN token VARCHAR(64), "
        "ADD COLUMN host VARCHAR(255), ADD COLUMN pid INTEGER, ADD COLUMN expires DOUBLE PRECISION, "
        "ADD COLUMN epoch BIGINT DEFAULT 0 NOT NULL, ADD COLUMN cancelled BOOLEAN DEFAULT false NOT NULL",
        "INSERT INTO agent_sessions (session_id) SELECT session_id FROM agent_journals UNION "
        "SELECT session_id FROM agent_runs ON CONFLICT (session_id) DO NOTHING",
        "UPDATE agent_sessions SET journal = j.body FROM agent_journals AS j "
        "WHERE j.session_id = agent_sessions.session_id",
        "UPDATE agent_sessions SET token = r.token, host = r.host, pid = r.pid, expires = r.expires, "
        "cancelled = r.cancelled, epoch = 1 FROM agent_runs AS r WHERE r.session_id = agent_sessions.session_id",
        "DROP TABLE agent_journals",
        "DROP TABLE agent_runs",
    ],
}
"""Upgrades, by the schema version each brings a database to: run ``MIGRATIONS[2]``, in order and in one
transaction, on a database created by agent-sessions 0.1 (schema 1: it has the table agent_runs)."""

@functools.lru_cache(maxsize=4 * sql.MAX_APPEND)
def _append(count: int, unsteered: bool, fenced: bool) -> TextClause:
    """One statement, so one round trip in autocommit: claim the session row by its version (when
    ``unsteered``, only while no steer waits; when ``fenced``, only while the lease is still
    ``:lease_token``/``:lease_epoch`` and not cancelled), drop its journal, and append ``count`` messages only if the
    claim matched. Either all happen or none does. PostgreSQL's reads do not lock, so here the append
    takes the row (and replaces the version) rather than only reading it as statements.append_if_current
    does; a takeover's UPDATE of the row waits for it, or it for the takeover, which it then sees. The
    messages are rows of a VALUES list, one parameter each: an array parameter would have psycopg escape
    every backslash of the JSON in Python."""
    guard = " AND NOT EXISTS (SELECT 1 FROM agent_steers WHERE session_id = :sid)" if unsteered else ""
    fence = " AND token = :lease_token AND epoch = :lease_epoch AND NOT cancelled" if fenced else ""
    rows = ", ".join(f"(CAST(:q{i} AS INTEGER), CAST(:b{i} AS TEXT))" for i in range(count))
    return text(
        "WITH claim AS (UPDATE agent_sessions SET version = :new_version, journal = NULL "
        f"WHERE session_id = :sid AND version = :known{fence}{guard} RETURNING session_id) "
        "INSERT INTO agent_messages (session_id, seq, body) "
        f"SELECT claim.session_id, v.seq, v.body FROM claim, (VALUES {rows}) AS v(seq, body)"
    )

# 40001 serialization_failure, 40P01 deadlock_detected: safe to run the transaction again.
_TRANSIENT = {"40001", "40P01"}


class Store(SQLStore):
    """Reads, taking steers, and the usual step's save are single statements run in autocommit: one
    round trip each instead of three (BEGIN, the statement, COMMIT). A single statement sees one
    snapshot and is atomic on its own, so a DELETE ... RETURNING still hands each steer to exactly one
    taker. Steers are never taken with the save in autocommit: when some wait, the save runs its
    transaction, so a crash cannot hand them over without the transcript that holds them."""

    backend = "PostgreSQL"
    raw_statements = True
    schema_hint = "create the tables by running stores.postgres.SCHEMA in your migration"
    dialects = ("postgresql",)
    engine_hint = "create_engine('postgresql+psycopg://...') once and pass it"

    def upsert_session(self, session: str, version: str) -> Any:
        stmt = postgresql.insert(sessions).values(session_id=session, version=version)
        return stmt.on_conflict_do_update(
            index_elements=[sessions.c.session_id], set_={"version": version, "journal": None, "updated": sql.NOW}
        )

    def insert_session(self, session: str) -> Any:
        return postgresql.insert(sessions).values(session_id=session).on_conflict_do_nothing()

    def __init__(
        self, engine: Engine, *, remember: int = REMEMBER, remember_bytes: int = REMEMBER_BYTES
    ) -> None:
        super().__init__(engine, remember=remember, remember_bytes=remember_bytes)
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    @contextmanager
    def _connection(self, read_only: bool) -> Iterator[Connection]:
        if not read_only:
            with super()._connection(read_only) as conn:
                yield conn
            return
        with self._autocommit.connect() as conn:
            yield conn

    def append(self, step: sql.Step) -> str | None:
        """The CTE drops the journal anyway (it updates the row), so ``step.drop_journal`` needs nothing."""
        count = len(step.items) - step.start
        if count > sql.MAX_APPEND:
            return None
        params = sql.append_params(step)
        version = params["new_version"] = os.urandom(16).hex()  # this append replaces the version
        statement = _append(count, step.unsteered, step.holder is not None)
        inserted = self._transaction(
            "save", step.session, lambda conn: self.run(conn, statement, params).rowcount, read_only=True
        )
        return version if inserted == count else None

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        return self._transaction("take_steers", session, lambda conn: self.take(conn, session), read_only=True)

    def is_transient(self, exc: DBAPIError) -> bool:
        return getattr(exc.orig, "sqlstate", None) in _TRANSIENT

    def message_limit(self) -> int:
        """A TEXT value holds at most 1 GB."""
        return 2**30 - 2**20


__all__ = ["MIGRATIONS", "SCHEMA", "Store", "metadata"]
