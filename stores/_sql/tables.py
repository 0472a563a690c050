"""The tables every SQL store uses, defined once.

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

from .clock import db_now

metadata = MetaData()
"""The SQLAlchemy metadata of every table (public as ``stores.postgres.metadata`` and the others), so a
migration tool such as Alembic's autogenerate sees them."""


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
    # When the row was made and last written, seconds since 1970 on the database's clock. Every write of
    # the row sets updated, except a leased run's per-step append, which does not touch the row (so a
    # step stays one statement; the heartbeat's renewal, every third of the ttl, moves it on). The
    # defaults also date rows that code of schema 2 inserts during a rolling upgrade.
    Column("created", Double, nullable=False, server_default=db_now()),
    Column("updated", Double, nullable=False, server_default=db_now()),
    # The session's metadata as agent_sessions.lifecycle.encode_metadata writes it; NULL: none. Its
    # keys are also rows of agent_session_tags, which is what list_sessions(where=) searches.
    Column("metadata", LongText, nullable=True),
    # The last seq the session's event log gave out (agent_sessions.eventlog); NULL: it has no log yet, and
    # its first append starts at first_seq of the database's clock. Claimed by the fenced UPDATE of each
    # append, so concurrent appenders queue on this row and never share a number. SQLite leaves it as an
    # earlier version left it: its one writer at a time reads the next numbers from the log itself
    # (statements.number_events), so a step with events does not write this row.
    Column("event_seq", BigInteger, nullable=True),
    # -- schema 5: stranded runs (docs/design/busy-and-stranded.md, section 2) --
    # Since when the session's turn has been open (seconds since 1970, the database's clock); NULL when it
    # is finished. Every save sets it (statements.OPEN_SINCE): kept when the transcript it leaves does not end
    # with an answer or input waits, NULL otherwise; add_steer_once and swap_journal set it as open. A hint
    # that may say open for a finished turn (recover clears it: mark_finished), never finished for an open one.
    Column("open_since", Double, nullable=True),
    # The Spec.name of the last run that took the lease (acquire writes it with the holder).
    Column("spec_name", String(255), nullable=True),
    # Only the open sessions: a sweep reads the runs in flight and the stranded ones, never the finished
    # ones. Partial on PostgreSQL and SQLite; on MySQL a plain index, whose NULLs sort first and are
    # skipped by the range the sweep reads.
    Index("agent_sessions_open", "open_since", postgresql_where=text("open_since IS NOT NULL"),
          sqlite_where=text("open_since IS NOT NULL")),
    # -- end of schema 5 --
    # Newest first for list_sessions (read backwards), oldest first for prune.
    Index("agent_sessions_by_updated", "updated", "session_id"),
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

steer_keys = Table(
    "agent_steer_keys",
    metadata,
    # The key of each steer a caller sent with one (add_steer_once), per session: a steer sent again after
    # its answer was lost finds its key here and is not stored twice. Inserted in the steer's transaction,
    # ignoring a duplicate (the key's check and its steer are one step); kept after the steer is delivered,
    # for as long as the session exists (delete and prune remove them with it). Bytes on MySQL, as the
    # session id is, so keys compare exactly.
    Column("session_id", SessionId, primary_key=True),
    Column("steer_key", SessionId, primary_key=True),
    **_MYSQL,
)

tags = Table(
    "agent_session_tags",
    metadata,
    # One row per metadata key of a session: list_sessions(where={name: value}) finds the sessions by
    # the index (name, value) instead of reading every session's JSON. value is the value's JSON form
    # (lifecycle.metadata_value, at most 255 bytes), so 1, 1.0, true and "1" stay four values.
    Column("session_id", SessionId, primary_key=True),
    Column("name", String(64), primary_key=True),
    Column("value", String(255), nullable=False),
    Index("agent_session_tags_by_value", "name", "value", "session_id"),
    **_MYSQL,
)

events = Table(
    "agent_events",
    metadata,
    # A session's event log: each event's text as eventlog.encode wrote it, kept verbatim (TEXT, not JSON),
    # numbered by agent_sessions.event_seq (SQLite: from the newest row here). The newest ``keep`` of each
    # append are kept, never fewer than one, so a log's newest number stays until its session goes.
    Column("session_id", SessionId, primary_key=True),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("body", LongText, nullable=False),
    **_MYSQL,
)

# -- schema 5: the queue (issue 26) --------------------------------------------------------------------------

queue = Table(
    "agent_queue",
    metadata,
    # The messages Runner.turn(if_busy="queue") left for a busy session, under their turn keys, in the
    # order they were accepted (id). The lease's holder takes the oldest waiting one into the transcript
    # (QueueStore.take_queued), sets taken and empties text: the row stays, so the key is accepted once for
    # as long as the session exists (delete and prune remove the rows with it). Keys are bytes on MySQL.
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("session_id", SessionId, nullable=False),
    Column("turn_key", SessionId, nullable=False),
    Column("text", LongText, nullable=False),
    Column("taken", Boolean, nullable=False, server_default=false()),
    Column("accepted", Double, nullable=False, server_default=db_now()),
    Index("agent_queue_by_key", "session_id", "turn_key", unique=True),
    Index("agent_queue_waiting", "session_id", "taken", "id"),
    **_MYSQL,
)

# -- end of schema 5's queue ----------------------------------------------------------------------------------

TABLES = (sessions, messages, steers, tags, events, steer_keys, queue)

SCHEMA_5_COLUMNS = ("open_since", "spec_name")
SCHEMA_5_INDEXES = ("agent_sessions_open",)
"""What schema 5 added to agent_sessions (stranded runs): the upgrades to earlier versions leave them to
``MIGRATIONS[5]``, which also creates the queue table."""

SCHEMA_VERSION = 5
"""1: leases in agent_runs and journals in agent_journals (0.1); 2: both on the agent_sessions row, so
one row lock fences every write of a run; 3: created, updated and metadata on that row, the tags table,
the indexes listing and pruning use, and the event log (event_seq on that row, the events table); 4: the
steer keys table (a steer sent again with its key is stored once); 5: open_since and spec_name on the session
row and the partial index of the open sessions (stranded runs), and the queue table (agent_queue: messages
left for a busy session, Runner.turn(if_busy="queue"))."""


def ddl(dialect: Dialect, tables: tuple[Table, ...] = TABLES) -> list[str]:
    """CREATE statements for ``dialect``, one per element: what the caller's migration runs. Each may be
    run again (IF NOT EXISTS). MySQL 8 has no CREATE INDEX IF NOT EXISTS (MariaDB has), so there the
    indexes are declared inside their CREATE TABLE."""
    out: list[str] = []
    for table in tables:
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
