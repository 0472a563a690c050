"""A store that lives as long as the process: for tests, scripts and single-process services."""

from __future__ import annotations

import copy
import heapq
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta

from agent_sessions import (
    ArgumentError,
    Holder,
    LeaseLost,
    Message,
    Saved,
    SessionBusy,
    SessionExists,
    TranscriptConflict,
    eventlog,
    lifecycle,
    validate,
)
from agent_sessions.contract import Scalar, SessionInfo, SessionPage, StoredEvent, when
from agent_sessions.messages import read_from, turn_open

PRUNE_BATCH = 500
"""Sessions deleted under one hold of the lock: other threads get a turn between batches."""


@dataclass
class _Run:
    """A session's lease, journal, steers and row. ``epoch`` outlives the holder, so it only ever grows.
    ``created`` is ``None`` until something writes the session (steers alone do not make it exist)."""

    holder: Holder | None = None
    handed: bool = False
    """A cancel the lease had when it was released: the next holder is handed it (``acquire``)."""
    epoch: int = 0
    journal: str | None = None
    steers: deque[str] = field(default_factory=deque)
    steer_keys: set[str] = field(default_factory=set)
    """The keys of the steers accepted with one (``add_steer_once``); they go with the session."""
    queue: deque[tuple[str, str]] = field(default_factory=deque)
    """The messages queued for the session's next turns (``enqueue``): (key, text), oldest first."""
    queue_keys: dict[str, str] = field(default_factory=dict)
    """Every key ``enqueue`` accepted, with its text, taken or not; they go with the session."""
    created: float | None = None
    updated: float = 0.0
    metadata: dict[str, Scalar] = field(default_factory=dict)
    events: deque[tuple[int, str]] = field(default_factory=deque)
    """The event log: (seq, the event's text), oldest first, at most the last append's ``keep``."""
    last_seq: int = 0
    """The last number given; 0 before the first append. Goes with the session on delete."""
    open_since: float | None = None
    """Since when the session's turn has been open (``LifecycleStore.list_sessions(stranded=True)``)."""
    spec: str | None = None
    """The ``Holder.spec`` of the last lease taken."""


class Store:
    """Thread-safe; one lock guards everything, since every operation is a few dict and deque steps.
    Expiry is decided by this process's clock (``time.time``): there is no other process to disagree.
    Followers of a session's events wait on a condition of that lock (``wait_for_events``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._appended = threading.Condition(self._lock)
        self._transcripts: dict[str, tuple[Message, ...]] = {}
        self._runs: dict[str, _Run] = {}
        self._next_log = 0
        self._last_created = 0.0
        """Above every seq this store gave: a new log starts at least here, whatever the clock did."""

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        items = validate.messages(msgs, trusted=self._transcripts.get(session, ()))
        with self._lock:
            self._transcripts[session] = items
            run = self._touch(session)
            run.journal = None
            _mark(run, turn_open(items))

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)
        with self._lock:
            return self._read(session, self._transcripts.get(session, ()))

    def add_steer(self, session: str, text: str) -> None:
        validate.session_id(session)
        validate.steer_text(text)
        with self._lock:
            self._run(session).steers.append(text)

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._lock:
            return self._take(session)

    def add_steer_once(self, session: str, text: str, key: str) -> bool:
        validate.session_id(session)
        validate.steer_text(text)
        validate.steer_key(key)
        with self._lock:
            run = self._run(session)
            if key in run.steer_keys:
                return False
            run.steer_keys.add(key)
            run.steers.append(text)
            _mark(run, True)
            return True

    # -- QueueStore ------------------------------------------------------------------------------------

    def enqueue(self, session: str, key: str, text: str) -> int:
        validate.session_id(session)
        validate.turn_key(key)
        validate.steer_text(text, "queued message")
        with self._lock:
            run = self._run(session)
            accepted = run.queue_keys.get(key)
            if accepted is None:
                run.queue_keys[key] = text
                run.queue.append((key, text))
            elif accepted != text:
                raise validate.queued_text_differs(session, key)
            self._touch(session)
            if accepted is None:
                _mark(run, True)  # a message waits: the turn is open (stranded runs)
            keys = [k for k, _ in run.queue]
            return keys.index(key) + 1 if key in keys else 0

    def queued(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._lock:
            run = self._runs.get(session)
            return [] if run is None else [k for k, _ in run.queue]

    def take_queued(self, session: str, holder: Holder, *, append: bool = True) -> Message | None:
        validate.session_id(session)
        with self._lock:
            run = self._fenced(session, holder)
            if not run.queue:
                return None
            key, text = run.queue.popleft()
            message = Message.user(text, key=key)
            if not append:
                return message
            self._transcripts[session] = (*self._transcripts.get(session, ()), message)
            run.journal = None
            self._touch(session)
            return message

    # -- RunStore --------------------------------------------------------------------------------------

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        validate.session_id(session)
        with self._lock:
            run = self._run(session)
            now = time.time()
            if run.holder is not None and run.holder.expires > now:
                return run.holder
            handed = run.handed or (run.holder is not None and run.holder.cancelled)
            run.epoch += 1
            run.holder = replace(holder, expires=now + ttl, cancelled=False, epoch=run.epoch)
            run.handed = False
            run.spec = holder.spec
            self._touch(session)
            return replace(run.holder, cancelled=True) if handed else run.holder

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        validate.session_id(session)
        with self._lock:
            run = self._fenced(session, holder)
            run.holder = replace(run.holder or holder, expires=time.time() + ttl)
            self._touch(session)

    def release(self, session: str, holder: Holder) -> None:
        validate.session_id(session)
        with self._lock:
            run = self._run(session)
            if _same(run.holder, holder):
                run.handed = self._cancelled(run)  # kept for the next holder
                run.holder = None
                self._touch(session)

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        with self._lock:
            held = self._run(session).holder
            return held if held is not None and held.expires > time.time() else None

    def cancel(self, session: str) -> bool:
        validate.session_id(session)
        with self._lock:
            run = self._run(session)
            if run.holder is None:
                return False
            run.holder = replace(run.holder, cancelled=True)
            self._touch(session)
            return True

    def check(self, session: str, holder: Holder) -> bool:
        validate.session_id(session)
        with self._lock:
            return self._cancelled(self._fenced(session, holder))

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        start: int = 0,
    ) -> Saved:
        validate.session_id(session)
        start = validate.save_start(start, replace, take_steers)
        items = validate.messages(msgs, trusted=self._transcripts.get(session, ())[start:])
        with self._lock:
            return self._save_fenced(session, holder, items, take_steers, replace, start)

    def journal(self, session: str) -> str | None:
        validate.session_id(session)
        with self._lock:
            return self._run(session).journal

    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        validate.session_id(session)
        with self._lock:
            run = self._fenced(session, holder)
            cancelled = self._cancelled(run)
            if not (cancelled and unless_cancelled):
                run.journal = journal
                self._touch(session)
            return cancelled

    def swap_journal(self, session: str, expected: str, journal: str) -> bool:
        validate.session_id(session)
        with self._lock:
            run = self._runs.get(session)
            if run is None or run.journal != expected:
                return False
            run.journal = journal
            _mark(run, True)  # a decision: the turn can go on
            self._touch(session)
            return True

    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None:
        validate.session_id(source)
        validate.session_id(target)
        with self._lock:
            if source not in self._transcripts:
                raise ArgumentError(f"cannot fork session {source!r}: it has no transcript")
            msgs = self._transcripts[source]
            validate.fork_index(at, len(msgs), source)
            if at:
                validate.fork_cut(msgs[at - 1], at, source, allow_unanswered)
            if target in self._transcripts:
                raise SessionExists(f"cannot fork {source!r} into {target!r}: {target!r} already has a transcript")
            # Copies: a message object is marked with the session it was read from (``_read``), so two
            # sessions must not share one.
            self._transcripts[target] = tuple(Message(m.role, m.content, key=m.key) for m in msgs[:at])
            self._touch(target)

    # -- EventStore ------------------------------------------------------------------------------------

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        validate.session_id(session)
        records = eventlog.check_append(events, keep)
        with self._lock:
            return self._append(self._fenced(session, holder), records, keep)

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int, start: int = 0,
    ) -> Saved:
        validate.session_id(session)
        start = validate.save_start(start, replace, take_steers)
        items = validate.messages(msgs, trusted=self._transcripts.get(session, ())[start:])
        records = eventlog.check_append(events, keep) if events else []
        eventlog.check_keep(keep)
        with self._lock:
            saved = self._save_fenced(session, holder, items, take_steers, replace, start)
            if records:
                self._append(self._run(session), records, keep)
            return saved

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        validate.session_id(session)
        after, limit = eventlog.check_read(after, limit)
        with self._lock:
            run = self._runs.get(session)
            kept = [] if run is None else [e for e in run.events if e[0] > after][:limit]
        return [eventlog.decode(seq, text) for seq, text in kept]

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        validate.session_id(session)
        with self._appended:
            return self._appended.wait_for(lambda: self._last_seq(session) > after, timeout)

    # -- LifecycleStore --------------------------------------------------------------------------------

    def list_sessions(
        self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50, after: str | None = None,
        *, stranded: bool = False, grace: float = 0.0,
    ) -> SessionPage:
        """Every session tested, the newest ``limit + 1`` of those kept by a heap (not all sorted),
        and only they described."""
        if stranded:
            return self._stranded(lifecycle.check_stranded(prefix, where, limit, after, grace), limit, after)
        wanted = lifecycle.check_listing(prefix, where, limit, after)
        cut = None if after is None else lifecycle.decode_cursor(after)
        with self._lock:
            keys = heapq.nlargest(limit + 1, (
                (run.updated, sid)
                for sid, run in self._runs.items()
                if run.created is not None
                and sid.startswith(prefix)
                and (cut is None or (run.updated, sid) < cut)
                and all(k in run.metadata and lifecycle.metadata_value(k, run.metadata[k]) == v
                        for k, v in wanted.items())
            ))
            rows = [(updated, self._info(sid, self._runs[sid])) for updated, sid in keys]
        return lifecycle.page(rows, limit)

    def _stranded(self, grace: float, limit: int, after: str | None) -> SessionPage:
        cut = None if after is None else lifecycle.decode_cursor(after)
        with self._lock:
            now = time.time()
            keys = heapq.nsmallest(limit + 1, (
                (run.open_since, sid)
                for sid, run in self._runs.items()
                if run.created is not None and run.open_since is not None and run.open_since <= now - grace
                and (run.holder is None or run.holder.expires <= now)
                and (not (self._cancelled(run) or run.handed) or run.queue)  # a cancel stops a run, not the queue
                and (cut is None or (run.open_since, sid) > cut)
            ))
            rows = [(since, self._info(sid, self._runs[sid])) for since, sid in keys]
        return lifecycle.page(rows, limit)

    def mark_finished(self, session: str, holder: Holder, journal: str | None) -> bool:
        validate.session_id(session)
        with self._lock:
            run = self._fenced(session, holder)
            if run.journal != journal or run.steers or run.queue:
                return False
            run.open_since = None
            return True

    def info(self, session: str) -> SessionInfo | None:
        validate.session_id(session)
        with self._lock:
            run = self._runs.get(session)
            return None if run is None or run.created is None else self._info(session, run)

    def set_metadata(self, session: str, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        validate.session_id(session)
        with self._lock:
            run = self._run(session)
            run.metadata = lifecycle.merge_metadata(run.metadata, changes)
            self._touch(session)
            return dict(run.metadata)

    def delete(self, session: str, *, force: bool = False) -> bool:
        validate.session_id(session)
        with self._lock:
            run = self._runs.get(session)
            if run is not None and run.holder is not None and run.holder.expires > time.time() and not force:
                raise SessionBusy(
                    f"session {session!r} is held by a live run ({run.holder.host}, pid {run.holder.pid}); "
                    f"delete(force=True) deletes it anyway and the run fails with LeaseLost",
                    run.holder,
                )
            existed = self._transcripts.pop(session, None) is not None
            existed |= run is not None and (run.created is not None or bool(run.steers) or bool(run.steer_keys)
                                            or bool(run.queue_keys))
            self._runs.pop(session, None)
            return existed

    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int:
        idle = lifecycle.idle_seconds(idle_for)
        limit = lifecycle.prune_limit(limit)
        deleted = 0
        while limit is None or deleted < limit:
            batch = PRUNE_BATCH if limit is None else min(PRUNE_BATCH, limit - deleted)
            with self._lock:
                now = time.time()
                idle_ones = [
                    sid for sid, run in self._runs.items()
                    if run.created is not None and run.updated < now - idle
                    and (run.holder is None or run.holder.expires <= now)
                ][:batch]
                for sid in idle_ones:
                    self._runs.pop(sid, None)
                    self._transcripts.pop(sid, None)
            deleted += len(idle_ones)
            if len(idle_ones) < batch:
                break
        return deleted

    def tail(self, session: str, last: int) -> list[Message]:
        validate.session_id(session)
        last = lifecycle.last_count(last)
        with self._lock:
            return self._read(session, self._transcripts.get(session, ())[-last:]) if last else []

    def read_back(self, session: str, stop: int | None, count: int) -> tuple[int, list[Message]]:
        validate.session_id(session)
        validate.read_back(stop, count)
        with self._lock:
            stored = self._transcripts.get(session, ())
            end = len(stored) if stop is None else min(stop, len(stored))
            first = max(end - count, 0)
            return (first, self._read(session, stored[first:end])) if end > first else (0, [])

    def pending_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._lock:
            run = self._runs.get(session)
            return [] if run is None else list(run.steers)

    # -- under the lock --------------------------------------------------------------------------------

    def _save_fenced(
        self, session: str, holder: Holder, items: tuple[Message, ...], take_steers: bool, replace: bool,
        start: int = 0,
    ) -> Saved:
        run = self._fenced(session, holder)
        stored = self._transcripts.get(session, ())
        if not replace and (len(stored) < start or not validate.is_extension(stored[start:], items)):
            raise TranscriptConflict(session, len(stored), start + len(items))
        taken = self._take(session) if take_steers else []
        items = stored[:start] + items if start else items
        if taken or items != stored or replace:
            self._transcripts[session] = saved = items + tuple(Message.user(t) for t in taken)
            run.journal = None
            _mark(run, turn_open(saved))
            self._touch(session)
        return Saved(taken, self._cancelled(run))

    def _append(self, run: _Run, records: list[str], keep: int) -> int:
        """Number ``records`` on from the log's last (a new log from the clock: ``first_seq``), drop the
        oldest beyond ``keep``, wake the followers."""
        seq = run.last_seq or max(eventlog.first_seq(time.time()), self._next_log) - 1
        for text in records:
            seq += 1
            run.events.append((seq, text))
        run.last_seq = seq
        self._next_log = max(self._next_log, seq + 1)
        while len(run.events) > keep:
            run.events.popleft()
        self._appended.notify_all()
        return seq

    def _last_seq(self, session: str) -> int:
        run = self._runs.get(session)
        return 0 if run is None else run.last_seq

    def _run(self, session: str) -> _Run:
        run = self._runs.get(session)
        if run is None:
            run = self._runs[session] = _Run()
        return run

    def _touch(self, session: str) -> _Run:
        """The session was written: it exists from now, and ``updated`` moves on (never back). ``created``
        is the session's incarnation too (``_read``): no two are the same, whatever the clock did."""
        run = self._run(session)
        now = time.time()
        if run.created is None:
            run.created = self._last_created = max(now, self._last_created + 1e-5)
        run.updated = max(run.updated, now)
        return run

    def _read(self, session: str, msgs: tuple[Message, ...]) -> list[Message]:
        """``msgs`` as a read returns them, marked with the session's incarnation (``messages.read_from``).

        Copies, as the other stores' reads decode objects of their own: the stored objects are the ones
        callers saved (an app's few-shot constants, messages copied into another session), and a mark set
        on them would be another caller's too: their own messages refused after a delete, or a read's mark
        overwritten by a read of another session (the erasure check then skipped)."""
        run = self._runs.get(session)
        if not msgs or run is None or run.created is None:
            return list(msgs)
        copies = [copy.copy(m) for m in msgs]
        read_from(copies, session, when(run.created))
        return copies

    def _info(self, session: str, run: _Run) -> SessionInfo:
        assert run.created is not None
        return SessionInfo(session, when(run.created), when(run.updated),
                           len(self._transcripts.get(session, ())), dict(run.metadata), run.spec,
                           None if run.open_since is None else when(run.open_since))

    def _take(self, session: str) -> list[str]:
        run = self._runs.get(session)
        if run is None or not run.steers:
            return []
        taken = list(run.steers)
        run.steers.clear()
        return taken

    def _fenced(self, session: str, holder: Holder) -> _Run:
        run = self._run(session)
        if not _same(run.holder, holder):
            token = None if run.holder is None else run.holder.token
            raise LeaseLost.superseded(session, holder.epoch, token, run.epoch)
        return run

    @staticmethod
    def _cancelled(run: _Run) -> bool:
        return run.holder is not None and run.holder.cancelled

    def __repr__(self) -> str:
        return "memory.Store()"


def _mark(run: _Run, opened: bool) -> None:
    """A write left the turn ``opened`` (or a steer waits: input too): keep ``open_since``, or clear it."""
    if opened or run.steers or run.queue:
        run.open_since = run.open_since if run.open_since is not None else time.time()
    else:
        run.open_since = None


def _same(held: Holder | None, holder: Holder) -> bool:
    return held is not None and held.token == holder.token and held.epoch == holder.epoch


__all__ = ["Store"]
