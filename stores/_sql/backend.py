"""The backend of every SQL store (``agent_sessions.backend``) over a SQLAlchemy Engine, in Core statements.

A write is one transaction: lock the session's row (``SELECT ... FOR UPDATE``, or SQLite's ``BEGIN
IMMEDIATE``), evaluate the guard in Python (``Guard.holds``, shared with the memory store), change the child
tables, and write the row the shared arithmetic computed (``next_row``). A read is one transaction too, so
all its parts are of one moment. The dialects differ only in the hooks of ``SQLBackend`` (how a transaction
begins, the store's clock, a prefix match, which errors to retry). PostgreSQL and MySQL replace reads and
writes with one statement each (``_once``), and keep the listings, events and identity.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Select,
    and_,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection

from agent_sessions.backend import (
    Acquire,
    Change,
    Guard,
    Idle,
    Open,
    Queued,
    Recent,
    Row,
    Snapshot,
    Steer,
    Want,
    Written,
    empty_row,
    first_events,
    indexed,
    next_row,
)
from agent_sessions.errors import AgentError, OutcomeUnknown, SchemaMismatch, StoreError

from .clock import db_now
from .tables import (
    CHILDREN,
    SCHEMA_VERSION,
    TABLES,
    events,
    keys,
    messages,
    queue,
    sessions,
    steers,
    store,
)
from .tables import tags as meta

T = TypeVar("T")
log = logging.getLogger(__name__)

RETRIES = 4
"""Times a transaction is run again after a deadlock, or a new session's row another writer made first."""
S = sessions.c
_ROW = [c for c in sessions.c]
_FIELDS = [c.name for c in _ROW]


def _children(guard: Guard) -> list[ColumnElement[Any]]:
    """What the guard asks of the child tables: how many of its steers wait, the queue's head, whether its
    key was accepted; scalar subqueries of the locked row's session, read in the statement that locks it."""
    t, qu, k, sid = steers.c, queue.c, keys.c, S.session_id
    return [select(func.count()).where(t.session_id == sid, t.id.in_(set(guard.steers) or {-1})).scalar_subquery(),
            select(func.min(qu.id)).where(qu.session_id == sid).scalar_subquery(),
            select(func.count()).where(k.session_id == sid, k.accepted_key == (guard.key_absent or ""))
            .scalar_subquery()]


_UPDATE = update(sessions).where(S.session_id == bindparam("b_session_id"))
"""The row's update, its SET the columns a write's values name: built once, as building it with its values
took SQLAlchemy a third of a SQLite write."""
_TABLE = re.compile(r"\b(?:" + "|".join(t.name for t in TABLES) + r")\b")
_oldest = select(func.min(events.c.seq)).where(events.c.session_id == S.session_id).scalar_subquery()
"""The oldest event kept, read with the row: a write that adds events trims the log only when it must."""


class SQLBackend:
    """A backend over ``engine``; ``name`` says which database in errors ("SQLite store")."""

    hint = "create the tables first"
    """What a ``StoreError`` for a missing table tells the caller to do."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self._identity: str | None = None
        row = self._select().where(S.session_id == bindparam("sid")).with_for_update()
        self._locking = {False: row, True: row.add_columns(_oldest)}
        """The row a write reads, with the oldest event when it trims the log: built once."""
        _LIVE.add(self)

    # -- the dialect's hooks -----------------------------------------------------------------------------

    def begin(self, conn: Connection, write: Change | None) -> None:
        """Begin ``conn``'s transaction: a write's of ``write``, or (``None``) a read's that sees one moment."""

    def clock(self) -> ColumnElement[float]:
        """The store's clock as a SQL expression: the database server's (``db_now``)."""
        return db_now()

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        return column.startswith(prefix, autoescape=True)

    def retry(self, exc: DBAPIError) -> bool:
        """A deadlock or the like: the transaction was rolled back and may simply run again."""
        return False

    def refine(self, exc: DBAPIError, what: str) -> AgentError | None:
        """A more precise error for ``exc`` than the plain ``StoreError`` (a lock wait given up)."""
        return None

    def after_fork(self) -> None:
        """In a forked child: drop the parent's connections without closing them (they are the parent's)."""
        self.engine.dispose(close=False)

    # -- transactions ------------------------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def _run(self, what: str, session: str, work: Callable[[Connection], T], write: Change | None = None) -> T:
        """``work`` in one transaction, run again after a deadlock, or (having written nothing) on a dead
        pooled connection. A connection lost while committing what a write changed is ``OutcomeUnknown``; a
        refused write changed nothing, so losing its COMMIT is no doubt about anything (it runs again)."""
        if self._identity is None and what != "identity":
            _ = self.identity
        attempt = 0
        while True:
            changed = False
            try:
                with self._connection() as conn:
                    self.begin(conn, write)
                    result = work(conn)
                    changed = write is not None and not write.empty and any(  # a Written, or delete_page's
                        getattr(w, "done", False) for w in (result if isinstance(result, list) else [result]))
                    conn.commit()
                return result
            except DBAPIError as exc:
                fresh = exc.connection_invalidated and not changed
                again = self.retry(exc) or fresh or (isinstance(exc, IntegrityError) and write is not None)
                if again and attempt < RETRIES:
                    attempt += 1
                    self._pause(what, session, exc, attempt)
                    continue
                raise self._error(what, session, exc, changed) from exc
            except SQLAlchemyError as exc:
                raise self._error(what, session, exc, False) from exc

    @contextmanager
    def _statement(self) -> Iterator[Any]:
        """What ``_once`` runs its statement on: a pooled connection (MySQL's: a cursor of one)."""
        with self._connection() as conn:
            yield conn

    def _pooled(self) -> PoolProxiedConnection | None:
        """The pooled DBAPI connection a server store's one statement runs on, with no ``Connection`` around
        it; ``None`` while anything listens for the engine's cursor events (a tracer: the statement then goes
        through SQLAlchemy's ``Connection``, so it sees every one). A driver's error checking it out is
        SQLAlchemy's (nothing was sent)."""
        dispatch = self.engine.dispatch
        if dispatch.before_cursor_execute or dispatch.after_cursor_execute:
            return None
        error = self.engine.dialect.loaded_dbapi.Error
        try:
            return self.engine.raw_connection()
        except error as exc:
            raise DBAPIError.instance("", None, exc, error) from exc

    def _once(self, what: str, session: str, call: Callable[[Any], T], *, writes: bool = False) -> T:
        """``call``, one statement, never run again when a write may have happened (``OutcomeUnknown``): a
        read on a pooled connection found dead (the server restarted since) is run once more, on a new one,
        and a write rolled back whole (``retry``: a deadlock) runs again. The first asks the database's
        identity first (``SchemaMismatch`` before anything is read or written)."""
        if self._identity is None and what != "identity":
            _ = self.identity
        attempt = 0
        while True:
            try:
                with self._statement() as handle:
                    return call(handle)
            except DBAPIError as exc:
                again = self.retry(exc) if writes else exc.connection_invalidated and not attempt
                if not again or attempt == RETRIES:
                    raise self._error(what, session, exc, writes) from exc
                attempt += 1
                if writes:
                    self._pause(what, session, exc, attempt)
            except SQLAlchemyError as exc:
                raise self._error(what, session, exc, False) from exc

    def _pause(self, what: str, session: str, exc: DBAPIError, attempt: int) -> None:
        log.warning("%s: %s of %r: %s; running it again (attempt %d of %d)", self.name, what, session, exc.orig,
                    attempt, RETRIES)
        time.sleep(0.002 * 2**attempt * random.random())

    def _error(self, what: str, session: str, exc: SQLAlchemyError, unknown: bool) -> AgentError:
        cause = str(getattr(exc, "orig", None) or exc).strip()
        what = f"{what} of session {session!r}" if session else what
        if unknown and isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return OutcomeUnknown(f"{self.name}: {what} may have happened: the connection dropped as it "
                                  f"committed ({cause})")
        refined = self.refine(exc, what) if isinstance(exc, DBAPIError) else None
        if refined is not None:
            return refined
        low = cause.lower()
        missing = _TABLE.search(cause)
        if missing and any(s in low for s in ("no such table", "doesn't exist", "does not exist", "undefinedtable")):
            return StoreError(f"{self.name}: table {missing.group(0)!r} does not exist ({what}); {self.hint}")
        return StoreError(f"{self.name}: {what} failed: {cause}")

    # -- identity ----------------------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        if self._identity is None:
            q = select(store.c.identity, store.c.schema_version).where(store.c.id == 1)
            found = self._run("identity", "", lambda conn: conn.execute(q).first())
            if found is None:
                mine = insert(store).values(id=1, identity=uuid.uuid4().hex, schema_version=SCHEMA_VERSION)
                try:
                    self._run("identity", "", lambda conn: conn.execute(mine))
                except StoreError as exc:
                    if not isinstance(exc.__cause__, IntegrityError):  # else another process drew it first
                        raise
                found = self._run("identity", "", lambda conn: conn.execute(q).first())
            assert found is not None
            if found[1] != SCHEMA_VERSION:
                raise SchemaMismatch(f"{self.name}: the database is of schema {found[1]}, this version of "
                                     f"agent-sessions reads and writes schema {SCHEMA_VERSION} only")
            self._identity = str(found[0])
        return self._identity

    # -- reading -----------------------------------------------------------------------------------------

    def _rows(self, conn: Connection, query: Select[Any]) -> list[Row]:
        return [Row(*r) for r in conn.execute(query)]

    def _select(self) -> Select[Any]:
        return select(*_ROW, self.clock().label("now"))

    def read(self, session: str, want: Want) -> Snapshot | None:
        return self._run("read", session, lambda conn: self._read(conn, session, want))

    def _read(self, conn: Connection, session: str, want: Want) -> Snapshot | None:
        found = self._rows(conn, self._select().where(S.session_id == session))
        if not found:
            return None
        row = found[0]
        start, texts = 0, []
        if want.start is not None or want.last is not None:
            stop = row.length if want.stop is None else min(want.stop, row.length)
            start = want.start if want.start is not None else max(stop - (want.last or 0), 0)
            if start < stop:
                texts = list(conn.execute(
                    select(messages.c.body).where(messages.c.session_id == session, messages.c.idx >= start,
                                                  messages.c.idx < stop).order_by(messages.c.idx)).scalars())
        waiting = []
        if want.steers and row.steers:
            waiting = [Steer(*r) for r in conn.execute(
                select(steers.c.id, steers.c.body, steers.c.steer_key).where(steers.c.session_id == session)
                .order_by(steers.c.id))]
        queued = []
        if want.queue and row.queued:
            queued = [Queued(*r) for r in conn.execute(
                select(queue.c.id, queue.c.queue_key, queue.c.body).where(queue.c.session_id == session)
                .order_by(queue.c.id))]
        return Snapshot(row, start, texts, waiting, queued)

    def events(self, session: str, after: int, limit: int) -> list[tuple[int, str]]:
        e = events.c
        q = select(e.seq, e.body).where(e.session_id == session, e.seq > after).order_by(e.seq).limit(limit)
        return self._run("events", session, lambda conn: [(int(s), b) for s, b in conn.execute(q)])

    def sessions(self, query: Recent | Open | Idle) -> list[Row]:
        return self._run("sessions", "", lambda conn: self._page(conn, query))

    def _page(self, conn: Connection, query: Recent | Open | Idle) -> list[Row]:
        """The rows of ``query``. A page filtered by values many sessions share walks the newest sessions past
        the cursor, each one's tags looked up by key, down to a window (the lookup by value would sort them
        all); its rows are the page when they fill it or no window is left, else the lookup gives it."""
        if isinstance(query, Recent) and query.where:
            cap = 10 * (query.limit + 1)  # common: 10 sessions per row of the page (510 for a page of 50)
            counts = conn.execute(select(*(select(func.count()).select_from(
                select(meta.c.session_id).where(meta.c.name == n, meta.c.value == v).limit(cap).subquery())
                .scalar_subquery() for n, v in query.where))).one()
            if min(counts) >= cap:
                ends = self._listing(Recent(query.prefix, (), 1, query.after))
                end = conn.execute(ends.with_only_columns(S.updated, S.session_id)  # a window of 20 per row
                                   .offset(20 * (query.limit + 1) - 1)).first()
                rows = self._rows(conn, self._listing(query, walk=True, end=None if end is None else tuple(end)))
                if len(rows) == query.limit or end is None:
                    return rows
        return self._rows(conn, self._listing(query))

    def _listing(self, query: Recent | Open | Idle, walk: bool = False, end: tuple[Any, ...] | None = None
                 ) -> Select[Any]:
        """Each query reads an index in its order and stops at the page's end: Recent and Idle the index of
        (exists_, updated, session_id), backwards and forwards from the cursor's bound; Open the index of the
        open sessions (whose ``exists_`` test is written so no planner prefers the other index)."""
        q = self._select()
        if isinstance(query, Open):
            q = q.where(S.open_since.is_not(None), S.open_since <= self.clock() - query.grace,
                        S.exists_.is_not(False))
            if query.after is not None:
                o, sid = query.after
                q = q.where(S.open_since >= o, or_(S.open_since > o, S.session_id > sid))
            return q.order_by(S.open_since, S.session_id).limit(query.limit)
        q = q.where(S.exists_ == true())
        if isinstance(query, Idle):
            return q.where(S.updated < self.clock() - query.idle_for).order_by(S.updated, S.session_id).limit(
                query.limit)
        if query.prefix:
            q = q.where(self.starts_with(S.session_id, query.prefix))
        for i, (name, value) in enumerate(query.where):
            m = meta.alias(f"m{i}")
            if walk:  # each session's tag by its key, as the walk reaches it
                q = q.where(select(m.c.value).where(m.c.session_id == S.session_id, m.c.name == name)
                            .scalar_subquery() == value)
            else:
                q = q.join(m, and_(m.c.session_id == S.session_id, m.c.name == name, m.c.value == value))
        if query.after is not None:
            u, sid = query.after
            q = q.where(S.updated <= u, or_(S.updated < u, S.session_id < sid))
        if end is not None:
            q = q.where(S.updated >= end[0], or_(S.updated > end[0], S.session_id >= end[1]))
        return q.order_by(S.exists_.desc(), S.updated.desc(), S.session_id.desc()).limit(query.limit)

    # -- writing -----------------------------------------------------------------------------------------

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        return self._run("write", session, lambda conn: self._write(conn, session, guard, change), write=change)

    def _write(self, conn: Connection, session: str, guard: Guard, change: Change) -> Written:
        trims = bool(change.events and change.keep)
        q = self._locking[trims]  # SQLite has no FOR UPDATE: BEGIN IMMEDIATE locked the file
        found = conn.execute(q.add_columns(*_children(guard)) if guard.reads_children else q, {"sid": session}).first()
        if found is None:
            now = float(conn.execute(select(self.clock())).scalar_one())
            row, oldest, extra = None, None, (0, None, 0)
            base = replace(empty_row(session), now=now)
        else:
            n = len(_ROW) + 1
            row = base = Row(*found[:n])
            oldest = found[n] if trims else None
            extra = tuple(found[n + trims:]) if guard.reads_children else (0, None, 0)
        present, head, key = extra
        waiting = guard.steers if present == len(set(guard.steers)) else ()
        if not guard.holds(base, base.now, waiting, head, bool(key)):
            return Written(False, row)
        if change.empty:
            return Written(True, base)
        if change.delete:
            if row is not None:
                _erase(conn, [session])
            return Written(True, row)
        counts = self._children_change(conn, session, base, change, oldest)
        new = next_row(base, change, base.now, *counts)
        if isinstance(change.lease, Acquire) and base.token is not None:
            log.info("%s: session %r: the lease of pid %s on %s (token %s…) had expired; taken over at epoch %s",
                     self.name, session, base.pid, base.host, base.token[:8], new.epoch)
        values = {name: getattr(new, "session" if name == "session_id" else name.rstrip("_")) for name in _FIELDS}
        if row is not None:
            values["b_session_id"] = values.pop("session_id")
        conn.execute(insert(sessions) if row is None else _UPDATE, values)
        return Written(True, new)

    def delete_page(self, guarded: Sequence[tuple[str, Guard]]) -> list[bool]:
        """``BatchDeletes.delete_many`` where ``_run`` locks as a write does: the rows read and locked, each guard
        checked as ``write`` checks it, the doomed sessions deleted a table at a time, in one transaction."""
        gone = Change(delete=True)

        def work(conn: Connection) -> list[Written]:
            query = self._select().where(S.session_id.in_([s for s, _ in guarded])).with_for_update()
            rows = {row.session: row for row in self._rows(conn, query)}
            done = [s in rows and g.holds(rows[s], rows[s].now) for s, g in guarded]
            doomed = [s for (s, _), d in zip(guarded, done, strict=True) if d]
            _erase(conn, doomed)  # none doomed (every guard refused, rare): deletes of nothing
            return [Written(d, rows.get(s)) for (s, _), d in zip(guarded, done, strict=True)]

        return [w.done for w in self._run("prune", "", work, write=gone)]

    def _children_change(self, conn: Connection, session: str, row: Row, change: Change,
                         oldest: int | None) -> tuple[int, int]:
        """Change the child tables; how many steers and queue items wait after it."""
        waiting, queued = row.steers, row.queued
        version = row.version + 1
        if change.splice is not None:
            at, texts = change.splice
            if at < row.length:
                conn.execute(delete(messages).where(messages.c.session_id == session, messages.c.idx >= at))
            if texts:
                conn.execute(insert(messages), [{"session_id": session, "idx": at + i, "body": body}
                                                for i, body in enumerate(texts)])
        if change.take_steers:
            waiting -= conn.execute(delete(steers).where(steers.c.session_id == session,
                                                         steers.c.id.in_(set(change.take_steers)))).rowcount
        if change.add_steer is not None:
            body, key = change.add_steer
            conn.execute(insert(steers).values(session_id=session, id=version, body=body, steer_key=key))
            waiting += 1
        if change.pop is not None:
            queued -= conn.execute(delete(queue).where(queue.c.session_id == session,
                                                       queue.c.id == change.pop)).rowcount
        if change.push is not None:
            key, body = change.push
            conn.execute(insert(queue).values(session_id=session, id=version, queue_key=key, body=body))
            queued += 1
        if change.drop_key is not None:
            conn.execute(delete(keys).where(keys.c.session_id == session, keys.c.accepted_key == change.drop_key))
        if change.add_key is not None:
            conn.execute(insert(keys).values(session_id=session, accepted_key=change.add_key))
        if change.metadata is not None:
            if row.metadata != "{}":
                names = [n for n, _ in indexed(row.metadata)]
                conn.execute(delete(meta).where(meta.c.session_id == session, meta.c.name.in_(names)))
            pairs = indexed(change.metadata)
            if pairs:
                conn.execute(insert(meta), [{"session_id": session, "name": n, "value": v} for n, v in pairs])
        if change.events:
            first = first_events(row, row.now)
            conn.execute(insert(events), [{"session_id": session, "seq": first + i, "body": body}
                                          for i, body in enumerate(change.events)])
            cut = first + len(change.events) - change.keep
            start = oldest if oldest is not None else first
            if change.keep and start < cut:
                e = events.c
                conn.execute(delete(events).where(e.session_id == session, e.seq >= start, e.seq < cut))
        return waiting, queued

    def close(self) -> None:
        """The engine is the caller's (SQLite's ``open`` disposes of the one it made)."""

    def __repr__(self) -> str:
        return f"{self.engine.url!r}"


def _erase(conn: Connection, ids: Sequence[str]) -> None:
    """The sessions ``ids`` gone from every table, a statement a table (a write's delete, a page of prune's)."""
    for table in (*CHILDREN, sessions):
        conn.execute(delete(table).where(table.c.session_id.in_(ids)))


def decoded(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def row_of(m: Mapping[str, Any], now: Any) -> Row:
    """The row a one-statement read or write answers, by the table's column names (MySQL's texts as bytes)."""
    return Row(decoded(m["session_id"]) or "", bool(m["exists_"]), decoded(m["incarnation"]) or "",
               float(m["created"]), float(m["updated"]), int(m["version"]), int(m["length"]), int(m["edits"]),
               decoded(m["token"]), int(m["epoch"]), float(m["expires"]), decoded(m["host"]) or "", int(m["pid"]),
               decoded(m["spec"]), decoded(m["turn"]), bool(m["cancelled"]), decoded(m["cancelled_turn"]),
               bool(m["handed"]), decoded(m["journal"]), None if m["open_since"] is None else float(m["open_since"]),
               decoded(m["metadata"]) or "{}", int(m["last_seq"]), int(m["steers"]), int(m["queued"]), float(now))


_LIVE: weakref.WeakSet[SQLBackend] = weakref.WeakSet()
"""Every SQL backend alive in this process, for the one at-fork handler below."""


def _forked() -> None:
    """A forked child (a Celery or gunicorn prefork worker) must not talk over its parent's sockets: two
    processes on one connection interleave their bytes. One handler for all backends, registered once."""
    for backend in list(_LIVE):
        backend.after_fork()


os.register_at_fork(after_in_child=_forked)

__all__ = ["SQLBackend"]
