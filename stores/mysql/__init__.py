"""A store in MySQL 8 or MariaDB, over the caller's SQLAlchemy Engine (PyMySQL). It runs no DDL: the
caller's migration runs each statement of ``SCHEMA``.

Only SQL both servers accept is used: no ``DELETE ... RETURNING`` (MariaDB only), no ``INSERT ... AS new``
(MySQL only), no JSON columns (MySQL 8's rewrites its text)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

try:
    from sqlalchemy import Connection, Engine, bindparam, delete, func, select, text
    from sqlalchemy.dialects import mysql
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.mysql requires SQLAlchemy and PyMySQL. Install them with: pip install 'stored-agent-sessions[mysql]'"
    ) from exc

from agent_sessions import ArgumentError

from .._known import REMEMBER, REMEMBER_BYTES
from .._sql import SQLStore, ddl, metadata
from .._sql import statements as sql
from .._sql.base import LOCK_WAIT, TRANSACTION_TIMEOUT
from .._sql.clock import db_now
from .._sql.driver import instrumented
from .._sql.tables import SessionId, events, messages, queue, sessions, steer_keys, steers, tags
from .kept import Conn, Kept, default_most

_DIALECT = mysql.dialect()
SCHEMA: list[str] = ddl(_DIALECT)
"""The DDL, one statement per element: ``for stmt in mysql.SCHEMA: conn.exec_driver_sql(stmt)``. Safe to
run again (CREATE TABLE IF NOT EXISTS, the indexes inside it: MySQL 8 has no CREATE INDEX IF NOT EXISTS);
it does not upgrade a database of an older schema: ``MIGRATIONS`` does."""
_NOW = str(db_now().compile(dialect=_DIALECT))

MIGRATIONS: dict[int, list[str]] = {
    2: [
        # 0.1 -> schema 2: the lease and the journal move onto the session's row, where one row lock fences
        # every write of a run. Run with no run in flight (a lease moves with epoch 1, unknown to 0.1's runs).
        "ALTER TABLE agent_sessions MODIFY version VARCHAR(32) NULL, ADD COLUMN journal LONGTEXT NULL, "
        "ADD COLUMN token VARCHAR(64) NULL, ADD COLUMN host VARCHAR(255) NULL, ADD COLUMN pid INTEGER NULL, "
        "ADD COLUMN expires DOUBLE NULL, ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0, "
        "ADD COLUMN cancelled BOOL NOT NULL DEFAULT false",
        "INSERT IGNORE INTO agent_sessions (session_id) SELECT session_id FROM agent_journals UNION "
        "SELECT session_id FROM agent_runs",
        "UPDATE agent_sessions AS s JOIN agent_journals AS j ON j.session_id = s.session_id SET s.journal = j.body",
        "UPDATE agent_sessions AS s JOIN agent_runs AS r ON r.session_id = s.session_id SET s.token = r.token, "
        "s.host = r.host, s.pid = r.pid, s.expires = r.expires, s.cancelled = r.cancelled, s.epoch = 1",
        "DROP TABLE agent_journals",
        "DROP TABLE agent_runs",
    ],
    3: [
        # schema 2 -> 3: when each session was made and last written (both the upgrade's time for the
        # sessions already there: none counts as idle before the upgrade), its metadata, the tags table,
        # the index listing and pruning use, and the event log (its counter on the row, its table).
        "ALTER TABLE agent_sessions ADD COLUMN created DOUBLE NULL, ADD COLUMN updated DOUBLE NULL, "
        "ADD COLUMN metadata LONGTEXT NULL, ADD COLUMN event_seq BIGINT NULL",
        f"UPDATE agent_sessions AS s JOIN (SELECT {_NOW} AS t) AS clock SET s.created = clock.t, s.updated = clock.t",
        f"ALTER TABLE agent_sessions MODIFY created DOUBLE NOT NULL DEFAULT {_NOW}, "
        f"MODIFY updated DOUBLE NOT NULL DEFAULT {_NOW}, "
        "ADD INDEX agent_sessions_by_updated (updated, session_id)",
        *ddl(_DIALECT, (tags, events)),
    ],
    4: [
        # schema 3 -> 4: the keys of steers sent with one (Session.steer(key=)); a new table, nothing rewritten.
        *ddl(_DIALECT, (steer_keys,)),
    ],
    5: [
        # -- schema 4 -> 5, stranded runs: open_since and spec_name on the session row, and the index of the
        # open sessions (a plain one: NULLs sort first and the sweep's range skips them).
        "ALTER TABLE agent_sessions ADD COLUMN open_since DOUBLE NULL, ADD COLUMN spec_name VARCHAR(255) NULL, "
        "ADD INDEX agent_sessions_open (open_since)",
        # Backfill: every session with a transcript is marked open since its last write, too many and never too
        # few; the first sweep (agent.recover) looks at each once, in pages, and clears the finished ones.
        "UPDATE agent_sessions SET open_since = updated WHERE version IS NOT NULL AND open_since IS NULL",
        # -- end of stranded runs
        # -- the queue (a message that arrives while the session is busy): agent_queue, the messages
        # Runner.turn(if_busy="queue") leaves for a busy session; a new table, nothing rewritten.
        *ddl(_DIALECT, (queue,)),
        # -- end of the queue
    ],
}
"""Upgrades, by the schema version each brings a database to: ``MIGRATIONS[5]`` on a database of schema 4 (it
has no table agent_queue); before it, run each statement of ``MIGRATIONS[4]``, in
order, on a database of schema 3 (it has no table agent_steer_keys); ``MIGRATIONS[3]`` and then ``[4]`` on one
of schema 2 (before the session lifecycle: agent_sessions has no column ``updated``); on one created by
agent-sessions 0.1 (schema 1: it has the table agent_runs), ``MIGRATIONS[2]``, ``[3]`` and ``[4]``. MySQL
commits DDL as it goes: run it with no run in flight (``[4]`` only creates a table: runs may go on), and if a
statement fails, fix the cause and run the rest. ``MIGRATIONS[5]`` (on schema 4) adds two columns and an index
and dates every session with a transcript as open: no run of the older version may be in flight (it would not
keep ``open_since``)."""

# 1213 deadlock: InnoDB has rolled the transaction back, so run it again. (1205, a lock wait that passed
# ``lock_wait``, is a session another worker holds inside a transaction: ``SessionLocked``, not retried.)
_TRANSIENT = {1213}
_LOCK_WAIT_TIMEOUT = 1205
_FIRST_WORD = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)


_PACKET = text("SELECT @@max_allowed_packet")
_MAKE = mysql.insert(sessions).values(session_id=sql.SID).on_duplicate_key_update(updated=sql.NOW)

# -- no lock beyond the session's own rows -----------------------------------------------------------------
# Under REPEATABLE READ (MySQL's default) InnoDB locks the gaps of what a writing statement reads: a range
# DELETE locks the first row past its range (the next session's first message), and the subqueries of an
# UPDATE are read with next-key locks (on the steers and queue of the sessions beside this one, when this one
# has none). Other sessions' inserts wait on those, and concurrent first saves of new sessions deadlocked. So
# the general save reads what it needs with the row lock, in the SELECT that takes it (whose subqueries are
# plain reads, made once the lock is held, and every writer of the session's messages or queue holds that
# lock), and deletes only the rows that are there, ending on the session's own last one.
_ROW = sessions.c.session_id
_LAST = select(func.max(messages.c.seq)).where(messages.c.session_id == _ROW).scalar_subquery()
_LOCK = select(*sql.LOCK.selected_columns, sql.input_waits(_ROW).label("waiting"), _LAST.label("last")).where(
    _ROW == sql.SID).with_for_update()
"""``sql.LOCK``, and whether input waits and the stored transcript's last index (``_WAITS``, ``_LAST_SEQ``).
Each subquery names the locked row, not ``:sid``: one that does not is evaluated once, as the statement is
planned, before the row's lock is granted, and would read what was there before the writer it waited for."""
_WAITS, _LAST_SEQ = 4, 5
_TRIM = text(
    "DELETE FROM agent_messages WHERE session_id = :sid AND seq >= :start AND seq <= :last LIMIT :count"
).bindparams(bindparam("sid", type_=SessionId))
"""The messages from ``:start`` to the last, whose count (a transcript is numbered from 0 without a hole) is
the ``LIMIT``: the DELETE stops at the last one, and does not read, so lock, the row after it."""


class Store(SQLStore):
    backend = "MySQL or MariaDB"
    _packet: int | None = None
    schema_hint = "create the tables by running each statement of stores.mysql.SCHEMA in your migration"
    dialects = ("mysql", "mariadb")
    engine_hint = "create_engine('mysql+pymysql://...?charset=utf8mb4') once and pass it"
    raw_statements = True
    # Under READ COMMITTED an INSERT ... SELECT reads without locks; the append's read of the session row
    # must lock it, so that a rewrite cannot commit between the append's check and its insert.
    share_lock = " LOCK IN SHARE MODE"
    # MariaDB reads no index range for (updated, session_id) < (:u, :id): a listing's keyset bounds are
    # written out (stores/_sql/listing.py).
    row_values = False

    def __init__(
        self, engine: Engine, *, remember: int = REMEMBER, remember_bytes: int = REMEMBER_BYTES,
        lock_wait: float = LOCK_WAIT, transaction_timeout: float = TRANSACTION_TIMEOUT, keep: int | None = None,
    ) -> None:
        """``keep``: connections the store may keep checked out of the engine's pool for its usual step
        (stores/mysql/kept.py); ``None``: up to two, always fewer than the pool's ``pool_size``, and none
        unless the pool is a ``QueuePool``. ``0`` keeps none: every statement goes through the pool."""
        super().__init__(engine, remember=remember, remember_bytes=remember_bytes, lock_wait=lock_wait,
                         transaction_timeout=transaction_timeout)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            raise ArgumentError(f"mysql.Store: keep must be a count of connections >= 0 or None, got {keep!r}")
        self._kept = Kept(engine, default_most(engine) if keep is None else keep)

    def close(self) -> None:
        """Give the connections the store keeps back to the engine's pool (a later step keeps them again).
        The engine is the caller's: dispose of it yourself."""
        self._kept.close()

    def after_fork(self) -> None:
        super().after_fork()
        self._kept.forget()

    lock_row = _LOCK

    def lock_session(self, conn: Connection, session: str) -> Sequence[Any]:
        """No RETURNING: the upsert (which takes the row's exclusive lock, not the shared one of INSERT
        IGNORE's duplicate check, so waiters queue rather than deadlock), then the locked row read
        (``_LOCK``)."""
        self.run(conn, _MAKE, {"sid": session})
        row = self.run(conn, _LOCK, {"sid": session}).first()
        assert row is not None  # made just before, and locked
        return row

    def trim(self, conn: Connection, session: str, start: int, row: Sequence[Any]) -> None:
        """Only the messages there are (``row``'s last index, read with the lock): none, no DELETE."""
        last = row[_LAST_SEQ]
        if last is not None and last >= start:
            self.run(conn, _TRIM, {"sid": session, "start": start, "last": last, "count": last - start + 1})

    def set_version(self, conn: Connection, session: str, version: str, opened: bool, row: Sequence[Any]) -> None:
        """Whether input waits as ``row`` read it (a steer a save takes makes its transcript open anyway)."""
        opened = opened or bool(row[_WAITS])
        self.run(conn, sql.SET_VERSION_OPENED, {"sid": session, "version": version, "open": opened})

    # INSERT IGNORE, not ON DUPLICATE KEY UPDATE: PyMySQL counts found rows, so an update that changes
    # nothing would count 1 as an insert does; an ignored row counts 0.
    add_steer_key = mysql.insert(steer_keys).values(session_id=sql.SID, steer_key=sql.STEER_KEY).prefix_with("IGNORE")

    add_queued = (
        mysql.insert(queue).values(session_id=sql.SID, turn_key=sql.QUEUE_KEY, text=sql.QUEUE_TEXT)
        .prefix_with("IGNORE")
    )

    def insert_session(self, session: str) -> Any:
        return mysql.insert(sessions).values(session_id=session).prefix_with("IGNORE")

    def take(self, conn: Connection, session: str) -> list[str]:
        """MySQL 8 has no DELETE ... RETURNING: lock the rows with SELECT ... FOR UPDATE, then delete them
        in the same transaction. A second taker waits on the locks and then finds them gone."""
        rows = self.run(conn, sql.LOCK_STEERS, {"sid": session}).all()
        if rows:
            conn.execute(delete(steers).where(steers.c.id.in_([r[0] for r in rows])))
        return [r[1] for r in rows]

    def message_limit(self) -> int:
        """What one statement may carry: half the server's ``max_allowed_packet`` (16 MiB by default on
        MariaDB, 64 MiB on MySQL 8) less room for the statement around it, since PyMySQL sends values as
        escaped literals (a JSON full of quotes and backslashes doubles). Read once per store."""
        if self._packet is None:
            packet = self._transaction("message_limit", "", lambda conn: self.run(conn, _PACKET, {}).scalar(),
                                       read_only=True, reads=True)
            self._packet = int(packet)  # type: ignore[call-overload]
        return (self._packet - 64 * 1024) // 2

    def append(self, step: sql.Step) -> str | None:
        """A step whose messages would not fit one statement is left to the transaction, which inserts
        them a statement each where needed (PyMySQL's executemany splits its batches)."""
        if sum(len(m.to_json()) for m in step.items[step.start:]) > self.message_limit():
            return None
        count = len(step.items) - step.start
        if (count > sql.MAX_APPEND or step.events or step.drop_journal or step.turning
                or instrumented(self.engine)):
            # a second statement (events, the journal, open_since), or a listener that must see it: a transaction
            return super().append(step)
        try:
            kept = self._kept.take()
        except SQLAlchemyError as exc:  # the pool had no connection to give within its pool_timeout
            raise self._error("save", step.session, exc) from exc
        if kept is None:  # all in use, none kept, or none could be kept
            return super().append(step)
        return self._append_kept(kept, step, count)

    def _append_kept(self, kept: Conn, step: sql.Step, count: int) -> str | None:
        """The usual step, whole, as one autocommitted statement on a kept connection (stores/mysql/kept.py):
        its commit is its own, and its share lock on the session row is held until then. ``None``: it
        inserted nothing, or another writer's messages are at these positions, or the connection died under
        it; the save then runs its transaction through the pool, which finds what is stored (a statement
        lost with its connection is either there, whole, or never will be: the transaction writes a new
        version, which such a statement would no longer match)."""
        assert self._driver is not None  # raw_statements
        params = sql.append_params(step)
        compiled = self._driver.compiled(
            sql.append_if_current(count, step.unsteered, step.holder is not None, True, self.share_lock), params)
        dbapi = self.engine.dialect.loaded_dbapi
        cursor = kept.raw.cursor()
        try:
            cursor.execute(compiled.sql, compiled.values(params))
        except dbapi.Error as exc:
            if self.engine.dialect.is_disconnect(exc, kept.raw, cursor):
                self._kept.drop(kept, exc)
                return None
            self._kept.give(kept)
            if isinstance(exc, dbapi.IntegrityError):  # another writer appended at these positions first
                return None
            error = DBAPIError.instance(compiled.sql, params, exc, dbapi.Error, dialect=self.engine.dialect)
            assert isinstance(error, DBAPIError)  # wrapping a driver's error
            if self.is_lock_timeout(error):
                raise self._locked("save", step.session) from error
            if self.is_transient(error):  # a deadlock rolled it back: the transaction, retried as usual
                return None
            raise self._error("save", step.session, error) from error
        except BaseException as exc:  # interrupted mid-statement: the line's state is unknown
            self._kept.drop(kept, exc)
            raise
        self._kept.give(kept)
        return step.known if cursor.rowcount == count else None

    def claim(self, conn: Connection, params: dict[str, Any], **shape: bool) -> int | None:
        """One statement, as UPDATE ... RETURNING is elsewhere: the claim sets ``event_seq`` through
        ``LAST_INSERT_ID(expr)``, whose value the server returns as the reply's insert id (PyMySQL's
        ``lastrowid``), on this connection only."""
        claimed = self.run(conn, sql.claim_events(last_insert_id=True, **shape), params)
        return int(claimed.lastrowid) if claimed.rowcount == 1 else None

    def bound_locks(self, statement: str) -> str:
        """Each statement waits at most ``lock_wait`` (whole seconds, at least 1) for a row lock, set for that
        statement alone, so the engine's connections keep their own setting: MariaDB's ``SET STATEMENT ...
        FOR``, MySQL's ``SET_VAR`` hint. (A transaction a stalled worker left open lasts until the server
        drops its connection: docs/stores/mysql.md says what to set on the server.)"""
        seconds = max(1, math.ceil(self.lock_wait))
        if getattr(self.engine.dialect, "is_mariadb", False):
            return f"SET STATEMENT innodb_lock_wait_timeout={seconds} FOR {statement}"
        return _FIRST_WORD.sub(rf"\1 /*+ SET_VAR(innodb_lock_wait_timeout={seconds}) */", statement, count=1)

    def is_lock_timeout(self, exc: DBAPIError) -> bool:
        args: tuple[object, ...] = getattr(exc.orig, "args", ())
        return bool(args) and args[0] == _LOCK_WAIT_TIMEOUT

    def is_transient(self, exc: DBAPIError) -> bool:
        args: tuple[object, ...] = getattr(exc.orig, "args", ())
        return bool(args) and args[0] in _TRANSIENT


__all__ = ["MIGRATIONS", "SCHEMA", "Store", "metadata"]
