from __future__ import annotations

import datetime
import functools
import threading
import time
from collections.abc import Iterator
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
from tests import servers

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


def test_a_runs_usual_step_is_still_one_update_and_it_sets_updated(database: Database[Any]) -> None:
    drop(database)
    writes = Writes()
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, event_listeners=[writes])
    try:
        store = mongodb.Store(client[DATABASE])
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
    finally:
        client.close()


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


def stored_events(db: Database[Any], session: str) -> list[int]:
    return [e["seq"] for e in db[mongodb.EVENTS].find({"session": session}).sort("seq", 1)]


def test_a_fenced_out_holders_claim_writes_nothing(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    old = store.acquire("s", agent.Holder("h", 1, "a" * 32, 0.0), 0.2)
    store.save_fenced("s", old, [agent.Message.user("q")], take_steers=False)
    last = store.append_events("s", old, note("old"), keep=100)
    storetest.crossprocess.wait_for(lambda: store.holder("s") is None, "the lease to expire")
    store.acquire("s", agent.Holder("h", 2, "b" * 32, 0.0), 30)
    before = database[mongodb.SESSIONS].find_one({"_id": "s"})
    with pytest.raises(agent.LeaseLost):
        store.append_events("s", old, note("late", 3), keep=100)
    with pytest.raises(agent.LeaseLost):  # the cached version makes it try the one-update append first
        store.save_fenced_events("s", old, [agent.Message.user("q"), agent.Message.assistant("late")],
                                 take_steers=False, events=note("late"), keep=100)
    assert database[mongodb.SESSIONS].find_one({"_id": "s"}) == before  # the counter included: nothing claimed
    assert stored_events(database, "s") == [last]


def test_a_gap_left_by_a_writer_that_died_between_claim_and_insert_is_skipped(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "a" * 32, 0.0), 30)
    first = store.append_events("s", held, note("before", 2), keep=100)
    dying = mongodb.Store(database)
    dying._events = DiesBeforeInserting(dying._events)  # type: ignore[assignment]
    with pytest.raises(Died):
        dying.append_events("s", held, note("lost", 3), keep=100)
    assert database[mongodb.SESSIONS].find_one({"_id": "s"})["events_last"] == first + 3  # type: ignore[index]
    follower = agent.open("s", mongodb.Store(database)).follow(after=first, timeout=30)
    later = threading.Timer(0.2, lambda: store.append_events("s", held, note("after", 2), keep=100))
    later.start()
    try:
        got = [next(follower), next(follower)]  # waits across the gap for the next events
    finally:
        later.join()
    assert [e.seq for e in got] == [first + 4, first + 5] and [e.data["tag"] for e in got] == ["after", "after"]
    every = store.events("s", 0, 100)
    assert [e.seq for e in every] == [first - 1, first, first + 4, first + 5]


class Died(BaseException):
    """What the test makes a writer do between its claim and its insert."""


class DiesBeforeInserting:
    def __init__(self, collection: Any) -> None:
        self.collection = collection

    def insert_many(self, *args: Any, **kwargs: Any) -> Any:
        raise Died

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collection, name)


def test_delete_and_prune_drop_the_events_and_a_late_insert_is_never_read(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "a" * 32, 0.0), 30)
    old = store.append_events("s", held, note("old", 3), keep=100)
    other = store.acquire("t", agent.Holder("h", 1, "b" * 32, 0.0), 30)
    store.append_events("t", other, note("t"), keep=100)
    assert store.delete("s", force=True) is True
    assert stored_events(database, "s") == [] and len(stored_events(database, "t")) == 1
    # a writer that claimed before the delete stores its events after it: no log reads them
    database[mongodb.EVENTS].insert_one({"session": "s", "seq": old + 1, "text": note("late")[0]})
    again = store.acquire("s", agent.Holder("h", 2, "c" * 32, 0.0), 30)
    assert store.events("s", 0, 100) == []
    new = store.append_events("s", again, note("new"), keep=100)
    assert [e.data["tag"] for e in store.events("s", 0, 100)] == ["new"] and new > old + 1
    store.release("s", again)
    store.release("t", other)
    time.sleep(0.05)
    assert store.prune(idle_for=0.01) == 2
    assert database[mongodb.EVENTS].count_documents({}) == 0  # the late one too: below the last number given


def test_events_ride_in_the_steps_update_and_the_cap_deletes_only_when_reached(database: Database[Any]) -> None:
    drop(database)
    writes = Writes()
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, event_listeners=[writes])
    try:
        store = mongodb.Store(client[DATABASE])
        held = store.acquire("s", agent.Holder("h", 1, "t" * 32, 0.0), 30)
        msgs = [agent.Message.user("go")]
        store.save_fenced("s", held, msgs, take_steers=True)  # the session has no log yet: the first one begins it
        msgs.append(agent.Message.assistant("step 1"))
        store.save_fenced_events("s", held, msgs, take_steers=True, events=note("1", 2), keep=4)
        for i in range(2, 4):
            msgs.append(agent.Message.assistant(f"step {i}"))
            writes.commands.clear()
            store.save_fenced_events("s", held, msgs, take_steers=True, events=note(str(i)), keep=4)
            assert writes.commands == ["findAndModify", "insert"]  # the cap is not reached: no delete
        assert store.messages("s") == msgs
        assert [e.data["tag"] for e in store.events("s", 0, 100)] == ["1", "1", "2", "3"]
        writes.commands.clear()
        store.save_fenced_events("s", held, msgs, take_steers=True, events=note("4"), keep=4)  # nothing to save
        assert writes.commands == ["findAndModify", "insert", "delete"]
        assert [e.data["tag"] for e in store.events("s", 0, 100)] == ["1", "2", "3", "4"]
    finally:
        client.close()


def test_an_insert_that_fails_part_way_takes_back_what_it_stored(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "a" * 32, 0.0), 30)
    last = store.append_events("s", held, note("a"), keep=100)
    database[mongodb.EVENTS].insert_one({"session": "s", "seq": last + 3, "text": "in the way"})
    with pytest.raises(agent.StoreError, match="append_events of session 's' failed"):
        store.append_events("s", held, note("b", 4), keep=100)  # the third collides: two were stored
    assert stored_events(database, "s") == [last]
    again = store.append_events("s", held, note("b", 4), keep=100)
    assert [e.seq for e in store.events("s", 0, 100)] == [last, *range(again - 3, again + 1)]
    assert again == last + 8


def test_the_event_index_exists_and_is_unique(database: Database[Any]) -> None:
    drop(database)
    index = {ix["name"]: ix for ix in database[mongodb.EVENTS].list_indexes()}["session_seq"]
    assert list(index["key"].items()) == [("session", 1), ("seq", 1)] and index["unique"] is True


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
