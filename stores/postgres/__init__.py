"""A store in PostgreSQL, over the caller's SQLAlchemy Engine (psycopg 3). It runs no DDL: the caller's
migration runs ``SCHEMA`` (the tables of schema 1 and the function every write calls).

Every write is one call of ``agent_sessions_write`` and every read one SELECT, each in autocommit: one
round trip to the server apiece (backend.py, write.sql). Followers of an event log and runs watching for a
cancel are woken by LISTEN/NOTIFY (listener.py).
"""

from __future__ import annotations

import functools
import math
import weakref
from importlib import resources
from typing import Any

try:
    from sqlalchemy import Engine
    from sqlalchemy.dialects import postgresql
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.postgres requires SQLAlchemy and psycopg. "
        "Install them with: pip install 'stored-agent-sessions[postgres]'"
    ) from exc

from agent_sessions import ArgumentError, Holder, eventlog, validate
from agent_sessions.backed import BackedStore

from .._sql import SCHEMA_VERSION, SchemaMismatch, ddl, metadata
from .backend import Backend
from .listener import CANCEL_CHANNEL, CHANNEL, Listener, Watch

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]
WRITE_FUNCTION: str = resources.files(__package__).joinpath("write.sql").read_text()
"""The function every write calls (``agent_sessions_write``), as ``CREATE OR REPLACE``: part of ``SCHEMA``."""
_NOT_OVER_AN_OLDER = f"""DO $older$ BEGIN
  IF to_regclass('agent_sessions') IS NOT NULL AND to_regclass('agent_store') IS NULL THEN
    RAISE EXCEPTION USING MESSAGE = 'agent-sessions: this database holds the tables of an earlier version '
      '(agent_sessions, and no agent_store); this SCHEMA makes schema {SCHEMA_VERSION} in a database without them';
  END IF;
END $older$"""
"""The first statement of ``SCHEMA``: the tables of an earlier version are another layout, which ``CREATE
TABLE IF NOT EXISTS`` would leave in place and the store could not use."""
SCHEMA: str = ";\n\n".join([_NOT_OVER_AN_OLDER, *ddl(_DIALECT), WRITE_FUNCTION.strip().removesuffix(";")]) + ";\n"
"""The DDL, as one string: ``conn.exec_driver_sql(postgres.SCHEMA)`` in your migration. Safe to run again
(IF NOT EXISTS, CREATE OR REPLACE); it refuses to run over the tables of an earlier version."""
MAX_TEXT = 2**28 - 2**20
"""The longest message the store keeps (bytes of its JSON): a write's change travels as one jsonb value,
which holds at most 256 MB."""
LOCK_WAIT = 2.0
"""Seconds a write waits for the session's row lock by default (``lock_wait``)."""


class NotWatching:
    """The cancel watch of a store made with ``push_cancels=False``: it never knows, so the run reads its
    flag before each idempotent tool."""

    __slots__ = ()

    def listening(self) -> None:
        return None

    def cancelled(self, since: object | None) -> None:
        return None

    def close(self) -> None:
        pass


NOT_WATCHING = NotWatching()


def _listening_connection(engine: Engine) -> Any:
    """A connection of the engine's own making (its URL, its connect arguments), detached from the pool:
    the listener keeps it for as long as it listens, and closes it."""
    pooled = engine.raw_connection()
    conn = pooled.driver_connection
    pooled.detach()  # the pool forgets it (and opens another in its place when needed): it is ours now
    assert conn is not None
    conn.rollback()  # autocommit may only be set outside a transaction
    return conn


class Store(BackedStore):
    """Sessions in PostgreSQL through ``engine`` (yours: the store never disposes of it).

    ``push_cancels=False``: a run reads its cancel flag before each idempotent tool and never relies on a
    notification (an engine whose connections cannot LISTEN: PgBouncer in transaction mode).
    ``lock_wait``: seconds a write waits for the session's row lock, held by a transaction of someone
    else's, before ``SessionLocked``. ``transaction_timeout`` is accepted as before and has nothing left
    to bound: the store holds no transaction open across a round trip."""

    def __init__(self, engine: Engine, *, push_cancels: bool = True, lock_wait: float = LOCK_WAIT,
                 transaction_timeout: float | None = None) -> None:
        if not isinstance(engine, Engine):
            raise ArgumentError(f"postgres.Store needs a SQLAlchemy Engine, got {type(engine).__name__}: "
                                "create_engine('postgresql+psycopg://...') once and pass it")
        if engine.dialect.name != "postgresql":
            raise ArgumentError(f"postgres.Store needs a PostgreSQL engine, got {engine.dialect.name!r}: "
                                "create_engine('postgresql+psycopg://...') once and pass it")
        self._pg = Backend(engine, lock_wait)
        super().__init__(self._pg, max_message_bytes=MAX_TEXT, name="PostgreSQL store")
        self.engine = engine
        self._push_cancels = push_cancels
        # The listeners' threads hold the engine, not the store, so a store dropped unclosed is collected,
        # and then stops its threads too. One for cancels (runs), one for events (followers).
        self._listener = Listener(functools.partial(_listening_connection, engine), CANCEL_CHANNEL)
        self._followers = Listener(functools.partial(_listening_connection, engine), CHANNEL)
        weakref.finalize(self, self._listener.close, 0)
        weakref.finalize(self, self._followers.close, 0)
        self._pg.listeners = (self._listener, self._followers)

    def watch_cancel(self, session: str, holder: Holder) -> Watch | NotWatching:
        """Keep whether a cancel of ``holder``'s lease is heard here (``contract.CancelWatcher``): a cancel's
        write notifies ``agent_cancels`` as it commits."""
        validate.session_id(session)
        if not self._push_cancels:
            return NOT_WATCHING
        return self._listener.watch(session, holder.epoch)

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        """Wait for a notification of ``session`` (``contract.EventWaiter``), at most ``timeout`` seconds."""
        validate.session_id(session)
        after, _ = eventlog.check_read(after, 1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ArgumentError(f"wait_for_events(timeout=) must be finite seconds >= 0, got {timeout!r}")
        return self._followers.wait(session, float(timeout), lambda: self._pg.last_seq(session) > after)

    def close(self) -> None:
        """Stop listening (the threads and their connections; a later wait or watch starts them again). The
        engine is the caller's: dispose of it yourself."""
        self._listener.close()
        self._followers.close()

    def __repr__(self) -> str:
        return f"postgres.Store({self._pg!r})"


__all__ = ["LOCK_WAIT", "SCHEMA", "SCHEMA_VERSION", "WRITE_FUNCTION", "Backend", "SchemaMismatch", "Store", "metadata"]
