"""A store in PostgreSQL, over the caller's SQLAlchemy Engine (psycopg 3). It runs no DDL: the caller's
migration runs ``SCHEMA``."""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

try:
    from sqlalchemy import Connection, Engine, Text, TextClause, cast, func, select, text
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.schema import CreateIndex
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.postgres requires SQLAlchemy and psycopg. "
        "Install them with: pip install 'stored-agent-sessions[postgres]'"
    ) from exc

from agent_sessions import ArgumentError, Holder, eventlog, validate

from .._known import REMEMBER, REMEMBER_BYTES
from .._sql import SQLStore, ddl, metadata
from .._sql import statements as sql
from .._sql.base import LOCK_WAIT, NOT_WATCHING, TRANSACTION_TIMEOUT, NotWatching
from .._sql.clock import db_micros, db_now
from .._sql.tables import SCHEMA_5_INDEXES, events, queue, sessions, steer_keys, tags
from .listener import CANCEL_CHANNEL, CHANNEL, FOLLOWED, Listener, Watch

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]
SCHEMA: str = ";\n\n".join(ddl(_DIALECT)) + ";\n"
"""The DDL, as one string: ``conn.exec_driver_sql(postgres.SCHEMA)`` in your migration. Safe to run again
(IF NOT EXISTS); it does not upgrade a database of an older schema: ``MIGRATIONS`` does."""
_NOW = str(db_now().compile(dialect=_DIALECT))
_FIRST = str(db_micros().compile(dialect=_DIALECT))

MIGRATIONS: dict[int, list[str]] = {
    2: [
        # 0.1 -> schema 2: the lease and the journal move onto the session's row, where one row lock fences
        # every write of a run. Run with no run in flight (a lease moves with epoch 1, unknown to 0.1's runs).
        "ALTER TABLE agent_sessions ALTER COLUMN version DROP NOT NULL",
        "ALTER TABLE agent_sessions ADD COLUMN journal TEXT, ADD COLUMN token VARCHAR(64), "
        "ADD COLUMN host VARCHAR(255), ADD COLUMN pid INTEGER, ADD COLUMN expires DOUBLE PRECISION, "
        "ADD COLUMN epoch BIGINT DEFAULT 0 NOT NULL, ADD COLUMN cancelled BOOLEAN DEFAULT false NOT NULL",
        "INSERT INTO agent_sessions (session_id) SELECT session_id FROM agent_journals UNION "
        "SELECT session_id FROM agent_runs ON CONFLICT (session_id) DO NOTHING",
        "UPDATE agent_sessions SET journal = j.body FROM agent_journals AS j "
        "WHERE j.session_id = agent_sessions.session_id",
        "UPDATE agent_sessions SET token = r.token, host = r.host, pid = r.pid, expires = r.expires, "
        "cancelled = r.cancelled, epoch = 1 FROM agent_runs AS r WHERE r.session_id = agent_sessions.session_id",
        "DROP TABLE agent_journals",
        "DROP TABLE agent_runs",
    ],
    3: [
        # schema 2 -> 3: when each session was made and last written (both the upgrade's time for the
        # sessions already there: none counts as idle before the upgrade), its metadata, the tags table,
        # the indexes listing and pruning use, and the event log (its counter on the row, its table).
        "ALTER TABLE agent_sessions ADD COLUMN created DOUBLE PRECISION, ADD COLUMN updated DOUBLE PRECISION, "
        "ADD COLUMN metadata TEXT, ADD COLUMN event_seq BIGINT",
        f"UPDATE agent_sessions SET (created, updated) = (SELECT clock.t, clock.t FROM (SELECT {_NOW} AS t) AS clock)",
        f"ALTER TABLE agent_sessions ALTER COLUMN created SET DEFAULT {_NOW}, ALTER COLUMN created SET NOT NULL, "
        f"ALTER COLUMN updated SET DEFAULT {_NOW}, ALTER COLUMN updated SET NOT NULL",
        *ddl(_DIALECT, (tags, events)),
        *(str(CreateIndex(index, if_not_exists=True).compile(dialect=_DIALECT)) for index in sessions.indexes
          if index.name not in SCHEMA_5_INDEXES),
    ],
    4: [
        # schema 3 -> 4: the keys of steers sent with one (Session.steer(key=)); a new table, nothing rewritten.
        *ddl(_DIALECT, (steer_keys,)),
    ],
    5: [
        # -- schema 4 -> 5, stranded runs: open_since and spec_name on the session row, the partial index of
        # the open sessions (docs/design/busy-and-stranded.md, sections 2 and 3).
        "ALTER TABLE agent_sessions ADD COLUMN IF NOT EXISTS open_since DOUBLE PRECISION, "
        "ADD COLUMN IF NOT EXISTS spec_name VARCHAR(255)",
        # Backfill: every session with a transcript is marked open since its last write, too many and never too
        # few; the first sweep (agent.recover) looks at each once, in pages, and clears the finished ones.
        "UPDATE agent_sessions SET open_since = updated WHERE version IS NOT NULL AND open_since IS NULL",
        *(str(CreateIndex(index, if_not_exists=True).compile(dialect=_DIALECT))
          for index in sessions.indexes if index.name == "agent_sessions_open"),
        # -- end of stranded runs
        # -- the queue (a message that arrives while the session is busy): agent_queue, the messages
        # Runner.turn(if_busy="queue") leaves for a busy session; a new table, nothing rewritten.
        *ddl(_DIALECT, (queue,)),
        # -- end of the queue
    ],
}
"""Upgrades, by the schema version each brings a database to, each run in order and in one transaction:
``MIGRATIONS[4]`` on a database of schema 3 (it has no table agent_steer_keys); ``MIGRATIONS[3]`` and then
``MIGRATIONS[4]`` on one of schema 2 (before the session lifecycle: agent_sessions has no column
``updated``); on one created by agent-sessions 0.1 (schema 1: it has the table agent_runs),
``MIGRATIONS[2]``, ``[3]`` and ``[4]``. ``MIGRATIONS[2]`` and ``[3]`` take an ACCESS EXCLUSIVE lock on
agent_sessions while they rewrite it; ``MIGRATIONS[4]`` only creates a table, beside runs in flight.
``MIGRATIONS[5]`` (on schema 4) adds two columns and an index, dates every session with a transcript as
open, and creates the table agent_queue: run it with no run of the older version in flight (that run would
not keep ``open_since``)."""

OPEN_SINCE = (
    "open_since = CASE WHEN CAST(:open AS BOOLEAN) OR EXISTS (SELECT 1 FROM agent_steers WHERE session_id = :sid) "
    "OR EXISTS (SELECT 1 FROM agent_queue WHERE session_id = :sid AND NOT taken) "
    f"THEN COALESCE(open_since, {_NOW}) ELSE NULL END"
)
"""``statements.OPEN_SINCE`` in the raw text of the one-statement append (schema 5: what waits for the session,
a steer or a queued message, keeps its turn open)."""

MAX_RIDING = 16
"""Events a save's one statement carries (``save_fenced_events``); a step with more appends them in a
transaction of three statements (``SQLStore.append``).
A step's save usually carries a few: its text, tool and steer events are appended as they happen."""


def _claim_seq(count: int) -> str:
    """The SET of a claim giving out the session's next ``count`` event numbers (a new log's first is
    ``first_seq`` of the database's clock)."""
    return f"event_seq = COALESCE(event_seq, {_FIRST} - 1) + {count}"


def _log(count: int, trim: bool = True) -> str:
    """The rest of a statement whose CTE ``claim`` returned the session's id and its last event number:
    store ``count`` events (``:e0`` ...) under the numbers claimed, drop the log's events beyond ``:keep``
    if ``trim`` (the new ones beyond it are not stored: a statement's DELETE sees none of its own INSERTs),
    notify the followers when it commits if there are any (``listener.FOLLOWED``: a NOTIFY nobody hears
    still cost the step with events about 0.04 ms), and return the last number and, if ``trim``, the log's
    oldest number before the statement (``NULL``: it held none); no row when the claim matched nothing. An
    append that waited on the row for a concurrent one does not see that one's events (its snapshot is
    older), so the log may hold a few beyond ``keep`` until the next append drops them. Without ``trim``
    (``Store._trims``: the store knows the log holds room for these) the step skips the DELETE, which cost
    it 0.04-0.05 ms even when it dropped nothing."""
    rows = ", ".join(f"({i + 1}, CAST(:e{i} AS TEXT))" for i in range(count))
    dropped = ("dropped AS (DELETE FROM agent_events AS e USING claim "
               "WHERE e.session_id = claim.session_id AND e.seq <= claim.event_seq - CAST(:keep AS BIGINT)) ")
    oldest = "(SELECT min(seq) FROM agent_events WHERE session_id = claim.session_id)"
    return (
        ", added AS (INSERT INTO agent_events (session_id, seq, body) "
        f"SELECT claim.session_id, claim.event_seq - {count} + v.k, v.body FROM claim, (VALUES {rows}) AS v(k, body) "
        f"WHERE v.k > {count} - CAST(:keep AS BIGINT)){', ' + dropped if trim else ' '}"
        f"SELECT claim.event_seq, CASE WHEN pg_try_advisory_xact_lock({FOLLOWED}) THEN NULL "
        f"ELSE pg_notify('{CHANNEL}', claim.session_id) END, {oldest if trim else 'NULL'} FROM claim"
    )


@functools.cache  # at most MAX_APPEND entries: never evicted, so each keeps its id
def _append_events(count: int) -> TextClause:
    """``append_events`` in one statement: the fenced claim of the numbers, then ``_log``."""
    return text(
        f"WITH claim AS (UPDATE agent_sessions SET {_claim_seq(count)} "
        "WHERE session_id = :sid AND token = :lease_token AND epoch = :lease_epoch RETURNING session_id, event_seq)"
        + _log(count)
    )


def _turned(turning: bool) -> str:
    """The SET of an append that opens or closes the turn (``Step.turning``), else nothing."""
    return f", {OPEN_SINCE}" if turning else ""


@functools.cache  # at most 8 x MAX_APPEND x MAX_RIDING entries: never evicted
def _append_riding(count: int, unsteered: bool, events: int, turning: bool, trim: bool) -> TextClause:
    """A leased run's usual save with its events (``save_fenced_events``), in one statement: ``_append``'s
    claim also claims the event numbers, its INSERT becomes a CTE, and ``_log`` stores the events. The claim
    matches or nothing is written."""
    guard = " AND NOT EXISTS (SELECT 1 FROM agent_steers WHERE session_id = :sid)" if unsteered else ""
    rows = ", ".join(f"(CAST(:q{i} AS INTEGER), CAST(:b{i} AS TEXT))" for i in range(count))
    return text(
        f"WITH claim AS (UPDATE agent_sessions SET version = :new_version, journal = NULL, {_claim_seq(events)}"
        f"{_turned(turning)} "
        "WHERE session_id = :sid AND version = :known AND token = :lease_token AND epoch = :lease_epoch "
        f"AND NOT cancelled{guard} RETURNING session_id, event_seq), "
        "saved AS (INSERT INTO agent_messages (session_id, seq, body) "
        f"SELECT claim.session_id, v.seq, v.body FROM claim, (VALUES {rows}) AS v(seq, body))"
        + _log(events, trim)
    )


_NOTIFY = text(f"SELECT pg_notify('{CHANNEL}', :sid)")
_MARKED = sql.CANCEL.returning(sessions.c.session_id, sessions.c.epoch).cte("marked")
_CANCEL = select(
    func.pg_notify(CANCEL_CHANNEL, cast(_MARKED.c.epoch, Text) + " " + _MARKED.c.session_id)
).select_from(_MARKED)
"""``sql.CANCEL`` notifying the holder's process as it commits (``Store.watch_cancel``), in one statement:
a row when it marked a lease."""


@functools.lru_cache(maxsize=8 * sql.MAX_APPEND)
def _append(count: int, unsteered: bool, fenced: bool, turning: bool) -> TextClause:
    """One statement, so one round trip in autocommit: claim the session row by its version (when
    ``unsteered``, only while no steer waits; when ``fenced``, only while the lease is still
    ``:lease_token``/``:lease_epoch`` and not cancelled), drop its journal, and append ``count`` messages only if the
    claim matched. Either all happen or none does. PostgreSQL's reads do not lock, so here the append
    takes the row (and replaces the version) rather than only reading it as statements.append_if_current
    does; a takeover's UPDATE of the row waits for it, or it for the takeover, which it then sees. The
    messages are rows of a VALUES list, one parameter each: an array parameter would have psycopg escape
    every backslash of the JSON in Python."""
    guard = " AND NOT EXISTS (SELECT 1 FROM agent_steers WHERE session_id = :sid)" if unsteered else ""
    fence = " AND token = :lease_token AND epoch = :lease_epoch AND NOT cancelled" if fenced else ""
    rows = ", ".join(f"(CAST(:q{i} AS INTEGER), CAST(:b{i} AS TEXT))" for i in range(count))
    return text(
        f"WITH claim AS (UPDATE agent_sessions SET version = :new_version, journal = NULL{_turned(turning)} "
        f"WHERE session_id = :sid AND version = :known{fence}{guard} RETURNING session_id) "
        "INSERT INTO agent_messages (session_id, seq, body) "
        f"SELECT claim.session_id, v.seq, v.body FROM claim, (VALUES {rows}) AS v(seq, body)"
    )

def _listening_connection(engine: Engine) -> Any:
    """A connection of the engine's own making (its URL, its connect arguments), detached from the pool:
    the listener keeps it for as long as it listens, and closes it."""
    pooled = engine.raw_connection()
    conn = pooled.driver_connection
    pooled.detach()  # the pool forgets it (and opens another in its place when needed): it is ours now
    assert conn is not None
    conn.rollback()  # autocommit may only be set outside a transaction
    return conn


def _event_params(records: Sequence[str], keep: int) -> dict[str, Any]:
    return {"keep": keep, **{f"e{i}": text for i, text in enumerate(records)}}


# 40001 serialization_failure, 40P01 deadlock_detected: safe to run the transaction again.
_TRANSIENT = {"40001", "40P01"}

_BOUNDS = text(
    "SELECT set_config('lock_timeout', :lock, true), set_config('idle_in_transaction_session_timeout', :idle, true)"
)
"""``SET LOCAL`` of both, in one round trip: they end with the transaction."""


class Store(SQLStore):
    """Reads, taking steers, and the usual step's save are single statements run in autocommit: one
    round trip each instead of three (BEGIN, the statement, COMMIT). A single statement sees one
    snapshot and is atomic on its own, so a DELETE ... RETURNING still hands each steer to exactly one
    taker. Steers are never taken with the save in autocommit: when some wait, the save runs its
    transaction, so a crash cannot hand them over without the transcript that holds them.

    Event logs: an append, and the usual save with its events, are one statement too, which notifies the
    channel ``agent_events``; ``wait_for_events`` listens on it (see listener.py), on a connection of its
    own that ``close`` closes.

    Cancels: ``cancel`` notifies the channel ``agent_cancels`` as it commits, and a leased run of this
    store watches it on another connection of its own (``watch_cancel``, ``contract.CancelWatcher``), so
    its check before an idempotent tool needs no round trip while that connection listens. Each listening
    connection is opened by its first use: a process that only runs agents listens for cancels alone, and
    its own event writes do not wake it."""

    backend = "PostgreSQL"
    raw_statements = True
    prepare_statements = True
    schema_hint = "create the tables by running stores.postgres.SCHEMA in your migration"
    dialects = ("postgresql",)
    engine_hint = "create_engine('postgresql+psycopg://...') once and pass it"
    # A common value's walk carries its window (a derived table, pulled lazily in the index's order), so
    # the page is the count and the walk, without a read of the window's end (stores/_sql/listing.py).
    windowed_walk = True

    lock_new = (
        postgresql.insert(sessions).values(session_id=sql.SID)
        .on_conflict_do_update(index_elements=[sessions.c.session_id], set_={"updated": sql.NOW})
        .returning(*sql.LOCK.selected_columns)
    )

    add_steer_key = (
        postgresql.insert(steer_keys).values(session_id=sql.SID, steer_key=sql.STEER_KEY).on_conflict_do_nothing()
    )

    add_queued = (
        postgresql.insert(queue).values(session_id=sql.SID, turn_key=sql.QUEUE_KEY, text=sql.QUEUE_TEXT)
        .on_conflict_do_nothing()
    )

    def insert_session(self, session: str) -> Any:
        return postgresql.insert(sessions).values(session_id=session).on_conflict_do_nothing()

    def __init__(
        self, engine: Engine, *, remember: int = REMEMBER, remember_bytes: int = REMEMBER_BYTES,
        push_cancels: bool = True, lock_wait: float = LOCK_WAIT, transaction_timeout: float = TRANSACTION_TIMEOUT,
    ) -> None:
        """``push_cancels=False``: a run reads its cancel flag before each idempotent tool, and never
        relies on a notification (for an engine whose connections cannot LISTEN: PgBouncer in transaction
        mode). ``lock_wait``: seconds a statement waits for a row lock before ``SessionLocked``;
        ``transaction_timeout``: seconds a transaction of the store may sit idle (its worker stalled) before
        the server ends it and frees its locks. Both are set in each transaction the store opens (``SET
        LOCAL``), never on the engine's connections."""
        super().__init__(engine, remember=remember, remember_bytes=remember_bytes, lock_wait=lock_wait,
                         transaction_timeout=transaction_timeout)
        self._bounds = {"lock": f"{round(self.lock_wait * 1000)}ms",
                        "idle": f"{round(self.transaction_timeout * 1000)}ms"}
        self._push_cancels = push_cancels
        self._event_last: dict[str, int] = {}
        """The last event number this store wrote to each session's log (``_trims``), bounded like ``_known``."""
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        # The listeners' threads hold the engine, not the store, so a store dropped unclosed is collected,
        # and then stops its threads too. One for cancels (runs), one for events (followers): listener.py.
        self._listener = Listener(functools.partial(_listening_connection, engine), CANCEL_CHANNEL)
        self._followers = Listener(functools.partial(_listening_connection, engine), CHANNEL)
        weakref.finalize(self, self._listener.close, 0)
        weakref.finalize(self, self._followers.close, 0)

    def autocommits(self, read_only: bool) -> bool:
        return read_only

    def is_lock_timeout(self, exc: DBAPIError) -> bool:
        return getattr(exc.orig, "sqlstate", None) == "55P03"  # lock_not_available

    @contextmanager
    def _connection(self, read_only: bool) -> Iterator[Connection]:
        """A write transaction begins by bounding itself: how long its statements wait for a lock, and how
        long it may sit idle (a worker stalled inside it) before the server ends it. A single statement in
        autocommit has no idle time of its own, and waits at most for such a transaction to end."""
        if not read_only:
            with super()._connection(read_only) as conn:
                self.run(conn, _BOUNDS, self._bounds)
                yield conn
            return
        with self._autocommit.connect() as conn:
            yield conn

    def append(self, step: sql.Step) -> str | None:
        """The CTE drops the journal anyway (it updates the row), so ``step.drop_journal`` needs nothing."""
        count = len(step.items) - step.start
        if count > sql.MAX_APPEND:
            return None
        if len(step.events) > MAX_RIDING:
            return super().append(step)  # the claim, the messages and the events in a transaction
        params = sql.append_params(step)
        version = params["new_version"] = os.urandom(16).hex()  # this append replaces the version
        if step.turning:
            params["open"] = step.opened
        if step.events:
            assert step.holder is not None  # save_fenced_events
            params.update(_event_params(step.events, step.keep))
            n = len(step.events)
            trim = self._trims(step.session, n, step.keep)
            riding = _append_riding(count, step.unsteered, n, step.turning, trim)
            row = self._transaction(
                "save", step.session, lambda conn: self.run(conn, riding, params).first(), read_only=True
            )
            if row is None:
                return None
            self._logged(step.session, n, step.keep, row, trim)
            return version
        statement = _append(count, step.unsteered, step.holder is not None, step.turning)
        inserted = self._transaction(
            "save", step.session, lambda conn: self.run(conn, statement, params).rowcount, read_only=True
        )
        return version if inserted == count else None

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        return self._transaction("take_steers", session, lambda conn: self.take(conn, session), read_only=True)

    # -- the event log ---------------------------------------------------------------------------------

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        """One statement in autocommit (up to ``MAX_APPEND`` events; more: the transaction)."""
        validate.session_id(session)
        records = eventlog.check_append(events, keep)
        if len(records) > sql.MAX_APPEND:
            return super().append_events(session, holder, records, keep=keep)
        params = {**sql.fence_params(session, holder), **_event_params(records, keep)}
        statement = _append_events(len(records))
        row = self._transaction(
            "append_events", session, lambda conn: self.run(conn, statement, params).first(), read_only=True
        )
        if row is None:
            raise self.lease_lost(session, holder)
        self._logged(session, len(records), keep, row, True)
        return int(row[0])

    def _trims(self, session: str, n: int, keep: int) -> bool:
        """Whether a write of ``n`` events to ``session``'s log must drop what falls beyond ``keep``: unless
        this store wrote the log's last number and knows its oldest (``_logged``) and the log has room for
        ``n`` more. Another writer's events since leave the log a few beyond ``keep`` until a write here
        that trims (the next, once ``_logged`` has seen their numbers), as a concurrent append does
        (``_log``); nothing is dropped that should stay."""
        floor, last = self._event_floor.get(session), self._event_last.get(session)
        return floor is None or last is None or last + n - keep >= floor

    def _logged(self, session: str, n: int, keep: int, row: Any, trimmed: bool) -> None:
        """Remember what a write of ``n`` events left (its row: the last number, and if ``trimmed`` the oldest
        before it): the log's last number, and its oldest (``_floor``)."""
        last = int(row[0])
        if trimmed:
            before = last - n + 1 if row[2] is None else int(row[2])
            self._floor(session, max(before, last - keep + 1))
        self._remember(self._event_last, session, last)

    def _floor(self, session: str, floor: int) -> None:
        """As ``SQLStore._floor``; a write that learned only the floor (the transaction paths: a save of
        more than ``MAX_RIDING`` events, the save's general transaction, a large ``append_events``) leaves
        the log's last number unknown here, so the next step trims (``_logged`` sets it again after)."""
        super()._floor(session, floor)
        self._event_last.pop(session, None)

    def notify(self, conn: Connection, session: str) -> None:
        self.run(conn, _NOTIFY, {"sid": session})

    # -- cancels, pushed to the holder -----------------------------------------------------------------

    def cancel(self, session: str) -> bool:
        """Mark the lease and, as that commits, notify every process listening (``watch_cancel``)."""
        validate.session_id(session)
        marked = self._transaction(
            "cancel", session, lambda conn: self.run(conn, _CANCEL, {"sid": session}).first(), read_only=True
        )
        return marked is not None

    def watch_cancel(self, session: str, holder: Holder) -> Watch | NotWatching:
        """Keep whether a cancel of ``holder``'s lease is heard here (contract.CancelWatcher); starts the
        listening connection if it is not running (listener.py), which ``close`` stops."""
        validate.session_id(session)
        if not self._push_cancels:
            return NOT_WATCHING
        return self._listener.watch(session, holder.epoch)

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        """Wait for a notification of ``session`` (contract.EventWaiter), at most ``timeout`` seconds."""
        validate.session_id(session)
        after, _ = eventlog.check_read(after, 1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ArgumentError(f"wait_for_events(timeout=) must be finite seconds >= 0, got {timeout!r}")
        return self._followers.wait(session, float(timeout), lambda: self._last_event(session) > after)

    def _last_event(self, session: str) -> int:
        last = self._transaction(
            "wait_for_events", session, lambda conn: self.run(conn, sql.LAST_EVENT, {"sid": session}).scalar(),
            read_only=True, reads=True,
        )
        return 0 if last is None else int(last)  # type: ignore[call-overload]

    def close(self) -> None:
        """Stop listening for events and cancels (the threads and their connections; a later wait or run
        starts them again; a run in flight meanwhile reads its cancel flag). The engine is the caller's:
        dispose of it yourself."""
        self._listener.close()
        self._followers.close()

    def after_fork(self) -> None:
        super().after_fork()
        self._listener.forget()
        self._followers.forget()

    def is_transient(self, exc: DBAPIError) -> bool:
        return getattr(exc.orig, "sqlstate", None) in _TRANSIENT

    def message_limit(self) -> int:
        """A TEXT value holds at most 1 GB."""
        return 2**30 - 2**20


__all__ = ["MIGRATIONS", "SCHEMA", "Store", "metadata"]
