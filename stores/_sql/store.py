"""The SQL store logic, once, for every dialect.

Saving appends: a Store remembers, per session, the transcript it last wrote or read and the version
token that went with it. A save whose transcript starts with that one, while the token in the database is
still the same, writes only the new messages (and deletes a diverged tail); otherwise it rewrites the
transcript. Either way it is one transaction, and the session row is locked first, so concurrent writers
of one session queue behind each other instead of deadlocking.
"""

from __future__ import annotations

import os
import random
import re
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    Executable,
    and_,
    case,
    delete,
    false,
    insert,
    literal,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from agent_sessions import ArgumentError, Holder, Message, MessageError, SessionExists, StoreError, validate

from .._known import Known, common_prefix
from . import statements as sql
from .driver import PARAMSTYLES, Driver, Rows
from .tables import TABLES, messages, runs, sessions

T = TypeVar("T")


_RETRIES = 4


class SQLStore:
    """Subclasses say what differs: the upsert, how steers are taken, which errors mean what."""

    backend: ClassVar[str] = "SQL"
    schema_hint: ClassVar[str] = "create them first"
    dialects: ClassVar[tuple[str, ...]] = ()
    """SQLAlchemy dialect names the store accepts; empty: any."""
    engine_hint: ClassVar[str] = ""
    raw_statements: ClassVar[bool] = False
    """Run the prebuilt statements on the DB-API cursor (see driver.py): for drivers where SQLAlchemy's
    execution path costs as much as the statement."""

    def __init__(self, engine: Engine, *, remember: int = 1024) -> None:
        if not isinstance(engine, Engine) or (self.dialects and engine.dialect.name not in self.dialects):
            raise ArgumentError(
                f"{type(self).__module__}.Store needs a SQLAlchemy Engine for {self.backend}, got {engine!r}; "
                f"{self.engine_hint}"
            )
        self.engine = engine
        self._known = Known(remember)
        raw = self.raw_statements and engine.dialect.paramstyle in PARAMSTYLES
        self._driver = Driver(engine.dialect) if raw else None
        _dispose_after_fork(self)

    # -- the Store protocol --------------------------------------------------------------------------

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        self._save(session, msgs, take=False)

    def save_with_steers(self, session: str, msgs: Sequence[Message]) -> list[str]:
        """One transaction: a plain read finds whether steers wait (usually none), only then are they
        taken, and the transcript holding them is saved before the commit."""
        return self._save(session, msgs, take=True)

    def _save(self, session: str, msgs: Sequence[Message], take: bool) -> list[str]:
        validate.session_id(session)
        known = self._known.get(session)
        items, shared = validate.messages_after(msgs, known[1] if known is not None else ())
        if known is not None and shared < len(known[1]):
            shared = common_prefix(known[1], items)  # diverged, or not the objects it saved: compare
        for m in items[shared:]:
            m.to_json()  # encode before the transaction opens: no lock is held while we serialise
        version = os.urandom(16).hex()
        if known is not None and shared == len(known[1]) < len(items):
            try:
                stored = self.append(session, known[0], version, items, shared, unsteered=take)
            except BaseException:
                self._known.forget(session)
                raise
            if stored is not None:
                self._known.put(session, stored, items)
                return []
        saved = items
        taken: list[str] = []

        def write(conn: Connection) -> None:
            nonlocal saved, taken
            waiting = take and self.run(conn, sql.ANY_STEER, {"sid": session}).first() is not None
            taken = self.take(conn, session) if waiting else []
            saved = items + tuple(Message.user(text) for text in taken)
            start = 0
            if known is not None and self._claim(conn, session, known[0], version):
                start = shared
                # Past what this process knows: its own diverged tail, or messages another writer appended
                # (an append keeps the version).
                self.run(conn, sql.TRIM, {"sid": session, "start": start})
            else:
                conn.execute(self.upsert_session(session, version))
                self.run(conn, sql.CLEAR, {"sid": session})
            if start < len(saved):
                self.run(
                    conn,
                    sql.APPEND,
                    [{"session_id": session, "seq": i, "body": saved[i].to_json()} for i in range(start, len(saved))],
                )

        try:
            self._transaction("save", session, write)
        except BaseException:
            self._known.forget(session)
            raise
        self._known.put(session, version, saved)
        return taken

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)

        def read(conn: Connection) -> list[Any]:
            return list(self.run(conn, sql.LOAD, {"sid": session}).all())

        rows = self._transaction("messages", session, read, read_only=True, reads=True)
        if not rows:
            return []
        try:
            items = tuple(Message.from_json(body) for _, body in rows if body is not None)
        except MessageError as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt message: {exc}") from exc
        self._known.put(session, rows[0][0], items)
        return list(items)

    def add_steer(self, session: str, text: str) -> None:
        validate.session_id(session)
        validate.steer_text(text)

        def add(conn: Connection) -> None:
            self.run(conn, sql.ADD_STEER, {"session_id": session, "text": text})

        self._transaction("add_steer", session, add)

    def take_steers(self, session: str) -> list[str]:
        """Usually nothing waits: a read, which takes no write lock, settles that before a write does."""
        validate.session_id(session)
        if not self._steers_waiting(session):
            return []
        return self._transaction("take_steers", session, lambda conn: self.take(conn, session))

    def _steers_waiting(self, session: str) -> bool:
        row = self._transaction(
            "take_steers", session, lambda conn: self.run(conn, sql.ANY_STEER, {"sid": session}).first(),
            read_only=True, reads=True,
        )
        return row is not None

    # -- RunStore ------------------------------------------------------------------------------------

    def fork(self, source: str, target: str, at: int | None) -> None:
        validate.session_id(source)
        validate.session_id(target)

        def copy(conn: Connection) -> None:
            if conn.execute(
                select(sessions.c.version).where(sessions.c.session_id == source).with_for_update()
            ).first() is None:
                raise ArgumentError(f"cannot fork session {source!r}: it has no transcript")
            length = int(self.run(conn, sql.LENGTH, {"sid": source}).scalar())  # type: ignore[call-overload]
            validate.fork_index(at, length, source)
            n = length if at is None else at
            if conn.execute(select(sessions.c.version).where(sessions.c.session_id == target)).first():
                raise SessionExists(f"cannot fork {source!r} into {target!r}: {target!r} already has a transcript")
            conn.execute(insert(sessions).values(session_id=target, version=uuid.uuid4().hex))
            conn.execute(
                insert(messages).from_select(
                    ["session_id", "seq", "body"],
                    select(literal(target, messages.c.session_id.type), messages.c.seq, messages.c.body).where(
                        and_(messages.c.session_id == source, messages.c.seq < n)
                    ),
                )
            )

        try:
            self._transaction("fork", source, copy)
        except StoreError as exc:
            if isinstance(exc.__cause__, IntegrityError):  # a concurrent fork to the same target won
                raise SessionExists(f"cannot fork {source!r} into {target!r}: {target!r} was just created") from exc
            raise

    def journal(self, session: str) -> str | None:
        validate.session_id(session)
        body = self._transaction(
            "journal", session, lambda conn: self.run(conn, sql.JOURNAL, {"sid": session}).scalar(),
            read_only=True, reads=True,
        )
        return None if body is None else str(body)

    def put_journal(self, session: str, journal: str | None) -> None:
        validate.session_id(session)

        def put(conn: Connection) -> None:
            self.run(conn, sql.DROP_JOURNAL, {"sid": session})
            if journal is not None:
                self.run(conn, sql.PUT_JOURNAL, {"session_id": session, "body": journal})

        self._transaction("put_journal", session, put)

    def acquire(self, session: str, holder: Holder, now: float) -> Holder:
        validate.session_id(session)
        row = runs.c

        def take(conn: Connection) -> Holder:
            # cancelled is assigned first: MySQL evaluates SET left to right, so it must still see the
            # old token. A renewal keeps a cancel; a take-over starts without one.
            conn.execute(
                update(runs)
                .where(and_(row.session_id == session, or_(row.token == holder.token, row.expires <= now)))
                .ordered_values(
                    (row.cancelled, case((row.token == holder.token, row.cancelled), else_=false())),
                    (row.host, holder.host),
                    (row.pid, holder.pid),
                    (row.token, holder.token),
                    (row.expires, holder.expires),
                )
            )
            current = self.run(conn, sql.HOLDER, {"sid": session}).first()
            if current is None:
                conn.execute(insert(runs).values(
                    session_id=session, host=holder.host, pid=holder.pid, token=holder.token,
                    expires=holder.expires, cancelled=False,
                ))
                return Holder(holder.host, holder.pid, holder.token, holder.expires, False)
            return _holder(current)

        for attempt in range(3):
            try:
                return self._transaction("acquire", session, take)
            except StoreError as exc:
                if not isinstance(exc.__cause__, IntegrityError) or attempt == 2:
                    raise  # otherwise another process inserted the lease first: read it next time
        raise AssertionError("unreachable")

    def release(self, session: str, token: str) -> None:
        validate.session_id(session)
        self._transaction("release", session, lambda conn: conn.execute(
            delete(runs).where(and_(runs.c.session_id == session, runs.c.token == token))
        ))

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        current = self._transaction(
            "holder", session, lambda conn: self.run(conn, sql.HOLDER, {"sid": session}).first(),
            read_only=True, reads=True,
        )
        return None if current is None else _holder(current)

    def cancel(self, session: str, now: float) -> bool:
        validate.session_id(session)
        stmt = update(runs).where(and_(runs.c.session_id == session, runs.c.expires > now)).values(cancelled=true())
        return bool(self._transaction("cancel", session, lambda conn: conn.execute(stmt).rowcount) == 1)

    # -- what dialects override ----------------------------------------------------------------------

    def run(self, conn: Connection, statement: Executable, params: dict[str, Any] | list[dict[str, Any]]) -> Rows:
        """Run one of ``statements``; the result has ``rowcount``, ``first()``, ``all()`` and ``scalar()``
        and its rows are tuples."""
        if self._driver is not None:
            return self._driver.run(conn, statement, params)
        return conn.execute(statement, params)

    def upsert_session(self, session: str, version: str) -> Any:
        raise NotImplementedError

    share_lock: ClassVar[str] = ""
    """Appended to the append's read of the session row where that read would not lock it (MySQL)."""

    def append(
        self, session: str, known: str, version: str, items: tuple[Message, ...], start: int, unsteered: bool
    ) -> str | None:
        """Append ``items[start:]`` in one statement if the stored version is still ``known`` (and, when
        ``unsteered``, no steer waits), returning the version stored now (``known``: see
        ``statements.append_if_current``); ``None`` when not, and the save then runs its transaction."""
        count = len(items) - start
        if count > sql.MAX_APPEND:
            return None
        params = sql.append_params(session, known, items, start)
        statement = sql.append_if_current(count, unsteered, self.share_lock)
        try:
            inserted = self._transaction("save", session, lambda conn: self.run(conn, statement, params).rowcount)
        except StoreError as exc:
            if isinstance(exc.__cause__, IntegrityError):  # another writer appended at these positions first
                return None
            raise
        return known if inserted == count else None

    def take(self, conn: Connection, session: str) -> list[str]:
        """Delete and return the session's steers, oldest first. DELETE ... RETURNING: rows another
        taker deleted first are simply not there, so each steer goes to exactly one taker."""
        rows = self.run(conn, sql.TAKE_STEERS, {"sid": session}).all()
        return [str(text) for _, text in sorted((int(id), text) for id, text in rows)]

    def is_transient(self, exc: DBAPIError) -> bool:
        """A deadlock or serialisation failure: the transaction may simply be run again."""
        return False

    # -- plumbing ------------------------------------------------------------------------------------

    def _claim(self, conn: Connection, session: str, known: str, version: str) -> bool:
        """Take the session row if it still has the version this process knows; lock it either way."""
        result = self.run(conn, sql.CLAIM, {"sid": session, "known": known, "new_version": version})
        return bool(result.rowcount == 1)

    @contextmanager
    def _connection(self, read_only: bool) -> Iterator[Connection]:
        """A connection of the engine's pool for one transaction. ``read_only``: the work only reads, or is
        one statement, so a dialect may begin without a write lock (SQLite) or run it in autocommit
        (PostgreSQL)."""
        with self.engine.begin() as conn:
            yield conn

    def _transaction(
        self, op: str, session: str, work: Callable[[Connection], T], read_only: bool = False, reads: bool = False
    ) -> T:
        """Run ``work`` in one transaction, again on a deadlock or serialisation failure. ``reads``: it
        only reads, so it is also run once more when its connection turns out dead (a pooled connection
        from before a server restart); a write is not, since it may have committed before the line went."""
        attempt = 0
        reconnected = False
        while True:
            try:
                with self._connection(read_only) as conn:
                    return work(conn)
            except DBAPIError as exc:
                if self.is_transient(exc) and attempt < _RETRIES:
                    attempt += 1
                    time.sleep(0.005 * (2**attempt) * random.random())
                    continue
                if reads and exc.connection_invalidated and not reconnected:
                    reconnected = True
                    continue
                raise self._error(op, session, exc) from exc
            except SQLAlchemyError as exc:
                raise self._error(op, session, exc) from exc

    def _error(self, op: str, session: str, exc: SQLAlchemyError) -> StoreError:
        cause = str(getattr(exc, "orig", None) or exc)
        missing = _TABLE_NAME.search(cause) if _looks_missing(cause) else None
        if missing:
            return StoreError(
                f"{self.backend} store: table {missing.group(0)!r} does not exist ({op} of session "
                f"{session!r}); {self.schema_hint}"
            )
        return StoreError(f"{self.backend} store: {op} of session {session!r} failed: {cause}")

    def __repr__(self) -> str:
        return f"{type(self).__module__}.Store({self.engine.url!r})"


def _holder(row: Sequence[Any]) -> Holder:
    """A row of agent_runs (sql.HOLDER's columns, in table order) as a Holder."""
    _, host, pid, token, expires, cancelled = row
    return Holder(host, pid, token, expires, bool(cancelled))


def _dispose_after_fork(store: SQLStore) -> None:
    """A forked child (a Celery or gunicorn prefork worker) must not talk over its parent's sockets: two
    processes on one connection interleave their bytes. So the child drops the pool it inherited,
    without closing those connections (they are still the parent's), and opens its own."""
    ref = weakref.ref(store)

    def forked() -> None:
        alive = ref()
        if alive is not None:
            alive.engine.dispose(close=False)
            alive._known = Known(alive._known.size)

    os.register_at_fork(after_in_child=forked)


_TABLE_NAME = re.compile(r"\b(?:" + "|".join(t.name for t in TABLES) + r")\b")


def _looks_missing(message: str) -> bool:
    text = message.lower()
    return any(s in text for s in ("no such table", "does not exist", "doesn't exist", "undefinedtable"))
