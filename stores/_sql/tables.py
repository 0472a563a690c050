"""The tables of schema 1, shared by every SQL store: one row per session, the rest in child tables keyed by
``session_id`` (``agent_sessions.backend`` says what each part holds).

Bodies are TEXT (LONGTEXT on MySQL), never jsonb or JSON: those types rewrite what they are given, and a
model's tool arguments must come back byte for byte. Ids and keys compare exactly everywhere: SQLite's
BINARY collation, PostgreSQL's "C", and bytes on MySQL, whose text collations pad ('a' = 'a ') on MariaDB.
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
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.schema import CreateIndex, CreateTable

SCHEMA_VERSION = 1
"""The layout these tables are; kept in ``agent_store.schema_version``."""

metadata = MetaData()
"""The SQLAlchemy metadata of every table (public as ``stores.postgres.metadata`` and the others), so a
migration tool such as Alembic's autogenerate sees them."""


class _Utf8Bytes(TypeDecorator[str]):
    impl = mysql.VARBINARY(1020)
    cache_ok = True

    def __init__(self, length: int = 1020) -> None:
        super().__init__()
        self.impl = mysql.VARBINARY(length)

    def process_bind_param(self, value: str | None, dialect: Dialect) -> bytes | None:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> str | None:
        return None if value is None else value.decode("utf-8")


def _key(chars: int) -> Any:
    """A text compared exactly: ``chars`` characters (bytes on MySQL: 4 a character)."""
    return (String(chars).with_variant(String(chars, collation="C"), "postgresql")
            .with_variant(_Utf8Bytes(4 * chars), "mysql", "mariadb"))


SessionId = _key(255)
AcceptedKey = _key(320)
"""The library's accepted keys are a kind prefix and a caller's key of up to 255 characters."""
LongText = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
_MYSQL: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


def _sid() -> Column[str]:
    return Column("session_id", SessionId, primary_key=True)


store = Table(
    "agent_store", metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("identity", String(64), nullable=False),
    Column("schema_version", Integer, nullable=False),
    **_MYSQL,
)

sessions = Table(
    "agent_sessions", metadata,
    _sid(),
    Column("exists_", Boolean, nullable=False),
    Column("incarnation", String(64), nullable=False),
    Column("created", Double, nullable=False),
    Column("updated", Double, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("length", Integer, nullable=False),
    Column("edits", BigInteger, nullable=False),
    Column("token", String(64), nullable=True),
    Column("epoch", BigInteger, nullable=False),
    Column("expires", Double, nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("spec", LongText, nullable=True),
    Column("turn", LongText, nullable=True),
    Column("cancelled", Boolean, nullable=False),
    Column("cancelled_turn", LongText, nullable=True),
    Column("handed", Boolean, nullable=False),
    Column("journal", LongText, nullable=True),
    Column("open_since", Double, nullable=True),
    Column("metadata", LongText, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    Column("steers", Integer, nullable=False),
    Column("queued", Integer, nullable=False),
    # Recent (read backwards: newest first) and Idle (oldest first), of the sessions that exist.
    Index("agent_sessions_updated", "exists_", "updated", "session_id"),
    # Open: only the open sessions where the dialect has partial indexes (MySQL's NULLs sort first, and
    # the range read skips them).
    Index("agent_sessions_open", "open_since", "session_id", postgresql_where=text("open_since IS NOT NULL"),
          sqlite_where=text("open_since IS NOT NULL")),
    **_MYSQL,
)

messages = Table(
    "agent_messages", metadata,
    _sid(),
    Column("idx", Integer, primary_key=True, autoincrement=False),
    Column("body", LongText, nullable=False),
    **_MYSQL,
)

steers = Table(
    "agent_steers", metadata,
    _sid(),
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("body", LongText, nullable=False),
    Column("steer_key", SessionId, nullable=True),
    **_MYSQL,
)

queue = Table(
    "agent_queue", metadata,
    _sid(),
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("queue_key", SessionId, nullable=False),
    Column("body", LongText, nullable=False),
    **_MYSQL,
)

keys = Table(
    "agent_keys", metadata,
    _sid(),
    Column("accepted_key", AcceptedKey, primary_key=True),
    **_MYSQL,
)

events = Table(
    "agent_events", metadata,
    _sid(),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("body", LongText, nullable=False),
    **_MYSQL,
)

tags = Table(
    "agent_metadata", metadata,
    _sid(),
    Column("name", SessionId, primary_key=True),
    Column("value", SessionId, nullable=False),
    # Recent.where: value is backend.meta_index of the value (at most 255 characters: lifecycle checks).
    Index("agent_metadata_lookup", "name", "value", "session_id"),
    **_MYSQL,
)

TABLES = (store, sessions, messages, steers, queue, keys, events, tags)
CHILDREN = (messages, steers, queue, keys, events, tags)
"""The tables keyed by session_id beside the row: a session's delete empties them of it."""


def ddl(dialect: Dialect) -> list[str]:
    """CREATE statements for ``dialect``, one per element: what the caller's migration runs. Each may be
    run again (IF NOT EXISTS). MySQL 8 has no CREATE INDEX IF NOT EXISTS (MariaDB has), so there the
    indexes are declared inside their CREATE TABLE. The store writes its ``agent_store`` row itself."""
    out: list[str] = []
    for table in TABLES:
        create = str(CreateTable(table, if_not_exists=True).compile(dialect=dialect)).strip()
        if dialect.name in ("mysql", "mariadb"):
            out.append(_inline_indexes(create, table, dialect))
            continue
        out.append(create)
        out.extend(
            str(CreateIndex(index, if_not_exists=True).compile(dialect=dialect)).strip()
            for index in sorted(table.indexes, key=lambda i: str(i.name))
        )
    return out


def _inline_indexes(create: str, table: Table, dialect: Dialect) -> str:
    """``create`` with ``INDEX name (columns)`` entries added after its last column or key."""
    quote = dialect.identifier_preparer.quote
    entries = [
        f"{'UNIQUE ' if index.unique else ''}INDEX {quote(str(index.name))} "
        f"({', '.join(quote(c.name) for c in index.columns)})"
        for index in sorted(table.indexes, key=lambda i: str(i.name))
    ]
    if not entries:
        return create
    end = create.rindex("\n)")  # the close of the column list, before the table options
    return create[:end] + "".join(f", \n\t{entry}" for entry in entries) + create[end:]
