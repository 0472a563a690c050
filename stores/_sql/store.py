"""The SQL store, once, for every dialect: a session's transcript (save, messages, fork), its steers, a
leased run's fenced save and its tool journal; the other capabilities joined in as mixins of their own
modules (lease.py, events.py, lifecycle.py, approvals.py, on base.py).

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

import os
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

from sqlalchemy import Connection, Executable, and_, insert, literal, select, update
from sqlalchemy.exc import IntegrityError

from agent_sessions import (
    ArgumentError,
    Holder,
    LeaseLost,
    Message,
    MessageError,
    Saved,
    SessionExists,
    StoreError,
    TranscriptConflict,
    validate,
)
from agent_sessions.contract import when
from agent_sessions.messages import read_from, turn_open

from .._known import common_prefix
from . import statements as sql
from .approvals import Approvals
from .events import EventLog
from .lease import Lease, lost
from .lifecycle import Lifecycle
from .tables import messages, sessions


class SQLStore(Lifecycle, EventLog, Approvals, Lease):
    """Subclasses say what differs: the upsert, how steers are taken, which errors mean what. What a dialect
    overrides: here ``add_steer_key``, ``lock_new`` or ``lock_session``, ``lock_row``, ``trim``, ``set_version``,
    ``share_lock``, ``append``, ``_put_journal``, ``take`` and ``message_limit``; ``claim`` and ``notify``
    (events.py); ``starts_with`` (lifecycle.py); ``insert_session``, ``run``, ``is_transient``, ``after_fork``
    and ``_connection`` (base.py)."""

    # -- the Store protocol --------------------------------------------------------------------------

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        """Replace the transcript (unfenced: for sessions no run holds)."""
        self._save(session, msgs, None, take=False, replace=True)

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        start: int = 0,
    ) -> Saved:
        start = validate.save_start(start, replace, take_steers)
        return self._save(session, msgs, holder, take=take_steers, replace=replace, offset=start)

    def _save(
        self, session: str, msgs: Sequence[Message], holder: Holder | None, take: bool, replace: bool,
        events: list[str] | None = None, keep: int = 0, offset: int = 0,
    ) -> Saved:
        """``events`` (only with a ``holder``): appended in the same step, even when nothing is saved.
        ``offset``: ``msgs`` are the transcript from that index on (``TailStore``), a fenced save's only."""
        validate.session_id(session)
        events = events or []
        known = self._known.get(session, offset)
        items, shared = validate.messages_after(msgs, known[1] if known is not None else ())
        if known is not None and shared < len(known[1]):
            shared = common_prefix(known[1], items)  # diverged, or not the objects it saved: compare
        # Encoded (and measured) before the transaction opens: no lock is held while we serialise.
        validate.stored_size(items, shared, self.message_limit(), f"{self.backend} store")
        if known is not None and shared == len(known[1]) and not (holder is not None and replace):
            try:
                if shared < len(items):
                    opened = turn_open(items)
                    step = sql.Step(session, known[0], items, shared, take, holder, session in self._journaled,
                                    tuple(events), keep, offset, opened=opened,
                                    turning=opened != turn_open(known[1]))
                    stored = self.append(step)
                    if stored is not None:
                        self._known.put(session, stored, items, after=known[1], start=offset)
                        self._journaled.discard(session)
                        return Saved([], False)
                elif holder is not None and not events:
                    unchanged = self._unchanged(session, holder, known[0], offset + len(items), take)
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
                                          holder, take, replace, offset)]
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
            self._known.put(session, version, transcript, start=offset)
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
        offset: int = 0,
    ) -> tuple[Saved, str | None, tuple[Message, ...]]:
        """The general save, inside its transaction, with the session row locked first (an unfenced save
        makes it if there is none: ``lock_session``). ``offset``: the stored index of ``items[0]``."""
        if holder is None:
            row = self.lock_session(conn, session)
        else:
            locked = self.run(conn, self.lock_row, {"sid": session}).first()
            if locked is None or locked[1] != holder.token or locked[2] != holder.epoch:
                raise lost(session, holder, None if locked is None else locked[1:3])
            row = locked
        stored_version = row[0]
        same = known is not None and stored_version is not None and stored_version == known[0]
        if holder is not None and not replace:
            start = self._stored_prefix(conn, session, items, shared if same else 0, offset)
        else:
            start = shared if same else 0
            if stored_version is not None:  # no version: no transcript, no message to delete
                self.trim(conn, session, start, row)
        waiting = take and self.run(conn, sql.ANY_STEER, {"sid": session}).first() is not None
        taken = self.take(conn, session) if waiting else []
        saved = items + tuple(Message.user(text) for text in taken)
        result = Saved(taken, bool(row[3]))
        if holder is not None and not replace and start == len(saved):
            return result, stored_version, saved  # nothing to write, so nothing written
        version = os.urandom(16).hex()
        self.set_version(conn, session, version, turn_open(saved), row)
        if start < len(saved):
            self.run(
                conn,
                sql.APPEND,
                [{"session_id": session, "seq": offset + i, "body": saved[i].to_json()}
                 for i in range(start, len(saved))],
            )
        return result, version, saved

    def _stored_prefix(
        self, conn: Connection, session: str, items: tuple[Message, ...], shared: int, offset: int = 0,
    ) -> int:
        """How many messages are stored from ``offset`` on, checking that they are the first ones of
        ``items`` (the first ``shared`` are known to be); ``TranscriptConflict`` when they are not, or when
        fewer than ``offset`` are stored."""
        if offset and not shared and self.run(conn, sql.HAS, {"sid": session, "seq": offset - 1}).first() is None:
            counted = self.run(conn, sql.LENGTH, {"sid": session}).first()
            raise TranscriptConflict(session, 0 if counted is None else int(counted[0]), offset + len(items))
        rows = self.run(conn, sql.BODIES_FROM, {"sid": session, "start": offset + shared}).all()
        end = shared + len(rows)
        if end > len(items) or any(items[shared + i].to_json() != body for i, (_, body) in enumerate(rows)):
            raise TranscriptConflict(session, offset + end, offset + len(items))
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

    def add_steer_once(self, session: str, text: str, key: str) -> bool:
        """One transaction: the key inserted unless it is there (the dialect's ``add_steer_key``), and the
        steer only when it was not. A concurrent sender of the same key waits on the first one's key row
        and then finds it; one that committed already is found at once."""
        validate.session_id(session)
        validate.steer_text(text)
        validate.steer_key(key)
        validate.deliverable_steer(text, self.message_limit(), f"{self.backend} store")
        assert self.add_steer_key is not None, f"{type(self).__name__} sets add_steer_key"
        statement = self.add_steer_key

        def add(conn: Connection) -> bool:
            if self.run(conn, statement, {"sid": session, "key": key}).rowcount != 1:
                return False
            self.run(conn, sql.ADD_STEER, {"session_id": session, "text": text})
            self.run(conn, sql.REOPEN, {"sid": session})  # input waits: the turn is open (no row: none yet)
            return True

        return self._transaction("add_steer", session, add)

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

    # -- QueueStore ------------------------------------------------------------------------------------

    def enqueue(self, session: str, key: str, text: str) -> int:
        """One transaction: the session row locked (made first if there is none, as a first save makes it),
        then the key's row inserted unless it is there (the dialect's ``add_queued``) and read back. The lock
        puts a session's enqueues and takes one after another, so the queue's ids are given in the order
        the messages are committed: the order they are accepted, and taken."""
        validate.session_id(session)
        validate.turn_key(key)
        validate.steer_text(text, "queued message")
        validate.deliverable_steer(text, self.message_limit(), f"{self.backend} store")
        assert self.add_queued is not None, f"{type(self).__name__} sets add_queued"
        statement = self.add_queued
        params = {"sid": session, "key": key}

        def add(conn: Connection) -> int:
            self.lock_session(conn, session)
            self.run(conn, statement, {**params, "text": text})
            row = self.run(conn, sql.QUEUED_ROW, params).first()
            assert row is not None  # inserted now, or there already
            if row[1]:
                return 0  # taken: its text is the transcript's now, not kept here (QueueStore allows that)
            if str(row[2]) != text:
                raise validate.queued_text_differs(session, key)
            self.run(conn, sql.REOPEN, {"sid": session})  # a message waits: the turn is open (stranded runs)
            position = self.run(conn, sql.QUEUE_POSITION, {"sid": session, "qid": row[0]}).scalar()
            return int(position)  # type: ignore[call-overload,no-any-return]

        return self._transaction("enqueue", session, add)

    def queued(self, session: str) -> list[str]:
        validate.session_id(session)
        rows = self._transaction(
            "queued", session, lambda conn: self.run(conn, sql.QUEUED_KEYS, {"sid": session}).all(),
            read_only=True, reads=True,
        )
        return [_key(row[0]) for row in rows]

    def take_queued(self, session: str, holder: Holder, *, append: bool = True) -> Message | None:
        """One transaction, the session row locked and the fence checked first: the oldest waiting row
        marked taken and its message appended, under a new version (which drops the journal)."""
        validate.session_id(session)

        def take(conn: Connection) -> Message | None:
            locked = self.run(conn, sql.LOCK, {"sid": session}).first()
            if locked is None or locked[1] != holder.token or locked[2] != holder.epoch:
                raise lost(session, holder, None if locked is None else locked[1:3])
            head = self.run(conn, sql.QUEUE_HEAD, {"sid": session}).first()
            if head is None:
                return None
            message = Message.user(str(head[2]), key=_key(head[1]))
            if append:
                length = int(self.run(conn, sql.LENGTH, {"sid": session}).scalar())  # type: ignore[call-overload]
                self.run(conn, sql.APPEND, [{"session_id": session, "seq": length, "body": message.to_json()}])
                self.run(conn, sql.SET_VERSION, {"sid": session, "version": os.urandom(16).hex()})
            self.run(conn, sql.TAKE_QUEUED, {"qid": head[0]})
            return message

        try:
            return self._transaction("take_queued", session, take)
        finally:
            self._known.forget(session)  # the transcript grew under a new version this process never saw
            self._journaled.discard(session)

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
        if self._put_journal(session, params) == 1:
            return False
        self.check(session, holder)  # raises LeaseLost when the lease is not the run's: then it is cancelled
        if not unless_cancelled and self._transaction(
            "put_journal", session, lambda conn: self.run(conn, sql.PUT_JOURNAL_CANCELLED, params).rowcount,
            read_only=True,
        ) != 1:
            self.check(session, holder)  # taken over in between
        return True

    def _put_journal(self, session: str, params: dict[str, Any]) -> int:
        """The usual journal write (``sql.PUT_JOURNAL``): how many rows it matched."""
        return self._transaction(
            "put_journal", session, lambda conn: self.run(conn, sql.PUT_JOURNAL, params).rowcount, read_only=True
        )

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

    # -- what dialects override ----------------------------------------------------------------------

    add_steer_key: ClassVar[Executable | None] = None
    """The dialect's insert of a steer's key (``sql.SID``, ``sql.STEER_KEY``) that does nothing when it is
    there already (``ON CONFLICT DO NOTHING``, ``INSERT IGNORE``): its row count says which."""

    add_queued: ClassVar[Executable | None] = None
    """The dialect's insert of a queued message (``sql.SID``, ``sql.QUEUE_KEY``, ``sql.QUEUE_TEXT``) that does
    nothing when its key is there already (``ON CONFLICT DO NOTHING``, ``INSERT IGNORE``)."""

    lock_new: ClassVar[Executable | None] = None
    """The dialect's ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` of ``lock_session``."""

    lock_row: ClassVar[Executable] = sql.LOCK
    """The session row read and locked by a leased run's general save: ``sql.LOCK``'s columns first (MySQL
    reads more: what its ``trim`` and ``set_version`` need to know)."""

    def trim(self, conn: Connection, session: str, start: int, row: Sequence[Any]) -> None:
        """Delete the messages of ``session`` (which has a transcript) from ``start`` on; ``row`` is the
        locked row (``lock_row``, ``lock_session``)."""
        self.run(conn, sql.TRIM, {"sid": session, "start": start})

    def set_version(self, conn: Connection, session: str, version: str, opened: bool, row: Sequence[Any]) -> None:
        """The general save's write of the session row: a new ``version``, no journal, and ``open_since``
        kept open while the transcript is (``opened``) or input waits."""
        self.run(conn, sql.SET_VERSION, {"sid": session, "version": version, "open": opened})

    def lock_session(self, conn: Connection, session: str) -> Sequence[Any]:
        """The session row (``sql.LOCK``'s columns), locked to the transaction's end, made first if there is
        none, in one statement: an unfenced save's first. ``SELECT ... FOR UPDATE`` of a row that is not
        there locks nothing on PostgreSQL, so two first saves of a new session would both append from seq
        0 and one fail on the primary key; an upsert waits for the other's row and then locks it."""
        assert self.lock_new is not None, f"{type(self).__name__} sets lock_new or overrides lock_session"
        row = self.run(conn, self.lock_new, {"sid": session}).first()
        assert row is not None  # an upsert returns its row
        return row

    def message_limit(self) -> int | None:
        """The largest message (stored JSON, bytes) this database can keep and deliver; ``None``: no
        limit short of memory. Checked before a save and before a steer is accepted."""
        return None

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
            if inserted == count and step.turning:
                self.run(conn, sql.SET_OPEN, {"sid": step.session, "open": step.opened})
            return inserted

        inserted = self._append_transaction(step.session, write)
        return step.known if inserted == count else None

    def take(self, conn: Connection, session: str) -> list[str]:
        """Delete and return the session's steers, oldest first. DELETE ... RETURNING: rows another
        taker deleted first are simply not there, so each steer goes to exactly one taker."""
        rows = self.run(conn, sql.TAKE_STEERS, {"sid": session}).all()
        return [str(text) for _, text in sorted((int(id), text) for id, text in rows)]


def _key(value: object) -> str:
    """A key as read: bytes where the column is (MySQL's VARBINARY; the raw driver path does not decode it)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
