"""A store in MySQL 8 or MariaDB, over the caller's SQLAlchemy Engine (PyMySQL). It runs no DDL: the
caller's migration runs each statement of ``SCHEMA``.

A write is ``SET TRANSACTION ISOLATION LEVEL READ COMMITTED``, the row's ``SELECT ... FOR UPDATE``, the
child tables' statements, the row's UPDATE (INSERT for a new session) and COMMIT. READ COMMITTED because
InnoDB then takes no gap locks on searches: sessions that share nothing never wait for each other, even
when one is new (a missing row locked at REPEATABLE READ locks the gap beside it, and two new sessions in
one gap deadlock). Reads run at the engine's level (REPEATABLE READ by default: one snapshot).
"""

from __future__ import annotations

import math
from typing import Any

try:
    import pymysql  # type: ignore[import-untyped]  # noqa: F401 - the driver it is tested with
    from sqlalchemy import ColumnElement, Connection, Engine, Select, text
    from sqlalchemy.dialects import mysql
    from sqlalchemy.exc import DBAPIError
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.mysql requires SQLAlchemy and PyMySQL. Install them with: pip install 'stored-agent-sessions[mysql]'"
    ) from exc

from agent_sessions import AgentError, ArgumentError, SessionLocked
from agent_sessions.backed import BackedStore
from agent_sessions.backend import Change

from .._sql import SchemaMismatch, SQLBackend, ddl, metadata
from .._sql.clock import db_now

SCHEMA: list[str] = ddl(mysql.dialect())
"""The DDL, one statement per element: ``for stmt in mysql.SCHEMA: conn.exec_driver_sql(stmt)``. Safe to
run again (CREATE TABLE IF NOT EXISTS, the indexes inside it: MySQL 8 has no CREATE INDEX IF NOT EXISTS)."""
LOCK_WAIT = 2.0
"""Seconds a write waits for the session's row lock another transaction holds before ``SessionLocked``."""
_DEADLOCK, _LOCK_WAIT_TIMEOUT = 1213, 1205
_PACKET = text("SELECT @@max_allowed_packet")
_READ_COMMITTED = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"


class Backend(SQLBackend):
    hint = "create the tables by running each statement of stores.mysql.SCHEMA in your migration"

    def __init__(self, engine: Engine, lock_wait: float) -> None:
        super().__init__(engine, "MySQL store")
        self.lock_wait = lock_wait
        self._packet: int | None = None

    def begin(self, conn: Connection, write: Change | None) -> None:
        if write is not None and write.delete:
            conn.exec_driver_sql(_READ_COMMITTED)

    def relock(self, conn: Connection, change: Change) -> bool:
        """A missing row's lock is a gap lock, and two new sessions in one gap would deadlock inserting
        their rows: begin again at READ COMMITTED, where InnoDB takes none."""
        if change.delete:
            return False
        conn.rollback()
        conn.exec_driver_sql(_READ_COMMITTED)
        return True

    def clock(self) -> ColumnElement[float]:
        return db_now()

    def lock(self, query: Select[Any], read: bool = False) -> Select[Any]:
        """Waiting at most ``lock_wait`` (whole seconds): MariaDB's ``WAIT``, MySQL's hint."""
        seconds = max(1, math.ceil(self.lock_wait))
        if getattr(self.engine.dialect, "is_mariadb", False):
            return query.with_for_update(read=read).with_statement_hint(f"WAIT {seconds}")
        return query.with_for_update(read=read).prefix_with(f"/*+ SET_VAR(innodb_lock_wait_timeout={seconds}) */")

    def lock_shared(self, query: Select[Any]) -> Select[Any]:
        """``LOCK IN SHARE MODE``: the read waits for a write in flight; the reads after it make the
        transaction's snapshot once it is granted, and no write commits until the read ends."""
        return self.lock(query, read=True)

    def retry(self, exc: DBAPIError) -> bool:
        return _code(exc) == _DEADLOCK

    def refine(self, exc: DBAPIError, what: str) -> AgentError | None:
        if _code(exc) != _LOCK_WAIT_TIMEOUT:
            return None
        return SessionLocked(f"{self.name}: {what} waited {self.lock_wait:g} s (lock_wait) for a lock another "
                             "worker holds inside a transaction on the session (stalled, or slow); nothing was "
                             "written")

    def message_limit(self) -> int:
        """What one statement may carry: half the server's ``max_allowed_packet`` less room for the
        statement around it (PyMySQL sends values as escaped literals: a JSON full of quotes doubles)."""
        if self._packet is None:
            self._packet = int(self._run("message_limit", "", lambda conn: conn.execute(_PACKET).scalar_one()))
        return (self._packet - 64 * 1024) // 2


def _code(exc: DBAPIError) -> object:
    args: tuple[object, ...] = getattr(exc.orig, "args", ())
    return args[0] if args else None


class Store(BackedStore):
    """Sessions in MySQL or MariaDB through ``engine`` (yours: the store never disposes of it)."""

    def __init__(self, engine: Engine, *, lock_wait: float = LOCK_WAIT, transaction_timeout: float | None = None
                 ) -> None:
        """``lock_wait``: seconds a write waits for the session's row lock (``SessionLocked`` after).
        ``transaction_timeout`` is accepted as the other server store's: MySQL has no idle-transaction timeout
        to set (a stalled connection's transaction ends with the server's ``wait_timeout``)."""
        if not isinstance(engine, Engine) or engine.dialect.name not in ("mysql", "mariadb"):
            raise ArgumentError(f"mysql.Store needs a SQLAlchemy Engine for MySQL or MariaDB, got {engine!r}; "
                                "create_engine('mysql+pymysql://...?charset=utf8mb4') once and pass it")
        if isinstance(lock_wait, bool) or not isinstance(lock_wait, (int, float)) or not 0 < lock_wait <= 86_400:
            raise ArgumentError(f"mysql.Store: lock_wait must be seconds in (0, 86400], got {lock_wait!r}")
        del transaction_timeout
        self.engine = engine
        self.mysql = Backend(engine, float(lock_wait))
        super().__init__(self.mysql, name="MySQL store")

    @property
    def max_message_bytes(self) -> int:
        """The server's, read at the first save that asks."""
        return self.mysql.message_limit()

    @max_message_bytes.setter
    def max_message_bytes(self, value: int | None) -> None:
        pass

    def __repr__(self) -> str:
        return f"mysql.Store({self.engine.url!r})"


__all__ = ["SCHEMA", "SchemaMismatch", "Store", "metadata"]
