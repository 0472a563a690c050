"""The SQL store logic, once, for every dialect.

A session is one row of ``agent_sessions`` (its transcript's version, its tool journal and its run
lease) plus its messages and steers. Every write a leased run makes is guarded by that row's lease token
and epoch, inside the write's own statement or transaction, so a run that was taken over can never write
again (the fencing rule of ``agent_sessions.RunStore``).

Saving appends: a Store remembers, per session, the transcript it last wrote or read and the version
token that went with it. A save whose transcript starts with that one, while the token in the database is
still the same, writes only the new messages, in one statement (the usual step). Otherwise it runs one
transaction that locks the session row first, so concurrent writers of one session queue behind each
other instead of deadlocking; there a leased run's save checks that the stored transcript is a prefix of
what it saves (a compare-and-swap) and a plain save rewrites what differs.
"""

from __future__ import annotations

import functools
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
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

from sqlalchemy import ColumnElement, Connection, Engine, Executable, and_, func, insert, literal, or_, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from agent_sessions import (
    ArgumentError,
    Holder,
    LeaseLost,
    Message,
    MessageError,
    Saved,
    SessionBusy,
    SessionExists,
    StoreError,
    TranscriptConflict,
    eventlog,
    lifecycle,
    validate,
)
from agent_sessions.contract import Scalar, SessionInfo, SessionPage, StoredEvent, when
from agent_sessions.messages import read_from

from .._known import REMEMBER, REMEMBER_BYTES, Known, common_prefix
from . import statements as sql
from .driver import PARAMSTYLES, Driver, Rows
from .tables import TABLES, messages, sessions, tags

T = TypeVar("T")
log = logging.getLogger(__name__)


_RETRIES = 4
ACQUIRE_ATTEMPTS = 5
"""Times ``acquire`` makes the session's row and locks it, when a delete lands between the two steps."""
PRUNE_BATCH = 500
"""Sessions ``prune`` deletes per transaction: a batch holds its rows' locks for milliseconds, not the
whole job's length."""
PRUNE_PAUSE = 0.02
"""Seconds prune sleeps between batches. SQLite hands its write lock to whoever asks when it is free, and a
writer asleep in its busy handler's backoff could otherwise miss every gap of a long prune (measured: a
save waiting 868 ms beside a 10,000-session prune)."""


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
    prepare_statements: ClassVar[bool] = False
    """With ``raw_statements``: have the driver prepare each statement at its first use (``Driver``)."""

    def __init__(
        self, engine: Engine, *, remember: int = REMEMBER, remember_bytes: int = REMEMBER_BYTES
    ) -> None:
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
        self._driver = Driver(engine.dialect, self.prepare_statements) if raw else None
        _dispose_after_fork(self)

    # -- the Store protocol --------------------------------------------------------------------------

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        """Replace the transcript (unfenced: for sessions no run holds)."""
        self._save(session, msgs, None, take=False, replace=True)

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False
    ) -> Saved:
        return self._save(session, msgs, holder, take=take_steers, replace=replace)

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int,
    ) -> Saved:
        """The save and the append in one step: the dialect's one-statement append where it can carry the
        events (PostgreSQL), otherwise the save's transaction, which appends them after its write."""
        validate.session_id(session)
        records = eventlog.check_append(events, keep) if events else []
        eventlog.check_keep(keep)
        return self._save(session, msgs, holder, take=take_steers, replace=replace, events=records, keep=keep)

    def _save(
        self, session: str, msgs: Sequence[Message], holder: Holder | None, take: bool, replace: bool,
        events: list[str] | None = None, keep: int = 0,
    ) -> Saved:
        """``events`` (only with a ``holder``): appended in the same step, even when nothing is saved."""
        validate.session_id(session)
        events = events or []
        known = self._known.get(session)
        items, shared = validate.messages_after(msgs, known[1] if known is not None else ())
        if known is not None and shared < len(known[1]):
            shared = common_prefix(known[1], items)  # diverged, or not the objects it saved: compare
        # Encoded (and measured) before the transaction opens: no lock is held while we serialise.
        validate.stored_size(items, shared, self.message_limit(), f"{self.backend} store")
        if known is not None and shared == len(known[1]) and not (holder is not None and replace):
            try:
                if shared < len(items):
                    step = sql.Step(session, known[0], items, shared, take, holder, session in self._journaled,
                                    tuple(events), keep)
                    stored = self.append(step)
                    if stored is not None:
                        self._known.put(session, stored, items, after=known[1])
                        self._journaled.discard(session)
                        return Saved([], False)
                elif holder is not None and not events:
                    unchanged = self._unchanged(session, holder, known[0], len(items), take)
                    if unchanged is not None:
                        return unchanged
            except BaseException:
                self._known.forget(session)
                raise
        outcome: list[tuple[Saved, str | None, tuple[Message, ...]]] = []
        refused: list[TranscriptConflict | LeaseLost] = []
        known_version = None if known is None else known[0]

        def write(conn: Connection) -> None:
            try:
                outcome[:] = [self._write(conn, session, items, known if known is not None else None, shared,
                                          holder, take, replace)]
            except (TranscriptConflict, LeaseLost) as exc:
                # Refused before anything was written (``_write`` checks the lease and the stored prefix
                # first): the transaction only read, so it commits rather than rolls back, which costs the
                # same and keeps psycopg's prepared statements (it forgets them all at each ROLLBACK; a
                # resumed run's first save meets this refusal by design).
                refused[:] = [exc]
                return
            if events:
                assert holder is not None
                logged[:] = [self._append_events(conn, session, holder, events, keep)[1]]

        logged: list[int] = []
        try:
            self._transaction("save", session, write)
            if refused:
                raise refused[0]
        except BaseException:
            self._known.forget(session)
            raise
        if logged:
            self._floor(session, logged[0])
        saved, version, transcript = outcome[0]
        if version is not None:
            self._known.put(session, version, transcript)
        if version != known_version:
            self._journaled.discard(session)  # a save that wrote dropped the journal
        return saved

    def _write(
        self,
        conn: Connection,
        session: str,
        items: tuple[Message, ...],
        known: tuple[str, tuple[Message, ...]] | None,
        shared: int,
        holder: Holder | None,
        take: bool,
        replace: bool,
    ) -> tuple[Saved, str | None, tuple[Message, ...]]:
        """The general save, inside its transaction, with the session row locked first (an unfenced save
        makes it if there is none: ``lock_session``)."""
        if holder is None:
            row = self.lock_session(conn, session)
        else:
            locked = self.run(conn, sql.LOCK, {"sid": session}).first()
            if locked is None or locked[1] != holder.token or locked[2] != holder.epoch:
                raise _lost(session, holder, None if locked is None else locked[1:3])
            row = locked
        stored_version = row[0]
        same = known is not None and stored_version is not None and stored_version == known[0]
        if holder is not None and not replace:
            start = self._stored_prefix(conn, session, items, shared if same else 0)
        else:
            start = shared if same else 0
            self.run(conn, sql.TRIM, {"sid": session, "start": start})
        waiting = take and self.run(conn, sql.ANY_STEER, {"sid": session}).first() is not None
        taken = self.take(conn, session) if waiting else []
        saved = items + tuple(Message.user(text) for text in taken)
        result = Saved(taken, bool(row[3]))
        if holder is not None and not replace and start == len(saved):
            return result, stored_version, saved  # nothing to write, so nothing written
        version = os.urandom(16).hex()
        self.run(conn, sql.SET_VERSION, {"sid": session, "version": version})
        if start < len(saved):
            self.run(
                conn,
                sql.APPEND,
                [{"session_id": session, "seq": i, "body": saved[i].to_json()} for i in range(start, len(saved))],
            )
        return result, version, saved

    def _stored_prefix(self, conn: Connection, session: str, items: tuple[Message, ...], shared: int) -> int:
        """How many messages are stored, checking that they are the first ones of ``items`` (the first
        ``shared`` are known to be); ``TranscriptConflict`` when they are not."""
        rows = self.run(conn, sql.BODIES_FROM, {"sid": session, "start": shared}).all()
        end = shared + len(rows)
        if end > len(items) or any(items[shared + i].to_json() != body for i, (_, body) in enumerate(rows)):
            raise TranscriptConflict(session, end, len(items))
        return end

    def _unchanged(self, session: str, holder: Holder, known: str, length: int, take: bool) -> Saved | None:
        """A fenced save with nothing new: one read shows the transcript is still the known one, the lease
        still ``holder``'s and no steer to take; then nothing is written. ``None``: run the transaction."""
        row = self._transaction(
            "save", session, lambda conn: self.run(conn, sql.STATE, {"sid": session, "length": length}).first(),
            read_only=True, reads=True,
        )
        if row is None:
            return None
        version, token, epoch, cancelled, steers, longer = row
        if token != holder.token or epoch != holder.epoch or version != known or longer or (take and steers):
            return None
        return Saved([], bool(cancelled))

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)

        def read(conn: Connection) -> list[Any]:
            return list(self.run(conn, sql.LOAD, {"sid": session}).all())

        rows = self._transaction("messages", session, read, read_only=True, reads=True)
        if not rows or rows[0][0] is None:
            return []
        try:
            items = tuple(Message.from_json(body) for _, _, body in rows if body is not None)
        except MessageError as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt message: {exc}") from exc
        read_from(items, session, when(float(rows[0][1])))
        self._known.put(session, rows[0][0], items)
        return list(items)

    def add_steer(self, session: str, text: str) -> None:
        validate.session_id(session)
        validate.steer_text(text)
        validate.deliverable_steer(text, self.message_limit(), f"{self.backend} store")

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

    # -- RunStore: the lease ---------------------------------------------------------------------------

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        validate.session_id(session)
        params = {"sid": session, "lease_token": holder.token, "lease_host": holder.host, "lease_pid": holder.pid,
                  "ttl": float(ttl)}

        def take(conn: Connection) -> Holder | None:
            row = self.run(conn, sql.LEASE, {"sid": session}).first()
            if row is None:
                return None  # made just before, and deleted since (a forced delete between the two steps)
            handed = False
            if row[0] is None or not row[2]:  # free, or expired on the database's clock
                self.run(conn, sql.TAKE_OVER, params)
                handed = bool(row[3])
                if row[0] is not None:
                    log.info("%s store: session %r: the lease of token %s… (epoch %d) had expired; taken over "
                             "at epoch %d", self.backend, session, str(row[0])[:8], row[1], row[1] + 1)
            current = self.run(conn, sql.CURRENT, {"sid": session}).first()
            assert current is not None
            got = _holder(current)
            return replace(got, cancelled=True) if handed else got

        # The row first, in a statement of its own: a transaction locking a row that is not there yet
        # would take a gap lock on MySQL, and concurrent first acquires would deadlock on their inserts.
        for _ in range(ACQUIRE_ATTEMPTS):
            self._transaction("acquire", session, lambda conn: conn.execute(self.insert_session(session)),
                              read_only=True)
            got = self._transaction("acquire", session, take)
            if got is not None:
                return got
        raise StoreError(f"{self.backend} store: session {session!r} was deleted under each of {ACQUIRE_ATTEMPTS} "
                         f"attempts to take its lease")

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        validate.session_id(session)
        params = {**sql.fence_params(session, holder), "ttl": float(ttl)}
        renewed = self._transaction(
            "renew", session, lambda conn: self.run(conn, sql.RENEW, params).rowcount, read_only=True
        )
        if renewed != 1:
            raise _lost(session, holder, self._check_row(session))

    def release(self, session: str, holder: Holder) -> None:
        validate.session_id(session)
        params = sql.fence_params(session, holder)
        self._transaction("release", session, lambda conn: self.run(conn, sql.RELEASE, params), read_only=True)

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        current = self._transaction(
            "holder", session, lambda conn: self.run(conn, sql.HOLDER, {"sid": session}).first(),
            read_only=True, reads=True,
        )
        return None if current is None else _holder(current)

    def cancel(self, session: str) -> bool:
        validate.session_id(session)
        cancelled = self._transaction(
            "cancel", session, lambda conn: self.run(conn, sql.CANCEL, {"sid": session}).rowcount, read_only=True
        )
        return bool(cancelled == 1)

    def check(self, session: str, holder: Holder) -> bool:
        validate.session_id(session)
        row = self._check_row(session)
        if row is None or row[0] != holder.token or row[1] != holder.epoch:
            raise _lost(session, holder, row)
        return bool(row[2])

    def lease_lost(self, session: str, holder: Holder) -> LeaseLost:
        """The ``LeaseLost`` of a fenced write that matched no row, saying whose lease is stored now."""
        return _lost(session, holder, self._check_row(session))

    def _check_row(self, session: str) -> Sequence[Any] | None:
        return self._transaction(
            "check", session, lambda conn: self.run(conn, sql.CHECK, {"sid": session}).first(),
            read_only=True, reads=True,
        )

    # -- RunStore: the journal and fork ----------------------------------------------------------------

    def journal(self, session: str) -> str | None:
        validate.session_id(session)
        body = self._transaction(
            "journal", session, lambda conn: self.run(conn, sql.JOURNAL, {"sid": session}).scalar(),
            read_only=True, reads=True,
        )
        return None if body is None else str(body)

    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        """One statement, matched while the lease is the run's and not cancelled; otherwise a read says
        which (a cancel stays until the lease passes on), and a cancelled run's journal is written by a
        statement fenced the same way, unless ``unless_cancelled``."""
        validate.session_id(session)
        params = {**sql.fence_params(session, holder), "body": journal}
        self._journaled.add(session)  # before the write: a save must drop it even if this reply is lost
        if self._transaction(
            "put_journal", session, lambda conn: self.run(conn, sql.PUT_JOURNAL, params).rowcount, read_only=True
        ) == 1:
            return False
        self.check(session, holder)  # raises LeaseLost when the lease is not the run's: then it is cancelled
        if not unless_cancelled and self._transaction(
            "put_journal", session, lambda conn: self.run(conn, sql.PUT_JOURNAL_CANCELLED, params).rowcount,
            read_only=True,
        ) != 1:
            self.check(session, holder)  # taken over in between
        return True

    def swap_journal(self, session: str, expected: str, journal: str) -> bool:
        """One statement whose WHERE holds the expected text (ApprovalStore): no lease, the text guards."""
        validate.session_id(session)
        params = {"sid": session, "expected": expected, "body": journal}
        return self._transaction(
            "swap_journal", session, lambda conn: self.run(conn, sql.SWAP_JOURNAL, params).rowcount, read_only=True
        ) == 1

    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None:
        validate.session_id(source)
        validate.session_id(target)

        def copy(conn: Connection) -> None:
            row = conn.execute(
                select(sessions.c.version).where(sessions.c.session_id == source).with_for_update()
            ).first()
            if row is None or row[0] is None:
                raise ArgumentError(f"cannot fork session {source!r}: it has no transcript")
            length = int(self.run(conn, sql.LENGTH, {"sid": source}).scalar())  # type: ignore[call-overload]
            validate.fork_index(at, length, source)
            if at and not allow_unanswered:
                body = self.run(conn, sql.BODIES_FROM, {"sid": source, "start": at - 1}).first()
                validate.fork_cut(None if body is None else Message.from_json(body[1]), at, source, False)
            n = length if at is None else at
            exists = SessionExists(f"cannot fork {source!r} into {target!r}: {target!r} already has a transcript")
            held = conn.execute(select(sessions.c.version).where(sessions.c.session_id == target)).first()
            if held is None:
                conn.execute(insert(sessions).values(session_id=target, version=uuid.uuid4().hex))
            elif held[0] is not None or conn.execute(
                update(sessions)
                .where(and_(sessions.c.session_id == target, sessions.c.version.is_(None)))
                .values(version=uuid.uuid4().hex, updated=sql.NOW)
            ).rowcount != 1:
                raise exists  # (a row holding only a lease has no transcript: the fork may fill it)
            conn.execute(
                insert(messages).from_select(
                    ["session_id", "seq", "body"],
                    select(literal(target, messages.c.session_id.type), messages.c.seq, messages.c.body).where(
                        and_(messages.c.session_id == source, messages.c.seq < n)
                    ),
                )
            )

        for attempt in range(3):
            try:
                self._transaction("fork", source, copy)
                return
            except StoreError as exc:
                # A concurrent fork to the same target won, or a run's first acquire made its row (holding
                # only a lease, which the next attempt fills): look again.
                if not isinstance(exc.__cause__, IntegrityError):
                    raise
                if attempt == 2:
                    raise SessionExists(
                        f"cannot fork {source!r} into {target!r}: {target!r} was just created") from exc

    # -- EventStore ------------------------------------------------------------------------------------

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        validate.session_id(session)
        records = eventlog.check_append(events, keep)
        last, floor = self._transaction(
            "append_events", session, lambda conn: self._append_events(conn, session, holder, records, keep)
        )
        self._floor(session, floor)
        return last

    def _append_events(
        self, conn: Connection, session: str, holder: Holder, records: list[str], keep: int
    ) -> tuple[int, int]:
        """In the caller's transaction: claim the next numbers on the session row (fenced; the row stays
        locked, so concurrent appenders queue), then ``_log_events``. Returns the last number given and the
        log's floor after it (``_floor`` it once the transaction commits)."""
        last = self.claim(conn, {**sql.fence_params(session, holder), "n": len(records)})
        if last is None:
            raise _lost(session, holder, self.run(conn, sql.CHECK, {"sid": session}).first())
        return last, self._log_events(conn, session, last, records, keep)

    def _log_events(self, conn: Connection, session: str, last: int, records: Sequence[str], keep: int) -> int:
        """Store ``records`` under the numbers just claimed (up to ``last``), drop the log's events beyond the
        newest ``keep`` (only when it holds any: ``_event_floor``), and wake the followers (``notify``).
        Returns the log's floor after this write."""
        n = len(records)
        first, cut = last - n + 1, last - keep
        floor = self._event_floor.get(session)
        if floor is None:
            oldest = self.run(conn, sql.FIRST_EVENT, {"sid": session}).scalar()
            floor = first if oldest is None else int(oldest)  # type: ignore[call-overload]
        rows = [{"session_id": session, "seq": first + i, "body": text}
                for i, text in enumerate(records) if first + i > cut]
        if rows:
            self.run(conn, sql.ADD_EVENTS, rows)
        if cut >= floor:
            self.run(conn, sql.DROP_EVENTS, {"sid": session, "cut": cut})
            floor = cut + 1
        self.notify(conn, session)
        return floor

    def _floor(self, session: str, floor: int) -> None:
        """Remember the log's floor, a transaction having committed it; bounded like ``_known``."""
        if len(self._event_floor) >= self._known.size and session not in self._event_floor:
            self._event_floor.clear()
        self._event_floor[session] = floor

    def claim(self, conn: Connection, params: dict[str, Any], **shape: bool) -> int | None:
        """Claim ``params["n"]`` event numbers (``sql.claim_events`` of ``shape``): the last number given, or
        ``None`` when the row did not match. One statement where UPDATE ... RETURNING is there."""
        if self.engine.dialect.update_returning:
            row = self.run(conn, sql.claim_events(returning=True, **shape), params).first()
            return None if row is None else int(row[0])
        if self.run(conn, sql.claim_events(**shape), params).rowcount != 1:
            return None
        last: int = int(self.run(conn, sql.LAST_EVENT, {"sid": params["sid"]}).scalar())  # type: ignore[call-overload]
        return last

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        validate.session_id(session)
        after, limit = eventlog.check_read(after, limit)
        rows = self._transaction(
            "events", session,
            lambda conn: self.run(conn, sql.READ_EVENTS, {"sid": session, "after": after, "limit": limit}).all(),
            read_only=True, reads=True,
        )
        try:
            return [eventlog.decode(int(seq), str(body)) for seq, body in rows]
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt event: {exc}") from exc

    # -- LifecycleStore ----------------------------------------------------------------------------------

    def list_sessions(
        self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50, after: str | None = None
    ) -> SessionPage:
        """One statement: the page's rows by the index (updated, session_id) read backwards, or, filtered,
        by the tags' index (name, value); then the message counts of those rows only."""
        wanted = lifecycle.check_listing(prefix, where, limit, after)
        S = sessions.c
        query = select(S.session_id, S.created, S.updated, S.metadata).select_from(sessions)
        for name, value in sorted(wanted.items()):
            tag = tags.alias()
            query = query.join(tag, and_(tag.c.session_id == S.session_id, tag.c.name == name, tag.c.value == value))
        if prefix:
            query = query.where(self.starts_with(S.session_id, prefix))
        if after is not None:
            updated, last = lifecycle.decode_cursor(after)
            query = query.where(or_(S.updated < updated, and_(S.updated == updated, S.session_id < last)))
        chosen = query.order_by(S.updated.desc(), S.session_id.desc()).limit(limit + 1).subquery()
        count = select(func.count()).where(messages.c.session_id == chosen.c.session_id).scalar_subquery()
        statement = select(chosen, count).order_by(chosen.c.updated.desc(), chosen.c.session_id.desc())
        # Built per call (its shape depends on the arguments), so run by SQLAlchemy, not the raw driver,
        # whose cache is for the prebuilt statements.
        rows = self._transaction("list_sessions", "", lambda conn: conn.execute(statement).all(),
                                 read_only=True, reads=True)
        return lifecycle.page([(float(row[2]), _info(row[0], row[1:])) for row in rows], limit)

    def info(self, session: str) -> SessionInfo | None:
        validate.session_id(session)
        row = self._transaction(
            "info", session, lambda conn: self.run(conn, sql.INFO, {"sid": session}).first(), read_only=True,
            reads=True,
        )
        return None if row is None else _info(session, row)

    def set_metadata(self, session: str, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        """Read, merge and write with the session row locked, so two concurrent changes never lose a key;
        the tags are rewritten with it."""
        validate.session_id(session)
        lifecycle.merge_metadata({}, changes)  # every key and value checked before anything is written

        def write(conn: Connection) -> dict[str, Scalar] | None:
            row = self.run(conn, sql.LOCK_METADATA, {"sid": session}).first()
            if row is None:
                return None
            merged = lifecycle.merge_metadata(lifecycle.decode_metadata(row[0]), changes)
            stored = lifecycle.encode_metadata(merged) if merged else None
            self.run(conn, sql.SET_METADATA, {"sid": session, "metadata": stored})
            self.run(conn, sql.CLEAR_TAGS, {"sid": session})
            if merged:
                self.run(conn, sql.ADD_TAG, [
                    {"session_id": session, "name": k, "value": lifecycle.metadata_value(k, v)}
                    for k, v in sorted(merged.items())
                ])
            return merged

        for _ in range(3):
            merged = self._transaction("set_metadata", session, write)
            if merged is not None:
                return merged
            # A new session: its row first, in a statement of its own (as acquire makes it), since locking
            # a row that is not there takes a gap lock on MySQL, and concurrent first writers would
            # deadlock on their inserts; then the merge again, with the row to lock.
            self._transaction("set_metadata", session, lambda conn: conn.execute(self.insert_session(session)),
                              read_only=True)
        raise StoreError(f"{self.backend} store: set_metadata of session {session!r}: the session was deleted "
                         "each time its row was made; not retried further")

    def delete(self, session: str, *, force: bool = False) -> bool:
        """One transaction: the session row locked first (as every writer of the session does), then its
        messages, steers, tags, events and the row itself deleted. A run holding a lease finds no row at its next
        write, which is LeaseLost, and a row-less session takes no fenced write."""
        validate.session_id(session)

        def remove(conn: Connection) -> bool:
            row = self.run(conn, sql.LOCK_LEASE, {"sid": session}).first()
            if row is not None and row[2] is not None and row[6] and not force:
                held = _holder(row[:6])
                raise SessionBusy(
                    f"session {session!r} is held by a live run ({held.host}, pid {held.pid}); "
                    f"delete(force=True) deletes it anyway and the run fails with LeaseLost",
                    held,
                )
            self.run(conn, sql.CLEAR, {"sid": session})
            steered = self.run(conn, sql.DELETE_STEERS, {"sid": session}).rowcount
            self.run(conn, sql.CLEAR_TAGS, {"sid": session})
            self.run(conn, sql.DELETE_EVENTS, {"sid": session})
            gone = self.run(conn, sql.DELETE_SESSION, {"sid": session}).rowcount
            return bool(gone or steered)

        try:
            return self._transaction("delete", session, remove)
        finally:
            self._known.forget(session)
            self._journaled.discard(session)
            self._event_floor.pop(session, None)

    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int:
        """Batches of at most ``PRUNE_BATCH``: the oldest idle sessions are read without locks, then
        deleted in a short transaction that locks their rows and checks again that each is still idle and
        unheld (on the database's clock), so a session saved or leased meanwhile survives. Stops early when
        a batch deletes nothing (every candidate was written meanwhile): the next run finds the rest."""
        idle = lifecycle.idle_seconds(idle_for)
        limit = lifecycle.prune_limit(limit)
        deleted = 0
        while limit is None or deleted < limit:
            batch = PRUNE_BATCH if limit is None else min(PRUNE_BATCH, limit - deleted)
            params = {"idle": idle, "batch": batch}
            found = self._transaction(
                "prune", "", functools.partial(_all, sql.IDLE_BATCH, params), read_only=True, reads=True
            )
            candidates = [str(row[0]) for row in found]
            if not candidates:
                break
            removed = self._transaction("prune", "", functools.partial(self._prune, candidates=candidates, idle=idle))
            deleted += removed
            if not removed or len(candidates) < batch:
                break
            time.sleep(PRUNE_PAUSE)  # a writer waiting for the lock gets it between batches
        if deleted:
            log.info("%s store: pruned %d sessions idle for over %.0f s", self.backend, deleted, idle)
        return deleted

    def _prune(self, conn: Connection, *, candidates: list[str], idle: float) -> int:
        ids = [str(row[0]) for row in conn.execute(sql.LOCK_IDLE, {"ids": candidates, "idle": idle}).all()]
        if ids:
            for statement in sql.PRUNE:
                conn.execute(statement, {"ids": ids})
            for session in ids:
                self._known.forget(session)
                self._journaled.discard(session)
                self._event_floor.pop(session, None)
        return len(ids)

    def tail(self, session: str, last: int) -> list[Message]:
        validate.session_id(session)
        last = lifecycle.last_count(last)
        if last == 0:
            return []
        rows = self._transaction(
            "tail", session, lambda conn: self.run(conn, sql.TAIL, {"sid": session, "last": last}).all(),
            read_only=True, reads=True,
        )
        try:
            items = [Message.from_json(body) for body, _ in reversed(rows)]
        except MessageError as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt message: {exc}") from exc
        if items:
            read_from(items, session, when(float(rows[0][1])))
        return items

    def pending_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        rows = self._transaction(
            "pending_steers", session, lambda conn: self.run(conn, sql.PENDING, {"sid": session}).all(),
            read_only=True, reads=True,
        )
        return [str(text) for (text,) in rows]

    # -- what dialects override ----------------------------------------------------------------------

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        """``column`` starts with ``prefix``: LIKE, with the prefix's own % and _ escaped (bound, never
        spliced), which is case-sensitive on PostgreSQL and on MySQL's binary session ids."""
        return column.startswith(prefix, autoescape=True)

    def run(self, conn: Connection, statement: Executable, params: dict[str, Any] | list[dict[str, Any]]) -> Rows:
        """Run one of ``statements``; the result has ``rowcount``, ``first()``, ``all()`` and ``scalar()``
        and its rows are tuples."""
        if self._driver is not None:
            return self._driver.run(conn, statement, params)
        return conn.execute(statement, params)

    lock_new: ClassVar[Executable | None] = None
    """The dialect's ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` of ``lock_session``."""

    def lock_session(self, conn: Connection, session: str) -> Sequence[Any]:
        """The session row (``sql.LOCK``'s columns), locked to the transaction's end, made first if there is
        none, in one statement: an unfenced save's first. ``SELECT ... FOR UPDATE`` of a row that is not
        there locks nothing on PostgreSQL, so two first saves of a new session would both append from seq
        0 and one fail on the primary key; an upsert waits for the other's row and then locks it."""
        assert self.lock_new is not None, f"{type(self).__name__} sets lock_new or overrides lock_session"
        row = self.run(conn, self.lock_new, {"sid": session}).first()
        assert row is not None  # an upsert returns its row
        return row

    def insert_session(self, session: str) -> Any:
        """Insert a bare session row (no transcript, no lease) unless there is one."""
        raise NotImplementedError

    def message_limit(self) -> int | None:
        """The largest message (stored JSON, bytes) this database can keep and deliver; ``None``: no
        limit short of memory. Checked before a save and before a steer is accepted."""
        return None

    def notify(self, conn: Connection, session: str) -> None:
        """Events of ``session`` are being written in ``conn``'s transaction: wake its followers when it
        commits, where the database can (PostgreSQL's NOTIFY); elsewhere they poll."""

    share_lock: ClassVar[str] = ""
    """Appended to the append's read of the session row where that read would not lock it (MySQL)."""

    def append(self, step: sql.Step) -> str | None:
        """Append ``step``'s new messages in one statement if the stored version is still the known one
        (and the rest of ``sql.append_if_current``'s conditions hold), returning the version stored now
        (the known one: an append keeps it); ``None`` when not, and the save then runs its transaction.
        When the step must drop a journal, that is a second statement of the same transaction."""
        count = len(step.items) - step.start
        if count > sql.MAX_APPEND:
            return None
        if step.events:
            return self._append_logged(step)
        params = sql.append_params(step)
        statement = sql.append_if_current(
            count, step.unsteered, step.holder is not None, not step.drop_journal, self.share_lock
        )

        def write(conn: Connection) -> int:
            inserted = self.run(conn, statement, params).rowcount
            if inserted == count and step.drop_journal:
                self.run(conn, sql.DROP_JOURNAL, {"sid": step.session})
            return inserted

        try:
            inserted = self._transaction("save", step.session, write)
        except StoreError as exc:
            if isinstance(exc.__cause__, IntegrityError):  # another writer appended at these positions first
                return None
            raise
        return step.known if inserted == count else None

    def _append_logged(self, step: sql.Step) -> str | None:
        """A leased run's usual save with its events (``save_fenced_events``), in one transaction: the claim
        of the event numbers on the session row, guarded as ``append_if_current`` guards the append (so it
        also locks the row, and a takeover waits for it or it for the takeover, which it then sees); if it
        matched, the new messages and the events (``_log_events``). Three statements (SQLite: each some
        microseconds, one BEGIN IMMEDIATE and one COMMIT), where the general path took ten. Anything the
        claim does not match (a steer, a cancel, a lost lease, another version) writes nothing and the save
        runs its transaction, which sorts out which, as after a plain append."""
        holder = step.holder
        assert holder is not None  # save_fenced_events
        params = {**sql.fence_params(step.session, holder), "known": step.known, "n": len(step.events)}
        rows = [{"session_id": step.session, "seq": i, "body": step.items[i].to_json()}
                for i in range(step.start, len(step.items))]

        def write(conn: Connection) -> int | None:
            last = self.claim(conn, params, save=True, unsteered=step.unsteered, drop_journal=step.drop_journal)
            if last is None:
                return None
            self.run(conn, sql.APPEND, rows)
            return self._log_events(conn, step.session, last, step.events, step.keep)

        try:
            floor = self._transaction("save", step.session, write)
        except StoreError as exc:
            if isinstance(exc.__cause__, IntegrityError):  # another writer appended at these positions first
                return None
            raise
        if floor is None:
            return None
        self._floor(step.session, floor)
        return step.known

    def take(self, conn: Connection, session: str) -> list[str]:
        """Delete and return the session's steers, oldest first. DELETE ... RETURNING: rows another
        taker deleted first are simply not there, so each steer goes to exactly one taker."""
        rows = self.run(conn, sql.TAKE_STEERS, {"sid": session}).all()
        return [str(text) for _, text in sorted((int(id), text) for id, text in rows)]

    def is_transient(self, exc: DBAPIError) -> bool:
        """A deadlock or serialisation failure: the transaction may simply be run again."""
        return False

    def after_fork(self) -> None:
        """In a forked child: forget the parent's connections (without closing them) and what it knew."""
        self.engine.dispose(close=False)
        self._known = Known(self._known.size, self._known.max_bytes)
        self._journaled = set()
        self._event_floor = {}

    # -- plumbing ------------------------------------------------------------------------------------

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
                raise self._error(op, session, exc) from exc
            except SQLAlchemyError as exc:
                raise self._error(op, session, exc) from exc

    def _error(self, op: str, session: str, exc: SQLAlchemyError) -> StoreError:
        """``session`` empty: the operation is of no one session (prune)."""
        cause = str(getattr(exc, "orig", None) or exc)
        what = f"{op} of session {session!r}" if session else op
        missing = _TABLE_NAME.search(cause) if _looks_missing(cause) else None
        if missing:
            return StoreError(
                f"{self.backend} store: table {missing.group(0)!r} does not exist ({what}); {self.schema_hint}"
            )
        return StoreError(f"{self.backend} store: {what} failed: {cause}")

    def __repr__(self) -> str:
        return f"{type(self).__module__}.Store({self.engine.url!r})"


def _holder(row: Sequence[Any]) -> Holder:
    """sql.HOLDER's or sql.CURRENT's columns as a Holder."""
    host, pid, token, expires, cancelled, epoch = row
    return Holder(host, int(pid), token, float(expires), bool(cancelled), int(epoch))


def _all(statement: Executable, params: dict[str, Any], conn: Connection) -> Sequence[Any]:
    return conn.execute(statement, params).all()


def _info(session: str, row: Sequence[Any]) -> SessionInfo:
    """``created, updated, metadata, messages`` as a SessionInfo."""
    created, updated, metadata, count = row
    return SessionInfo(session, when(float(created)), when(float(updated)), int(count),
                       lifecycle.decode_metadata(metadata))


def _lost(session: str, holder: Holder, stored: Sequence[Any] | None) -> LeaseLost:
    """``stored``: the stored lease's token and epoch, or ``None`` when the session has no row."""
    if stored is None:
        return LeaseLost.superseded(session, holder.epoch, None, None)
    return LeaseLost.superseded(session, holder.epoch, stored[0], int(stored[1]))


_LIVE: weakref.WeakSet[SQLStore] = weakref.WeakSet()
"""Every SQL store object alive in this process, for the one at-fork handler below."""


def _dispose_after_fork(store: SQLStore) -> None:
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
