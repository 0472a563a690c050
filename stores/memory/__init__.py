"""A store that lives as long as the process: for tests, scripts and single-process services.

The backend is a dict of sessions under one lock: every read and write is a few dict and list steps, so
each is atomic by holding it. Its clock is this process's (``time.time``): there is no other to disagree.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from agent_sessions.backed import BackedStore, new_incarnation
from agent_sessions.backend import (
    CANCEL,
    Acquire,
    Change,
    Guard,
    Idle,
    Open,
    Queued,
    Recent,
    Release,
    Renew,
    Row,
    Snapshot,
    Steer,
    Want,
    Written,
    first_seq,
    indexed,
)


@dataclass
class _Session:
    row: Row
    messages: list[str] = field(default_factory=list)
    steers: list[Steer] = field(default_factory=list)
    queue: list[Queued] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    events: list[tuple[int, str]] = field(default_factory=list)


def _empty(session: str) -> Row:
    return Row(session, False, "", 0.0, 0.0, 0, 0, 0, None, 0, 0.0, "", 0, None, None, False, None, False, None,
               None, "{}", 0, 0, 0, 0.0)


class Backend:
    """The sessions of one process, under one lock; a condition of that lock wakes event followers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._appended = threading.Condition(self._lock)
        self._sessions: dict[str, _Session] = {}
        self._identity = uuid.uuid4().hex

    @property
    def identity(self) -> str:
        return self._identity

    def read(self, session: str, want: Want) -> Snapshot | None:
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                return None
            start, texts = 0, []
            if want.start is not None or want.last is not None:
                stop = len(s.messages) if want.stop is None else min(want.stop, len(s.messages))
                start = want.start if want.start is not None else max(stop - (want.last or 0), 0)
                texts = s.messages[start:stop]
            return Snapshot(replace(s.row, now=time.time()), start, texts, list(s.steers) if want.steers else [],
                            list(s.queue) if want.queue else [], frozenset(k for k in want.keys if k in s.keys))

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        with self._lock:
            now = time.time()
            s = self._sessions.get(session)
            row = _empty(session) if s is None else s.row
            if not _holds(guard, s, row, now):
                return Written(False, None if s is None else replace(row, now=now))
            if change.empty:
                return Written(True, replace(row, now=now))
            if change.delete:
                self._sessions.pop(session, None)
                return Written(True, None if s is None else replace(row, now=now))
            if s is None:
                s = self._sessions[session] = _Session(row)
            self._apply(s, change, now)
            return Written(True, s.row)

    def _apply(self, s: _Session, change: Change, now: float) -> None:
        row = s.row
        version = row.version + 1
        fields: dict[str, object] = {"version": version, "now": now}
        if change.exist:
            if not row.exists:
                fields.update(exists=True, incarnation=new_incarnation(), created=now)
            fields["updated"] = max(row.updated, now)
        if change.splice is not None:
            at, texts = change.splice
            del s.messages[at:]
            s.messages.extend(texts)
            fields.update(length=len(s.messages), edits=row.edits + 1)
        if change.take_steers:
            taken = set(change.take_steers)
            s.steers = [x for x in s.steers if x.id not in taken]
        if change.add_steer is not None:
            s.steers.append(Steer(version, *change.add_steer))
        if change.push is not None:
            s.queue.append(Queued(version, *change.push))
        if change.pop is not None:
            s.queue = [q for q in s.queue if q.id != change.pop]
        if change.add_key is not None:
            s.keys.add(change.add_key)
        if change.drop_key is not None:
            s.keys.discard(change.drop_key)
        if change.sets_journal:
            fields["journal"] = change.journal
        lease = change.lease
        if isinstance(lease, Acquire):
            fields.update(token=lease.token, epoch=row.epoch + 1, expires=now + lease.ttl, host=lease.host,
                          pid=lease.pid, spec=lease.spec, turn=lease.turn, handed=row.handed or row.cancelled,
                          cancelled=False)
        elif isinstance(lease, Renew):
            fields["expires"] = now + lease.ttl
        elif isinstance(lease, Release):
            fields.update(token=None, handed=row.handed or row.cancelled, cancelled=False)
        elif lease == CANCEL:
            fields.update(cancelled=True, cancelled_turn=row.turn)
        if change.sets_turn:
            fields["turn"] = change.turn
        if change.handed is not None:
            fields["handed"] = change.handed
        if change.open == "set":
            fields["open_since"] = now if row.open_since is None else row.open_since
        elif change.open == "clear":
            fields["open_since"] = None
        if change.metadata is not None:
            fields["metadata"] = change.metadata
        if change.events:
            seq = row.last_seq or first_seq(now) - 1
            for text in change.events:
                seq += 1
                s.events.append((seq, text))
            del s.events[:-change.keep]
            fields["last_seq"] = seq
            self._appended.notify_all()
        s.row = replace(row, **fields, steers=len(s.steers), queued=len(s.queue))  # type: ignore[arg-type]

    def events(self, session: str, after: int, limit: int) -> list[tuple[int, str]]:
        with self._lock:
            s = self._sessions.get(session)
            return [] if s is None else [e for e in s.events if e[0] > after][:limit]

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        with self._appended:
            return self._appended.wait_for(lambda: self._last_seq(session) > after, timeout)

    def _last_seq(self, session: str) -> int:
        s = self._sessions.get(session)
        return 0 if s is None else s.row.last_seq

    def sessions(self, query: Recent | Open | Idle) -> list[Row]:
        with self._lock:
            now = time.time()
            rows = [replace(s.row, now=now) for s in self._sessions.values() if s.row.exists]
        if isinstance(query, Recent):
            rows = [r for r in rows if r.session.startswith(query.prefix)
                    and (query.after is None or (r.updated, r.session) < query.after)
                    and set(query.where) <= set(indexed(r.metadata))]
            return sorted(rows, key=lambda r: (r.updated, r.session), reverse=True)[:query.limit]
        if isinstance(query, Open):
            rows = [r for r in rows if r.open_since is not None and r.open_since <= now - query.grace
                    and (query.after is None or (r.open_since, r.session) > query.after)]
            return sorted(rows, key=lambda r: (r.open_since or 0.0, r.session))[:query.limit]
        rows = [r for r in rows if r.updated < now - query.idle_for]
        return sorted(rows, key=lambda r: (r.updated, r.session))[:query.limit]

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "memory"


def _holds(guard: Guard, s: _Session | None, row: Row, now: float) -> bool:
    held = row.token is not None
    steers = set() if s is None else {x.id for x in s.steers}
    return ((guard.exists is None or guard.exists == row.exists)
            and (guard.incarnation is None or guard.incarnation == row.incarnation)
            and (guard.version is None or guard.version == row.version)
            and (guard.length is None or guard.length == row.length)
            and (guard.edits is None or guard.edits == row.edits)
            and (guard.lease is None or (row.token, row.epoch) == guard.lease)
            and not (guard.lease_free and held and row.expires > now)
            and not (guard.lease_held and not held)
            and not (guard.not_cancelled and row.cancelled)
            and not (guard.no_steers and row.steers)
            and set(guard.steers) <= steers
            and (not guard.checks_journal or guard.journal == row.journal)
            and not (guard.no_queue and row.queued)
            and (guard.queue_head is None or (s is not None and bool(s.queue) and s.queue[0].id == guard.queue_head))
            and (guard.key_absent is None or s is None or guard.key_absent not in s.keys))


class Store(BackedStore):
    """Thread-safe; every operation holds one lock for a few dict and list steps. Followers of a session's
    events wait on a condition of that lock (``wait_for_events``)."""

    def __init__(self) -> None:
        self._memory = Backend()
        super().__init__(self._memory, name="memory store")

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        return self._memory.wait_for_events(session, after, timeout)

    def __repr__(self) -> str:
        return "memory.Store()"


__all__ = ["Backend", "Store"]
