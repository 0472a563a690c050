"""A store in PostgreSQL, over the caller's SQLAlchemy Engine (psycopg 3). It runs no DDL: the caller's
migration runs ``SCHEMA``."""

from __future__ import annotations

from typing import Any

try:
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.exc import DBAPIError
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.postgres requires SQLAlchemy and psycopg. Install them with: pip install 'agent-sessions[postgres]'"
    ) from exc

from .._sql import SQLStore, ddl
from .._sql.tables import sessions

SCHEMA: str = ";\n\n".join(ddl(postgresql.dialect())) + ";\n"  # type: ignore[no-untyped-call]
"""The DDL, as one string: ``conn.exec_driver_sql(postgres.SCHEMA)`` in your migration."""

# 40001 serialization_failure, 40P01 deadlock_detected: safe to run the transaction again.
_TRANSIENT = {"40001", "40P01"}


class Store(SQLStore):
    backend = "PostgreSQL"
    schema_hint = "create the tables by running stores.postgres.SCHEMA in your migration"
    dialects = ("postgresql",)
    engine_hint = "create_engine('postgresql+psycopg://...') once and pass it"

    def upsert_session(self, session: str, version: str, length: int) -> Any:
        stmt = postgresql.insert(sessions).values(session_id=session, version=version, length=length)
        return stmt.on_conflict_do_update(
            index_elements=[sessions.c.session_id], set_={"version": version, "length": length}
        )

    def is_transient(self, exc: DBAPIError) -> bool:
        return getattr(exc.orig, "sqlstate", None) in _TRANSIENT


__all__ = ["SCHEMA", "Store"]
