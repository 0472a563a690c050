from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import bson
import pymongo
import pytest
from pymongo import monitoring
from pymongo.database import Database

import agent_sessions as agent
import storetest
import storetest.crossprocess
from agent_sessions.eventlog import encode
from stores import mongodb
from storetest import processes
from tests import mongo_events_children, servers

MONGO_URL = servers.MONGO_URL
DATABASE = servers.MONGO_DATABASE


@pytest.fixture(scope="module")
def database() -> Iterator[Database[Any]]:
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, serverSelectionTimeoutMS=10_000)
    db = client[DATABASE]
    client.admin.command("ping")
    yield db
    client.close()


def drop(db: Database[Any]) -> None:
    """The server slows as collections grow: every test starts from empty collections."""
    for name in mongodb.COLLECTIONS:
        db.drop_collection(name)
    mongodb.create_indexes(db)


class TestMongoDBStoreKeepsTheContract(storetest.StoreContract):
    capabilities = storetest.Capability.all()
    examples = 15
    steers_per_adder = 10
    long_transcript = 2000

    @pytest.fixture(autouse=True)
    def _database(self, database: Database[Any]) -> None:
        drop(database)
        self.database = database

    def make_store(self) -> mongodb.Store:
        return mongodb.Store(self.database)

    def process_factory(self) -> functools.partial[mongodb.Store]:
        return functools.partial(servers.mongo_store, MONGO_URL, DATABASE)


def test_the_store_takes_a_database_not_a_url() -> None:
    with pytest.raises(agent.ArgumentError, match="needs a pymongo Database"):
        mongodb.Store(MONGO_URL)  # type: ignore[arg-type]


def test_tool_arguments_are_stored_as_strings_not_documents(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    call = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c", "f", storetest.strategies.ODD_JSON)])
    store.save("s", [call])
    doc = database[mongodb.SESSIONS].find_one({"_id": "s"})
    assert doc is not None and doc["tail"] == [call.to_json()]


def test_an_appending_save_pushes_only_the_new_messages(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(20)]
    store.save("s", msgs)
    other = mongodb.Store(database)  # sees the document another writer will change under it
    assert other.messages("s") == msgs
    store.save("s", [*msgs, agent.Message.assistant("a")])
    other.save("s", [*msgs, agent.Message.assistant("b")])  # stale version: rewrites, never appends twice
    assert store.messages("s") == [*msgs, agent.Message.assistant("b")]


def pages(db: Database[Any]) -> list[str]:
    return sorted(p["_id"] for p in db[mongodb.PAGES].find({}, {"_id": 1}))


def test_a_growing_transcript_moves_full_pages_out_of_the_session_document(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs: list[agent.Message] = []
    for i in range(3 * mongodb.PAGE + 5):  # one message a save: every page boundary is crossed by an append
        msgs.append(agent.Message.user(f"m{i}"))
        assert store.save_fenced("s", held, msgs, take_steers=True).steers == []
    doc = database[mongodb.SESSIONS].find_one({"_id": "s"})
    assert doc is not None and len(doc["tail"]) == 5
    assert len(pages(database)) == 3
    assert mongodb.Store(database).messages("s") == msgs


def test_a_page_left_by_a_writer_that_died_before_committing_is_not_read(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(mongodb.PAGE - 1)]
    store.save("s", msgs)
    generation = database[mongodb.SESSIONS].find_one({"_id": "s"})["version"].split(":")[0]  # type: ignore[index]
    dead = [agent.Message.user("never committed").to_json()] * mongodb.PAGE
    database[mongodb.PAGES].insert_one({"_id": f"{generation}:0", "bodies": dead})
    assert mongodb.Store(database).messages("s") == msgs  # the page lies past the committed tail
    grown = [*msgs, agent.Message.assistant("a"), agent.Message.assistant("b")]
    store.save("s", grown)  # its page is taken: the append gives way to a rewrite
    assert mongodb.Store(database).messages("s") == grown
    assert f"{generation}:0" not in pages(database)  # the replaced generation's pages are gone


def test_a_rewrite_deletes_the_pages_it_replaced(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    store.save("s", [agent.Message.user(f"m{i}") for i in range(2 * mongodb.PAGE)])
    first = pages(database)
    assert len(first) == 2
    store.save("s", [agent.Message.user("other")])
    assert pages(database) == []
    assert store.messages("s") == [agent.Message.user("other")]


def test_what_mongodb_cannot_keep_is_refused_and_a_document_too_large_is_a_store_error(
    database: Database[Any],
) -> None:
    drop(database)
    store = mongodb.Store(database)
    over = "x" * (mongodb.MAX_MESSAGE_BYTES + 1)
    with pytest.raises(agent.ArgumentError, match="could never be delivered"):
        store.add_steer("big", over)
    with pytest.raises(agent.ArgumentError, match="keeps messages of at most"):
        store.save("big", [agent.Message.user(over)])
    under = "x" * (mongodb.MAX_MESSAGE_BYTES - 1000)
    store.add_steer("big", under)
    held = store.acquire("big", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    assert store.save_fenced("big", held, [], take_steers=True).steers == [under]  # delivered, in a page
    assert mongodb.Store(database).messages("big") == [agent.Message.user(under)]
    with pytest.raises(agent.StoreError, match="put_journal of session 'big' failed"):
        store.put_journal("big", held, "j" * (17 * 2**20))  # DocumentTooLarge, inside the family
    assert store.journal("big") is None


def test_pages_are_cut_by_bytes_too_so_no_document_passes_16_mb(database: Database[Any]) -> None:
    """32 one-megabyte tool results were one 32 MB page; a real mongod refuses documents over 16 MB."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    msgs: list[agent.Message] = [agent.Message.user("read them all")]
    for i in range(40):
        call = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call(f"c{i}", "read", "{}")])
        result = agent.Message(agent.Role.USER, [agent.Content.tool_result(f"c{i}", f"{i}" + "y" * 2**20)])
        msgs += [call, result]
        store.save_fenced("s", held, msgs, take_steers=True)
    sizes = [len(bson.encode(p)) for p in database[mongodb.PAGES].find()]
    sizes.append(len(bson.encode(database[mongodb.SESSIONS].find_one({"_id": "s"}) or {})))
    assert max(sizes) < 16 * 2**20 and len(sizes) > 2
    assert mongodb.Store(database).messages("s") == msgs
    store.save("s", msgs[:3])  # a rewrite: the old generation's pages all go
    assert len(list(database[mongodb.PAGES].find())) == 0
    assert mongodb.Store(database).messages("s") == msgs[:3]


# -- the lifecycle on MongoDB ----------------------------------------------------------------------------


class Writes(monitoring.CommandListener):
    """The write commands a client sends (a real server's count, not a mock's)."""

    WRITES = frozenset({"insert", "update", "delete", "findAndModify"})

    def __init__(self) -> None:
        self.commands: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in self.WRITES:
            self.commands.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@contextlib.contextmanager
def counting_writes(database: Database[Any]) -> Iterator[tuple[mongodb.Store, Writes]]:
    """A store on emptied collections, over a client of its own whose write commands are counted."""
    drop(database)
    writes = Writes()
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, event_listeners=[writes])
    try:
        yield mongodb.Store(client[DATABASE]), writes
    finally:
        client.close()


def test_a_runs_usual_step_is_still_one_update_and_it_sets_updated(database: Database[Any]) -> None:
    with counting_writes(database) as (store, writes):
        held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
        msgs = [agent.Message.user("go")]
        store.save_fenced("s", held, msgs, take_steers=True)
        before = store.info("s")
        for i in range(5):
            time.sleep(0.005)
            msgs.append(agent.Message.assistant(f"step {i}"))
            writes.commands.clear()
            store.save_fenced("s", held, msgs, take_steers=True)
            assert writes.commands == ["update"]
        after = store.info("s")
        assert before is not None and after is not None and after.updated > before.updated
        assert after.messages == 6 and after.created == before.created


def test_every_write_to_the_session_document_moves_updated_on(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    seen: list[datetime.datetime] = []

    def moved() -> None:
        info = store.info("s")
        assert info is not None
        assert not seen or info.updated > seen[-1]
        seen.append(info.updated)
        time.sleep(0.005)

    store.save("s", [agent.Message.user("q")])
    moved()
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    moved()
    store.renew("s", held, 30)
    moved()
    store.put_journal("s", held, "{}")
    moved()
    assert store.cancel("s")
    moved()
    store.release("s", held)
    moved()
    store.set_metadata("s", {"k": 1})
    moved()
    created = seen[0]
    store.add_steer("s", "a steer does not make it newer")
    store.take_steers("s")
    info = store.info("s")
    assert info is not None and info.updated == seen[-1] and info.created == created
    store.fork("s", "f", None)
    forked = store.info("f")
    assert forked is not None and forked.created == forked.updated > seen[-1] and forked.messages == 1


def test_where_compares_json_forms_that_mongodb_would_call_equal(database: Database[Any]) -> None:
    """MongoDB finds 1 == 1.0 == true-ish nowhere but 1 == 1.0: the tags keep the JSON form apart."""
    drop(database)
    store = mongodb.Store(database)
    for sid, value in (("int", 1), ("float", 1.0), ("bool", True), ("str", "1")):
        store.set_metadata(sid, {"v": value})
    for value, sid in ((1, "int"), (1.0, "float"), (True, "bool"), ("1", "str")):
        assert [s.id for s in store.list_sessions(where={"v": value})] == [sid]
    doc = database[mongodb.SESSIONS].find_one({"_id": "float"})
    assert doc is not None and doc["tags"] == ["v=1.0"]
    store.set_metadata("float", {"v": None, "w": "x"})
    assert list(store.list_sessions(where={"v": 1.0})) == []
    assert [s.id for s in store.list_sessions(where={"w": "x"})] == ["float"]


def test_concurrent_set_metadata_never_loses_a_key(database: Database[Any]) -> None:
    drop(database)
    stores = [mongodb.Store(database) for _ in range(4)]
    barrier = threading.Barrier(len(stores), timeout=30)
    errors: list[BaseException] = []

    def label(n: int, store: mongodb.Store) -> None:
        try:
            barrier.wait()
            for i in range(6):
                store.set_metadata("s", {f"k{n}_{i}": i})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=label, args=(n, s)) for n, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    info = stores[0].info("s")
    assert info is not None and dict(info.metadata) == {f"k{n}_{i}": i for n in range(4) for i in range(6)}
    assert sorted(database[mongodb.SESSIONS].find_one({"_id": "s"})["tags"]) == sorted(  # type: ignore[index]
        f"k{n}_{i}={i}" for n in range(4) for i in range(6))


def test_delete_removes_the_pages_and_the_id_starts_again_from_nothing(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(3 * mongodb.PAGE)]
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    store.save_fenced("s", held, msgs, take_steers=False)
    store.set_metadata("s", {"user": "u"})
    assert len(pages(database)) == 3
    assert store.delete("s", force=True) is True
    assert pages(database) == [] and database[mongodb.SESSIONS].find_one({"_id": "s"}) is None
    with pytest.raises(agent.LeaseLost):
        store.save_fenced("s", held, [*msgs, agent.Message.assistant("late")], take_steers=False)
    assert database[mongodb.SESSIONS].find_one({"_id": "s"}) is None  # the late write brought nothing back
    store.save("s", msgs[:2])  # this process knew the old version: its save must not append to it
    again = store.acquire("s", agent.Holder("h", 2, "u" * 32, 0.0), 30)
    assert again.epoch == 1 and again.token == "u" * 32
    info = mongodb.Store(database).info("s")
    assert info is not None and (info.messages, dict(info.metadata)) == (2, {})
    assert mongodb.Store(database).messages("s") == msgs[:2] and store.tail("s", 5) == msgs[:2]


def test_tail_reads_only_the_pages_it_needs(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(5 * mongodb.PAGE + 3)]
    store.save("s", msgs)
    database[mongodb.PAGES].delete_many({"_id": {"$regex": ":[0-2]$"}})  # the three oldest pages
    assert store.tail("s", mongodb.PAGE + 3) == msgs[-(mongodb.PAGE + 3):]
    assert store.tail("s", 2 * mongodb.PAGE + 3) == msgs[-(2 * mongodb.PAGE + 3):]
    with pytest.raises(agent.StoreError, match="kept racing"):  # what a vanished page looks like
        store.tail("s", 3 * mongodb.PAGE + 3)


class SavedJustBeforeItsDelete:
    """The sessions collection, but a save of ``session`` lands between prune's pick and its delete."""

    def __init__(self, collection: Any, session: str, save: Any) -> None:
        self.collection, self.session, self.save = collection, session, save

    def find_one_and_delete(self, where: dict[str, Any], **kwargs: Any) -> Any:
        if where.get("_id") == self.session:
            self.save()
        return self.collection.find_one_and_delete(where, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collection, name)


def test_prune_spares_a_session_saved_after_it_was_picked(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    for sid in ("a", "b", "c"):
        store.save(sid, [agent.Message.user(sid)])
    time.sleep(0.05)
    other = mongodb.Store(database)
    store._sessions = SavedJustBeforeItsDelete(  # type: ignore[assignment]
        store._sessions, "b", lambda: other.save("b", [agent.Message.user("b"), agent.Message.assistant("kept")]))
    assert store.prune(idle_for=0.01) == 2
    assert [s.id for s in other.list_sessions()] == ["b"]
    assert other.messages("b") == [agent.Message.user("b"), agent.Message.assistant("kept")]


def test_the_indexes_listing_and_pruning_use_exist(database: Database[Any]) -> None:
    drop(database)
    mongodb.create_indexes(database)  # twice: idempotent
    keys = {tuple(ix["key"].items()) for ix in database[mongodb.SESSIONS].list_indexes()}
    assert (("updated", -1), ("_id", -1)) in keys
    assert (("tags", 1), ("updated", -1), ("_id", -1)) in keys


# -- the event log on MongoDB ----------------------------------------------------------------------------


def note(tag: str, n: int = 1) -> list[str]:
    return [encode("note", {"tag": tag, "n": i}) for i in range(n)]


def event_pages(db: Database[Any]) -> list[str]:
    return sorted(p["_id"] for p in db[mongodb.EVENT_PAGES].find({}, {"_id": 1}))


def the_log(db: Database[Any], session: str) -> dict[str, Any]:
    """The session document's event log: its numbers, its tail and the pages it names."""
    doc = db[mongodb.SESSIONS].find_one({"_id": session}, {"_id": 0, "events_from": 1, "events_last": 1,
                                                           "events_tail": 1, "events_pages": 1, "events_log": 1})
    assert doc is not None
    return dict(doc)


def named_pages(db: Database[Any], session: str) -> list[str]:
    """The ids of the pages the session's document names, oldest first."""
    log = the_log(db, session)
    return [f"{log['events_log']}:{key}" for _, key in log["events_pages"]]


def consecutive(events: list[agent.StoredEvent]) -> list[int]:
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"not consecutive: {seqs}"
    return seqs


def full_tail(store: mongodb.Store, session: str, held: agent.Holder) -> int:
    """Append single events until the document's tail holds ``EVENT_PAGE - 1``: the next append overflows it."""
    last = 0
    for i in range(mongodb.EVENT_PAGE - 1):
        last = store.append_events(session, held, note(f"fill{i}"), keep=10_000)
    return last


class Paused:
    """A collection, passed through, whose ``method`` runs (``after`` it, or before) and then waits until
    ``go`` is set, having set ``there``: the test does something at that moment of a writer's write."""

    def __init__(self, collection: Any, method: str, *, after: bool = True) -> None:
        self.collection, self.method, self.after = collection, method, after
        self.there, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.collection, name)
        if name != self.method:
            return real

        def paused(*args: Any, **kwargs: Any) -> Any:
            done = real(*args, **kwargs) if self.after else None
            self.there.set()
            assert self.go.wait(60), "the test never let the writer go on"
            return done if self.after else real(*args, **kwargs)

        return paused


class Outcome:
    """What a call run in a thread returned or raised."""

    def __init__(self, call: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,))
        self.thread.start()

    def _run(self, call: Any) -> None:
        try:
            self.value = call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc

    def join(self) -> Outcome:
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self


def test_a_steps_events_ride_in_its_one_update_and_a_page_is_written_every_few_dozen(database: Database[Any]) -> None:
    with counting_writes(database) as (store, writes):
        held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
        msgs = [agent.Message.user("go")]
        store.save_fenced("s", held, msgs, take_steers=True)
        per_step = []
        for i in range(25):
            msgs.append(agent.Message.assistant(f"step {i}"))
            writes.commands.clear()
            store.save_fenced_events("s", held, msgs, take_steers=True, events=note(str(i), 3), keep=10_000)
            per_step.append(list(writes.commands))
        # the usual step: one update, which claims the numbers and stores the events (no insert, no read);
        # when the document's tail would reach EVENT_PAGE events: that update misses, the document is
        # read, a page is inserted and the update that names it commits
        assert per_step.count(["update"]) == 23
        assert per_step.count(["update", "insert", "update"]) == 2  # 75 events: two pages of 32
        assert len(event_pages(database)) == 2 and sorted(named_pages(database, "s")) == event_pages(database)
        assert len(the_log(database, "s")["events_tail"]) == 75 - 2 * mongodb.EVENT_PAGE
        events = mongodb.Store(database).events("s", 0, 1000)
        consecutive(events)
        assert [e.data["tag"] for e in events] == [str(i) for i in range(25) for _ in range(3)]
        assert mongodb.Store(database).messages("s") == msgs


def test_an_event_larger_than_the_tail_gets_a_page_of_its_own_counted_in_bytes(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    small = store.append_events("s", held, note("small"), keep=100)
    text = "é" * (mongodb.EVENT_TAIL_BYTES // 2 + 10)
    # the store keeps an event's text as it is given, not necessarily ASCII: this one has fewer chars than bytes
    big = json.dumps({"kind": "note", "at": time.time(), "data": {"tag": "big", "text": text}}, ensure_ascii=False)
    assert len(big) < mongodb.EVENT_TAIL_BYTES < len(big.encode())
    last = store.append_events("s", held, [big, *note("after")], keep=100)
    log = the_log(database, "s")
    assert log["events_tail"] == [] and len(log["events_pages"]) == 1  # the small one, the big one and the last
    assert len(bson.encode(database[mongodb.SESSIONS].find_one({"_id": "s"}) or {})) < 10_000
    got = mongodb.Store(database).events("s", 0, 100)
    assert [e.seq for e in got] == [small, small + 1, last] and got[1].data["text"] == text


def test_a_writer_fenced_out_mid_append_writes_nothing_readable(database: Database[Any]) -> None:
    """Two writers: A has written its page (the tail was full) when its lease lapses and B takes the session
    and appends; A's update, fenced by its token and epoch, matches nothing: LeaseLost, and its page goes."""
    drop(database)
    store = mongodb.Store(database)
    a = store.acquire("s", agent.Holder("a", 1, "a" * 32, 0.0), 0.3)
    store.save_fenced("s", a, [agent.Message.user("q")], take_steers=False)
    filled = full_tail(store, "s", a)
    writer_a = mongodb.Store(database)
    writer_a._event_pages = paused = Paused(writer_a._event_pages, "insert_many")  # type: ignore[assignment]
    appending = Outcome(lambda: writer_a.append_events("s", a, note("late a", 3), keep=10_000))
    assert paused.there.wait(30)
    assert len(event_pages(database)) == 1 and named_pages(database, "s") == []  # written, named by nothing
    storetest.crossprocess.wait_for(lambda: store.holder("s") is None, "A's lease to lapse")
    b = mongodb.Store(database).acquire("s", agent.Holder("b", 2, "b" * 32, 0.0), 30)
    by_b = store.append_events("s", b, note("b", 2), keep=10_000)  # B's own page
    paused.go.set()
    assert isinstance(appending.join().error, agent.LeaseLost)
    with pytest.raises(agent.LeaseLost):  # the save path too, its events with it
        writer_a.save_fenced_events("s", a, [agent.Message.user("q"), agent.Message.assistant("late")],
                                    take_steers=False, events=note("late a"), keep=10_000)
    every = mongodb.Store(database).events("s", 0, 1000)
    assert consecutive(every)[-1] == by_b == filled + 2
    assert [e.data["tag"] for e in every] == [f"fill{i}" for i in range(mongodb.EVENT_PAGE - 1)] + ["b", "b"]
    assert event_pages(database) == sorted(named_pages(database, "s"))  # A took its page back
    assert mongodb.Store(database).messages("s") == [agent.Message.user("q")]


def test_a_writer_killed_between_its_page_and_its_update_leaves_no_gap(database: Database[Any]) -> None:
    """A process writes its page, then is killed (SIGKILL) before the update that would claim its numbers and
    name the page. Nothing was claimed: the next append takes the next number, a follower that was waiting
    sees no gap and nothing of the dead writer's, and the session's deletion takes the page it left."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 60)
    filled = full_tail(store, "s", held)
    seen: list[agent.StoredEvent] = []
    follower = threading.Thread(target=lambda: seen.extend(itertools.islice(
        agent.open("s", mongodb.Store(database)).follow(after=0, timeout=60), mongodb.EVENT_PAGE + 1)))
    follower.start()
    ctx = processes.context(mongo_events_children.dies_after_its_page)
    out = ctx.Queue()
    child = ctx.Process(target=mongo_events_children.dies_after_its_page, args=("s", held, 2, out))
    child.start()
    try:
        written = out.get(timeout=60)
        assert isinstance(written, list), written
        assert event_pages(database) == written and named_pages(database, "s") == []
    finally:
        child.kill()
        child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert the_log(database, "s")["events_last"] == filled  # it claimed nothing
    last = store.append_events("s", held, note("after", 2), keep=10_000)
    follower.join(60)
    assert last == filled + 2
    assert consecutive(seen)[-1] == last and "dead" not in {e.data["tag"] for e in seen}
    assert seen == mongodb.Store(database).events("s", 0, 1000)
    assert written[0] in event_pages(database) and written[0] not in named_pages(database, "s")
    assert store.delete("s", force=True) and event_pages(database) == []  # the dead writer's page with the log


@pytest.mark.parametrize("deleted", ["after its page", "before its page"])
def test_a_delete_racing_an_append_leaves_nothing_readable_and_no_page(database: Database[Any], deleted: str) -> None:
    """The session is deleted while a writer appends across a page boundary: after it wrote its page (the
    delete takes the page with the log), or before it did (the writer's page lands after the delete). Its
    update matches no document: LeaseLost; it takes its page back; the id started again reads only its own."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 60)
    old = full_tail(store, "s", held)
    old_log = the_log(database, "s")["events_log"]
    writer = mongodb.Store(database)
    writer._event_pages = paused = Paused(  # type: ignore[assignment]
        writer._event_pages, "insert_many", after=deleted == "after its page")
    appending = Outcome(lambda: writer.append_events("s", held, note("late", 2), keep=10_000))
    assert paused.there.wait(30)
    assert store.delete("s", force=True) is True
    paused.go.set()
    assert isinstance(appending.join().error, agent.LeaseLost)
    assert event_pages(database) == [] and store.events("s", 0, 100) == []
    # a writer that died with its page just written after the delete leaves it: the new log never reads it
    database[mongodb.EVENT_PAGES].insert_one({"_id": f"{old_log}:dead", "session": "s", "first": old + 1,
                                              "texts": note("late")})
    again = store.acquire("s", agent.Holder("h", 2, "u" * 32, 0.0), 30)
    new = store.append_events("s", again, note("new"), keep=100)
    assert new > old + 1 and [e.data["tag"] for e in store.events("s", 0, 100)] == ["new"]
    assert [e.data["tag"] for e in store.events("s", old, 100)] == ["new"]


def test_deletes_racing_free_running_appenders_leave_no_page(database: Database[Any]) -> None:
    """Real threads, no pause: appenders writing pages (batches of 5, keep 40: the cap drops pages as they
    go) while the session is deleted under them, ten times over."""
    drop(database)
    store = mongodb.Store(database)
    for round_ in range(10):
        held = store.acquire("s", agent.Holder("h", round_, uuid.uuid4().hex, 0.0), 60)
        store.append_events("s", held, note("first"), keep=40)
        runs = [Outcome(functools.partial(append_until_lost, mongodb.Store(database), held)) for _ in range(2)]
        time.sleep(0.05 + 0.02 * round_)
        assert store.delete("s", force=True) is True
        for run in runs:
            assert isinstance(run.join().error, agent.LeaseLost), run.error
        assert store.events("s", 0, 100) == [] and event_pages(database) == []


def append_until_lost(store: mongodb.Store, held: agent.Holder) -> None:
    while True:
        store.append_events("s", held, note("go", 5), keep=40)


def test_the_cap_drops_whole_pages_in_the_same_write(database: Database[Any]) -> None:
    with counting_writes(database) as (store, writes):
        held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
        for i in range(10):
            last = store.append_events("s", held, note(f"a{i}", 10), keep=1000)
        before = named_pages(database, "s")
        assert len(before) == 3 and len(the_log(database, "s")["events_tail"]) == 4
        writes.commands.clear()
        last = store.append_events("s", held, note("b", 31), keep=40)  # overflows: a planned write
        assert writes.commands == ["findAndModify", "insert", "findAndModify", "delete"]
        log = the_log(database, "s")
        assert log["events_from"] == last - 39 and log["events_last"] == last
        after = named_pages(database, "s")
        assert after[0] == before[2] and len(after) == 2  # the two wholly below the cap are gone
        assert event_pages(database) == sorted(after)
        kept = store.events("s", 0, 1000)
        assert consecutive(kept) == list(range(last - 39, last + 1))
        writes.commands.clear()
        last = store.append_events("s", held, note("c", 2), keep=5)  # the tail has room: one update, capped
        assert writes.commands == ["findAndModify"]
        assert [e.seq for e in store.events("s", 0, 1000)] == list(range(last - 4, last + 1))


def test_a_reader_racing_the_cap_reads_again_and_never_sees_a_hole(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 60)
    store.append_events("s", held, note("first"), keep=50)
    writing = Outcome(lambda: [store.append_events("s", held, note(f"w{i}", 7), keep=50) for i in range(120)])
    reader = mongodb.Store(database)
    reads = 0
    while writing.thread.is_alive():
        got = reader.events("s", 0, 1000)
        assert 1 <= len(got) <= 50
        consecutive(got)
        reads += 1
    assert writing.join().error is None and reads > 5
    assert len(reader.events("s", 0, 1000)) == 50 and len(event_pages(database)) <= 3


def test_processes_appending_across_page_boundaries_never_share_a_number(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 120)
    ctx = processes.context(mongo_events_children.appender)
    with ctx.Manager() as manager, ProcessPoolExecutor(3, mp_context=ctx) as pool:
        barrier = manager.Barrier(3)
        reports = list(pool.map(mongo_events_children.appender, ["s"] * 3, [held] * 3, range(3), [15] * 3,
                                [barrier] * 3, timeout=180))
    every = store.events("s", 0, 1000)
    consecutive(every)
    sizes = {f"{w}-{b}": 1 + (w * 7 + b * 5) % 13 for w in range(3) for b in range(15)}
    assert len(every) == sum(sizes.values())
    returned = [n for _, numbers in reports for n in numbers]
    assert len(set(returned)) == len(returned)
    for tag, size in sizes.items():  # each batch whole, in one run of numbers, ending at the number returned
        mine = [e for e in every if e.data["tag"] == tag]
        assert [e.data["n"] for e in mine] == list(range(size)) and consecutive(mine)[-1] in returned
    assert event_pages(database) == sorted(named_pages(database, "s"))  # every loser took its page back


def test_a_page_that_could_not_be_written_claims_nothing(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
    filled = full_tail(store, "s", held)
    failing = mongodb.Store(database)
    failing._event_pages = FailsToInsert(failing._event_pages)  # type: ignore[assignment]
    with pytest.raises(agent.StoreError, match="append_events of session 's' (failed|may have happened)"):
        failing.append_events("s", held, note("lost", 2), keep=100)
    assert the_log(database, "s")["events_last"] == filled and event_pages(database) == []
    again = failing.append_events("s", held, note("again", 2), keep=100)  # the next try goes through
    assert again == filled + 2 and consecutive(store.events("s", 0, 100))[-1] == again


class FailsToInsert:
    def __init__(self, collection: Any) -> None:
        self.collection, self.failed = collection, False

    def insert_many(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise pymongo.errors.AutoReconnect("the connection dropped")
        return self.collection.insert_many(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collection, name)


def test_delete_and_prune_take_the_log_and_its_pages(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "a" * 32, 0.0), 30)
    store.append_events("s", held, note("s", 20), keep=1000)
    store.append_events("s", held, note("s", 20), keep=1000)
    other = store.acquire("t", agent.Holder("h", 1, "b" * 32, 0.0), 30)
    store.append_events("t", other, note("t", 20), keep=1000)
    store.append_events("t", other, note("t", 20), keep=1000)
    assert len(event_pages(database)) == 2
    t_pages = named_pages(database, "t")
    assert store.delete("s", force=True) is True
    assert event_pages(database) == sorted(t_pages) and store.events("s", 0, 100) == []
    store.release("t", other)
    time.sleep(0.05)
    assert store.prune(idle_for=0.01) == 1
    assert event_pages(database) == []


def test_the_event_log_needs_no_index_beyond_id(database: Database[Any]) -> None:
    drop(database)
    assert [ix["name"] for ix in database[mongodb.EVENT_PAGES].list_indexes()] in ([], ["_id_"])
    assert all(collection != mongodb.EVENTS for collection, _, _ in mongodb.INDEXES)


class _LeasedAfterTheDelete:
    """The sessions collection of a store, passed through; just after ``find_one_and_delete`` finds nothing,
    ``then`` runs (another worker making the session and taking its lease)."""

    def __init__(self, collection: Any, then: Any) -> None:
        self._collection = collection
        self._then = then

    def find_one_and_delete(self, *args: Any, **kwargs: Any) -> Any:
        doc = self._collection.find_one_and_delete(*args, **kwargs)
        then, self._then = self._then, None
        if doc is None and then is not None:
            then()
        return doc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)


def test_a_forced_delete_that_finds_nothing_is_not_refused_by_a_run_made_after_it(database: Database[Any]) -> None:
    """Found by the model-based test (issue 29): a forced delete found no document, a run made the session
    and took its lease before the delete's next read, and the delete raised SessionBusy (which ``force``
    never does). It deleted nothing: False, and the new session stays."""
    drop(database)
    store, other = mongodb.Store(database), mongodb.Store(database)
    holder = agent.Holder("test", 1, "t" * 32, 0.0)
    store._sessions = _LeasedAfterTheDelete(store._sessions, lambda: other.acquire("s", holder, 30))  # type: ignore[assignment]
    assert store.delete("s", force=True) is False
    held = other.holder("s")
    assert held is not None and held.token == holder.token
