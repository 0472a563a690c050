"""The session rules, once: every store of the library is a ``BackedStore`` over a ``Backend``.

Each operation a store offers (``contract``) is said here as one guarded write of the backend, or a read and
then a write whose guard holds exactly what the read decided on: a write another process made wrong meanwhile
is refused, and the operation reads again (at most ``ATTEMPTS`` times). The backend only keeps what it is
given and evaluates the guard.

A run's save carries only what is new, placed by what the run last wrote under its lease (``_Wrote``) or by
where its messages were read (``messages.read_from``), so the usual step is one write. Messages from
anywhere else (made by the caller, read from another database) are compared with the stored transcript first.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from . import eventlog, lifecycle, validate
from .backend import (
    CANCEL,
    Acquire,
    Backend,
    BatchDeletes,
    Change,
    Guard,
    Idle,
    Open,
    Recent,
    Release,
    Renew,
    Row,
    Snapshot,
    Want,
    Written,
)
from .errors import (
    ArgumentError,
    LeaseLost,
    OutcomeUnknown,
    SessionBusy,
    SessionExists,
    StoreError,
    TranscriptConflict,
    TranscriptDeleted,
)
from .messages import Message, origin, read_from, turn_open
from .values import Holder, Saved, Scalar, SessionInfo, SessionPage, StoredEvent, when

log = logging.getLogger(__name__)
_K = TypeVar("_K")
_T = TypeVar("_T")

ATTEMPTS = 20
"""Writes an operation makes at most: each refusal means another process changed the session meanwhile."""
REMEMBER = 4096
"""Leases whose last write a store object remembers: the runs it serves at once, with room to spare."""
PRUNE_BATCH = 500
STRANDED_BATCH = 200


@dataclass(frozen=True, slots=True)
class Read:
    """What one read of a transcript saw: marked on each message it returned (with its index)."""

    identity: str
    incarnation: str
    edits: int
    length: int


@dataclass(frozen=True, slots=True)
class _Wrote:
    """What a lease's last write left (or a plain save's, or a whole read's, in ``incarnation``): the stored
    transcript from ``start`` on is ``msgs``."""

    edits: int
    length: int
    start: int
    msgs: tuple[Message, ...]
    incarnation: str | None = None


@dataclass(frozen=True, slots=True)
class _Plan:
    """Where a save's new messages go: ``at``, guarded by the stored ``length`` and ``edits`` (and the
    ``incarnation`` its messages were read from); ``None`` fields ask nothing."""

    at: int
    new: tuple[Message, ...]
    length: int | None = None
    edits: int | None = None
    incarnation: str | None = None


def _key(kind: str, key: str) -> str:
    """Steer keys and turn keys are apart: a key accepted for one is free for the other."""
    return f"{kind}:{key}"


class BackedStore:
    """A store whose every rule is this library's, kept by ``backend``. ``max_message_bytes``: the largest
    stored message the backend can keep (``None``: any)."""

    def __init__(self, backend: Backend, *, max_message_bytes: int | None = None, name: str = "store") -> None:
        self.backend = backend
        self.max_message_bytes = max_message_bytes
        self.name = name
        self._lock = threading.Lock()
        self._wrote: OrderedDict[tuple[str, str, int], _Wrote] = OrderedDict()
        self._saved: OrderedDict[str, _Wrote] = OrderedDict()
        """Per session, the whole transcript as this store last saved or read it: what a plain save extends."""
        self._journals: OrderedDict[tuple[str, str, int], str | None] = OrderedDict()
        """Per lease, the journal as its acquire found it or its last write left it (``journal_as_taken``)."""

    # -- reading ---------------------------------------------------------------------------------------------

    def _decode(self, session: str, snap: Snapshot) -> list[Message]:
        msgs = [Message.from_json(text) for text in snap.messages]
        row = snap.row
        read_from(msgs, session, Read(self.backend.identity, row.incarnation, row.edits, row.length), snap.start)
        return msgs

    def _row(self, session: str) -> Row | None:
        snap = self.backend.read(session, Want())
        return None if snap is None else snap.row

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)
        snap = self.backend.read(session, Want(start=0))
        if snap is None:
            return []
        msgs, row = self._decode(session, snap), snap.row
        self._remember(self._saved, session, _Wrote(row.edits, row.length, 0, tuple(msgs), row.incarnation))
        return msgs

    def tail(self, session: str, last: int) -> list[Message]:
        validate.session_id(session)
        last = lifecycle.last_count(last)
        if not last:
            return []
        snap = self.backend.read(session, Want(last=last))
        return [] if snap is None else self._decode(session, snap)

    def read_back(self, session: str, stop: int | None, count: int) -> tuple[int, list[Message]]:
        validate.session_id(session)
        validate.read_back(stop, count)
        snap = self.backend.read(session, Want(stop=stop, last=count))
        if snap is None or not snap.messages:
            return 0, []
        return snap.start, self._decode(session, snap)

    def journal(self, session: str) -> str | None:
        validate.session_id(session)
        row = self._row(session)
        return None if row is None else row.journal

    def pending_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        snap = self.backend.read(session, Want(steers=True))
        return [] if snap is None else [s.text for s in snap.steers]

    def queued(self, session: str) -> list[str]:
        validate.session_id(session)
        snap = self.backend.read(session, Want(queue=True))
        return [] if snap is None else [q.key for q in snap.queue]

    def info(self, session: str) -> SessionInfo | None:
        validate.session_id(session)
        row = self._row(session)
        return None if row is None or not row.exists else _info(row)

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        row = self._row(session)
        if row is None or row.token is None or row.expires <= row.now:
            return None
        return _holder(row)

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        validate.session_id(session)
        after, limit = eventlog.check_read(after, limit)
        return [eventlog.decode(seq, text) for seq, text in self.backend.events(session, after, limit)]

    # -- steers ----------------------------------------------------------------------------------------------

    def add_steer(self, session: str, text: str) -> None:
        validate.session_id(session)
        validate.steer_text(text)
        validate.deliverable_steer(text, self.max_message_bytes, self.name)
        self.backend.write(session, Guard(), Change(add_steer=(text, None)))

    def add_steer_once(self, session: str, text: str, key: str) -> bool:
        validate.session_id(session)
        validate.steer_text(text)
        validate.steer_key(key)
        validate.deliverable_steer(text, self.max_message_bytes, self.name)
        kept = _key("s", key)
        return self.backend.write(session, Guard(key_absent=kept),
                                  Change(add_steer=(text, key), add_key=kept, open="set")).done

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        for _ in _attempts():
            snap = self.backend.read(session, Want(steers=True))
            if snap is None or not snap.steers:
                return []
            ids = tuple(s.id for s in snap.steers)
            if self.backend.write(session, Guard(steers=ids), Change(take_steers=ids)).done:
                return [s.text for s in snap.steers]
        raise self._busy("take_steers", session)

    # -- a plain save -----------------------------------------------------------------------------------------

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        """``msgs`` become the transcript: when they extend what this store last saved or read of it whole,
        only the rest is written, guarded by the incarnation, edits and length it had then; else all of them."""
        validate.session_id(session)
        items = validate.messages(msgs)
        validate.stored_size(items, self.max_message_bytes, self.name)
        opened = turn_open(items)
        with self._lock:
            known = self._saved.get(session)
        plan = None if known is None or not validate.is_extension(known.msgs, items) else _Plan(
            known.length, items[len(known.msgs):], known.length, known.edits, known.incarnation)
        for _ in _attempts():
            plan = plan if plan is not None and plan.at else _Plan(0, items)
            guard = Guard(length=plan.length, edits=plan.edits, incarnation=plan.incarnation, no_steers=not opened,
                          no_queue=not opened)
            change = Change(exist=True, splice=(plan.at, tuple(m.to_json() for m in plan.new)), journal=None,
                            open="set" if opened else "clear")
            written = self.backend.write(session, guard, change)
            row = written.row
            if written.done:
                assert row is not None
                self._remember(self._saved, session, _Wrote(row.edits, row.length, 0, items, row.incarnation))
                return
            if plan.at and (row is None or (row.incarnation, row.edits, row.length) != (
                    plan.incarnation, plan.edits, plan.length)):
                plan = None  # the transcript moved since: write it whole
            else:
                opened = True  # input came: the turn stays open
        raise self._busy("save", session)

    # -- runs ------------------------------------------------------------------------------------------------

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        validate.session_id(session)
        taking = Acquire(holder.host, holder.pid, holder.token, holder.spec, ttl, holder.turn)
        written = self.backend.write(session, Guard(lease_free=True), Change(exist=True, lease=taking))
        row = written.row
        assert row is not None and row.token is not None  # a lease that is not free has a holder
        if written.done or row.token == holder.token:
            # Taken now, or by an earlier try of this very acquire whose answer was lost: this claimant's,
            # with the cancel it was handed.
            self._remember(self._journals, (session, holder.token, row.epoch), row.journal)
            return Holder(holder.host, holder.pid, holder.token, row.expires, row.handed, row.epoch,
                          turn=row.cancelled_turn if row.handed else holder.turn)
        return _holder(row)

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        validate.session_id(session)
        self._fenced(session, holder, Change(exist=True, lease=Renew(ttl)))

    def release(self, session: str, holder: Holder) -> None:
        """A cancel the lease was asked for, or was handed and did not act on (a save that ``closes`` the
        cancelled turn acts on it), is handed to the next holder."""
        validate.session_id(session)
        self.backend.write(session, _lease(holder), Change(exist=True, lease=Release()))

    def cancel(self, session: str, *, once: str | None = None) -> bool:
        """``once``: a key (an interrupting turn's): the cancel is made at most once under it, whoever holds
        the lease then, and a call finding nobody to cancel spends the key too."""
        validate.session_id(session)
        if once is None:
            return self.backend.write(session, Guard(lease_held=True), Change(exist=True, lease=CANCEL)).done
        kept = _key("i", validate.steer_key(once, "turn key"))
        written = self.backend.write(session, Guard(lease_held=True, key_absent=kept),
                                     Change(exist=True, lease=CANCEL, add_key=kept))
        if not written.done and (written.row is None or written.row.token is None):
            self.backend.write(session, Guard(key_absent=kept), Change(add_key=kept))  # nobody to cancel now
        return written.done

    def check(self, session: str, holder: Holder) -> bool:
        validate.session_id(session)
        return _owned(session, holder, self._row(session)).cancelled

    def journal_as_taken(self, session: str, holder: Holder) -> str | None:
        validate.session_id(session)
        with self._lock:
            lease = (session, holder.token, holder.epoch)
            if lease in self._journals:
                return self._journals[lease]
        return self.journal(session)

    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        validate.session_id(session)
        if not isinstance(journal, str):
            raise ArgumentError(f"put_journal(journal=) must be a str, got {type(journal).__name__}")
        guard = Guard(lease=(holder.token, holder.epoch), not_cancelled=unless_cancelled)
        written = self.backend.write(session, guard, Change(exist=True, journal=journal))
        if not written.done:
            _owned(session, holder, written.row)  # else it was refused for the cancel: nothing written
            return True
        assert written.row is not None
        self._remember(self._journals, (session, holder.token, holder.epoch), written.row.journal)
        return written.row.cancelled

    def swap_journal(self, session: str, expected: str, journal: str) -> bool:
        validate.session_id(session)
        return self.backend.write(session, Guard(exists=True, journal=expected),
                                  Change(exist=True, journal=journal, open="set")).done

    def mark_finished(self, session: str, holder: Holder, journal: str | None) -> bool:
        validate.session_id(session)
        guard = Guard(lease=(holder.token, holder.epoch), journal=journal, no_steers=True, no_queue=True)
        written = self.backend.write(session, guard, Change(open="clear"))
        if not written.done:
            _owned(session, holder, written.row)
        return written.done

    def save_fenced(self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool,
                    replace: bool = False, start: int = 0, closes: bool = False) -> Saved:
        """``closes``: the save closes the turn whose cancel the lease was handed (``acquire``), so that
        cancel is spent, in the same write (a run that fails before it hands the cancel on)."""
        return self._save(session, holder, msgs, take_steers, replace, start, (), 0, closes)

    def save_fenced_events(self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool,
                           replace: bool = False, events: Sequence[str], keep: int, start: int = 0,
                           closes: bool = False) -> Saved:
        return self._save(session, holder, msgs, take_steers, replace, start, events, keep, closes, logged=True)

    def give_back(self, session: str, holder: Holder, steers: Sequence[str]) -> list[str]:
        """Leave ``steers`` (given to a run that fails) as the session's waiting steers, in order, each fenced by
        ``holder``; return those not left, from the first that could not be."""
        validate.session_id(session)
        for i, text in enumerate(steers):
            if not self.backend.write(session, _lease(holder), Change(add_steer=(text, None))).done:
                return list(steers[i:])
        return []

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        validate.session_id(session)
        records = eventlog.check_append(events, keep)
        return self._fenced(session, holder, Change(events=tuple(records), keep=keep)).last_seq

    def _fenced(self, session: str, holder: Holder, change: Change) -> Row:
        written = self.backend.write(session, _lease(holder), change)
        if not written.done:
            _owned(session, holder, written.row)
            raise AssertionError("a refused fenced write whose lease still holds")  # pragma: no cover
        assert written.row is not None
        return written.row

    def _save(self, session: str, holder: Holder, msgs: Sequence[Message], take_steers: bool, replace: bool,
              start: int, events: Sequence[str], keep: int, closes: bool, logged: bool = False) -> Saved:
        """A leased run's save: only what is new, where the stored transcript ends, in one write, fenced by the
        lease and guarded by the transcript it extends."""
        validate.session_id(session)
        start = validate.save_start(start, replace, take_steers)
        lease = (session, holder.token, holder.epoch)
        with self._lock:
            wrote = self._wrote.get(lease)
        trusted = wrote.msgs if wrote is not None and wrote.start == start else ()
        items = validate.messages(msgs, trusted=trusted)
        records = tuple(eventlog.check_append(events, keep)) if events else ()
        if logged:
            eventlog.check_keep(keep)
        plan = self._planned(session, items, start, replace, wrote)
        taking: list[Message] = []
        steer_ids: tuple[int, ...] = ()
        opened: bool | None = None
        lost: OutcomeUnknown | None = None
        for _ in _attempts():
            if plan is None:
                plan = self._compared(session, items, start, replace)
            new = (*plan.new, *taking)
            if new or replace:
                validate.stored_size(plan.new, self.max_message_bytes, self.name)
                if opened is None:
                    opened = turn_open(new) if new else False
                guard = Guard(lease=(holder.token, holder.epoch), length=plan.length, edits=plan.edits,
                              incarnation=plan.incarnation, steers=steer_ids,
                              no_steers=not steer_ids and (take_steers or not opened), no_queue=not opened)
                change = Change(exist=True, splice=(plan.at, tuple(m.to_json() for m in new)), journal=None,
                                take_steers=steer_ids, open="set" if opened else "clear", events=records, keep=keep,
                                handed=False if closes else None)
            else:
                guard = Guard(lease=(holder.token, holder.epoch), length=plan.length, edits=plan.edits,
                              incarnation=plan.incarnation, no_steers=take_steers)
                change = Change(events=records, keep=keep, handed=False if closes else None)
            try:
                written = self.backend.write(session, guard, change)
            except OutcomeUnknown as exc:
                landed = self._landed(session, holder, plan, new if change.splice is not None else None,
                                      records[-keep:] if records else ())
                if landed is None:
                    if lost is not None:  # twice: the line is down, not unlucky
                        raise StoreError(f"session {session!r}: a save failed twice ({exc})") from exc
                    lost = exc
                    continue  # it did not land: the same write again (its guard holds it to once)
                written = Written(True, landed)
            row = written.row
            if written.done:
                assert row is not None
                self._remember(self._wrote, lease, _Wrote(row.edits, row.length, start, (*items, *taking)))
                self._remember(self._journals, lease, row.journal)
                return Saved([m.text for m in taking], row.cancelled, [m.key for m in taking],
                             bool(taking) and not taking[0].steer)
            row = _owned(session, holder, row)
            if plan.incarnation is not None and row.incarnation != plan.incarnation:
                raise TranscriptDeleted(session, row.length, start + len(items))
            if (plan.length is not None and row.length != plan.length) or (
                    plan.edits is not None and row.edits != plan.edits):
                plan, taking, steer_ids, opened = None, [], (), None  # the transcript moved: compare again
                continue
            if take_steers and row.steers and not steer_ids:
                snap = self.backend.read(session, Want(steers=True))
                waiting = [] if snap is None else snap.steers
                # With no turn in progress (the last one ended: answered or at its budget, its open mark
                # cleared; or cancelled, its cancel handed on), the first steer begins one: that turn's
                # message, stored as no steer (a steer joins a turn).
                joins = (row.open_since is not None and not row.handed) or turn_open(plan.new)
                taking = [Message.user(s.text, key=s.key or "", steer=joins or i > 0) for i, s in enumerate(waiting)]
                steer_ids = tuple(s.id for s in waiting)
                opened = None
                continue
            if steer_ids:
                taking, steer_ids = [], ()  # another taker was first (a plain take_steers): look again
                continue
            opened = True  # a queued message or a steer came: the turn stays open
        raise self._busy("save_fenced", session)

    def _landed(self, session: str, holder: Holder, plan: _Plan, new: Sequence[Message] | None,
                records: Sequence[str]) -> Row | None:
        """A save whose answer was lost: the row, if it landed; ``None`` if it did not, so the same write goes
        again (its guard holds it to once). Landed: the lease still this holder's, the transcript from where
        its messages went holding exactly them, one edit on, and the log ending in exactly its events (they
        carry their time, and only the lease's holder writes events). A save that wrote neither goes again."""
        at = plan.at if new is not None else None
        snap = self.backend.read(session, Want(start=at))
        row = _owned(session, holder, None if snap is None else snap.row)
        assert snap is not None
        if new is None and not records:
            return None
        if new is not None and (snap.messages != [m.to_json() for m in new]
                                or (plan.edits is not None and row.edits != plan.edits + 1)):
            return None
        if records and [text for _, text in self.backend.events(session, row.last_seq - len(records),
                                                                len(records))] != list(records):
            return None
        log.warning("session %r: a save went unanswered; read back, it had landed", session)
        return row

    def _planned(self, session: str, items: tuple[Message, ...], start: int, replace: bool,
                 wrote: _Wrote | None) -> _Plan | None:
        """Where the new messages go, if this store knows without a read: what the lease wrote last, or the
        read the messages came from; a new conversation's first save guesses an empty transcript."""
        if replace:
            # Replaced on purpose, but never from messages read before an erasure.
            return _Plan(0, items, incarnation=self._incarnation_read(session, items))
        if wrote is not None and wrote.start == start and validate.is_extension(wrote.msgs, items):
            return _Plan(wrote.length, items[len(wrote.msgs):], wrote.length, wrote.edits)
        marked = self._marked(session, items, start)
        if marked is not None:
            read, count = marked
            return _Plan(read.length, items[count:], read.length, read.edits, read.incarnation)
        if start == 0 and not any(origin(m) is not None for m in items):
            return _Plan(0, items, 0)
        return None

    def _marked(self, session: str, items: tuple[Message, ...], start: int) -> tuple[Read, int] | None:
        """The read ``items`` begin with, and how many of them it gave, when those are the whole of what it
        read from ``start`` on, in order (what that read saw is then a prefix of ``items``)."""
        if not items:
            return None
        first = origin(items[0])
        if first is None or first[0] != session or not isinstance(first[1], Read) or first[2] != start:
            return None
        read = first[1]
        if read.identity != self.backend.identity:
            return None
        count = 0
        for i, m in enumerate(items):
            mark = origin(m)
            if mark is None or mark[1] is not read or mark[2] != start + i:
                break
            count += 1
        return (read, count) if start + count == read.length else None

    def _compared(self, session: str, items: tuple[Message, ...], start: int, replace: bool) -> _Plan:
        """Read the stored transcript from ``start`` on and compare: ``items`` must extend it."""
        snap = self.backend.read(session, Want(start=start))
        if snap is None:
            stored, length, edits, incarnation = [], 0, 0, ""
        else:
            stored, length, edits = self._decode(session, snap), snap.row.length, snap.row.edits
            incarnation = snap.row.incarnation
        read = self._incarnation_read(session, items)
        if read is not None and read != incarnation:
            raise TranscriptDeleted(session, length, start + len(items))
        if length < start or not validate.is_extension(stored, items):
            raise TranscriptConflict(session, length, start + len(items))
        return _Plan(length, items[len(stored):], length, edits)

    def _incarnation_read(self, session: str, items: Sequence[Message]) -> str | None:
        """The incarnation of ``session`` in this database that messages of ``items`` were read from (one
        that is not the only one, "": read from more than one, which cannot all be the current one)."""
        read = {o[1].incarnation for m in items if (o := origin(m)) is not None and o[0] == session
                and isinstance(o[1], Read) and o[1].identity == self.backend.identity}
        if not read:
            return None
        return read.pop() if len(read) == 1 else ""

    def _remember(self, table: OrderedDict[_K, _T], key: _K, value: _T) -> None:
        with self._lock:
            table[key] = value
            table.move_to_end(key)
            while len(table) > REMEMBER:
                table.popitem(last=False)

    # -- the queue -------------------------------------------------------------------------------------------

    def enqueue(self, session: str, key: str, text: str) -> int:
        validate.session_id(session)
        validate.steer_key(key, "turn key")
        validate.steer_text(text, "queued message")
        kept = _key("q", key)
        written = self.backend.write(session, Guard(key_absent=kept),
                                     Change(exist=True, push=(key, text), add_key=kept, open="set"))
        if written.done:
            assert written.row is not None
            return written.row.queued
        snap = self.backend.read(session, Want(queue=True))
        waiting = [] if snap is None else snap.queue
        for position, item in enumerate(waiting, 1):
            if item.key == key:
                if item.text != text:
                    raise ArgumentError(f"session {session!r}: the turn key {key!r} is already used by a queued "
                                        "message whose text differs from this one; a key names one message")
                return position
        return 0

    def withdraw(self, session: str, key: str) -> bool:
        """Take ``key``'s message out of the queue, unanswered, if it waits there: for a message sent again
        after the transcript took it (its caller answers from the transcript). Guarded by what it read, so
        the item it removes is the one it found."""
        validate.session_id(session)
        for _ in _attempts():
            snap = self.backend.read(session, Want(queue=True))
            item = None if snap is None else next((q for q in snap.queue if q.key == key), None)
            if snap is None or item is None:
                return False
            if self.backend.write(session, Guard(version=snap.row.version),
                                  Change(pop=item.id, drop_key=_key("q", key))).done:
                return True
        raise self._busy("withdraw", session)

    def take_queued(self, session: str, holder: Holder, *, append: bool = True) -> Message | None:
        validate.session_id(session)
        for _ in _attempts():
            snap = self.backend.read(session, Want(queue=True))
            _owned(session, holder, None if snap is None else snap.row)
            assert snap is not None
            if not snap.queue:
                return None
            head = snap.queue[0]
            message = Message.user(head.text, key=head.key)
            row = snap.row
            # The key goes with the item into the transcript (or was there already: ``append=False``): sent
            # again, the message is queued again, and dropped unanswered at the head (``busy.queued_keys``).
            if append:
                guard = Guard(lease=(holder.token, holder.epoch), queue_head=head.id, length=row.length,
                              edits=row.edits)
                change = Change(exist=True, pop=head.id, splice=(row.length, (message.to_json(),)), journal=None,
                                turn=head.key, drop_key=_key("q", head.key))
            else:
                guard = Guard(lease=(holder.token, holder.epoch), queue_head=head.id)
                change = Change(pop=head.id, drop_key=_key("q", head.key))
            written = self.backend.write(session, guard, change)
            if written.done:
                assert written.row is not None
                self._remember(self._journals, (session, holder.token, holder.epoch), written.row.journal)
                return message
            _owned(session, holder, written.row)
        raise self._busy("take_queued", session)

    # -- fork ------------------------------------------------------------------------------------------------

    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None:
        validate.session_id(source)
        validate.session_id(target)
        snap = self.backend.read(source, Want(start=0))
        if snap is None or not snap.row.exists or not (snap.row.length or snap.row.edits):
            raise ArgumentError(f"cannot fork session {source!r}: it has no transcript")
        validate.fork_index(at, snap.row.length, source)
        texts = tuple(snap.messages[:at])
        if at:
            validate.fork_cut(Message.from_json(texts[-1]), at, source, allow_unanswered)
        opened = turn_open([Message.from_json(texts[-1])]) if texts else False
        written = self.backend.write(target, Guard(length=0, edits=0),
                                     Change(exist=True, splice=(0, texts), open="set" if opened else None))
        if not written.done:
            raise SessionExists(f"cannot fork {source!r} into {target!r}: {target!r} already has a transcript")

    # -- the lifecycle ---------------------------------------------------------------------------------------

    def list_sessions(self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50,
                      after: str | None = None, *, stranded: bool = False, grace: float = 0.0) -> SessionPage:
        if stranded:
            return self._stranded(lifecycle.check_stranded(prefix, where, limit, after, grace), limit, after)
        wanted = lifecycle.check_listing(prefix, where, limit, after)
        cut = None if after is None else lifecycle.decode_cursor(after)
        rows = self.backend.sessions(Recent(prefix, tuple(sorted(wanted.items())), limit + 1, cut))
        return lifecycle.page([(row.updated, _info(row)) for row in rows], limit)

    def _stranded(self, grace: float, limit: int, after: str | None) -> SessionPage:
        """The open sessions, filtered to those no live run holds and no cancel stopped (unless a message
        is queued: a cancel stops a run, not the messages queued behind it)."""
        cut = None if after is None else lifecycle.decode_cursor(after)
        found: list[tuple[float, SessionInfo]] = []
        while len(found) <= limit:
            rows = self.backend.sessions(Open(grace, STRANDED_BATCH, cut))
            for row in rows:
                if row.open_since is None:  # pragma: no cover - the query asks for open ones
                    continue
                if (row.token is None or row.expires <= row.now) and (not (row.cancelled or row.handed) or row.queued):
                    found.append((row.open_since, _info(row)))
            if len(rows) < STRANDED_BATCH:
                break
            last = rows[-1]
            assert last.open_since is not None
            cut = (last.open_since, last.session)
        return lifecycle.page(found[:limit + 1], limit)

    def set_metadata(self, session: str, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        validate.session_id(session)
        for _ in _attempts():
            row = self._row(session)
            merged = lifecycle.merge_metadata(lifecycle.decode_metadata(None if row is None else row.metadata),
                                              changes)
            guard = Guard(version=0 if row is None else row.version)
            if self.backend.write(session, guard, Change(exist=True, metadata=lifecycle.encode_metadata(merged))).done:
                return merged
        raise self._busy("set_metadata", session)

    def delete(self, session: str, *, force: bool = False) -> bool:
        validate.session_id(session)
        written = self.backend.write(session, Guard() if force else Guard(lease_free=True), Change(delete=True))
        if written.done:
            return written.row is not None
        row = written.row
        assert row is not None
        raise SessionBusy(f"session {session!r} is held by a live run ({row.host}, pid {row.pid}); "
                          f"delete(force=True) deletes it anyway and the run fails with LeaseLost", _holder(row))

    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int:
        """Each idle session deleted by a write guarded by the version and incarnation the listing saw and a
        free lease: one saved, leased or steered since (or deleted and begun anew) is left. A page of the
        listing is one transaction where the backend can (``BatchDeletes``)."""
        idle = lifecycle.idle_seconds(idle_for)
        limit = lifecycle.prune_limit(limit)
        deleted = 0
        while limit is None or deleted < limit:
            batch = PRUNE_BATCH if limit is None else min(PRUNE_BATCH, limit - deleted)
            rows = self.backend.sessions(Idle(idle, batch))
            if not rows:
                break
            before = deleted
            # In the sessions' order, so two prunes at once lock the rows they share in one order.
            guarded = [(row.session, Guard(version=row.version, incarnation=row.incarnation, lease_free=True))
                       for row in sorted(rows, key=lambda r: r.session)]
            if isinstance(self.backend, BatchDeletes):
                deleted += sum(self.backend.delete_many(guarded))
            else:
                deleted += sum(self.backend.write(s, g, Change(delete=True)).done for s, g in guarded)
            if len(rows) < batch or deleted == before:
                break
        return deleted

    def close(self) -> None:
        self.backend.close()

    def _busy(self, what: str, session: str) -> StoreError:
        return StoreError(f"session {session!r}: {what} was refused {ATTEMPTS} times, each time because another "
                          f"process changed the session meanwhile")

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self.backend!r})"


def _attempts() -> Iterator[int]:
    """The ``ATTEMPTS`` tries of a read and a guarded write: the first at once, each later one after a random
    pause growing to 64 ms, so writers refused for reading and writing in step with each other fall out of
    step instead of meeting again until their attempts run out."""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(random.random() * 0.001 * 2 ** min(attempt, 6))
        yield attempt


def _lease(holder: Holder) -> Guard:
    return Guard(lease=(holder.token, holder.epoch))


def _owned(session: str, holder: Holder, row: Row | None) -> Row:
    """``row``, if it still holds ``holder``'s lease; else ``LeaseLost``."""
    if row is None or row.token != holder.token or row.epoch != holder.epoch:
        raise LeaseLost.superseded(session, holder.epoch, None if row is None else row.token,
                                   None if row is None or not row.epoch else row.epoch)
    return row


def _holder(row: Row) -> Holder:
    assert row.token is not None
    return Holder(row.host, row.pid, row.token, row.expires, row.cancelled, row.epoch)


def _info(row: Row) -> SessionInfo:
    live = row.token is not None and row.expires > row.now
    return SessionInfo(row.session, when(row.created), when(row.updated), row.length,
                       lifecycle.decode_metadata(row.metadata), row.spec,
                       None if row.open_since is None else when(row.open_since),
                       _holder(row) if live else None, row.cancelled or row.handed, row.steers, row.queued)



