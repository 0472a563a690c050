from __future__ import annotations

import functools
import gc
import json
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event

import agent_sessions as agent
import storetest
from stores import sqlite
sql_lifecycle: Any = None  # TODO
from storetest.scripted import ToolsThenAnswer
from tests.sql_helpers import failing, statements_of


class TestSQLiteStoreKeepsTheContract(storetest.StoreContract):
    @pytest.fixture(autouse=True)
    def _file(self, tmp_path: Path) -> Iterator[None]:
        self.path = tmp_path / "sessions.db"
        self.opened: list[sqlite.Store] = []
        yield
        for store in self.opened:
            store.close()

    def make_store(self) -> sqlite.Store:
        store = sqlite.open(self.path)
        self.opened.append(store)
        return store

    def process_factory(self) -> functools.partial[sqlite.Store]:
        return functools.partial(sqlite.open, str(self.path))


def test_an_appending_save_writes_only_the_new_messages(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "s.db")
    msgs = [agent.Message.user(f"m{i}") for i in range(100)]
    store.save("s", msgs)
    with statements_of(store) as seen:
        store.save("s", [*msgs, agent.Message.user("new")])
    # Seen by SQLite itself, on the path production takes: the one INSERT, in autocommit (no BEGIN/COMMIT).
    assert len(seen) == 1 and seen[0][0].startswith("INSERT INTO agent_messages")
    assert store.messages("s")[-1].text == "new"
    # A save that answers the turn also clears the session's open_since (stranded runs): a second statement
    # of the same transaction.
    with statements_of(store) as seen:
        store.save("s", [*msgs, agent.Message.user("new"), agent.Message.assistant("done")])
    assert [s[0].split()[0] for s in seen if s[0].split()[0] in ("INSERT", "UPDATE")] == ["INSERT", "UPDATE"]
    assert store.info("s").open_since is None  # type: ignore[union-attr]


def test_a_runs_step_is_the_one_insert_and_one_that_fails_forgets_the_session(tmp_path: Path) -> None:
    """The usual step of a leased run (``Store._step``): one INSERT, in autocommit; when it fails, the store
    forgets what it knew of the session, and the next save, the general way, stores the right transcript."""
    store = sqlite.open(tmp_path / "s.db")
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced("s", held, msgs, take_steers=True)
    msgs += [agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "grep", "{}")]),
             agent.Message(agent.Role.USER, [agent.Content.tool_result("c1", "found")])]
    with statements_of(store) as seen:
        assert store.save_fenced("s", held, msgs, take_steers=True) == agent.Saved([], False)
    assert len(seen) == 1 and seen[0][0].startswith("INSERT INTO agent_messages")
    store._limit = 100  # as if SQLite kept no longer strings: a longer message is refused before the write
    with pytest.raises(agent.ArgumentError, match=r"messages\[3\] is 2\d\d bytes as stored .* at most 100 bytes"):
        store.save_fenced("s", held, [*msgs, agent.Message.user("x" * 200)], take_steers=True)
    store._limit = None
    assert sqlite.open(tmp_path / "s.db").messages("s") == msgs
    with failing(store.engine, "INSERT INTO agent_messages"), pytest.raises(agent.StoreError):
        store.save_fenced("s", held, [*msgs, agent.Message.user("lost")], take_steers=True)
    assert store._known.get("s") is None
    msgs.append(agent.Message.user("q2"))
    store.save_fenced("s", held, msgs, take_steers=True)
    assert sqlite.open(tmp_path / "s.db").messages("s") == msgs


def test_a_tracer_listening_for_cursor_events_sees_every_statement_and_changes_no_result(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "traced.db")
    traced: list[str] = []

    def trace(conn: object, cursor: object, statement: str, *args: object) -> None:
        traced.append(statement)

    event.listen(store.engine, "before_cursor_execute", trace)
    held = store.acquire("traced", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    store.add_steer("traced", "s")
    msgs = [agent.Message.user("q")]
    assert store.save_fenced("traced", held, msgs, take_steers=True).steers == ["s"]
    store.save_fenced("traced", held, [*msgs, agent.Message.user("s"), agent.Message.assistant("a")],
                      take_steers=True)
    event.remove(store.engine, "before_cursor_execute", trace)
    assert sqlite.open(tmp_path / "traced.db").messages("traced")[-1] == agent.Message.assistant("a")
    assert [s for s in traced if s.startswith("INSERT INTO agent_messages")]
    assert [s for s in traced if "agent_steers" in s]


def test_open_refuses_memory_and_creates_tables_once_per_file(tmp_path: Path) -> None:
    with pytest.raises(agent.ArgumentError, match="stores.memory"):
        sqlite.open(":memory:")
    a, b = sqlite.open(tmp_path / "x.db"), sqlite.open(tmp_path / "x.db")
    a.save("s", [agent.Message.user("kept")])
    assert b.messages("s") == [agent.Message.user("kept")]
    with a.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_dropped_table_is_a_store_error_naming_it(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "y.db")
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE agent_steers")
    with pytest.raises(agent.StoreError, match="table 'agent_steers' does not exist"):
        store.take_steers("s")


def test_a_save_that_fails_midway_leaves_the_previous_transcript(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "m.db")
    before = [agent.Message.user(f"m{i}") for i in range(5)]
    store.save("s", before)
    with failing(store.engine, "INSERT INTO agent_messages"), pytest.raises(agent.StoreError, match="injected"):
        store.save("s", [*before[:2], agent.Message.user("diverged")])
    assert sqlite.open(tmp_path / "m.db").messages("s") == before


def _open_files(path: Path) -> int:
    """File descriptors of this process open on ``path`` (the database file itself)."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            if fds.joinpath(fd.name).resolve() == path.resolve():
                count += 1
        except OSError:
            continue
    return count


def test_64_concurrent_runs_on_one_store_all_finish_and_close_closes_every_connection(tmp_path: Path) -> None:
    """Each run is a thread with a heartbeat thread of its own: 128 threads on one store. A bounded pool
    made the 16th wait 30 s and fail."""
    path = tmp_path / "threads.db"
    store = sqlite.open(path)
    entered = threading.Barrier(65)

    @agent.tool
    def meet(n: int) -> str:
        """Wait until every run is inside its tool, so all 64 hold the store at once."""
        entered.wait(60)
        return "met"

    runs = [agent.Runner().start(agent.Spec(session=agent.open(f"t{i}", store), tools=[meet]),
                                 [agent.Message.user("go")], ToolsThenAnswer(["meet"])) for i in range(64)]
    entered.wait(60)
    results = [run.wait(120) for run in runs]
    assert [r.stop_reason for r in results] == ["answered"] * 64
    assert all(store.messages(f"t{i}") == results[i].messages for i in range(64))
    assert _open_files(path) >= 64  # each run's thread opened its own
    store.close()
    assert _open_files(path) == 0


def test_making_stores_does_not_grow_the_process(tmp_path: Path) -> None:
    """One at-fork handler for all stores: a handler per store could never be removed."""
    path = tmp_path / "many.db"
    sqlite.open(path).close()
    engine = sqlite.open(path).engine

    def make(n: int) -> None:
        for _ in range(n):
            sqlite.Store(engine)

    make(50)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    make(2000)
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 100_000, f"2,000 stores made and dropped left {grown} bytes behind"


def test_what_a_store_remembers_of_transcripts_is_bounded_by_bytes(tmp_path: Path) -> None:
    """Each store object keeps the transcripts it last saved (for appends): 300 one-megabyte transcripts
    saved and dropped once left 574 MB alive."""
    store = sqlite.open(tmp_path / "big.db", remember_bytes=8 * 2**20)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(40):
        store.save(f"big-{i}", [agent.Message.user("x" * 2**20)])
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 3 * 8 * 2**20, f"40 MB of transcripts saved and dropped left {grown / 2**20:.0f} MB alive"
    assert store._known.bytes <= 8 * 2**20
    assert store.messages("big-39")[0].text == "x" * 2**20 and store.messages("big-0")[0].text == "x" * 2**20
    store.close()


def test_concurrent_set_metadata_never_loses_a_key(tmp_path: Path) -> None:
    """8 threads, each with a store of its own on the file, adding 4 keys each to one new session."""
    path = tmp_path / "meta.db"
    sqlite.open(path).close()
    barrier = threading.Barrier(8, timeout=30)
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        store = sqlite.open(path)
        try:
            barrier.wait()
            for j in range(4):
                store.set_metadata("s", {f"k{i}-{j}": i})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            store.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    store = sqlite.open(path)
    info = store.info("s")
    assert info is not None and dict(info.metadata) == {f"k{i}-{j}": i for i in range(8) for j in range(4)}
    store.close()


def test_prune_deletes_in_batches_each_its_own_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sql_lifecycle, "PRUNE_BATCH", 3)
    store = sqlite.open(tmp_path / "prune.db")
    for i in range(10):
        store.save(f"s{i}", [agent.Message.user(f"m{i}")])
        store.set_metadata(f"s{i}", {"user": "u"})
        store.add_steer(f"s{i}", "stale")
    assert store.prune(idle_for=0, limit=4) == 4  # batches of 3, then 1
    with statements_of(store) as seen:
        assert store.prune(idle_for=0) == 6
    assert len([q for q, _ in seen if q.startswith("DELETE FROM agent_sessions")]) == 2
    assert len([q for q, _ in seen if q == "BEGIN IMMEDIATE"]) == 2  # the reads take no write lock
    assert list(store.list_sessions()) == [] and list(store.list_sessions(where={"user": "u"})) == []
    with store.engine.connect() as conn:
        for table in ("agent_messages", "agent_steers", "agent_session_tags", "agent_sessions"):
            assert conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar() == 0, table
    store.close()


def test_a_prefix_is_case_sensitive_and_literal(tmp_path: Path) -> None:
    """SQLite's LIKE ignores ASCII case, so the prefix is compared, not matched."""
    store = sqlite.open(tmp_path / "prefix.db")
    for sid in ("Abc", "abc", "ab%", "a_c", "b"):
        store.save(sid, [agent.Message.user(sid)])
    assert sorted(s.id for s in store.list_sessions(prefix="a")) == ["a_c", "ab%", "abc"]
    assert [s.id for s in store.list_sessions(prefix="A")] == ["Abc"]
    assert [s.id for s in store.list_sessions(prefix="ab%")] == ["ab%"]
    assert [s.id for s in store.list_sessions(prefix="a_")] == ["a_c"]
    store.close()


def _stored(store: sqlite.Store, sid: str) -> tuple[int, int]:
    """The session's messages and events, as the file holds them: a row of agent_messages each; a row of
    agent_events each, or all of a write's in one (a batch: its body a U+001E before each event's text)."""
    with store.engine.connect() as conn:
        messages = conn.exec_driver_sql("SELECT count(*) FROM agent_messages WHERE session_id = ?", (sid,)).scalar()
        events = conn.exec_driver_sql(
            "SELECT coalesce(sum(CASE WHEN substr(body, 1, 1) = char(30) "
            "THEN length(body) - length(replace(body, char(30), '')) ELSE 1 END), 0) "
            "FROM agent_events WHERE session_id = ?", (sid,)).scalar()
    return int(messages or 0), int(events or 0)  # type: ignore[call-overload]


def test_a_save_with_events_is_one_transaction_writing_both_or_neither(tmp_path: Path) -> None:
    store, other = sqlite.open(tmp_path / "ride.db"), sqlite.open(tmp_path / "ride.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    q = [agent.Message.user("q")]
    store.save_fenced("s", holder, q, take_steers=False)
    note = [agent.eventlog.encode("note", {"n": 1})]
    with statements_of(store) as seen:
        store.save_fenced_events("s", holder, [*q, agent.Message.assistant("a")], take_steers=False, events=note,
                                 keep=100)
    assert [s for s, _ in seen if s in ("BEGIN IMMEDIATE", "COMMIT")] == ["BEGIN IMMEDIATE", "COMMIT"]
    assert _stored(store, "s") == (2, 1)
    other.save_fenced("s", holder, [agent.Message.user("other")], take_steers=False, replace=True)
    with pytest.raises(agent.TranscriptConflict):
        store.save_fenced_events("s", holder, [*q, agent.Message.assistant("a"), agent.Message.assistant("b")],
                                 take_steers=False, events=note, keep=100)
    assert _stored(store, "s") == (1, 1)
    store.close()
    other.close()


def test_the_usual_save_with_events_is_one_transaction_that_never_writes_the_session_row(tmp_path: Path) -> None:
    """BEGIN IMMEDIATE, the guarded read of the event numbers from the log (SQLite has one writer at a time:
    no other takes them before COMMIT), the messages, the events, COMMIT: no write of the session row, no cap
    DELETE while the log holds fewer than ``keep``."""
    store = sqlite.open(tmp_path / "fast.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced("s", holder, msgs, take_steers=False)
    notes = [agent.eventlog.encode("note", {"n": n}) for n in range(3)]
    msgs.append(agent.Message.assistant("a1"))
    store.save_fenced_events("s", holder, msgs, take_steers=True, events=notes[:1], keep=100)
    msgs.append(agent.Message.assistant("a2"))
    with statements_of(store) as seen:
        last = store.save_fenced_events("s", holder, msgs, take_steers=True, events=notes, keep=100)
    verbs = [" ".join(q.split()[:3]) for q, _ in seen]
    assert verbs == ["BEGIN IMMEDIATE", "SELECT coalesce((SELECT max(agent_events.seq)", "INSERT INTO agent_messages",
                     "INSERT INTO agent_events", "COMMIT"]  # the three events in one row
    assert last == agent.Saved([], False) and not any("agent_sessions SET" in q for q, _ in seen)
    seqs = [e.seq for e in store.events("s", 0, 100)]
    assert seqs == list(range(seqs[0], seqs[0] + 4))
    assert _stored(store, "s") == (3, 4)
    # A superseded holder: the claim matches nothing, the transaction finds the lease gone, nothing written.
    stale = agent.Holder("h", 1, "u" * 32, 0.0, epoch=holder.epoch)
    with pytest.raises(agent.LeaseLost):
        store.save_fenced_events("s", stale, [*msgs, agent.Message.assistant("late")], take_steers=True,
                                 events=notes, keep=100)
    assert _stored(store, "s") == (3, 4)
    store.close()


def test_the_usual_save_with_events_keeps_the_newest_under_the_cap_and_numbers_on_across_store_objects(
    tmp_path: Path,
) -> None:
    """The usual step's events, read-numbered from the log: with a cap, the log keeps exactly the newest
    ``keep``, its numbers consecutive; a second store object (which knows no floor: it reads the numbers first) and the
    first again go on from the newest, and a log numbered by an earlier version on the session row
    (``event_seq``, no event left) goes on after that number."""
    path = tmp_path / "cap.db"
    store, other = sqlite.open(path), sqlite.open(path)
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced("s", holder, msgs, take_steers=False)
    written = 0
    for step in range(6):
        for writer in (store, other, store):
            msgs.append(agent.Message.assistant(f"a{step}"))
            notes = [agent.eventlog.encode("note", {"n": written + k}) for k in range(3)]
            writer.save_fenced_events("s", holder, msgs, take_steers=True, events=notes, keep=7)
            written += 3
            kept = store.events("s", 0, 100)
            assert [e.data["n"] for e in kept] == list(range(max(0, written - 7), written))
            assert [e.seq for e in kept] == list(range(kept[0].seq, kept[0].seq + len(kept)))
    assert store.messages("s") == msgs
    newest = store.events("s", 0, 100)[-1].seq
    with store.engine.begin() as conn:  # as a log an earlier version numbered on the row, its events gone
        conn.exec_driver_sql("DELETE FROM agent_events WHERE session_id = 's'")
        conn.exec_driver_sql(f"UPDATE agent_sessions SET event_seq = {newest + 50} WHERE session_id = 's'")
    for writer in (other, store):
        msgs.append(agent.Message.assistant("after"))
        writer.save_fenced_events("s", holder, msgs, take_steers=True, events=[agent.eventlog.encode("x", {})],
                                  keep=7)
    assert [e.seq for e in store.events("s", 0, 100)] == [newest + 51, newest + 52]
    store.close()
    other.close()


def test_delete_and_prune_drop_the_events_rows(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "drop.db")
    for sid in ("deleted", "pruned"):
        held = store.acquire(sid, agent.Holder("h", 1, "t" * 32, 0.0), 30)
        store.save_fenced_events(sid, held, [agent.Message.user("q")], take_steers=False,
                                 events=[agent.eventlog.encode("note", {})] * 3, keep=100)
        store.release(sid, held)
        assert _stored(store, sid) == (1, 3)
    assert store.delete("deleted") is True and _stored(store, "deleted") == (0, 0)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE agent_sessions SET updated = updated - 7200 WHERE session_id = 'pruned'")
    assert store.prune(idle_for=3600) == 1 and _stored(store, "pruned") == (0, 0)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM agent_events").scalar() == 0
    store.close()


def test_a_log_begun_again_within_the_same_millisecond_numbers_above_the_deleted_one(tmp_path: Path) -> None:
    """SQLite's own clock (``julianday('now')``) counts milliseconds: a session deleted and made again within
    one began its new log at its old log's first number: one number named two events, and a follower
    holding a number of the old log skipped the new one's first events. The store reads the host's clock
    to the microsecond instead. Without fsyncs
    (``synchronous=OFF``) a delete and a new log's first write take a fraction of a millisecond, so the
    millisecond clock gave numbers again in most of these rounds."""
    store = sqlite.open(tmp_path / "again.db", synchronous="OFF")
    texts = [agent.eventlog.encode("note", {"n": n}) for n in range(5)]
    reused = []
    for i in range(100):
        held = store.acquire("s", agent.Holder("h", 1, f"{i:032d}", 0.0), 30)
        old = store.append_events("s", held, texts, keep=100)
        store.delete("s", force=True)
        again = store.acquire("s", agent.Holder("h", 1, f"{i:031d}x", 0.0), 30)
        new = store.append_events("s", again, texts[:1], keep=100)
        store.delete("s", force=True)
        if new <= old:
            reused.append((old, new))
    assert not reused, f"{len(reused)} of 100 new logs numbered within their deleted one's numbers: {reused[:3]}"
    store.close()


def test_a_step_whose_events_fail_to_insert_writes_nothing_and_raises_a_store_error(tmp_path: Path) -> None:
    """The usual step with events runs on the driver in its own transaction: a database error in it (here the
    events' INSERT, failed by a trigger) rolls back the messages too and is a StoreError, and the store goes
    on: the next step writes both, numbered on from the log."""
    store = sqlite.open(tmp_path / "fails.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced_events("s", holder, msgs, take_steers=False, events=[agent.eventlog.encode("a", {})], keep=100)
    msgs.append(agent.Message.assistant("a"))
    note = [agent.eventlog.encode("b", {})] * 2
    with failing(store.engine, "INSERT INTO agent_events"), pytest.raises(agent.StoreError, match="injected"):
        store.save_fenced_events("s", holder, msgs, take_steers=False, events=note, keep=100)
    assert _stored(store, "s") == (1, 1)
    store.save_fenced_events("s", holder, msgs, take_steers=False, events=note, keep=100)
    assert _stored(store, "s") == (2, 3)
    seqs = [e.seq for e in store.events("s", 0, 100)]
    assert seqs == list(range(seqs[0], seqs[0] + 3))
    store.close()


def test_a_usual_step_that_goes_the_general_way_saves_a_transcript_given_as_an_iterator(tmp_path: Path) -> None:
    """The usual step (``_step``, ``_step_logged``) reads the transcript given; when it then leaves the save to
    the general path (a cancel, a journal, the turn closed), that path must see the same messages, not an
    iterator the first read emptied (it raised TranscriptConflict, as if the transcript had been cut)."""
    store = sqlite.open(tmp_path / "iter.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced("s", holder, msgs, take_steers=False)
    store.cancel("s")
    msgs.append(agent.Message.user("more"))
    saved = store.save_fenced_events("s", holder, (m for m in msgs),  # type: ignore[arg-type]
                                     take_steers=False, events=[agent.eventlog.encode("n", {})], keep=5)
    assert saved == agent.Saved([], True)
    msgs.append(agent.Message.assistant("a"))  # the turn closes: the general way too
    assert store.save_fenced("s", holder, iter(msgs), take_steers=False) == agent.Saved(  # type: ignore[arg-type]
        [], True)
    assert sqlite.open(tmp_path / "iter.db").messages("s") == msgs
    assert _stored(store, "s") == (3, 1)
    store.close()


@pytest.mark.parametrize("session", [5, "", "x" * 1000, None])
def test_a_save_with_bad_events_and_a_bad_session_id_names_the_session_id_first(
    tmp_path: Path, session: object,
) -> None:
    """As every SQL store's save_fenced_events checks them: the session id before the events."""
    store = sqlite.open(tmp_path / "order.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    for events in ([1], "not a list"):
        with pytest.raises(agent.ArgumentError, match="session id"):
            store.save_fenced_events(session, holder, [agent.Message.user("q")],  # type: ignore[arg-type]
                                     take_steers=False, events=events, keep=5)  # type: ignore[arg-type]
    store.close()


# -- the event log's batches: a write's events in one row ---------------------------------------------------

def _legacy_rows(store: sqlite.Store, sid: str, texts: list[str]) -> None:
    """Events as a store of the previous version wrote them, a row each, numbered on from the log (or the
    clock), as its append did."""
    with store.engine.begin() as conn:
        newest = conn.exec_driver_sql("SELECT max(seq) FROM agent_events WHERE session_id = ?", (sid,)).scalar()
        first = int(newest) + 1 if newest is not None else agent.eventlog.first_seq(time.time())
        for i, text in enumerate(texts):
            conn.exec_driver_sql("INSERT INTO agent_events (session_id, seq, body) VALUES (?, ?, ?)",
                                 (sid, first + i, text))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    writes=st.lists(st.tuples(st.integers(1, 7), st.sampled_from(["save", "append", "legacy", "other"])),
                    min_size=1, max_size=14),
    keep=st.integers(1, 12),
    reads=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), max_size=4),
)
def test_a_batched_log_reads_as_a_log_of_a_row_per_event_would(
    tmp_path: Path, writes: list[tuple[int, str]], keep: int, reads: list[tuple[int, int]],
) -> None:
    """Whatever mix of writes (the usual step's one transaction, an append, a second store object that knows
    no floor, rows a previous version wrote one per event), the log reads as the model of it: exactly the
    newest ``keep`` events, numbered consecutively, each text byte for byte; any ``after`` and ``limit``
    (inside a batch too) read the model's slice; the cap's cuts inside a batch keep the rest of it."""
    path = tmp_path / f"batches-{uuid.uuid4().hex}.db"
    store, other = sqlite.open(path), sqlite.open(path)
    try:
        holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
        msgs = [agent.Message.user("q")]
        store.save_fenced("s", holder, msgs, take_steers=False)
        model: list[str] = []  # every text written, oldest first
        for w, (n, how) in enumerate(writes):
            texts = [agent.eventlog.encode("note", {"w": w, "i": i, "odd": '"\\\n\u00e9\U0001f600'}) for i in range(n)]
            if how == "save":
                msgs = [*msgs, agent.Message.assistant(f"a{w}")]
                store.save_fenced_events("s", holder, msgs, take_steers=False, events=texts, keep=keep)
            elif how == "append":
                store.append_events("s", holder, texts, keep=keep)
            elif how == "other":
                other.append_events("s", holder, texts, keep=keep)
            else:
                _legacy_rows(store, "s", texts)
            model += texts
            if how == "legacy":  # the previous version's append kept its cap as it went; this one added rows only
                continue
            got = store.events("s", 0, 1000)
            seqs = [e.seq for e in got]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
            assert [e.data for e in got] == [json.loads(t)["data"] for t in model[-keep:]], (w, how)
        every = store.events("s", 0, 1000)
        assert _stored(store, "s")[1] == len(every)
        for after_step, limit in reads:
            after = every[0].seq - 1 + after_step if every else after_step
            assert store.events("s", after, limit) == [e for e in every if e.seq > after][:limit]
    finally:
        store.close()
        other.close()


def test_the_cap_cuts_inside_a_batch_and_keeps_the_rest_byte_for_byte(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "cut.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    texts = [agent.eventlog.encode("note", {"n": n, "text": f'{n} "é" \\ \x00'}) for n in range(10)]
    last = store.append_events("s", holder, texts[:5], keep=100)  # one row of five
    assert _stored(store, "s") == (0, 5)
    store.append_events("s", holder, texts[5:7], keep=4)  # the cut falls inside the first batch: 7 - 4 = 3 go
    got = store.events("s", 0, 100)
    assert [e.seq for e in got] == list(range(last - 1, last + 3))
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT seq, body FROM agent_events WHERE session_id = 's' ORDER BY seq").all()
    assert rows == [(last, "\x1e" + "\x1e".join(texts[3:5])), (last + 2, "\x1e" + "\x1e".join(texts[5:7]))]
    store.append_events("s", holder, texts[7:8], keep=2)  # cut again inside a batch: one event left in it, alone
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT seq, body FROM agent_events WHERE session_id = 's' ORDER BY seq").all()
    assert rows == [(last + 2, texts[6]), (last + 3, texts[7])]
    assert [agent.eventlog.decode(e.seq, t).data for e, t in zip(store.events("s", 0, 100), texts[6:8], strict=True)]
    store.close()


@pytest.mark.parametrize("where", ["append", "save"])
def test_an_event_text_holding_the_batch_separator_is_refused_before_anything_is_written(
    tmp_path: Path, where: str,
) -> None:
    store = sqlite.open(tmp_path / "sep.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    store.save_fenced("s", holder, [agent.Message.user("q")], take_steers=False)
    bad = [agent.eventlog.encode("note", {}), '{"kind":"note","at":1.0,"data":{}}\x1e']
    with pytest.raises(agent.ArgumentError, match=r"events\[1\] holds a raw U\+001E"):
        if where == "append":
            store.append_events("s", holder, bad, keep=100)
        else:
            store.save_fenced_events("s", holder, [agent.Message.user("q"), agent.Message.assistant("a")],
                                     take_steers=False, events=bad, keep=100)
    assert _stored(store, "s") == (1, 0)
    store.close()


def test_a_write_of_many_events_is_rows_of_at_most_batch_max_and_a_cut_rewrites_one(tmp_path: Path) -> None:
    """A write of more events than a row holds (``BATCH_MAX``) is several batches; the cap cutting inside
    the oldest rewrites that one row, and every event reads back in order, byte for byte."""
    from stores._sql.events import BATCH_MAX

    store = sqlite.open(tmp_path / "many.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    texts = [agent.eventlog.encode("note", {"n": n}) for n in range(2 * BATCH_MAX + 3)]
    last = store.append_events("s", holder, texts, keep=10_000)
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT seq, body FROM agent_events WHERE session_id = 's' ORDER BY seq").all()
    assert [seq for seq, _ in rows] == [last - BATCH_MAX - 3, last - 3, last]
    assert [body.count("\x1e") for _, body in rows] == [BATCH_MAX, BATCH_MAX, 3]
    assert [e.seq for e in store.events("s", 0, 1000)] == list(range(last - len(texts) + 1, last + 1))
    store.append_events("s", holder, texts[:1], keep=len(texts) - 5)  # cuts 6 from the first batch
    got = store.events("s", 0, 1000)
    assert len(got) == len(texts) - 5 and [e.data for e in got] == [
        json.loads(t)["data"] for t in [*texts, texts[0]][6:]]
    assert store.events("s", got[0].seq, 1) == [got[1]]
    with store.engine.connect() as conn:
        first = conn.exec_driver_sql("SELECT body FROM agent_events WHERE session_id = 's' ORDER BY seq").first()
    assert first is not None and first[0] == "\x1e" + "\x1e".join(texts[6:BATCH_MAX])
    store.close()


def test_a_step_with_events_after_another_process_force_deleted_the_session_writes_nothing(tmp_path: Path) -> None:
    """The usual step's transcript is this object's memory, read before the write: a forced delete by
    another store object landing between leaves the step's guarded read matching no row, so nothing is
    written, not the messages, not the events, not the session row again, and the save says why."""
    path = tmp_path / "deleted.db"
    store, other = sqlite.open(path), sqlite.open(path)
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced_events("s", holder, msgs, take_steers=True, events=[agent.eventlog.encode("a", {})], keep=100)
    assert other.delete("s", force=True) is True
    with pytest.raises((agent.LeaseLost, agent.TranscriptDeleted)):
        store.save_fenced_events("s", holder, [*msgs, agent.Message.assistant("late")], take_steers=True,
                                 events=[agent.eventlog.encode("b", {})] * 3, keep=100)
    assert _stored(store, "s") == (0, 0) and other.holder("s") is None
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM agent_sessions WHERE session_id = 's'").scalar() == 0
    store.close()
    other.close()


@pytest.mark.parametrize("take", [False, True])
def test_the_usual_step_past_batch_max_and_at_the_cap_stores_rows_of_at_most_batch_max(
    tmp_path: Path, take: bool
) -> None:
    """The usual step with events writes a row of at most ``BATCH_MAX`` events itself; more, or a write the
    cap cuts, go through ``_log_events``: every event reads back, in order, numbered consecutively, and no
    row holds more than a batch. (Checked against the code before the step wrote its row itself by a
    differential run: identical bytes at every step.)"""
    from stores._sql.events import BATCH_MAX

    store = sqlite.open(tmp_path / "step.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced("s", holder, msgs, take_steers=take)
    written: list[str] = []
    for step, (n, keep) in enumerate([(1, 1000), (BATCH_MAX, 1000), (BATCH_MAX + 1, 1000), (3, 1000),
                                      (2, BATCH_MAX + 4), (BATCH_MAX + 1, BATCH_MAX + 1)]):
        msgs = [*msgs, agent.Message.assistant(f"a{step}")]
        texts = [agent.eventlog.encode("note", {"step": step, "i": i, "f": 1.5, "b": True}) for i in range(n)]
        saved = store.save_fenced_events("s", holder, msgs, take_steers=take, events=texts, keep=keep)
        assert saved == agent.Saved([], False)
        written = [*written, *texts][-keep:]
        got = store.events("s", 0, 1000)
        assert [json.dumps(json.loads(t)["data"]) for t in written] == [json.dumps(e.data) for e in got]
        assert [e.seq for e in got] == list(range(got[-1].seq - len(got) + 1, got[-1].seq + 1))
        with store.engine.connect() as conn:
            bodies = [b for (b,) in conn.exec_driver_sql("SELECT body FROM agent_events ORDER BY seq")]
        assert all(b.count("\x1e") <= BATCH_MAX for b in bodies)
    assert store.messages("s") == msgs
    store.close()
