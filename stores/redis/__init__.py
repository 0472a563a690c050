"""A store in Redis, through the caller's redis-py client: every write one Lua script, every read another.

Give it your client (``redis.Redis``; the store never makes or closes connections) and a key prefix:
``redis.Store(client, prefix="myapp:agent:")``. A session's keys share a hash tag (``{session}``), so one
script touches one slot; the listing indexes are three sorted sets under the prefix. Durability is the
server's (``appendfsync``: docs/stores/redis.md).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, TypeVar

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
    change_json,
    guard_json,
    indexed,
    new_incarnation,
)
from agent_sessions.errors import OutcomeUnknown, StoreError

try:
    import redis
except ImportError as exc:  # pragma: no cover - the extra's job
    raise ImportError("stores.redis requires redis-py: pip install 'stored-agent-sessions[redis]'") from exc

_T = TypeVar("_T")
WRITE = resources.files(__package__).joinpath("write.lua").read_text()
READ = resources.files(__package__).joinpath("read.lua").read_text()
BATCH = 200
"""Index entries a listing reads at a time."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Backend:
    def __init__(self, client: redis.Redis, prefix: str = "agent_sessions:") -> None:
        self.client = client
        self.prefix = prefix
        self._write = client.register_script(WRITE)
        self._read = client.register_script(READ)
        self._identity: str | None = None
        self._updated, self._open = f"{prefix}index:updated", f"{prefix}index:open"

    @property
    def identity(self) -> str:
        if self._identity is None:
            key = f"{self.prefix}identity"
            self._call("identity", "", lambda: self.client.set(key, uuid.uuid4().hex, nx=True))
            self._identity = _text(self._call("identity", "", lambda: self.client.get(key)))
        return self._identity

    def _keys(self, session: str) -> list[str]:
        base = f"{self.prefix}{{{session}}}:"
        return [base + part for part in ("row", "messages", "steers", "queue", "keys", "events")]

    def _call(self, what: str, session: str, call: Callable[[], _T], *, writes: bool = False) -> _T:
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            error = OutcomeUnknown if writes else StoreError
            raise error(f"redis store: {what} of session {session!r}: {exc}") from exc
        except redis.RedisError as exc:
            raise StoreError(f"redis store: {what} of session {session!r}: {exc}") from exc

    def read(self, session: str, want: Want) -> Snapshot | None:
        asked = {k: v for k, v in (("start", want.start), ("stop", want.stop), ("last", want.last),
                                    ("steers", want.steers), ("queue", want.queue))
                 if v is not None}
        got = self._call("read", session, lambda: self._read(self._keys(session)[:4], [json.dumps(asked)]))
        if not got:
            return None
        row, journal, now, steers, queued, start, texts, waiting, queue = got
        return Snapshot(_row(session, row, journal, now, steers, queued), int(start), [_text(t) for t in texts],
                        [Steer(*json.loads(item)) for item in waiting], [Queued(*json.loads(item)) for item in queue])

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        keys = [*self._keys(session), self._updated, self._open]
        mkeys = "[]" if change.metadata is None else json.dumps(
            [f"{self.prefix}index:meta:{k}={v}" for k, v in indexed(change.metadata)])
        args = [session, json.dumps(guard_json(guard)), json.dumps(change_json(change)), mkeys, new_incarnation()]
        got = self._call("write", session, lambda: self._write(keys, args), writes=True)
        row = None if len(got) == 1 else _row(session, *got[1:])
        return Written(bool(got[0]), row)

    def events(self, session: str, after: int, limit: int) -> list[tuple[int, str]]:
        key = self._keys(session)[5]
        got = self._call("events", session, lambda: self.client.zrangebyscore(key, f"({after}", "+inf", 0, limit))
        return [(int(seq), text) for seq, _, text in (_text(m).partition(":") for m in got)]

    def sessions(self, query: Recent | Open | Idle) -> list[Row]:
        return self._call("listing", "", lambda: self._sessions(query))

    def _sessions(self, query: Recent | Open | Idle) -> list[Row]:
        now = self._now()
        if isinstance(query, Idle):
            found = self.client.zrangebyscore(self._updated, "-inf", f"({now - query.idle_for}", 0, query.limit)
            return [r for r in self._rows([_text(s) for s in found]) if r.exists]
        if isinstance(query, Open):
            rows: list[Row] = []
            low = "-inf" if query.after is None else query.after[0]
            offset = 0
            while len(rows) < query.limit:
                page = self.client.zrangebyscore(self._open, low, now - query.grace, offset, BATCH, withscores=True)
                offset += len(page)
                wanted = [s for s, score in _scored(page) if query.after is None or (score, s) > query.after]
                rows += [r for r in self._rows(wanted) if r.exists and r.open_since is not None]
                if len(page) < BATCH:
                    break
            return sorted(rows, key=lambda r: (r.open_since or 0.0, r.session))[:query.limit]
        index = self._updated if not query.where else f"{self.prefix}index:meta:{query.where[0][0]}={query.where[0][1]}"
        high: str | float = "+inf" if query.after is None else query.after[0]
        rows, offset = [], 0
        while len(rows) < query.limit:
            page = self.client.zrevrangebyscore(index, high, "-inf", offset, BATCH, withscores=True)
            offset += len(page)
            wanted = [s for s, score in _scored(page)
                      if s.startswith(query.prefix) and (query.after is None or (score, s) < query.after)]
            rows += [r for r in self._rows(wanted)
                     if r.exists and set(query.where) <= set(indexed(r.metadata))]
            if len(page) < BATCH:
                break
        return sorted(rows, key=lambda r: (r.updated, r.session), reverse=True)[:query.limit]

    def _rows(self, sessions: Sequence[str]) -> list[Row]:
        pipe = self.client.pipeline(transaction=False)
        for session in sessions:
            self._read(self._keys(session)[:4], ["{}"], client=pipe)
        return [_row(s, *got[:5]) for s, got in zip(sessions, pipe.execute(), strict=True) if got]

    def _now(self) -> float:
        seconds, micros = self.client.time()
        return float(seconds) + float(micros) / 1_000_000

    def close(self) -> None:
        pass  # the client is the caller's

    def __repr__(self) -> str:
        return f"redis prefix {self.prefix!r}"


def _row(session: str, text: Any, journal: Any, now: Any, steers: Any, queued: Any) -> Row:
    f: dict[str, str] = json.loads(text)
    open_since = f.get("open")
    return Row(session, f.get("exists") == "1", f.get("inc", ""), float(f.get("created", 0)),
               float(f.get("updated", 0)), int(f.get("version", 0)), int(f.get("length", 0)), int(f.get("edits", 0)),
               f.get("token"), int(f.get("epoch", 0)), float(f.get("expires", 0)), f.get("host", ""),
               int(f.get("pid", 0)), f.get("spec"), f.get("turn"), f.get("cancelled") == "1", f.get("cturn"),
               f.get("handed") == "1",
               None if journal is None else _text(journal), None if open_since is None else float(open_since),
               f.get("meta", "{}"),
               int(f.get("last_seq", 0)), int(steers), int(queued), float(_text(now)))


def _scored(page: Any) -> list[tuple[str, float]]:
    """A sorted set's (member, score) pairs, members as text."""
    return [(_text(member), float(score)) for member, score in page]


class Store(BackedStore):
    """Sessions in Redis, through ``client`` (yours: the store never closes it), every key under
    ``prefix``."""

    def __init__(self, client: redis.Redis, prefix: str = "agent_sessions:") -> None:
        super().__init__(Backend(client, prefix), name="redis store")

    def __repr__(self) -> str:
        return f"redis.Store({self.backend!r})"


__all__ = ["Backend", "Store"]
