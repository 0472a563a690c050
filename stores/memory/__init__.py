"""A store that lives as long as the process: for tests, scripts and single-process services.

The backend is a dict of sessions under one lock: every read and write is a few dict and list steps, so
each is atomic by holding it. Its clock is this process's (``time.time``): there is no other to disagree.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from agent_sessions.backed import BackedStore
from agent_sessions.backend import (
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


@dataclass
class _Session:
    row: Row
    messages: list[str] = field(default_factory=list)
    steers: list[Steer] = field(default_factory=list)
    queue: list[Queued] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    events: list[tuple[int, str]] = field(default_factory=list)


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
                            list(s.queue) if want.queue else [])

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        with self._lock:
            now = time.time()
            s = self._sessions.get(session)
            row = empty_row(session) if s is None else s.row
            steers = () if s is None else [x.id for x in s.steers]
            head = s.queue[0].id if s is not None and s.queue else None
            if not guard.holds(row, now, steers, head, s is not None and guard.key_absent in s.keys):
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
        version = s.row.version + 1
        if change.splice is not None:
            at, texts = change.splice
            del s.messages[at:]
            s.messages.extend(texts)
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
        if change.events:
            seq = first_events(s.row, now)
            s.events.extend(enumerate(change.events, seq))
            del s.events[:-change.keep]
            self._appended.notify_all()
        s.row = next_row(s.row, change, now, len(s.steers), len(s.queue))

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
