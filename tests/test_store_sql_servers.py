"""The PostgreSQL and MySQL stores against real servers: storetest, plus what only SQL stores promise."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, func, inspect, select, text

import agent_sessions as agent
import storetest
from agent_sessions import lifecycle
from agent_sessions.backed import BackedStore as SQLStore
from agent_sessions.eventlog import encode
from stores import mysql, postgres, sqlite
from stores._sql.tables import events, messages
from stores.postgres.listener import FOLLOWED
from tests import servers
from tests.sql_helpers import failing, statements_of


@dataclass(frozen=True)
class Backend:
    name: str
    url: str
    store: type[SQLStore]
    in_another_process: Callable[[str], SQLStore]


POSTGRES = Backend("postgres", servers.POSTGRES_URL, postgres.Store, servers.postgres_store)
MYSQL = Backend("mysql", servers.MYSQL_URL, mysql.Store, servers.mysql_store)
_WRITE_CALL = {"postgres": "SELECT agent_sessions_write(", "mysql": "CALL agent_sessions_write("}
"""How each server store's one statement a write begins."""


@contextmanager
def connected(backend: Backend) -> Iterator[Engine]:
    """An engine on a database holding freshly created tables, as the caller's migration leaves it."""
    servers.create_database(backend.url)
    engine = create_engine(backend.url, pool_size=8, max_overflow=12)
    servers.fresh_schema(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module", params=[POSTGRES, MYSQL], ids=lambda b: b.name)
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def engine(backend: Backend) -> Iterator[Engine]:
    with connected(backend) as engine:
        yield engine


class ServerStoreContract(storetest.StoreContract):
    backend: Backend

    engine: Engine

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _engine(cls) -> Iterator[None]:
        with connected(cls.backend) as engine:
            cls.engine = engine
            yield

    @pytest.fixture(autouse=True)
    def _closing(self) -> Iterator[None]:
        """Each test's stores closed as it ends: a MySQL store keeps up to two of the class's engine's 20
        connections until it is closed or collected, and collection comes when the GC runs, so ten unclosed
        stores of earlier tests could leave a test waiting out the pool's timeout."""
        self.made: list[SQLStore] = []
        yield
        for store in self.made:
            store.close()

    def make_store(self) -> SQLStore:
        store = self.backend.store(self.engine)
        self.made.append(store)
        return store

    def process_factory(self) -> functools.partial[SQLStore]:
        return functools.partial(self.backend.in_another_process, self.backend.url)


class TestPostgresStoreKeepsTheContract(ServerStoreContract):
    backend = POSTGRES


class TestMySQLStoreKeepsTheContract(ServerStoreContract):
    backend = MYSQL
    huge_text_bytes = 4_000_000  # under half of MariaDB's default 16 MiB max_allowed_packet (message_limit)


def test_a_plain_save_is_one_transaction_of_one_insert(backend: Backend, engine: Engine) -> None:
    """A plain save replaces the transcript (``BackedStore.save``): one DELETE and one multi-row INSERT, the
    row, one COMMIT."""
    store = backend.store(engine)
    msgs = [agent.Message.user(f"m{i}") for i in range(100)]
    store.save("append-only", msgs)
    with statements_of(store) as seen:
        store.save("append-only", [*msgs, agent.Message.assistant("new")])
    assert len(seen) == 1 and seen[0][0].startswith(_WRITE_CALL[backend.name]), seen  # the server does the rest
    assert backend.store(engine).messages("append-only")[-1] == agent.Message.assistant("new")


def test_missing_tables_are_a_store_error_pointing_at_schema(backend: Backend) -> None:
    empty = create_engine(servers.database_url(backend.url, servers.database_name("empty")))
    try:
        with pytest.raises(agent.StoreError, match=rf"table 'agent_store' does not exist.*{backend.name}\.SCHEMA"):
            backend.store(empty).take_steers("s")
        with pytest.raises(agent.StoreError, match="table 'agent_store' does not exist"):
            backend.store(empty).save("s", [agent.Message.user("x")])
    finally:
        empty.dispose()


def test_the_store_takes_an_engine_not_a_url(backend: Backend) -> None:
    with pytest.raises(agent.ArgumentError, match="needs a SQLAlchemy Engine"):
        backend.store(backend.url)  # type: ignore[arg-type]


def test_postgres_schema_is_one_string_keeping_json_as_text() -> None:
    """JSON travels to the write function as jsonb (its guard and change), but no column is JSON."""
    assert isinstance(postgres.SCHEMA, str)
    assert postgres.SCHEMA.endswith(postgres.WRITE_FUNCTION)
    tables = postgres.SCHEMA[:-len(postgres.WRITE_FUNCTION)]
    assert "JSON" not in tables.upper() and "body TEXT" in tables
    assert f"pg_try_advisory_xact_lock({FOLLOWED})" in postgres.WRITE_FUNCTION  # the key followers hold


def test_mysql_schema_is_a_list_keeping_json_as_longtext() -> None:
    assert isinstance(mysql.SCHEMA, list) and all(isinstance(s, str) for s in mysql.SCHEMA)
    assert not [s for s in mysql.SCHEMA if s.startswith("CREATE TABLE") and " JSON" in s.upper()]
    assert any("body LONGTEXT" in s for s in mysql.SCHEMA)


def test_mysql_take_steers_uses_no_mariadb_only_sql() -> None:
    """A take is CALLs of the schema's procedures, whose SQL is MySQL 8's too: no RETURNING, no lock's WAIT
    clause, no CREATE OR REPLACE, no SET STATEMENT (the row is locked by a plain FOR UPDATE)."""
    with connected(MYSQL) as engine:
        store = mysql.Store(engine)
        store.add_steer("portable", "x")
        with statements_of(store) as seen:
            assert store.take_steers("portable") == ["x"]
    assert {sql.split("(")[0] for sql, _ in seen} <= {"CALL agent_sessions_read", "CALL agent_sessions_write"}, seen
    for procedure in (mysql.WRITE_PROCEDURE, mysql.READ_PROCEDURE):
        code = "\n".join(line.split("--")[0] for line in procedure.upper().splitlines())
        assert not [word for word in ("RETURNING", " WAIT ", "OR REPLACE", "SET STATEMENT") if word in code]
    assert "FOR UPDATE;" in mysql.WRITE_PROCEDURE


def test_a_mysql_transcript_larger_than_a_packet_is_read_whole() -> None:
    """A read answers the messages as rows, each within ``max_allowed_packet``, never as one aggregate of
    them all: a transcript of several near-limit messages, more than a packet together, reads back whole."""
    with connected(MYSQL) as engine:
        store = mysql.Store(engine)
        packet = int(engine.connect().exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
        big = "x" * (store.max_message_bytes - 1024)
        msgs = [agent.Message.user(f"{i}{big}") for i in range(packet // len(big) + 2)]
        held = store.acquire("over-a-packet", agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
        for n in range(1, len(msgs) + 1):  # a step's save appends its new message: each write within a packet
            store.save_fenced("over-a-packet", held, msgs[:n], take_steers=False)
        assert sum(len(m.text) for m in msgs) > packet
        assert mysql.Store(engine).messages("over-a-packet") == msgs


@pytest.mark.parametrize("fails_at", ["DELETE FROM agent_messages", "INSERT INTO agent_messages"])
def test_a_save_that_fails_midway_leaves_the_previous_transcript(backend: Backend, engine: Engine,
                                                                  fails_at: str) -> None:
    store = backend.store(engine)
    before = [agent.Message.user(f"m{i}") for i in range(5)]
    store.save("midway", before)
    with failing(engine, fails_at), pytest.raises(agent.StoreError, match="injected: the server went away"):
        store.save("midway", [*before[:2], agent.Message.user("diverged")])  # a delete, then an insert
    assert backend.store(engine).messages("midway") == before
    assert store.messages("midway") == before
    store.save("midway", [*before, agent.Message.assistant("after")])  # and the store carries on
    assert backend.store(engine).messages("midway") == [*before, agent.Message.assistant("after")]


def test_a_steer_mysql_could_never_deliver_is_refused_and_one_it_can_is_delivered() -> None:
    """A steer is stored as text but delivered as escaped JSON (each "é" six bytes, and PyMySQL escapes
    its backslash again): one of 0.4 x max_allowed_packet was accepted and then failed every save."""
    with connected(MYSQL) as engine:
        store = mysql.Store(engine)
        with engine.connect() as conn:
            packet = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar() or 0)
        with pytest.raises(agent.ArgumentError, match="could never be delivered"):
            store.add_steer("steered", "é" * int(0.4 * packet))
        assert store.max_message_bytes is not None
        fits = "é" * (store.max_message_bytes // 6 - 1000)
        store.add_steer("steered", fits)
        held = store.acquire("steered", agent.Holder("h", 1, "t" * 32, 0.0), 30)
        assert store.save_fenced("steered", held, [agent.Message.user("q")], take_steers=True).steers == [fits]
        assert mysql.Store(engine).messages("steered") == [agent.Message.user("q"), agent.Message.user(fits)]
        big = [agent.Message.user("q"), agent.Message.user(fits), agent.Message.assistant(fits),
               agent.Message.user(fits)]  # together over a packet: the append gives way to the transaction
        store.save_fenced("steered", held, big, take_steers=True)
        assert mysql.Store(engine).messages("steered") == big


def test_the_store_gives_each_pooled_connection_back_as_it_took_it(backend: Backend, engine: Engine) -> None:
    """The store runs its statements on the engine's pooled connections (PostgreSQL's in autocommit for the
    statement) and gives each back as it took it, after a write that waited out a held row lock too: a
    caller's transaction on the same connection is still a transaction (its rollback undoes it)."""
    one = create_engine(backend.url, pool_size=1, max_overflow=0)  # the store and the caller share it
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS given_back (n INTEGER)"))
    try:
        store = backend.store(one, lock_wait=0.2)
        store.save("given-back", [agent.Message.user("hi")])
        with engine.connect() as holder:
            holder.execute(text("SELECT 1 FROM agent_sessions WHERE session_id = 'given-back' FOR UPDATE"))
            with pytest.raises(agent.SessionLocked):
                store.save("given-back", [agent.Message.user("hi"), agent.Message.user("again")])
            holder.rollback()
        for _ in range(2):  # after the refused write, then after one that went through
            with one.connect() as conn:
                conn.execute(text("INSERT INTO given_back (n) VALUES (1)"))
                conn.rollback()
                assert conn.execute(text("SELECT count(*) FROM given_back")).scalar() == 0
            store.save("given-back", [agent.Message.user("hi"), agent.Message.user("again")])
        assert [m.text for m in store.messages("given-back")] == ["hi", "again"]
    finally:
        one.dispose()


def test_a_tracer_listening_for_cursor_events_sees_every_statement_and_changes_no_result(
    backend: Backend, engine: Engine,
) -> None:
    """MySQL's statements run on PyMySQL's cursor; with a listener for SQLAlchemy's cursor events (a tracer,
    OpenTelemetry's SQLAlchemy instrumentation) they go through SQLAlchemy, so it sees every one."""
    traced: list[str] = []

    def trace(conn: object, cursor: object, statement: str, *args: object) -> None:
        traced.append(statement)

    event.listen(engine, "before_cursor_execute", trace)
    try:
        store = backend.store(engine)
        held = store.acquire("traced", agent.Holder("h", 1, "t" * 32, 0.0), 30)
        store.add_steer("traced", "s")
        msgs = [agent.Message.user("q")]
        assert store.save_fenced("traced", held, msgs, take_steers=True).steers == ["s"]
        store.save_fenced("traced", held, [*msgs, agent.Message.user("s"), agent.Message.assistant("a")],
                          take_steers=True)
        store.release("traced", held)
    finally:
        event.remove(engine, "before_cursor_execute", trace)
    assert backend.store(engine).messages("traced") == [*msgs, agent.Message.user("s"), agent.Message.assistant("a")]
    # every write one call of the write function (or procedure), every read one statement
    assert sum(s.startswith(_WRITE_CALL[backend.name]) for s in traced) >= 5


def test_schema_can_be_run_twice_and_metadata_is_public(backend: Backend) -> None:
    """A migration that runs SCHEMA on a database that has the tables (re-run, or its own tool's second
    pass) succeeds: CREATE TABLE and CREATE INDEX IF NOT EXISTS, MySQL's indexes inside the CREATE TABLE."""
    with connected(backend) as engine:  # SCHEMA once, as the caller's migration ran it
        with engine.begin() as conn:
            for statement in [postgres.SCHEMA] if backend is POSTGRES else mysql.SCHEMA:
                conn.exec_driver_sql(statement)
        found = inspect(engine)
        assert {i["name"] for i in found.get_indexes("agent_sessions")} == {"agent_sessions_updated",
                                                                          "agent_sessions_open"}
        assert {i["name"] for i in found.get_indexes("agent_metadata")} == {"agent_metadata_lookup"}
        store = backend.store(engine)
        store.set_metadata("twice", {"k": "v"})
        assert [s.id for s in store.list_sessions(where={"k": "v"})] == ["twice"]
    module = postgres if backend is POSTGRES else mysql
    assert "metadata" in module.__all__
    assert set(module.metadata.tables) == {"agent_store", "agent_sessions", "agent_messages", "agent_steers",
                                           "agent_queue", "agent_keys", "agent_events", "agent_metadata"}
    assert sqlite.metadata is module.metadata and "metadata" in sqlite.__all__


def test_concurrent_set_metadata_never_loses_a_key(backend: Backend, engine: Engine) -> None:
    """Read, merge and write guarded by the version read: 16 threads each adding 2 keys to one new session
    end with all 32 (a merge outside the guard loses the keys of whoever wrote in between), and none runs out
    of attempts (refused writers retrying in step with each other did, before their random pauses)."""
    sid = f"meta-race-{uuid.uuid4().hex[:8]}"
    barrier = threading.Barrier(16, timeout=30)
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        store = backend.store(engine)
        try:
            barrier.wait()
            for j in range(2):
                store.set_metadata(sid, {f"k{i}-{j}": i})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    info = backend.store(engine).info(sid)
    assert info is not None and dict(info.metadata) == {f"k{i}-{j}": i for i in range(16) for j in range(2)}
    assert [s.id for s in backend.store(engine).list_sessions(prefix=sid, where={"k15-1": 15, "k0-0": 0})] == [sid]


def test_a_leased_runs_step_moves_updated_and_one_statement_writes_the_row(backend: Backend, engine: Engine) -> None:
    """Every write of the session writes its row once (``updated``, its counters, ``open_since``): a leased
    run's step too, so a listing by ``updated`` sees a running session move. The save that answers the turn
    clears ``open_since`` (stranded runs) in that one UPDATE."""
    store = backend.store(engine)
    sid = f"step-{uuid.uuid4().hex[:8]}"
    held = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced(sid, held, msgs, take_steers=True)
    before = store.info(sid)
    assert before is not None
    call = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "look", "{}")])
    result = agent.Message(agent.Role.USER, [agent.Content.tool_result("c1", "found")])
    time.sleep(0.01)
    with statements_of(store) as seen:
        store.save_fenced(sid, held, [*msgs, call, result], take_steers=True)  # a step: the turn stays open
    assert _one_write(backend, seen) or len([q for q, _ in seen if q.startswith("UPDATE agent_sessions")]) == 1
    stepped = store.info(sid)
    assert stepped is not None and stepped.updated > before.updated and stepped.open_since == before.open_since
    with statements_of(store) as seen:
        store.save_fenced(sid, held, [*msgs, call, result, agent.Message.assistant("a")], take_steers=True)
    updates = [q for q, _ in seen if q.startswith("UPDATE")]
    assert _one_write(backend, seen) or (len(updates) == 1 and "open_since" in updates[0])
    after = store.info(sid)
    assert after is not None and after.messages == 4
    assert after.open_since is None and before.open_since is not None
    store.release(sid, held)


# -- the event log ---------------------------------------------------------------------------------------


def _one_write(backend: Backend, seen: list[tuple[str, int]]) -> bool:
    """The write was one statement, a call of the schema's function (PostgreSQL) or procedure (MySQL), which
    does all of it."""
    assert [q.split("(")[0] + "(" for q, _ in seen] == [_WRITE_CALL[backend.name]], seen
    return True


def _notes(n: int, tag: str) -> list[str]:
    return [encode("note", {"n": i, "tag": tag}) for i in range(n)]


def _stored(engine: Engine, sid: str) -> tuple[int, int]:
    """The session's rows in agent_messages and agent_events, as the database holds them."""
    with engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(select(func.count()).select_from(t).where(t.c.session_id == sid)).scalar_one()
            for t in (messages, events)
        )


def test_a_save_with_events_writes_both_or_neither(backend: Backend, engine: Engine) -> None:
    store, other = backend.store(engine), backend.store(engine)
    sid = f"ride-{uuid.uuid4().hex[:8]}"
    holder = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
    q = [agent.Message.user("q")]
    store.save_fenced(sid, holder, q, take_steers=False)
    with statements_of(store) as seen:
        store.save_fenced_events(sid, holder, [*q, agent.Message.assistant("a")], take_steers=False,
                                 events=_notes(2, "ride"), keep=100)
    # the usual step stays one statement: the events ride in the save's write
    assert len(seen) == 1 and seen[0][0].startswith(_WRITE_CALL[backend.name]), seen
    assert _stored(engine, sid) == (2, 2)
    # Another writer rewrote the transcript: the save conflicts, and its events are not written either.
    other.save_fenced(sid, holder, [agent.Message.user("other")], take_steers=False, replace=True)
    with pytest.raises(agent.TranscriptConflict):
        store.save_fenced_events(sid, holder, [*q, agent.Message.assistant("a"), agent.Message.assistant("b")],
                                 take_steers=False, events=_notes(1, "conflict"), keep=100)
    assert _stored(engine, sid) == (1, 2)
    # A superseded holder, with the stored transcript known (PostgreSQL tries its one statement first).
    known = store.messages(sid)
    stale = dataclasses.replace(holder, token=uuid.uuid4().hex)
    with pytest.raises(agent.LeaseLost):
        store.save_fenced_events(sid, stale, [*known, agent.Message.assistant("late")], take_steers=False,
                                 events=_notes(1, "late"), keep=100)
    with pytest.raises(agent.LeaseLost):
        store.append_events(sid, stale, _notes(1, "late"), keep=100)
    assert _stored(engine, sid) == (1, 2)
    assert [e.data["tag"] for e in store.events(sid, 0, 100)] == ["ride", "ride"]


def test_the_usual_save_with_events_is_one_transaction_and_the_cap_trims_in_it(backend: Backend,
                                                                              engine: Engine) -> None:
    """The row locked, the messages, the events (one multi-row INSERT), the row, COMMIT; the cap's DELETE only
    once the log holds something to drop; a steer waiting is taken in the save's write, events and all."""
    store = backend.store(engine)
    sid = f"fast-{uuid.uuid4().hex[:8]}"
    holder = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced(sid, holder, msgs, take_steers=False)
    msgs.append(agent.Message.assistant("a1"))
    store.save_fenced_events(sid, holder, msgs, take_steers=True, events=_notes(2, "first"), keep=100)
    msgs.append(agent.Message.assistant("a2"))
    with statements_of(store) as seen:
        store.save_fenced_events(sid, holder, msgs, take_steers=True, events=_notes(2, "second"), keep=100)
    verbs = [q.split(" SET ")[0] if q.startswith("UPDATE") else " ".join(q.split()[:3]) for q, _ in seen]
    assert _one_write(backend, seen) or [v for v in verbs if not v.startswith("SELECT")] == [
        "INSERT INTO agent_messages", "INSERT INTO agent_events", "UPDATE agent_sessions", "COMMIT"], seen
    assert _one_write(backend, seen) or [rows for q, rows in seen if q.startswith("INSERT INTO agent_events")] == [2]
    logged = store.events(sid, 0, 100)
    assert [e.seq for e in logged] == list(range(logged[0].seq, logged[0].seq + 4))
    msgs.append(agent.Message.assistant("a3"))  # the cap: three kept, the oldest dropped in the same write
    with statements_of(store) as seen:
        store.save_fenced_events(sid, holder, msgs, take_steers=True, events=_notes(1, "third"), keep=3)
    assert _one_write(backend, seen) or any(q.startswith("DELETE FROM agent_events") for q, _ in seen)
    assert [e.seq for e in store.events(sid, 0, 100)] == [e.seq for e in logged[2:]] + [logged[-1].seq + 1]
    store.add_steer(sid, "wait")
    msgs.append(agent.Message.assistant("a4"))
    saved = store.save_fenced_events(sid, holder, msgs, take_steers=True, events=_notes(1, "steered"), keep=100)
    assert saved.steers == ["wait"] and store.messages(sid)[-1] == agent.Message.user("wait")
    assert [e.data["tag"] for e in store.events(sid, 0, 100)][-1] == "steered"


def test_the_cap_holds_when_another_store_appended_meanwhile(backend: Backend, engine: Engine) -> None:
    """A store remembers how low a session's log goes, to skip the cap's DELETE; what another process
    appends or drops meanwhile never makes that wrong."""
    mine, theirs = backend.store(engine), backend.store(engine)
    sid = f"floor-{uuid.uuid4().hex[:8]}"
    holder = mine.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
    mine.append_events(sid, holder, _notes(3, "mine"), keep=100)
    last = mine.append_events(sid, holder, _notes(1, "mine"), keep=2)
    assert [e.seq for e in mine.events(sid, 0, 100)] == [last - 1, last]
    theirs.append_events(sid, holder, _notes(5, "theirs"), keep=6)
    last = mine.append_events(sid, holder, _notes(2, "mine again"), keep=4)
    assert [e.seq for e in mine.events(sid, 0, 100)] == list(range(last - 3, last + 1))
    assert _stored(engine, sid) == (0, 4)


def test_delete_and_prune_drop_the_events_rows(backend: Backend, engine: Engine) -> None:
    store = backend.store(engine)
    deleted, pruned = f"del-{uuid.uuid4().hex[:8]}", f"prune-{uuid.uuid4().hex[:8]}"
    for sid in (deleted, pruned):
        held = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
        store.save_fenced_events(sid, held, [agent.Message.user("q")], take_steers=False, events=_notes(3, sid),
                                 keep=100)
        store.append_events(sid, held, _notes(2, sid), keep=100)
        store.release(sid, held)
        assert _stored(engine, sid) == (1, 5)
    assert store.delete(deleted) is True and _stored(engine, deleted) == (0, 0)
    with engine.begin() as conn:  # the oldest idle session of the database, so prune's first pick
        conn.execute(text("UPDATE agent_sessions SET updated = updated - 864000000 WHERE session_id = :sid"),
                     {"sid": pruned.encode() if backend is MYSQL else pruned})
    assert store.prune(idle_for=3600, limit=1) == 1
    assert _stored(engine, pruned) == (0, 0) and store.info(pruned) is None


def test_prune_deletes_a_page_of_the_listing_in_one_transaction(backend: Backend, engine: Engine) -> None:
    """A prune of thousands is a few commits, not one a session: PostgreSQL calls the write function for each
    session of the page in one statement. MySQL calls its procedure a session (stores/mysql/backend.py)."""
    store = backend.store(engine)
    sids = sorted(f"page-{i}-{uuid.uuid4().hex[:8]}" for i in range(5))
    for sid in sids:
        store.save(sid, [agent.Message.user("q")])
        store.set_metadata(sid, {"page": "p"})
    with engine.begin() as conn:  # the oldest idle sessions of the database, so prune's first page
        for sid in sids:
            conn.execute(text("UPDATE agent_sessions SET updated = updated - 864000000 WHERE session_id = :sid"),
                         {"sid": sid.encode() if backend is MYSQL else sid})
    kept = f"kept-{uuid.uuid4().hex[:8]}"
    store.save(kept, [agent.Message.user("fresh")])
    with statements_of(store) as seen:
        assert store.prune(idle_for=3600, limit=5) == 5
    assert all(store.info(sid) is None for sid in sids) and store.info(kept) is not None
    assert not list(store.list_sessions(where={"page": "p"}))
    writes = [q for q, _ in seen if "agent_sessions_write" in q]
    if backend is POSTGRES:
        assert len(writes) == 1 and "unnest" in writes[0], seen
        assert len([q for q, _ in seen if q == "COMMIT"]) <= 2, seen  # the listing's read, the page's delete
    else:
        assert len(writes) == 5, seen


@pytest.mark.parametrize("lands", ["the newest tagged one deleted", "a tagged one saved anew", "a new one tagged"])
def test_a_common_values_page_is_the_filter_whatever_lands_between_its_window_and_its_walk(
        backend: Backend, engine: Engine, monkeypatch: pytest.MonkeyPatch, lands: str) -> None:
    """The listing's walk for a common value reads the window's end, then walks (on PostgreSQL each in a snapshot
    of its own): a write landing between them still leaves a page that is the filter, as before it or after."""
    store = backend.store(engine)
    tag = {"walk": uuid.uuid4().hex[:8]}
    sids = [f"walk-{i:03d}-{uuid.uuid4().hex[:6]}" for i in range(70)]  # common for a page of 2: 30 counted
    for sid in sids:
        store.set_metadata(sid, tag)

    def page() -> list[str]:
        return [i.id for i in store.list_sessions(where=tag, limit=2)]

    def everything() -> list[str]:
        return [i.id for i in store.list_sessions(where=tag, limit=lifecycle.MAX_PAGE)][:2]

    before, real, walked = everything(), type(store.backend)._listing, []

    def listing(self: Any, query: Any, walk: bool = False, end: Any = None) -> Any:
        if walk and not walked:
            walked.append(end)
            if lands == "the newest tagged one deleted":
                store.delete(before[0])
            elif lands == "a tagged one saved anew":
                store.set_metadata(sids[0], {"touched": True})
            else:
                store.set_metadata(f"walk-new-{uuid.uuid4().hex[:6]}", tag)
        return real(self, query, walk, end)

    monkeypatch.setattr(type(store.backend), "_listing", listing)
    got = page()
    monkeypatch.undo()
    assert walked, "the page did not walk"
    assert got in (before, everything()), (lands, got, before, everything())


def test_prune_waits_lock_wait_for_a_row_another_transaction_holds(backend: Backend, engine: Engine) -> None:
    """As a write does, then ``SessionLocked``, not the server's own lock timeout (MySQL's: 50 s)."""
    store = backend.store(engine, lock_wait=1)
    sid = f"held-{uuid.uuid4().hex[:8]}"
    store.save(sid, [agent.Message.user("q")])
    key = sid.encode() if backend is MYSQL else sid
    with engine.begin() as conn:  # the oldest idle session of the database, so prune's first pick
        conn.execute(text("UPDATE agent_sessions SET updated = updated - 864000000 WHERE session_id = :sid"),
                     {"sid": key})
    with engine.connect() as holder:
        holder.execute(text("SELECT 1 FROM agent_sessions WHERE session_id = :sid FOR UPDATE"), {"sid": key})
        began = time.monotonic()
        with pytest.raises(agent.SessionLocked):
            store.prune(idle_for=3600, limit=1)
        assert time.monotonic() - began < 10
        holder.rollback()
    assert store.prune(idle_for=3600, limit=1) == 1 and store.info(sid) is None


WRITER = """
import sys
import agent_sessions as agent
from agent_sessions.eventlog import encode
from tests import servers

store = servers.postgres_store(sys.argv[1])
holder = agent.Holder("writer", 2, sys.argv[3], 0.0, epoch=int(sys.argv[4]))
print("ready", flush=True)
for line in sys.stdin:
    store.append_events(sys.argv[2], holder, [encode("note", {"line": line.strip()})], keep=100)
    print("written", flush=True)
"""


def test_postgres_followers_wake_on_a_write_from_another_process(engine: Engine) -> None:
    """``wait_for_events`` returns when another process appends (LISTEN/NOTIFY), not at its timeout; with
    nothing appended it returns False at the timeout; ``close`` stops the listening thread."""
    if engine.dialect.name != "postgresql":
        pytest.skip("LISTEN/NOTIFY: PostgreSQL only")
    store = postgres.Store(engine)
    sid = f"wake-{uuid.uuid4().hex[:8]}"
    holder = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 120)
    last = store.append_events(sid, holder, _notes(1, "first"), keep=100)
    started = time.monotonic()
    assert store.wait_for_events(sid, last, 0.3) is False
    assert 0.25 < time.monotonic() - started < 5
    assert store.wait_for_events(sid, last - 1, 5) is True  # one is there already: at once
    root = Path(__file__).resolve().parent.parent
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, engine.url.render_as_string(hide_password=False), sid, holder.token,
         str(holder.epoch)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        assert writer.stdout.readline().strip() == "ready"
        delays = []
        def wait(after: int, woke: list[float]) -> None:
            woke.append(time.monotonic() if store.wait_for_events(sid, after, 10) else math.inf)

        for round_ in range(5):
            woke: list[float] = []
            waiter = threading.Thread(target=wait, args=(last, woke))
            waiter.start()
            time.sleep(0.2)  # waiting (not finding the event already there) when the other process writes
            sent = time.monotonic()
            writer.stdin.write(f"{round_}\n")
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "written"
            waiter.join(15)
            delays.append(woke[0] - sent)
            got = store.events(sid, last, 100)
            assert [e.data["line"] for e in got] == [str(round_)]
            last = got[-1].seq
        assert max(delays) < 0.5, f"woken after {delays} s"
        assert statistics.median(delays) < 0.25, f"woken after {delays} s"
    finally:
        writer.stdin.close()
        writer.wait(30)
    thread = store._followers._thread
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive()
    assert store.wait_for_events(sid, 0, 1) is True  # a closed store listens again when asked
    store.close()
    dropped = postgres.Store(engine)
    assert dropped.wait_for_events(sid, 0, 1) is True
    thread = dropped._followers._thread
    del dropped  # never closed: collected all the same, and its thread stops
    gc.collect()
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive()


RACER = """
import sys, threading, uuid
import agent_sessions as agent
from sqlalchemy import insert
from stores._sql.tables import messages
from tests import servers

kind, url = sys.argv[1], sys.argv[2]
make = servers.postgres_store if kind == "postgres" else servers.mysql_store
stores = [make(url) for _ in range(4)]  # each with its own pool of 2: connections are reused at once
errors = []

def race(work):
    barrier = threading.Barrier(len(stores))
    def run(i):
        try:
            barrier.wait(30)
            work(i, stores[i])
        except agent.LeaseLost:
            pass
        except Exception as exc:
            errors.append(repr(exc))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

for _ in range(20):
    sid = "racer-" + uuid.uuid4().hex
    race(lambda i, store: store.save(sid, [agent.Message.user(f"{i}-{j}") for j in range(3)]))
    fenced = "racer-fenced-" + uuid.uuid4().hex
    def fenced_first(i, store):
        held = store.acquire(fenced, agent.Holder("racer", i, uuid.uuid4().hex, 0.0), 0.05)
        store.save_fenced(fenced, held, [agent.Message.user(f"{i}-{j}") for j in range(3)], take_steers=True,
                          replace=True)
    race(fenced_first)
# A batch whose first row fails while the rest are being sent (psycopg's executemany pipeline). PostgreSQL's
# store sends no batch: its writes are one call of the schema's function each.
store = stores[0]
sid = "racer-batch-" + uuid.uuid4().hex
store.save(sid, [agent.Message.user("kept")])
rows = [{"session_id": sid, "idx": i, "body": "{}"} for i in range(500)]
try:
    if kind != "postgres":
        store.backend._run("save", sid, lambda conn: conn.execute(insert(messages), rows))
        errors.append("the duplicate batch was stored")
except agent.StoreError:
    pass
for n in range(10):  # the pool's connections, the failed one among them, still work
    store.save(sid, [agent.Message.user("kept"), *[agent.Message.user(str(k)) for k in range(n)]])
assert store.messages(sid)[-1] == agent.Message.user("8")
print("errors", len(errors), errors[:3], flush=True)
"""


def test_racing_first_saves_and_a_failed_batch_leave_a_clean_exit(backend: Backend, engine: Engine) -> None:
    """Concurrent first saves (plain and fenced) of new sessions, and a batch insert that fails on its first
    row, in a child process: no save fails, and nothing is left for psycopg to report at exit (before,
    each failed executemany logged "error ignored terminating <psycopg.Pipeline [INERROR]>")."""
    root = Path(__file__).resolve().parent.parent
    child = subprocess.run(
        [sys.executable, "-c", RACER, backend.name, engine.url.render_as_string(hide_password=False)],
        capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "errors 0 []", child.stdout
    assert "error ignored" not in child.stderr and "Traceback" not in child.stderr, child.stderr
