"""The three tables every SQL store uses, defined once.

Message bodies and steer texts are TEXT (LONGTEXT on MySQL), never jsonb or JSON: those types rewrite
what they are given (reorder keys, drop duplicates, respace), and a model's tool arguments must come back
byte for byte.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    false,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.schema import CreateIndex, CreateTable

metadata = MetaData()


class _Utf8Bytes(TypeDecorator[str]):
    impl = mysql.VARBINARY(1020)
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> bytes | None:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> str | None:
        return None if value is None else value.decode("utf-8")


# MySQL compares text with PAD SPACE collations ('a' = 'a '), and MariaDB lacks MySQL 8's NO PAD binary
# collation, so on MySQL the key is bytes: VARBINARY compares exactly. 1,020 = 255 characters x 4 bytes.
SessionId = String(255).with_variant(_Utf8Bytes(), "mysql", "mariadb")
LongText = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
_MYSQL: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


sessions = Table(
    "agent_sessions",
    metadata,
    Column("session_id", SessionId, primary_key=True),
    # A random token, replaced by every save that may change a stored message (an append need not): a
    # writer that knows the current token may append only its new messages; any other writer rewrites.
    # NULL: no transcript yet (the row holds only a lease).
    Column("version", String(32), nullable=True),
    # The tool journal of the reply being run (see agent_sessions.journal); a save that writes drops it.
    Column("journal", LongText, nullable=True),
    # The run lease. token is NULL when nobody holds it; epoch only grows, one step per new holder, and
    # every write of a leased run is guarded by token and epoch on this row (the fencing token).
    Column("token", String(64), nullable=True),
    Column("host", String(255), nullable=True),
    Column("pid", Integer, nullable=True),
    Column("expires", Double, nullable=True),  # seconds since 1970 on the database's clock
    Column("epoch", BigInteger, nullable=False, server_default=text("0")),
    Column("cancelled", Boolean, nullable=False, server_default=false()),
    **_MYSQL,
)

messages = Table(
    "agent_messages",
    metadata,
    Column("session_id", SessionId, primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("body", LongText, nullable=False),
    **_MYSQL,
)

steers = Table(
    "agent_steers",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("session_id", SessionId, nullable=False),
    Column("text", LongText, nullable=False),
    Index("agent_steers_by_session", "session_id", "id"),
    **_MYSQL,
)

TABLES = (sessions, messages, steers)

SCHEMA_VERSION = 2
"""1: leases in agent_runs and journals in agent_journals (0.1); 2: both on the agent_sessions row, so
one row lock fences every write of a run."""


def ddl(dialect: Dialect) -> list[str]:
    """CREATE statements for ``dialect``, one per element: what the caller's migration runs."""
    out: list[str] = []
    for table in TABLES:
        out.append(str(CreateTable(table).compile(dialect=dialect)).strip())
        out.extend(str(CreateIndex(index).compile(dialect=dialect)).strip() for index in table.indexes)
    return out
