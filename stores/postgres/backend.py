"""The PostgreSQL backend: every write one call of ``agent_sessions_write`` (write.sql), every read one SELECT,
each a single statement in autocommit, so one round trip to the server.

The write's function locks the session's row, evaluates the guard and applies the change in the server,
as the Lua script does for Redis; a read is one statement, so one snapshot, with the messages, steers,
queue and keys it asks for as JSON arrays beside the row.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from agent_sessions.backed import new_incarnation
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
    indexed,
)
from agent_sessions.errors import OutcomeUnknown, SessionLocked, StoreError

from .._sql.tables import SCHEMA_VERSION, SchemaMismatch

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_WRITE = text("SELECT agent_sessions_write(:sid, CAST(:guard AS jsonb), CAST(:change AS jsonb), :inc, :lock_wait)")
_NOW = "extract(epoch FROM clock_timestamp())::double precision"
_READ = text(
    "SELECT s.*, " + _NOW + " AS now_, m.start AS start_, "
    "CASE WHEN m.start IS NOT NULL THEN (SELECT json_agg(body ORDER BY idx) FROM agent_messages "
    "  WHERE session_id = s.session_id AND idx >= m.start AND idx < m.stop) END AS messages_, "
    "CASE WHEN :steers THEN (SELECT json_agg(json_build_array(id, body, steer_key) ORDER BY id) "
    "  FROM agent_steers WHERE session_id = s.session_id) END AS steers_, "
    "CASE WHEN :queue THEN (SELECT json_agg(json_build_array(id, queue_key, body) ORDER BY id) "
    "  FROM agent_queue WHERE session_id = s.session_id) END AS queue_, "
    "CASE WHEN cardinality(CAST(:keys AS text[])) > 0 THEN (SELECT json_agg(accepted_key) FROM agent_keys "
    "  WHERE session_id = s.session_id AND accepted_key = ANY(CAST(:keys AS text[]))) END AS keys_ "
    "FROM agent_sessions AS s, LATERAL (SELECT CASE WHEN CAST(:start AS integer) IS NOT NULL "
    "  OR CAST(:last AS integer) IS NOT NULL THEN coalesce(CAST(:start AS integer), greatest(least("
    "  coalesce(CAST(:stop AS integer), s.length), s.length) - CAST(:last AS integer), 0)) END AS start, "
    "  least(coalesce(CAST(:stop AS integer), s.length), s.length) AS stop) AS m "
    "WHERE s.session_id = :sid"
)
_EVENTS = text(
    "SELECT seq, body FROM agent_events WHERE session_id = :sid AND seq > :after ORDER BY seq LIMIT :limit"
)
_IDENTITY = text(
    "WITH made AS (INSERT INTO agent_store (id, identity, schema_version) VALUES (1, :identity, :version) "
    "ON CONFLICT (id) DO NOTHING RETURNING identity, schema_version) "
    "SELECT identity, schema_version FROM made UNION ALL "
    "SELECT identity, schema_version FROM agent_store WHERE id = 1"
)
_LAST_SEQ = text("SELECT last_seq FROM agent_sessions WHERE session_id = :sid")
_ROW = "s.*, " + _NOW + " AS now_"
_RECENT = (
    "SELECT " + _ROW + " FROM agent_sessions AS s WHERE s.exists_ AND s.session_id LIKE :prefix ESCAPE '\\' "
    "{after}{where} ORDER BY s.exists_ DESC, s.updated DESC, s.session_id DESC LIMIT :limit"
)
_OPEN = text(
    "SELECT * FROM (SELECT " + _ROW + " FROM agent_sessions AS s WHERE s.open_since IS NOT NULL "
    "AND s.open_since <= " + _NOW + " - :grace AND (CAST(:after_t AS double precision) IS NULL "
    "OR (s.open_since, s.session_id) > (CAST(:after_t AS double precision), CAST(:after_id AS text))) "
    "ORDER BY s.open_since, s.session_id LIMIT :limit) AS o WHERE o.exists_"
)
_IDLE = text(
    "SELECT " + _ROW + " FROM agent_sessions AS s WHERE s.exists_ AND s.updated < " + _NOW + " - :idle "
    "ORDER BY s.exists_, s.updated, s.session_id LIMIT :limit"
)

MISSING_HINT = "create the tables by running stores.postgres.SCHEMA in your migration"


class Backend:
    """Sessions in PostgreSQL through the caller's SQLAlchemy ``Engine`` (psycopg 3); each read and write
    one statement on a pooled connection in autocommit."""

    def __init__(self, engine: Engine, lock_wait: float | None = None) -> None:
        self.engine = engine
        self.lock_wait = lock_wait
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._identity: str | None = None

    @property
    def identity(self) -> str:
        if self._identity is None:
            made = uuid.uuid4().hex
            got = self._run("identity", "", lambda conn: conn.execute(
                _IDENTITY, {"identity": made, "version": SCHEMA_VERSION}).first())
            assert got is not None
            identity, version = got
            if version != SCHEMA_VERSION:
                raise SchemaMismatch(f"PostgreSQL store: the database holds schema {version}, this library "
                                     f"uses schema {SCHEMA_VERSION}")
            self._identity = str(identity)
        return self._identity

    def read(self, session: str, want: Want) -> Snapshot | None:
        params = {"sid": session, "start": want.start, "stop": want.stop, "last": want.last,
                  "steers": want.steers, "queue": want.queue, "keys": list(want.keys)}
        got = self._run("read", session, lambda conn: conn.execute(_READ, params).mappings().first())
        if got is None:
            return None
        return Snapshot(_row(got, got["now_"]), got["start_"] or 0, got["messages_"] or [],
                        [Steer(*s) for s in got["steers_"] or ()], [Queued(*q) for q in got["queue_"] or ()],
                        frozenset(got["keys_"] or ()))

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        params = {"sid": session, "guard": json.dumps(_guard(guard)), "change": json.dumps(_change(change)),
                  "inc": new_incarnation() if change.exist else "", "lock_wait": self.lock_wait}
        got = self._run("write", session, lambda conn: conn.execute(_WRITE, params).scalar_one(), writes=True)
        row = got["row"]
        return Written(got["done"], None if row is None else _row(row, got["now"]))

    def events(self, session: str, after: int, limit: int) -> list[tuple[int, str]]:
        params = {"sid": session, "after": after, "limit": limit}
        got = self._run("events", session, lambda conn: conn.execute(_EVENTS, params).all())
        return [(int(seq), body) for seq, body in got]

    def last_seq(self, session: str) -> int:
        """The session's last event number (0: none): what a follower's wait asks."""
        got = self._run("wait_for_events", session, lambda conn: conn.execute(_LAST_SEQ, {"sid": session}).scalar())
        return 0 if got is None else int(got)

    def sessions(self, query: Recent | Open | Idle) -> list[Row]:
        if isinstance(query, Recent):
            statement, params = _recent(query)
        elif isinstance(query, Open):
            after_t, after_id = query.after if query.after is not None else (None, None)
            statement, params = _OPEN, {"grace": query.grace, "after_t": after_t, "after_id": after_id,
                                        "limit": query.limit}
        else:
            statement, params = _IDLE, {"idle": query.idle_for, "limit": query.limit}
        got = self._run("listing", "", lambda conn: conn.execute(statement, params).mappings().all())
        return [_row(m, m["now_"]) for m in got]

    def _run(self, what: str, session: str, call: Callable[[Connection], _T], *, writes: bool = False) -> _T:
        """``call`` on a pooled connection in autocommit; the driver's errors as ``StoreError``, and as
        ``OutcomeUnknown`` for a write whose statement was sent and whose answer was lost."""
        of = f" of session {session!r}" if session else ""
        try:
            conn = self._autocommit.connect()
        except SQLAlchemyError as exc:
            raise StoreError(f"PostgreSQL store: {what}{of} failed: no connection ({exc})") from exc
        try:
            with conn:
                return call(conn)
        except DBAPIError as exc:
            if writes and exc.connection_invalidated:
                raise OutcomeUnknown(f"PostgreSQL store: {what}{of} may have happened: the connection failed "
                                     f"before the server answered ({exc.orig})") from exc
            if getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_not_available: lock_wait ran out
                raise SessionLocked(f"PostgreSQL store: {what}{of}: another transaction held the session's row "
                                    f"longer than lock_wait ({self.lock_wait} s); nothing was written") from exc
            raise StoreError(f"PostgreSQL store: {what}{of} failed: {exc.orig}{_hint(exc)}") from exc
        except SQLAlchemyError as exc:
            raise StoreError(f"PostgreSQL store: {what}{of} failed: {exc}") from exc

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        with self._autocommit.connect() as conn:
            yield conn

    def close(self) -> None:
        pass  # the engine is the caller's

    def __repr__(self) -> str:
        return f"postgres {self.engine.url.render_as_string(hide_password=True)!r}"


def _hint(exc: DBAPIError) -> str:
    """What to do about a missing table or function: the schema was not made (or is not schema 1)."""
    state = getattr(exc.orig, "sqlstate", None)
    return f" ({MISSING_HINT})" if state in ("42P01", "42883") else ""


def _recent(query: Recent) -> tuple[Any, dict[str, Any]]:
    prefix = query.prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    params: dict[str, Any] = {"prefix": prefix, "limit": query.limit}
    after = ""
    if query.after is not None:
        after = " AND (s.updated, s.session_id) < (:after_t, :after_id)"
        params.update(after_t=query.after[0], after_id=query.after[1])
    where = ""
    for i, (name, value) in enumerate(query.where):
        where += (f" AND EXISTS (SELECT 1 FROM agent_metadata AS t WHERE t.session_id = s.session_id "
                  f"AND t.name = :n{i} AND t.value = :v{i})")
        params.update({f"n{i}": name, f"v{i}": value})
    return text(_RECENT.format(after=after, where=where)), params


def _row(m: Mapping[Any, Any], now: Any) -> Row:
    return Row(m["session_id"], bool(m["exists_"]), m["incarnation"], float(m["created"]), float(m["updated"]),
               int(m["version"]), int(m["length"]), int(m["edits"]), m["token"], int(m["epoch"]),
               float(m["expires"]), m["host"], int(m["pid"]), m["spec"], m["turn"], bool(m["cancelled"]),
               m["cancelled_turn"], bool(m["handed"]), m["journal"],
               None if m["open_since"] is None else float(m["open_since"]), m["metadata"], int(m["last_seq"]),
               int(m["steers"]), int(m["queued"]), float(now))


def _guard(guard: Guard) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("exists", "incarnation", "version", "length", "edits", "queue_head", "key_absent"):
        value = getattr(guard, name)
        if value is not None:
            out[name] = value
    if guard.lease is not None:
        out["lease"] = list(guard.lease)
    for name in ("lease_free", "lease_held", "not_cancelled", "no_steers", "no_queue"):
        if getattr(guard, name):
            out[name] = True
    if guard.steers:
        out["steers"] = list(guard.steers)
    if guard.checks_journal:
        out["journal"] = [guard.journal]
    return out


def _change(change: Change) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if change.exist:
        out["exist"] = True
    if change.delete:
        out["delete"] = True
    if change.splice is not None:
        out["splice"] = [change.splice[0], list(change.splice[1])]
    if change.take_steers:
        out["take_steers"] = list(change.take_steers)
    for name in ("add_steer", "push"):
        value = getattr(change, name)
        if value is not None:
            out[name] = list(value)
    for name in ("pop", "add_key", "drop_key", "open"):
        value = getattr(change, name)
        if value is not None:
            out[name] = value
    if change.metadata is not None:
        out["metadata"] = change.metadata
        out["meta_index"] = [list(pair) for pair in indexed(change.metadata)]
    if change.sets_journal:
        out["journal"] = [change.journal]
    if change.sets_turn:
        out["turn"] = [change.turn]
    if change.handed is not None:
        out["handed"] = change.handed
    lease = change.lease
    if isinstance(lease, Acquire):
        out["lease"] = {"acquire": {"host": lease.host, "pid": lease.pid, "token": lease.token, "spec": lease.spec,
                                    "ttl": lease.ttl, "turn": lease.turn}}
    elif isinstance(lease, Renew):
        out["lease"] = {"renew": lease.ttl}
    elif isinstance(lease, Release):
        out["lease"] = {"release": True}
    elif lease == CANCEL:
        out["lease"] = {"cancel": True}
    if change.events:
        out["events"], out["keep"] = list(change.events), change.keep
    return out
