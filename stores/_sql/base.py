"""What every part of the SQL store stands on: the caller's engine, what this object remembers of each
session, and one way to run work on the database, as one transaction retried on a deadlock or a
serialisation failure, with a driver's error turned into a ``StoreError`` that names the missing table.
Also the at-fork handler, so a forked worker never talks over its parent's connections.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from sqlalchemy import Connection, Engine, Executable
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from agent_sessions import ArgumentError, OutcomeUnknown, SessionLocked, StoreError

from .._known import REMEMBER, REMEMBER_BYTES, Known
from .driver import PARAMSTYLES, Driver, Rows
from .tables import TABLES

T = TypeVar("T")
log = logging.getLogger("stores._sql.store")
"""One logger for all of the SQL store's modules, under the name it had when they were one (docs/api.md)."""


_RETRIES = 4

LOCK_WAIT = 2.0
"""Seconds a statement of the store waits for a row lock another transaction holds before it gives up with
``SessionLocked`` (PostgreSQL's ``lock_timeout``; MySQL's ``innodb_lock_wait_timeout``, whole seconds)."""
TRANSACTION_TIMEOUT = 10.0
"""Seconds a transaction the store opened may sit idle (its worker stalled between two statements) before
PostgreSQL ends it and frees its locks (``idle_in_transaction_session_timeout``): well inside a lease's
ttl (30 s by default), so a frozen worker cannot wedge a session past what its lease could hold it for."""


class SQLBase:
    """The engine, this object's memory of its sessions, and transactions; each part of the store (store.py,
    lease.py, events.py, lifecycle.py, approvals.py) builds on it."""

    backend: ClassVar[str] = "SQL"
    schema_hint: ClassVar[str] = "create them first"
    dialects: ClassVar[tuple[str, ...]] = ()
    """SQLAlchemy dialect names the store accepts; empty: any."""
    engine_hint: ClassVar[str] = ""
    raw_statements: ClassVar[bool] = False
    """Run the prebuilt statements on the DB-API cursor (see driver.py): for drivers where SQLAlchemy's
    execution path costs as much as the statement."""
    prepare_statements: ClassVar[bool] = False
    """With ``raw_statements``: have the driver prepare each statement at its first use (``Driver``)."""

    def __init__(
        self, engine: Engine, *, remember: int = REMEMBER, remember_bytes: int = REMEMBER_BYTES,
        lock_wait: float = LOCK_WAIT, transaction_timeout: float = TRANSACTION_TIMEOUT,
    ) -> None:
        for name, value in (("lock_wait", lock_wait), ("transaction_timeout", transaction_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400:
                raise ArgumentError(f"{type(self).__module__}.Store: {name} must be seconds in (0, 86400], got "
                                    f"{value!r}")
        self.lock_wait = float(lock_wait)
        self.transaction_timeout = float(transaction_timeout)
        if not isinstance(engine, Engine) or (self.dialects and engine.dialect.name not in self.dialects):
            raise ArgumentError(
                f"{type(self).__module__}.Store needs a SQLAlchemy Engine for {self.backend}, got {engine!r}; "
                f"{self.engine_hint}"
            )
        self.engine = engine
        self._known = Known(remember, remember_bytes)
        self._journaled: set[str] = set()
        """Sessions this object wrote a journal for since their last save: their next append drops it."""
        self._event_floor: dict[str, int] = {}
        """Per session, a number at or below the oldest event its log holds (``_log_events``): the cap's
        DELETE runs only once it could drop something. Numbers only grow (a log begun anew after a delete
        starts above the old one's), and the cap and deletes only raise the oldest, so what another process
        does never makes it wrong; set only once the transaction that learned it has committed."""
        raw = self.raw_statements and engine.dialect.paramstyle in PARAMSTYLES
        self._driver = Driver(engine.dialect, self.prepare_statements, self.bound_locks) if raw else None
        _dispose_after_fork(self)

    def run(self, conn: Connection, statement: Executable, params: dict[str, Any] | list[dict[str, Any]]) -> Rows:
        """Run one of ``statements``; the result has ``rowcount``, ``first()``, ``all()`` and ``scalar()``
        and its rows are tuples."""
        if self._driver is not None:
            return self._driver.run(conn, statement, params)
        return conn.execute(statement, params)

    def bound_locks(self, statement: str) -> str:
        """``statement`` (compiled SQL) made to wait at most ``lock_wait`` for a row lock, where the dialect
        does that per statement (MySQL); as it is elsewhere."""
        return statement

    def is_lock_timeout(self, exc: DBAPIError) -> bool:
        """Did the statement give up waiting for a lock (``lock_wait``)?"""
        return False

    def insert_session(self, session: str) -> Any:
        """Insert a bare session row (no transcript, no lease) unless there is one."""
        raise NotImplementedError

    def is_transient(self, exc: DBAPIError) -> bool:
        """A deadlock or serialisation failure: the transaction may simply be run again."""
        return False

    def after_fork(self) -> None:
        """In a forked child: forget the parent's connections (without closing them) and what it knew."""
        self.engine.dispose(close=False)
        self._known = Known(self._known.size, self._known.max_bytes)
        self._journaled = set()
        self._event_floor = {}

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
            committing = False
            try:
                with self._connection(read_only) as conn:
                    result = work(conn)
                    committing = True  # what is left is the COMMIT, as the block ends
                return result
            except DBAPIError as exc:
                if self.is_lock_timeout(exc):
                    raise self._locked(op, session) from exc
                if self.is_transient(exc) and attempt < _RETRIES:
                    attempt += 1
                    pause = 0.005 * (2**attempt) * random.random()
                    log.warning("%s store: %s of session %r: %s; retrying in %.3f s (attempt %d of %d)",
                                self.backend, op, session, getattr(exc, "orig", exc), pause, attempt, _RETRIES)
                    time.sleep(pause)
                    continue
                if reads and exc.connection_invalidated and not reconnected:
                    reconnected = True
                    log.warning("%s store: %s of session %r met a dead connection (%s); reading again on a "
                                "new one", self.backend, op, session, getattr(exc, "orig", exc))
                    continue
                # The line dropped while the database had the COMMIT (or the one autocommitted statement that
                # writes): it may have committed. Before that, it rolled the transaction back.
                unknown = exc.connection_invalidated and not reads and (committing or self.autocommits(read_only))
                raise self._error(op, session, exc, unknown=unknown) from exc
            except SQLAlchemyError as exc:
                raise self._error(op, session, exc) from exc

    def _locked(self, op: str, session: str) -> SessionLocked:
        """What a statement that gave up waiting for a row lock (``lock_wait``) raises."""
        log.info("%s store: %s of session %r waited %.1f s for a row lock and gave up", self.backend, op, session,
                 self.lock_wait)
        return SessionLocked(
            f"{self.backend} store: {op} of session {session!r} waited {self.lock_wait:g} s (lock_wait) for a lock "
            "another worker holds inside a transaction on the session (stalled, or slow); nothing was written"
        )

    def _append_transaction(self, session: str, work: Callable[[Connection], T]) -> T | None:
        """``work``, a save's append of messages at the positions after the known transcript, in one
        transaction; ``None`` when another writer appended at these positions first."""
        try:
            return self._transaction("save", session, work)
        except StoreError as exc:
            if isinstance(exc.__cause__, IntegrityError):  # another writer appended at these positions first
                return None
            raise

    def autocommits(self, read_only: bool) -> bool:
        """Does ``_connection(read_only)`` run its statement in autocommit (so a write is committed by the
        statement itself)? PostgreSQL's read-only connections do."""
        return False

    def _error(self, op: str, session: str, exc: SQLAlchemyError, unknown: bool = False) -> StoreError:
        """``session`` empty: the operation is of no one session (prune). ``unknown``: the write may have
        happened (``OutcomeUnknown``)."""
        cause = str(getattr(exc, "orig", None) or exc)
        what = f"{op} of session {session!r}" if session else op
        if unknown:
            return OutcomeUnknown(f"{self.backend} store: {what} may have happened: the connection dropped before "
                                  f"the database answered ({cause.strip()})")
        missing = _TABLE_NAME.search(cause) if _looks_missing(cause) else None
        if missing:
            return StoreError(
                f"{self.backend} store: table {missing.group(0)!r} does not exist ({what}); {self.schema_hint}"
            )
        return StoreError(f"{self.backend} store: {what} failed: {cause}")

    def __repr__(self) -> str:
        return f"{type(self).__module__}.Store({self.engine.url!r})"


_LIVE: weakref.WeakSet[SQLBase] = weakref.WeakSet()
"""Every SQL store object alive in this process, for the one at-fork handler below."""


def _dispose_after_fork(store: SQLBase) -> None:
    _LIVE.add(store)


def _forked() -> None:
    """A forked child (a Celery or gunicorn prefork worker) must not talk over its parent's sockets: two
    processes on one connection interleave their bytes. So in the child each store drops the pool it
    inherited, without closing those connections (they are still the parent's), and opens its own. One
    handler for all stores, registered once: a handler per store could never be removed, and a process
    making a store per request would grow, and run them all at every fork."""
    for store in list(_LIVE):
        store.after_fork()


os.register_at_fork(after_in_child=_forked)


_TABLE_NAME = re.compile(r"\b(?:" + "|".join(t.name for t in TABLES) + r")\b")


def _looks_missing(message: str) -> bool:
    text = message.lower()
    return any(s in text for s in ("no such table", "does not exist", "doesn't exist", "undefinedtable"))


class NotWatching:
    """The cancel watch of a store told not to watch (PostgreSQL's ``push_cancels=False``, SQLite's
    ``watch_cancels=False``): it never knows, so the run reads its flag before each idempotent tool."""

    __slots__ = ()

    def listening(self) -> None:
        return None

    def cancelled(self, since: object | None) -> None:
        return None

    def close(self) -> None:
        pass


NOT_WATCHING = NotWatching()
