"""A store in MySQL 8 or MariaDB, over the caller's SQLAlchemy Engine (PyMySQL). It runs no DDL: the
caller's migration runs each statement of ``SCHEMA`` (the tables of schema 1 and the procedures every write
and read call).

Every write is one ``CALL agent_sessions_write(...)``, its own transaction at READ COMMITTED (InnoDB then
takes no gap locks: sessions that share nothing never wait for each other, even when one is new), and
every read one ``CALL agent_sessions_read(...)``: one round trip apiece (backend.py, write.sql).
"""

from __future__ import annotations

try:
    import pymysql  # type: ignore[import-untyped]  # noqa: F401 - the driver it is tested with
    from sqlalchemy import Engine
    from sqlalchemy.dialects import mysql
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.mysql requires SQLAlchemy and PyMySQL. Install them with: pip install 'stored-agent-sessions[mysql]'"
    ) from exc

from agent_sessions import ArgumentError
from agent_sessions.backed import BackedStore

from .._sql import SchemaMismatch, ddl, metadata
from .backend import READ_PROCEDURE, WRITE_PROCEDURE, Backend

SCHEMA: list[str] = [*ddl(mysql.dialect()), "DROP PROCEDURE IF EXISTS agent_sessions_write", WRITE_PROCEDURE.strip(),
                     "DROP PROCEDURE IF EXISTS agent_sessions_read", READ_PROCEDURE.strip()]
"""The DDL, one statement per element: ``for stmt in mysql.SCHEMA: conn.exec_driver_sql(stmt)``. Safe to
run again (CREATE TABLE IF NOT EXISTS, the indexes inside it: MySQL 8 has no CREATE INDEX IF NOT EXISTS;
the procedure dropped and made again: MySQL 8 has no CREATE OR REPLACE PROCEDURE)."""
LOCK_WAIT = 2.0
"""Seconds a write waits for the session's row lock another transaction holds before ``SessionLocked``."""


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


__all__ = ["LOCK_WAIT", "READ_PROCEDURE", "SCHEMA", "WRITE_PROCEDURE", "Backend", "SchemaMismatch", "Store", "metadata"]
