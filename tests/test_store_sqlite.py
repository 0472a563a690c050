from __future__ import annotations

import functools
import gc
import json
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event

import agent_sessions as agent
import storetest
from agent_sessions import backed
from stores import sqlite
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


def _verbs(seen: list[tuple[str, int]]) -> list[str]:
    return [" ".join(q.split()[:3]) if q.startswith(("INSERT", "DELETE")) else " ".join(q.split()[:2])
            for q, _ in seen]


def test_a_plain_save_is_one_transaction_writing_only_what_is_new(tmp_path: Path) -> None:
    """A plain save (``BackedStore.save``) of the messages it last saved and one more inserts that one, with the
    row, in one BEGIN IMMEDIATE transaction; one of other messages replaces the transcript: the old messages'
    DELETE and the new ones' one multi-row INSERT. (A leased run's step: the next test.)"""
    store = sqlite.open(tmp_path / "s.db")
    msgs = [agent.Message.user(f"m{i}") for i in range(100)]
    store.save("s", msgs)
    with statements_of(store) as seen:
        store.save("s", [*msgs, agent.Message.user("new")])
    assert _verbs(seen) == ["BEGIN IMMEDIATE", "SELECT agent_sessions.session_id,", "INSERT INTO agent_messages",
                            "UPDATE agent_sessions", "COMMIT"]
    assert [rows for q, rows in seen if q.startswith("INSERT")] == [1]
    with statements_of(store) as seen:
        store.save("s", [agent.Message.user(f"m{i}") for i in range(100)])  # equal, but not what it saved
    assert _verbs(seen) == ["BEGIN IMMEDIATE", "SELECT agent_sessions.session_id,", "DELETE FROM agent_messages",
                            "INSERT INTO agent_messages", "UPDATE agent_sessions", "COMMIT"]
    assert [rows for q, rows in seen if q.startswith("INSERT")] == [100]
    store.save("s", [*msgs, agent.Message.user("new")])
    assert store.messages("s")[-1].text == "new"
    store.save("s", [*msgs, agent.Message.user("new"), agent.Message.assistant("done")])
    assert store.info("s").open_since is None  # type: ignore[union-attr]


def test_a_runs_step_is_one_transaction_and_one_that_fails_leaves_the_next_to_store_the_right_transcript(
    tmp_path: Path,
) -> None:
    """The usual step of a leased run: BEGIN IMMEDIATE, the row, the new messages, the row, COMMIT. A message
    longer than SQLite keeps is refused before the write; a step whose INSERT fails raises a StoreError, and
    the next save stores the right transcript."""
    store = sqlite.open(tmp_path / "s.db")
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced("s", held, msgs, take_steers=True)
    msgs += [agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "grep", "{}")]),
             agent.Message(agent.Role.USER, [agent.Content.tool_result("c1", "found")])]
    with statements_of(store) as seen:
        assert store.save_fenced("s", held, msgs, take_steers=True) == agent.Saved([], False)
    assert _verbs(seen) == ["BEGIN IMMEDIATE", "SELECT agent_sessions.session_id,", "INSERT INTO agent_messages",
                            "UPDATE agent_sessions", "COMMIT"]
    assert store.max_message_bytes == 1_000_000_000  # SQLITE_MAX_LENGTH, as the library was built
    store.max_message_bytes = 100  # as if SQLite kept no longer strings: a longer message is refused first
    with pytest.raises(agent.ArgumentError, match=r"messages\[\d\] is 2\d\d bytes as stored .* at most 100 bytes"):
        store.save_fenced("s", held, [*msgs, agent.Message.user("x" * 200)], take_steers=True)
    store.max_message_bytes = None
    assert sqlite.open(tmp_path / "s.db").messages("s") == msgs
    with failing(store.engine, "INSERT INTO agent_messages"), pytest.raises(agent.StoreError):
        store.save_fenced("s", held, [*msgs, agent.Message.user("lost")], take_steers=True)
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
    store.add_steer("s", "waiting")
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
    assert _open_files(path) >= 1  # the pool's, as many as were in use at once (not one a thread)
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
    """A page of the listing is one transaction: a prune of thousands is a few commits, and a writer beside it
    waits for one page at most, not for a run of short transactions that keeps taking the file's lock."""
    monkeypatch.setattr(backed, "PRUNE_BATCH", 3)
    store = sqlite.open(tmp_path / "prune.db")
    for i in range(10):
        store.save(f"s{i}", [agent.Message.user(f"m{i}")])
        store.set_metadata(f"s{i}", {"user": "u"})
        store.add_steer(f"s{i}", "stale")
    assert store.prune(idle_for=0, limit=4) == 4  # a page of 3, then 1
    with statements_of(store) as seen:
        assert store.prune(idle_for=0) == 6
    assert len([q for q, _ in seen if q.startswith("DELETE FROM agent_sessions")]) == 2  # a statement a page
    assert len([q for q, _ in seen if q == "BEGIN IMMEDIATE"]) == 2  # the listing reads take no write lock
    assert list(store.list_sessions()) == [] and list(store.list_sessions(where={"user": "u"})) == []
    with store.engine.connect() as conn:
        for table in ("agent_messages", "agent_steers", "agent_metadata", "agent_sessions"):
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
    """The session's messages and events, as the file holds them: a row each."""
    with store.engine.connect() as conn:
        messages = conn.exec_driver_sql("SELECT count(*) FROM agent_messages WHERE session_id = ?", (sid,)).scalar()
        events = conn.exec_driver_sql("SELECT count(*) FROM agent_events WHERE session_id = ?", (sid,)).scalar()
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


def test_the_usual_save_with_events_is_one_transaction_and_trims_nothing_under_the_cap(tmp_path: Path) -> None:
    """BEGIN IMMEDIATE, the row (with the oldest event kept), the messages, the events, the row, COMMIT: no
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
    assert _verbs(seen) == ["BEGIN IMMEDIATE", "SELECT agent_sessions.session_id,", "INSERT INTO agent_messages",
                            "INSERT INTO agent_events", "UPDATE agent_sessions", "COMMIT"]
    assert [rows for q, rows in seen if q.startswith("INSERT INTO agent_events")] == [3]
    assert last == agent.Saved([], False)
    seqs = [e.seq for e in store.events("s", 0, 100)]
    assert seqs == list(range(seqs[0], seqs[0] + 4))
    assert _stored(store, "s") == (3, 4)
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
    ``keep``, its numbers consecutive; a second store object and the
    first again go on from the newest."""
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

def test_a_write_of_many_events_is_a_row_each_and_the_cap_keeps_the_newest_byte_for_byte(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "many.db")
    holder = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    texts = [agent.eventlog.encode("note", {"n": n, "f": 1.5, "b": True}) for n in range(203)]
    last = store.append_events("s", holder, texts, keep=10_000)
    assert [e.seq for e in store.events("s", 0, 1000)] == list(range(last - len(texts) + 1, last + 1))
    store.append_events("s", holder, texts[:1], keep=len(texts) - 5)  # drops the oldest 6
    got = store.events("s", 0, 1000)
    assert [e.data for e in got] == [json.loads(t)["data"] for t in [*texts, texts[0]][6:]]
    assert store.events("s", got[0].seq, 1) == [got[1]]
    with store.engine.connect() as conn:
        query = "SELECT body FROM agent_events WHERE session_id = 's' ORDER BY seq"
        bodies = [b for (b,) in conn.exec_driver_sql(query)]
    assert bodies == [*texts, texts[0]][6:]
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
