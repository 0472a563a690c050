"""A store in one SQLite file: the embedded default. Unlike the server stores it creates its tables on
open, since a file has no one else to coordinate a migration with."""

from __future__ import annotations

import functools
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

try:
    from sqlalchemy import ColumnElement, Connection, Executable, MetaData, Table, and_, create_engine, event, func
    from sqlalchemy.dialects.sqlite import dialect as sqlite_dialect
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert
    from sqlalchemy.engine import Engine
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError
    from sqlalchemy.pool import NullPool
    from sqlalchemy.schema import CreateIndex, CreateTable
except ImportError as exc:  # pragma: no cover - exercised by tests/test_boundary.py in a bare venv
    raise ImportError(
        "stores.sqlite requires SQLAlchemy. Install it with: pip install 'stored-agent-sessions[sqlite]'"
    ) from exc

from agent_sessions import ArgumentError, Holder, Message, Saved, eventlog, validate
from agent_sessions.messages import turn_open

from .._known import REMEMBER, REMEMBER_BYTES
from .._sql import SQLStore, metadata
from .._sql import statements as sql
from .._sql.base import NOT_WATCHING, NotWatching
from .._sql.driver import Compiled, instrumented
from .._sql.events import BATCH_MAX, batch
from .._sql.tables import SCHEMA_5_COLUMNS, SCHEMA_5_INDEXES, SCHEMA_VERSION, ddl, queue, sessions, steer_keys

BUSY_TIMEOUT_MS = 30_000
_ADD_MESSAGES = "INSERT INTO agent_messages (session_id, seq, body) VALUES (?, ?, ?)"
_ADD_EVENTS = "INSERT INTO agent_events (session_id, seq, body) VALUES (?, ?, ?)"
"""The step's rows, on the driver (``Store._append_logged_raw``): what ``sql.APPEND`` and ``sql.ADD_EVENTS``
compile to here, without building their parameters as dicts."""
_Usual = tuple[str, tuple[Message, ...], tuple[Message, ...], Connection, sqlite3.Connection]
"""What the usual step knows once ``Store._usual`` has checked it: the known version and transcript, the
transcript given, the thread's connection and its driver connection (``Store._held``)."""


@functools.cache
def _claim_sql(unsteered: bool) -> str:
    """The step's claim (``sql.number_events``) compiled for SQLite, its parameters by position in the order
    ``Store._logged`` gives them (the session, the clock, 1, the count, the session, the lease, the known
    version, and the session again if the save takes steers): the step builds that tuple directly."""
    names = ["sid", "clock", "param_1", "n", "sid", "lease_token", "lease_epoch", "known"]
    names += ["sid"] if unsteered else []
    compiled = sql.number_events(save=True, unsteered=unsteered).compile(dialect=sqlite_dialect())
    if list(compiled.positiontup or ()) != names or compiled.params.get("param_1") != 1:
        raise RuntimeError(f"number_events binds {compiled.positiontup}, not {names}")
    return compiled.string


@functools.lru_cache(maxsize=8 * sql.MAX_APPEND)
def _append_sql(count: int, unsteered: bool, fenced: bool, journal_free: bool = True) -> str:
    """``sql.append_if_current`` compiled for SQLite, its parameters by position, in the order ``Store.append``
    gives them (the rows' seq and body, the session, the known version, the lease, the session again): the
    usual step builds that tuple directly, with no dict of named values to pick from (a few µs a step)."""
    names = [n for i in range(count) for n in (f"q{i}", f"b{i}")] + ["sid", "known"]
    names += ["lease_token", "lease_epoch"] if fenced else []
    names += ["sid"] if unsteered else []
    compiled = sql.append_if_current(count, unsteered, fenced, journal_free).compile(dialect=sqlite_dialect())
    if list(compiled.positiontup or ()) != names:
        raise RuntimeError(f"append_if_current binds {compiled.positiontup}, not {names}")
    return compiled.string


def _create_sessions(name: str) -> str:
    """agent_sessions' CREATE TABLE of schema 4, under another name: an upgrade builds the new table beside
    the old (schema 5's columns are added by its own step)."""
    schema4 = Table("agent_sessions", MetaData(),
                    *(c._copy() for c in sessions.columns if c.name not in SCHEMA_5_COLUMNS))
    statement = str(CreateTable(schema4).compile(dialect=sqlite_dialect())).strip()
    return statement.replace("CREATE TABLE agent_sessions ", f"CREATE TABLE {name} ", 1)


_SCHEMA_2_COLUMNS = "session_id, version, journal, token, host, pid, expires, epoch, cancelled"


MIGRATIONS: dict[int, list[str]] = {
    2: [
        # 0.1 -> schema 2: the lease and the journal move onto the session's row. SQLite cannot drop a NOT
        # NULL, so the row's table is rebuilt (https://www.sqlite.org/lang_altertable.html#otheralter).
        _create_sessions("agent_sessions_new"),
        "INSERT INTO agent_sessions_new (session_id, version) SELECT session_id, version FROM agent_sessions",
        "INSERT OR IGNORE INTO agent_sessions_new (session_id) SELECT session_id FROM agent_journals "
        "UNION SELECT session_id FROM agent_runs",
        "UPDATE agent_sessions_new SET journal = (SELECT body FROM agent_journals AS j "
        "WHERE j.session_id = agent_sessions_new.session_id)",
        "UPDATE agent_sessions_new SET (token, host, pid, expires, cancelled, epoch) = (SELECT token, host, pid, "
        "expires, cancelled, 1 FROM agent_runs AS r WHERE r.session_id = agent_sessions_new.session_id) "
        "WHERE session_id IN (SELECT session_id FROM agent_runs)",
        "DROP TABLE agent_sessions",
        "ALTER TABLE agent_sessions_new RENAME TO agent_sessions",
        "DROP TABLE agent_journals",
        "DROP TABLE agent_runs",
    ],
    3: [
        # schema 2 -> 3: created, updated (both now, for every existing session: none has been idle since
        # the upgrade) and metadata on the session's row. SQLite cannot add a column whose default is an
        # expression, so the row's table is rebuilt (with event_seq, the event log's counter); the tags and
        # events tables are new, made by create_all.
        _create_sessions("agent_sessions_new"),
        f"INSERT INTO agent_sessions_new ({_SCHEMA_2_COLUMNS}) SELECT {_SCHEMA_2_COLUMNS} FROM agent_sessions",
        "DROP TABLE agent_sessions",
        "ALTER TABLE agent_sessions_new RENAME TO agent_sessions",
        *(str(CreateIndex(index).compile(dialect=sqlite_dialect())).strip() for index in sessions.indexes
          if index.name not in SCHEMA_5_INDEXES),
    ],
    4: [
        # schema 3 -> 4: the keys of steers sent with one (Session.steer(key=)); a new table.
        *ddl(sqlite_dialect(), (steer_keys,)),
    ],
    5: [
        # -- schema 4 -> 5, stranded runs: open_since and spec_name on the session row, the partial index of
        # the open sessions.
        "ALTER TABLE agent_sessions ADD COLUMN open_since DOUBLE",
        "ALTER TABLE agent_sessions ADD COLUMN spec_name VARCHAR(255)",
        # Backfill: every session with a transcript is marked open since its last write, too many and never too
        # few; the first sweep (agent.recover) looks at each once, in pages, and clears the finished ones.
        "UPDATE agent_sessions SET open_since = updated WHERE version IS NOT NULL AND open_since IS NULL",
        *(str(CreateIndex(index).compile(dialect=sqlite_dialect())).strip()
          for index in sessions.indexes if index.name == "agent_sessions_open"),
        # -- end of stranded runs
        # -- the queue (a message that arrives while the session is busy): agent_queue, the messages
        # Runner.turn(if_busy="queue") leaves for a busy session; a new table, nothing rewritten.
        *ddl(sqlite_dialect(), (queue,)),
        # -- end of the queue
    ],
}
"""What ``open`` runs, in one transaction, on a file of an older schema (the file's ``PRAGMA user_version``
says which; a file of agent-sessions 0.1 has 0 and the table agent_sessions)."""


class Store(SQLStore):
    backend = "SQLite"
    raw_statements = True
    batches = True  # a write's events in one row (stores/_sql/events.py)
    schema_hint = "stores.sqlite.open creates the tables; was the file replaced after it was opened?"
    # Reads need no write lock: in WAL mode a deferred transaction reads beside a writer.

    lock_new = (
        sqlite_insert(sessions).values(session_id=sql.SID)
        .on_conflict_do_update(index_elements=[sessions.c.session_id], set_={"updated": sql.NOW})
        .returning(*sql.LOCK.selected_columns)
    )

    add_steer_key = (
        sqlite_insert(steer_keys).values(session_id=sql.SID, steer_key=sql.STEER_KEY).on_conflict_do_nothing()
    )

    add_queued = (
        sqlite_insert(queue).values(session_id=sql.SID, turn_key=sql.QUEUE_KEY, text=sql.QUEUE_TEXT)
        .on_conflict_do_nothing()
    )

    def insert_session(self, session: str) -> Any:
        return sqlite_insert(sessions).values(session_id=session).on_conflict_do_nothing()

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        """SQLite's LIKE ignores ASCII case, so: the first characters equal the prefix (exact, by the
        BINARY collation), and a lower bound the primary key's index can start from."""
        return and_(column >= prefix, func.substr(column, 1, len(prefix)) == prefix)

    def __init__(
        self, engine: Engine, *, remember: int = REMEMBER, remember_bytes: int = REMEMBER_BYTES,
        watch_cancels: bool = True,
    ) -> None:
        """``watch_cancels=False``: a run reads its cancel flag before each idempotent tool, as it did
        before the store watched its connection's data version (``watch_cancel``)."""
        super().__init__(engine, remember=remember, remember_bytes=remember_bytes)
        self._watch_cancels = watch_cancels
        self._mark = object()
        """Replaced as each write of this object that may mark or take a lease ends (``cancel``,
        ``acquire``, ``release``, ``delete``, ``prune``): on the thread's own connection such a commit does
        not move ``PRAGMA data_version``, so a watch compares this too (``Watch``)."""
        self._local = threading.local()
        self._limit: int | None = None
        self._pins_lock = threading.Lock()
        self._pins: list[tuple[weakref.ref[threading.Thread], Connection]] = []
        """Every connection a thread holds, with its thread: close() closes them all, and a thread that
        ended leaves its connection to be closed when the next thread opens one."""

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        start: int = 0,
    ) -> Saved:
        """The usual step of a run first (``_step``); anything else the way every SQL store saves."""
        if replace is False and type(take_steers) is bool and type(start) is int and start == 0:
            saved = self._step(session, holder, msgs, take_steers)
            if saved is not None:
                return saved
        return super().save_fenced(session, holder, msgs, take_steers=take_steers, replace=replace, start=start)

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int, start: int = 0,
    ) -> Saved:
        """The usual step of a run with the log on first (``_step_logged``); anything else the way every SQL
        store saves with events."""
        if replace is False and type(take_steers) is bool and type(start) is int and start == 0 and events:
            try:
                records = eventlog.check_append(events, keep)
            except ArgumentError:
                validate.session_id(session)  # a bad session id is what the general save names first
                raise
            saved = self._step_logged(session, holder, msgs, take_steers, records, keep)
            if saved is not None:
                return saved
        return super().save_fenced_events(session, holder, msgs, take_steers=take_steers, replace=replace,
                                          events=events, keep=keep, start=start)

    def _usual(self, session: object, msgs: Sequence[Message]) -> _Usual | None:
        """A run's usual step, with the least Python: new messages appended to the transcript this object
        knows, written here directly (no ``sql.Step``, no call through ``SQLStore._save`` and ``append``). Its
        Python runs right after the previous step's fsync, with cold caches, where each call and object costs
        two to three times what it does in a loop, and it is most of what the step costs over the raw
        driver's: with ``synchronous=FULL``, 0.165-0.173 ms a step against 0.184-0.196 through ``_save`` as
        it was, the raw driver's 0.108 (N=10 and 1,000); with the log on, the same held (docs/performance.md).

        What ``SQLStore._save`` checks, checked the same way: the given transcript extends the known one (the
        very objects, or equal ones: ``messages_after``), so a replaced earlier message is never left unsaved;
        the new messages are valid and short enough (``_bodies``); a failure forgets the session. ``None``: not
        the usual step (an unknown session, nothing new or too much, the turn opened or closed, a listener, an
        open transaction); the general save then does it all (checking the messages again: a rare path)."""
        if type(session) is not str:
            return None  # the general save refuses it
        if type(msgs) is not list and not isinstance(msgs, Sequence):
            return None  # read once here, an iterator would reach the general save empty
        known = self._known.get(session)  # (a session it knows passed validate.session_id as it was saved or read)
        if known is None:
            return None
        version, before = known
        items, shared = validate.messages_after(msgs, before)
        if shared != len(before) or not 0 < len(items) - shared <= sql.MAX_APPEND:
            return None
        if turn_open(items) != turn_open(before):
            return None  # open_since changes: a second statement (append's transaction)
        conn, driver = self._held()
        if instrumented(self.engine) or driver.in_transaction:
            return None  # listeners see it through SQLAlchemy; inside a transaction autocommit commits nothing
        return version, before, items, conn, driver

    def _bodies(self, items: tuple[Message, ...], start: int) -> list[str]:
        """The new messages' stored JSON, each refused before anything is written if the store cannot keep
        it, as the general save does."""
        limit = self.message_limit()
        bodies = [items[i].to_json() for i in range(start, len(items))]
        for body in bodies:
            if len(body) > limit:
                validate.stored_size(items, start, limit, f"{self.backend} store")
        return bodies

    def _step(self, session: str, holder: Holder, msgs: Sequence[Message], take: bool) -> Saved | None:
        """The usual step (``_usual``) without events: the one autocommitted INSERT of ``append``. ``None``:
        not the usual step, or the INSERT matched nothing (a steer, a cancel, a lost lease, another version)
        or met another writer's rows."""
        usual = self._usual(session, msgs)
        if usual is None:
            return None
        version, before, items, _, driver = usual
        shared = len(before)
        values: list[Any] = []
        for i, body in enumerate(self._bodies(items, shared), shared):
            values += (i, body)
        values += (session, version, holder.token, holder.epoch)
        if take:
            values.append(session)
        count = len(items) - shared
        try:
            if session in self._journaled:
                inserted = self._dropping_journal(driver, session, _append_sql(count, take, True, False), values)
            else:
                inserted = driver.execute(_append_sql(count, take, True), values).rowcount
        except sqlite3.IntegrityError:  # another writer appended at these positions first
            return None
        except sqlite3.Error as exc:
            self._known.forget(session)
            raise self._error("save", session, DBAPIError.instance("append", None, exc, sqlite3.Error)) from exc
        except BaseException:
            self._known.forget(session)
            raise
        if inserted != count:
            return None
        self._known.put(session, version, items, after=before)
        self._journaled.discard(session)
        return Saved([], False)

    def _step_logged(
        self, session: str, holder: Holder, msgs: Sequence[Message], take: bool, records: list[str], keep: int
    ) -> Saved | None:
        """The usual step (``_usual``) with its events: ``_logged``'s one transaction on the driver. A journal
        to drop goes the general way (its transaction drops it beside the claim)."""
        usual = self._usual(session, msgs)
        if usual is None or session in self._journaled:
            return None
        version, before, items, conn, driver = usual
        shared = len(before)
        rows = [(session, i, body) for i, body in enumerate(self._bodies(items, shared), shared)]
        try:
            written = self._logged(session, holder, version, rows, take, records, keep, conn, driver)
        except BaseException:
            self._known.forget(session)
            raise
        if not written:
            return None
        self._known.put(session, version, items, after=before)
        return Saved([], False)

    def _dropping_journal(self, driver: sqlite3.Connection, session: str, append: str, values: list[Any]) -> int:
        """The step after a journal write (a non-idempotent tool's start): the step's INSERT, matched whatever
        journal the row holds, and the journal dropped, in one BEGIN IMMEDIATE transaction on the driver,
        as ``SQLStore.append`` does in SQLAlchemy's (whose machinery, on SQLite, cost as much as the
        statements). The rows inserted; none: nothing written."""
        driver.execute("BEGIN IMMEDIATE")
        try:
            inserted: int = driver.execute(append, values).rowcount
            if inserted:
                drop = self._compiled(sql.DROP_JOURNAL, {"sid": session})
                driver.execute(drop.sql, drop.values({"sid": session}))
            driver.execute("COMMIT")
        except BaseException:
            if driver.in_transaction:
                driver.execute("ROLLBACK")
            raise
        return inserted

    def _put_journal(self, session: str, params: dict[str, Any]) -> int:
        """The usual journal write, one UPDATE autocommitted on the driver (a writing statement takes the
        write lock before it reads: BEGIN IMMEDIATE, the UPDATE and COMMIT in one call), as the step's
        append is; through SQLAlchemy where something listens, or inside an open transaction."""
        driver = self._held()[1]
        if instrumented(self.engine) or driver.in_transaction:
            return super()._put_journal(session, params)
        statement = self._compiled(sql.PUT_JOURNAL, params)
        try:
            matched: int = driver.execute(statement.sql, statement.values(params)).rowcount
        except sqlite3.Error as exc:
            raise self._error("put_journal", session,
                              DBAPIError.instance(statement.sql, None, exc, sqlite3.Error)) from exc
        return matched

    def _compiled(self, statement: Executable, params: dict[str, Any]) -> Compiled:
        assert self._driver is not None  # SQLite's statements run on the driver (raw_statements)
        return self._driver.compiled(statement, params)

    def append(self, step: sql.Step) -> str | None:
        """The usual step of a run, on the driver alone: the one INSERT, in autocommit. A statement that
        writes takes the write lock before it reads, so alone it is what BEGIN IMMEDIATE, the INSERT and
        COMMIT are, in one call; it inserts all its rows or, failing, none. The statement of
        SQLStore.append, without the machinery around it, which on SQLite cost as much."""
        conn, driver = self._held()
        count = len(step.items) - step.start
        # (the engine's listeners: the store's own connections have none of their own)
        if (count > sql.MAX_APPEND or instrumented(self.engine) or driver.in_transaction or step.drop_journal
                or step.turning):
            # listeners see it there; inside an open transaction, autocommit would not commit it; a journal
            # to drop, or a turn opened or closed (open_since), is a second statement, so a transaction
            return super().append(step)
        if step.events:
            return self._append_logged_raw(step, conn, driver)
        holder, items, offset = step.holder, step.items, step.offset
        values: list[Any] = []
        for i in range(step.start, len(items)):
            values += (offset + i, items[i].to_json())
        values += (step.session, step.known)
        if holder is not None:
            values += (holder.token, holder.epoch)
        if step.unsteered:
            values.append(step.session)
        try:
            inserted: int = driver.execute(_append_sql(count, step.unsteered, holder is not None), values).rowcount
        except sqlite3.IntegrityError:  # another writer appended at these positions first
            return None
        except sqlite3.Error as exc:
            raise self._error("save", step.session, DBAPIError.instance("append", None, exc, sqlite3.Error)) from exc
        return step.known if inserted == count else None

    def _append_logged_raw(self, step: sql.Step, conn: Connection, driver: sqlite3.Connection) -> str | None:
        """A leased run's step with its events reached through the general save (``SQLStore._save``: a session
        this object had not read yet, say): ``_logged`` with the step's rows."""
        holder = step.holder
        assert holder is not None  # save_fenced_events
        items, offset, session = step.items, step.offset, step.session
        rows = [(session, offset + i, items[i].to_json()) for i in range(step.start, len(items))]
        written = self._logged(session, holder, step.known, rows, step.unsteered, step.events, step.keep, conn, driver)
        return step.known if written else None

    def _logged(
        self, session: str, holder: Holder, known: str, rows: list[tuple[str, int, str]], unsteered: bool,
        records: Sequence[str], keep: int, conn: Connection, driver: sqlite3.Connection,
    ) -> bool:
        """A leased run's usual step with its events (``save_fenced_events``), on the driver as the plain
        append is: BEGIN IMMEDIATE; the event numbers, read from the log where ``append_if_current`` would
        match (``claim``); the messages (``rows``); the events; COMMIT. The session row is read, never
        written, so the step adds only the events' pages to the WAL. Nothing matched (a steer, a cancel, a
        journal, a lost lease, another version), or another writer's messages at these positions: nothing is
        written (False), and the save runs its transaction, which sorts out which.

        The events go in one row (a batch, as ``add_events`` joins them) when the store knows the log's floor,
        they fit one batch and nothing falls to the cap (the usual step); otherwise ``_log_events`` stores them
        and drops what the cap cuts. Every step of a run with the log on takes this path, so it builds no more
        than it sends (the claim's parameters as a tuple, its statement compiled once: ``_claim_sql``): over
        the plain step, in the loop, it cost 0.047-0.055 ms with the general ``_log_events``, 0.037-0.042 ms
        so (docs/performance.md)."""
        n = len(records)
        claim = (session, eventlog.first_seq(time.time()), 1, n, session, holder.token, holder.epoch, known)
        floor: int | None = None
        try:
            driver.execute("BEGIN IMMEDIATE")
            claimed = driver.execute(_claim_sql(unsteered), (*claim, session) if unsteered else claim).fetchone()
            if claimed is None:
                driver.execute("ROLLBACK")
                return False
            driver.executemany(_ADD_MESSAGES, rows)
            last = int(claimed[0])
            oldest = self._event_floor.get(session)
            if oldest is not None and n <= keep and n <= BATCH_MAX and last - keep < oldest:
                # the cap drops nothing: the usual step's events in one row, as ``add_events`` writes them
                driver.execute(_ADD_EVENTS, (session, last, records[0] if n == 1 else batch(records)))
            else:
                floor = self._log_events(conn, session, last, records, keep)
            driver.execute("COMMIT")
        except (sqlite3.Error, DBAPIError) as exc:
            if driver.in_transaction:
                driver.execute("ROLLBACK")
            cause = exc.orig if isinstance(exc, DBAPIError) else exc
            if isinstance(cause, sqlite3.IntegrityError):  # another writer appended at these positions first
                return False
            wrapped = exc if isinstance(exc, DBAPIError) else DBAPIError.instance("append", None, exc, sqlite3.Error)
            raise self._error("save", session, wrapped) from exc
        except BaseException:
            if driver.in_transaction:
                driver.execute("ROLLBACK")
            raise
        if floor is not None:
            self._floor(session, floor)
        return True

    def claim(self, conn: Connection, params: dict[str, Any], **shape: bool) -> int | None:
        """The event numbers read from the log, not claimed on the session row (``sql.number_events``): every
        transaction that writes here began with BEGIN IMMEDIATE, SQLite's one writer at a time, so no other
        can take them before this one's events are stored. A new log starts at the host's clock read here,
        to the microsecond. Only a journal to drop writes the row."""
        row = self.run(conn, sql.number_events(**shape), {**params, "clock": eventlog.first_seq(time.time())}).first()
        if row is None:
            return None
        if shape.get("drop_journal"):
            self.run(conn, sql.DROP_JOURNAL, {"sid": params["sid"]})
        return int(row[0])

    def add_events(self, conn: Connection, session: str, numbered: list[tuple[int, str]]) -> None:
        """On the driver, as the messages are (unless something listens for cursor events)."""
        if instrumented(conn):
            super().add_events(conn, session, numbered)
            return
        driver: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
        try:
            driver.executemany(_ADD_EVENTS, [(session, seq, text) for seq, text in self.rows_of(numbered)])
        except sqlite3.Error as exc:
            raise DBAPIError.instance(_ADD_EVENTS, None, exc, sqlite3.Error) from exc

    # -- cancels: what the thread's connection has seen committed by others ----------------------------------

    def watch_cancel(self, session: str, holder: Holder) -> Watch | NotWatching:
        """The run's watch (``contract.CancelWatcher``): the data version of the calling thread's connection,
        which moves when any other connection commits (``Watch``). It keeps nothing of the run's own (made
        per run, so the store holds no reference back to it: a store dropped unclosed is freed at once)."""
        validate.session_id(session)
        return Watch(self) if self._watch_cancels else NOT_WATCHING

    def version(self) -> tuple[object, int, object] | None:
        """``Watch.listening``: this thread's connection (its ``_held`` entry, new with each connection
        opened), the connection's ``PRAGMA data_version`` and the store's mark, read now; ``None`` inside a
        transaction on that connection (whose snapshot a later read of the version would repeat), or when the
        connection was closed (the read that follows opens another)."""
        held = self._entry()
        if held is None:
            try:
                self._held()
            except (SQLAlchemyError, sqlite3.Error):  # the read that follows meets it, and says so
                return None
            held = self._entry()
            if held is None:
                return None
        driver = held[2]
        if driver.in_transaction:
            return None
        mark = self._mark  # read before the version: a mark replaced after the version's read is seen next time
        try:
            return held, driver.execute("PRAGMA data_version").fetchone()[0], mark
        except sqlite3.Error:  # closed (by ``close``, from any thread): ProgrammingError
            return None

    def unchanged(self, since: object | None) -> bool:
        """Did nothing commit since ``since`` (a ``version()``), on any connection but this thread's own, and
        no write of this store object that may mark or take a lease end meanwhile? ``False`` whenever it
        cannot tell: another connection now (closed, reopened, forked, another thread), one inside a
        transaction, an error."""
        if not isinstance(since, tuple) or len(since) != 3:
            return False
        held = self._entry()
        if held is None or since[0] is not held or since[2] is not self._mark:
            return False
        driver = held[2]
        if driver.in_transaction:
            return False
        try:
            same: bool = driver.execute("PRAGMA data_version").fetchone()[0] == since[1]
        except sqlite3.Error:  # closed since, and not yet replaced: no version to compare
            return False
        return same

    def _entry(self) -> tuple[int, Connection, sqlite3.Connection] | None:
        """This thread's ``_held`` entry of this process unless ``close`` closed it; opens none. (Closed, its
        sqlite3 connection may be another's by now, on an engine with a pool: never asked.) An invalidated
        one is not checked for, as ``_held`` does: its sqlite3 connection is closed, and raises."""
        held: tuple[int, Connection, sqlite3.Connection] | None = getattr(self._local, "held", None)
        if held is None or held[0] != os.getpid() or held[1].closed:
            return None
        return held

    def _marking(self) -> None:
        self._mark = object()

    def cancel(self, session: str) -> bool:
        try:
            return super().cancel(session)
        finally:
            self._marking()

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        try:
            return super().acquire(session, holder, ttl)
        finally:
            self._marking()

    def release(self, session: str, holder: Holder) -> None:
        try:
            super().release(session, holder)
        finally:
            self._marking()

    def delete(self, session: str, *, force: bool = False) -> bool:
        try:
            return super().delete(session, force=force)
        finally:
            self._marking()

    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int:
        try:
            return super().prune(idle_for, limit)
        finally:
            self._marking()

    def _held(self) -> tuple[Connection, sqlite3.Connection]:
        """This thread's connection of the file, and its sqlite3 connection (a forked child opens its own).
        Threads hold one each, however many there are: ``open`` gives the engine no pool to run out of."""
        held: tuple[int, Connection, sqlite3.Connection] | None = getattr(self._local, "held", None)
        if held is None or held[0] != os.getpid() or held[1].closed or held[1].invalidated:
            conn = self.engine.connect()
            driver: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
            held = (os.getpid(), conn, driver)
            self._local.held = held
            with self._pins_lock:
                ended = [c for t, c in self._pins if not _alive(t)]
                self._pins = [(t, c) for t, c in self._pins if _alive(t)]
                self._pins.append((weakref.ref(threading.current_thread()), conn))
            for old in ended:
                old.close()
        return held[1], held[2]

    @contextmanager
    def _connection(self, read_only: bool) -> Iterator[Connection]:
        """Each thread keeps one connection of the file (checking one out of the pool for every
        transaction cost as much as the transaction's statements; a forked child opens its own), and
        the transaction is begun and ended on the driver. Should a statement go through SQLAlchemy
        (the upsert, or any statement while something listens for cursor events), SQLAlchemy begins its
        own transaction on top of ours (its begin event sees one open and sends nothing) and ends it."""
        conn, driver = self._held()
        _driver_execute(driver, "BEGIN" if read_only else "BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction():
                conn.rollback()
            elif driver.in_transaction:
                _driver_execute(driver, "ROLLBACK")
            raise
        if conn.in_transaction():
            conn.commit()
        else:
            _driver_execute(driver, "COMMIT")

    def is_transient(self, exc: DBAPIError) -> bool:
        return "database is locked" in str(exc.orig)

    def message_limit(self) -> int:
        """SQLite's longest string or blob (SQLITE_MAX_LENGTH, 1,000,000,000 bytes unless built otherwise);
        read once, since it is the library's, the same on every connection."""
        if self._limit is None:
            self._limit = self._held()[1].getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
        return self._limit

    def close(self) -> None:
        """Close every connection this store opened, in every thread. Using the store afterwards opens new
        ones."""
        with self._pins_lock:
            pins, self._pins = self._pins, []
        for _, conn in pins:
            conn.close()
        self.engine.dispose()

    def after_fork(self) -> None:
        super().after_fork()
        with self._pins_lock:
            self._pins = []  # the parent's: not closed here
        self._local = threading.local()


def open(
    path: str | os.PathLike[str],
    *,
    synchronous: str = "FULL",
    remember: int = REMEMBER,
    remember_bytes: int = REMEMBER_BYTES,
    watch_cancels: bool = True,
) -> Store:
    """Open (creating if needed) the store in ``path``. Safe for many threads and many processes on one
    file: writes take SQLite's write lock at BEGIN IMMEDIATE, so take_steers is exactly once.
    ``remember`` and ``remember_bytes`` bound what the store keeps in memory of the transcripts it last
    saved or read (so a save that only adds messages appends them): that many sessions, that many bytes.
    ``watch_cancels=False``: a run reads its cancel flag before every idempotent tool, even when nothing
    was committed since its last read (``Store.watch_cancel``, docs/runs/leases.md)."""
    name = os.fspath(path)
    if not name or name == ":memory:" or name.startswith("file::memory:"):
        raise ArgumentError("sqlite.open needs a file path; for a store in memory use stores.memory.Store()")
    if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ArgumentError(f"sqlite.open(synchronous=) must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
    # No pool: each thread holds one connection of its own for as long as it lives (a per-call checkout
    # cost as much as the statements), so a bounded pool would make the 16th concurrent thread wait.
    engine = create_engine(f"sqlite:///{name}", poolclass=NullPool)
    _configure(engine, synchronous.upper())
    with engine.begin() as conn:  # BEGIN IMMEDIATE: two processes opening one file create or upgrade it once
        _upgrade(conn)
        metadata.create_all(conn)
        conn.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return Store(engine, remember=remember, remember_bytes=remember_bytes, watch_cancels=watch_cancels)


def _upgrade(conn: Connection) -> None:
    """Run the migrations a file of an older schema needs; a new file needs none (create_all makes it)."""
    version = int(conn.exec_driver_sql("PRAGMA user_version").scalar() or 0)
    if version == 0:
        if not conn.exec_driver_sql("SELECT 1 FROM sqlite_master WHERE name = 'agent_sessions'").first():
            return
        version = 1  # written by 0.1, which set no user_version
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[target]:
            conn.exec_driver_sql(statement)


def _configure(engine: Engine, synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver's own BEGIN is deferred; we issue ours
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {synchronous}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def begin(conn: Any) -> None:
        dbapi_connection = conn.connection.dbapi_connection
        if not dbapi_connection.in_transaction:  # the store began it already (see Store._connection)
            dbapi_connection.execute("BEGIN IMMEDIATE")


class Watch:
    """A run's watch of its lease (``contract.CancelWatch``) on SQLite, where nothing is pushed: a cancel
    committed by any other connection, of this process or another, moves ``PRAGMA data_version`` on the
    connection the run's thread holds (https://www.sqlite.org/pragma.html#pragma_data_version). So when it
    has not moved since just before the run's last read of its flag, on the same connection, and this store
    object wrote no cancel meanwhile (its own commits do not move it: ``Store._mark``), nothing can have
    been committed after that read: no cancel can have landed, and the run need not read again. Otherwise,
    ``None``: the run reads. It never answers ``True``; one data version serves every run of the thread,
    of every session."""

    __slots__ = ("_store",)

    exact = True
    """Its ``False`` is as good as a read of the flag made as it was asked (no push to wait for):
    storetest's model counts it as one (``storetest.model_ops``)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def listening(self) -> tuple[object, int, object] | None:
        return self._store.version()

    def cancelled(self, since: object | None) -> bool | None:
        return False if since is not None and self._store.unchanged(since) else None

    def close(self) -> None:
        pass


def _alive(thread: weakref.ref[threading.Thread]) -> bool:
    held = thread()
    return held is not None and held.is_alive()


def _driver_execute(driver: sqlite3.Connection, sql: str) -> None:
    try:
        driver.execute(sql)
    except sqlite3.Error as exc:
        raise DBAPIError.instance(sql, None, exc, sqlite3.Error) from exc


__all__ = ["MIGRATIONS", "Store", "metadata", "open"]
