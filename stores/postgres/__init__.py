"""A store in PostgreSQL over the caller's SQLAlchemy Engine. PLACEHOLDER on the port-sql branch: the
PostgreSQL port is another branch's (port-pg); this is only enough for the test suite to import."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine
from sqlalchemy.dialects import postgresql

from agent_sessions.backed import BackedStore
from agent_sessions.backend import Change

from .._sql import SchemaMismatch, SQLBackend, ddl, metadata
from .._sql.clock import db_now

SCHEMA: str = ";\n\n".join(ddl(postgresql.dialect())) + ";\n"  # type: ignore[no-untyped-call]


class Backend(SQLBackend):
    hint = "create the tables by running stores.postgres.SCHEMA in your migration"

    def begin(self, conn: Connection, write: Change | None) -> None:
        if write is None:
            conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")

    def clock(self) -> ColumnElement[float]:
        return db_now()


class Store(BackedStore):
    def __init__(self, engine: Engine, **options: Any) -> None:
        self.engine = engine
        super().__init__(Backend(engine, "PostgreSQL store"), name="PostgreSQL store")


__all__ = ["SCHEMA", "SchemaMismatch", "Store", "metadata"]
