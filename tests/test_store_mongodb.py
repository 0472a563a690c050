"""The MongoDB store keeps the contract (storetest), on mongoeco through pymongo; and what is MongoDB's own:
where things lie (the session's document, its parts), the round trips a write costs, what a writer that is
refused, fenced out or killed between its parts and its update leaves, the schema."""

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
from agent_sessions.backend import Change, Guard
from agent_sessions.eventlog import encode
from stores import mongodb
from storetest import processes
from storetest.crossprocess import wait_for
from tests import mongo_events_children, servers

MONGO_URL = servers.MONGO_URL
DATABASE = servers.MONGO_DATABASE


@pytest.fixture(scope="module")
def database() -> Iterator[Database[Any]]:
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, serverSelectionTimeoutMS=10_000)
    db = client[DATABASE]
    client.admin.command("ping")
    yield db
    client.drop_database(DATABASE)
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


HOLDER = agent.Holder("h", 1, "t" * 32, 0.0)


def the_doc(db: Database[Any], session: str) -> dict[str, Any]:
    doc = db[mongodb.SESSIONS].find_one({"_id": session})
    assert doc is not None
    return dict(doc)


def parts(db: Database[Any]) -> list[str]:
    return sorted(p["_id"] for p in db[mongodb.PARTS].find({}, {"_id": 1}))


def named(db: Database[Any], session: str) -> list[str]:
    """The parts the session's document names: its pages of messages and of events, its long items."""
    doc = the_doc(db, session)
    return sorted([e["p"] for e in [*doc.get("pages", []), *doc.get("event_pages", [])]]
                  + [x["ref"] for kind in ("steers", "queue") for x in doc.get(kind, []) if "ref" in x])


def only_named_parts_stay(db: Database[Any], session: str) -> None:
    """The parts nothing names are deleted unacknowledged (no round trip waited for): wait for them."""
    wait_for(lambda: parts(db) == named(db, session), "the parts nothing names to be deleted", timeout=10)


# -- where things lie ------------------------------------------------------------------------------------


def test_the_store_takes_a_database_not_a_url() -> None:
    with pytest.raises(agent.ArgumentError, match="needs a pymongo Database"):
        mongodb.Store(MONGO_URL)  # type: ignore[arg-type]


def test_tool_arguments_are_stored_as_strings_not_documents(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    call = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c", "f", storetest.strategies.ODD_JSON)])
    store.save("s", [call])
    assert the_doc(database, "s")["tail"] == [call.to_json()]


def test_a_growing_transcript_moves_full_pages_out_of_the_session_document(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 30)
    msgs: list[agent.Message] = []
    for i in range(3 * mongodb.PAGE + 5):  # one message a save: every page boundary is crossed by an append
        msgs.append(agent.Message.user(f"m{i}"))
        assert store.save_fenced("s", held, msgs, take_steers=True).steers == []
    doc = the_doc(database, "s")
    assert len(doc["tail"]) < mongodb.PAGE and [e["n"] for e in doc["pages"]] == [mongodb.PAGE] * 3
    only_named_parts_stay(database, "s")
    assert mongodb.Store(database).messages("s") == msgs


def test_a_part_a_dead_writer_left_is_never_read_and_the_next_planned_write_deletes_it(
    database: Database[Any],
) -> None:
    """A writer inserts its part, then dies before the update that would name it: nothing reads the part,
    and the session's next write that needs parts deletes it (it was planned on a version the document
    has moved past)."""
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(mongodb.PAGE - 1)]
    store.save("s", msgs)
    doc = the_doc(database, "s")
    dead = [agent.Message.user("never committed").to_json()] * mongodb.PAGE
    database[mongodb.PARTS].insert_one({"_id": "dead", "session": "s", "generation": doc["generation"],
                                        "seal": doc.get("seal", 0), "texts": dead})
    assert mongodb.Store(database).messages("s") == msgs and store.tail("s", 3) == msgs[-3:]
    grown = [*msgs, agent.Message.assistant("a"), agent.Message.assistant("b")]
    store.save("s", grown)  # the tail overflows: a planned write, which deletes what writers before it left
    assert mongodb.Store(database).messages("s") == grown
    only_named_parts_stay(database, "s")
    assert "dead" not in parts(database) and len(parts(database)) == 1


def test_a_write_needing_parts_on_a_session_with_no_document_leaves_nothing_visible(database: Database[Any]) -> None:
    """The plan of a first long save makes a document holding only its generation: until the save's update
    lands (here: never, the writer stops after its parts), no read, listing or delete sees a session."""
    drop(database)
    store = mongodb.Store(database)
    store.mongo.parts = paused = Paused(store.mongo.parts, "insert_many")  # type: ignore[assignment]
    saving = Outcome(lambda: store.save("new", [agent.Message.user(f"m{i}") for i in range(2 * mongodb.PAGE)]))
    assert paused.there.wait(30)
    other = mongodb.Store(database)
    assert other.messages("new") == [] and other.info("new") is None and other.journal("new") is None
    assert [s.id for s in other.list_sessions()] == [] and other.holder("new") is None
    assert set(the_doc(database, "new")) == {"_id", "generation"}
    paused.go.set()
    assert saving.join().error is None and len(other.messages("new")) == 2 * mongodb.PAGE


def test_a_rewrite_deletes_the_pages_it_replaced(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    store.save("s", [agent.Message.user(f"m{i}") for i in range(2 * mongodb.PAGE)])
    assert len(parts(database)) == 2
    store.save("s", [agent.Message.user("other")])
    only_named_parts_stay(database, "s")
    assert parts(database) == [] and store.messages("s") == [agent.Message.user("other")]


def test_a_splice_into_a_page_names_it_shorter_and_reads_only_what_it_names(database: Database[Any]) -> None:
    """A splice cutting the transcript inside a page (the contract allows one anywhere): the page is never
    rewritten, its entry counts fewer of its messages."""
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(2 * mongodb.PAGE + 4)]
    store.save("s", msgs)
    instead = agent.Message.user("instead")
    assert store.backend.write("s", Guard(), Change(splice=(mongodb.PAGE + 6, (instead.to_json(),)))).done
    doc = the_doc(database, "s")
    assert [e["n"] for e in doc["pages"]] == [mongodb.PAGE, 6] and doc["tail"] == [instead.to_json()]
    cut = [*msgs[:mongodb.PAGE + 6], instead]
    assert mongodb.Store(database).messages("s") == cut and store.tail("s", 8) == cut[-8:]
    only_named_parts_stay(database, "s")
    assert len(parts(database)) == 2


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
    store.add_steer("big", under)  # a part: the document holds its id
    assert len(bson.encode(the_doc(database, "big"))) < 10_000
    held = store.acquire("big", HOLDER, 30)
    assert store.save_fenced("big", held, [], take_steers=True).steers == [under]  # delivered, in a page
    assert mongodb.Store(database).messages("big") == [agent.Message.user(under)]
    with pytest.raises(agent.StoreError, match="write of session 'big' failed"):
        store.put_journal("big", held, "j" * (17 * 2**20))  # DocumentTooLarge, inside the family
    assert store.journal("big") is None


def test_long_steers_and_queued_messages_are_parts_until_taken(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    long = "s" * (mongodb.ITEM_BYTES + 1)
    store.add_steer("s", "short")
    assert store.add_steer_once("s", long, "k1") and not store.add_steer_once("s", long, "k1")
    assert store.enqueue("s", "q1", long + "q") == 1 and store.enqueue("s", "q1", long + "q") == 1
    assert len(parts(database)) == 2 and len(bson.encode(the_doc(database, "s"))) < 10_000
    assert mongodb.Store(database).pending_steers("s") == ["short", long]
    assert store.take_steers("s") == ["short", long]
    held = store.acquire("s", HOLDER, 30)
    assert store.take_queued("s", held) == agent.Message.user(long + "q", key="q1")
    store.save_fenced("s", held, [*store.messages("s"), *(agent.Message.user("p") for _ in range(mongodb.PAGE))],
                      take_steers=False)  # a planned write: it deletes the parts taken since
    only_named_parts_stay(database, "s")
    assert len(parts(database)) == 1 and store.queued("s") == []


def test_pages_are_cut_by_bytes_too_so_no_document_passes_16_mb(database: Database[Any]) -> None:
    """32 one-megabyte tool results would be one 32 MB page; a real mongod refuses documents over 16 MB."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 30)
    msgs: list[agent.Message] = [agent.Message.user("read them all")]
    for i in range(40):
        call = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call(f"c{i}", "read", "{}")])
        result = agent.Message(agent.Role.USER, [agent.Content.tool_result(f"c{i}", f"{i}" + "y" * 2**20)])
        msgs += [call, result]
        store.save_fenced("s", held, msgs, take_steers=True)
    sizes = [len(bson.encode(p)) for p in database[mongodb.PARTS].find()]
    sizes.append(len(bson.encode(the_doc(database, "s"))))
    assert max(sizes) < 16 * 2**20 and len(sizes) > 2
    assert mongodb.Store(database).messages("s") == msgs
    store.save("s", msgs[:3])  # a rewrite: the old pages all go (a new one holds its megabyte)
    only_named_parts_stay(database, "s")
    assert len(parts(database)) == 1 and mongodb.Store(database).messages("s") == msgs[:3]


def test_tail_reads_only_the_pages_it_needs(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(5 * mongodb.PAGE + 3)]
    store.save("s", msgs)
    pages = the_doc(database, "s")["pages"]
    database[mongodb.PARTS].delete_many({"_id": {"$in": [e["p"] for e in pages[:3]]}})  # the three oldest
    assert store.tail("s", mongodb.PAGE + 3) == msgs[-(mongodb.PAGE + 3):]
    assert store.tail("s", 2 * mongodb.PAGE + 3) == msgs[-(2 * mongodb.PAGE + 3):]
    with pytest.raises(agent.StoreError, match="kept racing"):  # what a vanished page looks like
        store.tail("s", 3 * mongodb.PAGE + 3)


# -- round trips --------------------------------------------------------------------------------------------


class Commands(monitoring.CommandListener):
    """The commands a client sends (a real server's count, not a mock's)."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in ("hello", "isMaster", "ping", "endSessions"):
            self.commands.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@contextlib.contextmanager
def counting(database: Database[Any]) -> Iterator[tuple[mongodb.Store, Commands]]:
    """A store on emptied collections, over a client of its own whose commands are counted."""
    drop(database)
    commands = Commands()
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, event_listeners=[commands])
    try:
        yield mongodb.Store(client[DATABASE]), commands
    finally:
        client.close()


def test_a_runs_usual_step_is_one_find_and_modify_and_it_sets_updated(database: Database[Any]) -> None:
    with counting(database) as (store, seen):
        held = store.acquire("s", HOLDER, 30)
        msgs = [agent.Message.user("go")]
        store.save_fenced("s", held, msgs, take_steers=True)
        before = store.info("s")
        for i in range(5):
            time.sleep(0.005)
            msgs.append(agent.Message.assistant(f"step {i}"))
            seen.commands.clear()
            store.save_fenced("s", held, msgs, take_steers=True)
            assert seen.commands == ["findAndModify"]
        after = store.info("s")
        assert before is not None and after is not None and after.updated > before.updated
        assert after.messages == 6 and after.created == before.created


def test_a_refused_write_answers_with_the_row_in_its_one_round_trip(database: Database[Any]) -> None:
    """The guard is the server's to evaluate inside the update, whose filter is the id alone: a refused
    write still finds the document, and answers with it."""
    with counting(database) as (store, seen):
        held = store.acquire("s", HOLDER, 30)
        store.save_fenced("s", held, [agent.Message.user("go")], take_steers=True)
        seen.commands.clear()
        other = store.acquire("s", agent.Holder("o", 2, "o" * 32, 0.0), 30)
        assert other.token == held.token and seen.commands == ["findAndModify"]  # busy: the holder, at once
        assert store.cancel("s")
        store.release("s", held)
        taken = store.acquire("s", agent.Holder("o", 2, "o" * 32, 0.0), 30)
        seen.commands.clear()
        with pytest.raises(agent.LeaseLost):
            store.save_fenced("s", held, [agent.Message.user("go"), agent.Message.assistant("late")],
                              take_steers=True)
        assert seen.commands == ["findAndModify"]
        seen.commands.clear()
        with pytest.raises(agent.LeaseLost):
            store.put_journal("s", held, "{}")
        assert seen.commands == ["findAndModify"] and taken.cancelled  # the cancel was handed on


def test_a_step_whose_events_fill_the_tail_plans_a_page_every_few_dozen(database: Database[Any]) -> None:
    with counting(database) as (store, seen):
        held = store.acquire("s", HOLDER, 30)
        msgs = [agent.Message.user("go")]
        store.save_fenced("s", held, msgs, take_steers=True)
        per_step = []
        for i in range(45):
            msgs.append(agent.Message.assistant(f"step {i}"))
            seen.commands.clear()
            store.save_fenced_events("s", held, msgs, take_steers=True, events=note(str(i), 3), keep=10_000)
            per_step.append(list(seen.commands))
        # the usual step: one update, which numbers and stores the events; when the document's tail would
        # reach EVENT_PAGE events, the update is refused for room (and says so), the layout is read, a page
        # inserted and the update that names it commits, then what nothing names is deleted, unacknowledged
        planned = ["findAndModify", "findAndModify", "insert", "findAndModify", "delete"]
        assert per_step.count(["findAndModify"]) == 42 and per_step.count(planned) == 3, per_step
        only_named_parts_stay(database, "s")
        assert len(parts(database)) == 3  # two pages of events, one of messages
        assert len(the_doc(database, "s")["events"]) == 135 - 2 * mongodb.EVENT_PAGE
        events = mongodb.Store(database).events("s", 0, 1000)
        consecutive(events)
        assert [e.data["tag"] for e in events] == [str(i) for i in range(45) for _ in range(3)]
        assert mongodb.Store(database).messages("s") == msgs


# -- the lifecycle ----------------------------------------------------------------------------------------


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
    held = store.acquire("s", HOLDER, 30)
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
    """MongoDB finds 1 == 1.0: the tags keep the JSON forms apart."""
    drop(database)
    store = mongodb.Store(database)
    for sid, value in (("int", 1), ("float", 1.0), ("bool", True), ("str", "1")):
        store.set_metadata(sid, {"v": value})
    for value, sid in ((1, "int"), (1.0, "float"), (True, "bool"), ("1", "str")):
        assert [s.id for s in store.list_sessions(where={"v": value})] == [sid]
    assert the_doc(database, "float")["tags"] == ["v=1.0"]
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
    assert sorted(the_doc(database, "s")["tags"]) == sorted(f"k{n}_{i}={i}" for n in range(4) for i in range(6))


def test_delete_removes_the_parts_and_the_id_starts_again_from_nothing(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    msgs = [agent.Message.user(f"m{i}") for i in range(3 * mongodb.PAGE)]
    held = store.acquire("s", HOLDER, 30)
    store.save_fenced("s", held, msgs, take_steers=False)
    store.set_metadata("s", {"user": "u"})
    assert len(parts(database)) == 3
    assert store.delete("s", force=True) is True
    assert parts(database) == [] and database[mongodb.SESSIONS].find_one({"_id": "s"}) is None
    with pytest.raises(agent.LeaseLost):
        store.save_fenced("s", held, [*msgs, agent.Message.assistant("late")], take_steers=False)
    assert database[mongodb.SESSIONS].find_one({"_id": "s"}) is None  # the late write brought nothing back
    store.save("s", msgs[:2])  # this process wrote the old transcript: its save must not append to it
    again = store.acquire("s", agent.Holder("h", 2, "u" * 32, 0.0), 30)
    assert again.epoch == 1 and again.token == "u" * 32
    info = mongodb.Store(database).info("s")
    assert info is not None and (info.messages, dict(info.metadata)) == (2, {})
    assert mongodb.Store(database).messages("s") == msgs[:2] and store.tail("s", 5) == msgs[:2]


class SavedJustBeforeItsDelete:
    """The sessions collection, but a save of ``session`` lands just before its delete."""

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
    store.mongo.documents = SavedJustBeforeItsDelete(  # type: ignore[assignment]
        store.mongo.documents, "b", lambda: other.save("b", [agent.Message.user("b"), agent.Message.assistant("kept")]))
    assert store.prune(idle_for=0.01) == 2
    assert [s.id for s in other.list_sessions()] == ["b"]
    assert other.messages("b") == [agent.Message.user("b"), agent.Message.assistant("kept")]


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


def test_a_forced_delete_that_finds_nothing_is_never_refused_by_a_run_made_after_it(database: Database[Any]) -> None:
    """Found by the model-based test: a forced delete found no document, a run made the session and took
    its lease before the delete's next read, and the delete raised SessionBusy (which ``force`` never
    does). The delete reads what is there and deletes again: the run made meanwhile is deleted, and fails
    with LeaseLost."""
    drop(database)
    store, other = mongodb.Store(database), mongodb.Store(database)
    store.mongo.documents = _LeasedAfterTheDelete(  # type: ignore[assignment]
        store.mongo.documents, lambda: other.acquire("s", HOLDER, 30))
    assert store.delete("s", force=True) is True
    assert other.holder("s") is None
    with pytest.raises(agent.LeaseLost):
        other.renew("s", agent.Holder("h", 1, "t" * 32, 0.0, epoch=1), 30)


def test_the_schema_is_1_its_indexes_exist_and_a_newer_one_is_refused(database: Database[Any]) -> None:
    drop(database)
    mongodb.create_indexes(database)  # twice: idempotent
    mongodb.upgrade(database)  # schema 1 already: nothing to do
    keys = {tuple(ix["key"].items()) for ix in database[mongodb.SESSIONS].list_indexes()}
    assert {(("updated", -1), ("_id", -1)), (("tags", 1), ("updated", -1), ("_id", -1)),
            (("open_since", 1), ("_id", 1))} <= keys
    schema = database[mongodb.SCHEMA].find_one({"_id": "schema"})
    assert schema is not None and schema["version"] == mongodb.SCHEMA_VERSION == 1
    assert mongodb.Store(database).backend.identity == schema["identity"]
    database[mongodb.SCHEMA].update_one({"_id": "schema"}, {"$set": {"version": 2}})
    with pytest.raises(agent.StoreError, match="newer than"):
        _ = mongodb.Store(database).backend.identity
    drop(database)


def test_a_database_made_by_schema_1_opens() -> None:
    """What schema 1 wrote, as it wrote it (a session, its page, its log, a steer), read by this version."""
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, serverSelectionTimeoutMS=10_000)
    db = client[servers.database_name("schema1")]
    try:
        for name in mongodb.COLLECTIONS:
            db.drop_collection(name)
        msgs = [agent.Message.user(f"m{i}").to_json() for i in range(mongodb.PAGE + 2)]
        events = [encode("note", {"n": i}) for i in range(3)]
        db[mongodb.SCHEMA].insert_one({"_id": "schema", "version": 1, "identity": "i" * 32})
        db[mongodb.PARTS].insert_one({"_id": "p1", "session": "s", "generation": "g", "seal": 0,
                                      "texts": msgs[:mongodb.PAGE]})
        db[mongodb.SESSIONS].insert_one({
            "_id": "s", "generation": "g", "seal": 1, "version": 3, "exists": True, "incarnation": "c" * 32,
            "created": 1.8e9, "updated": 1.8e9 + 1, "at": 1.8e9 + 1, "write": "w", "length": len(msgs), "edits": 1,
            "tail": msgs[mongodb.PAGE:], "tail_bytes": 20, "pages": [{"p": "p1", "f": 0, "n": mongodb.PAGE}],
            "epoch": 1, "expires": 1.8e9, "host": "h", "pid": 1, "metadata": '{"user":"u"}', "tags": ['user="u"'],
            "last_seq": 12, "events_start": 10, "events_from": 10, "events": events, "events_bytes": 60,
            "event_pages": [], "steers": [{"id": 2, "text": "steer", "key": None}]})
        mongodb.upgrade(db)
        store = mongodb.Store(db)
        assert [m.to_json() for m in store.messages("s")] == msgs
        assert [e.seq for e in store.events("s", 0, 10)] == [10, 11, 12]
        assert store.pending_steers("s") == ["steer"]
        assert [s.id for s in store.list_sessions(where={"user": "u"})] == ["s"]
        held = store.acquire("s", HOLDER, 30)
        assert store.save_fenced("s", held, [*store.messages("s"), agent.Message.assistant("a")],
                                 take_steers=True).steers == ["steer"]
        assert store.append_events("s", held, events, keep=100) == 15
    finally:
        client.drop_database(db.name)
        client.close()


# -- the event log ----------------------------------------------------------------------------------------


def note(tag: str, n: int = 1) -> list[str]:
    return [encode("note", {"tag": tag, "n": i}) for i in range(n)]


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


def test_an_event_larger_than_the_tail_gets_a_page_of_its_own_counted_in_bytes(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 30)
    small = store.append_events("s", held, note("small"), keep=100)
    text = "é" * (mongodb.EVENT_TAIL_BYTES // 2 + 10)
    # the store keeps an event's text as it is given, not necessarily ASCII: this one has fewer chars than bytes
    big = json.dumps({"kind": "note", "at": time.time(), "data": {"tag": "big", "text": text}}, ensure_ascii=False)
    assert len(big) < mongodb.EVENT_TAIL_BYTES < len(big.encode())
    last = store.append_events("s", held, [big, *note("after")], keep=100)
    doc = the_doc(database, "s")
    assert doc["events"] == [] and len(doc["event_pages"]) == 1  # the small one, the big one and the last
    assert len(bson.encode(doc)) < 10_000
    got = mongodb.Store(database).events("s", 0, 100)
    assert [e.seq for e in got] == [small, small + 1, last] and got[1].data["text"] == text


@pytest.mark.parametrize("meanwhile", ["an append", "a steer"])
def test_a_plan_overtaken_by_a_write_of_what_it_read_is_planned_again(database: Database[Any], meanwhile: str) -> None:
    """A writer has inserted its page (the tail was full) when another write lands. An append of events
    changed what the plan read: the update is refused for room, the writer deletes its page, plans again
    and commits. A steer changed nothing the plan read (sixteen steering processes must not starve a run's
    page): it commits as planned."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 30)
    filled = full_tail(store, "s", held)
    writer = mongodb.Store(database)
    writer.mongo.parts = paused = Paused(writer.mongo.parts, "insert_many")  # type: ignore[assignment]
    appending = Outcome(lambda: writer.append_events("s", held, note("late", 3), keep=10_000))
    assert paused.there.wait(30)
    first = parts(database)
    if meanwhile == "a steer":
        store.add_steer("s", "meanwhile")
    else:
        store.append_events("s", held, note("meanwhile"), keep=10_000)
    paused.go.set()
    extra = 1 if meanwhile == "an append" else 0
    assert appending.join().value == filled + extra + 3
    only_named_parts_stay(database, "s")
    assert (parts(database) == first) is (meanwhile == "a steer") and len(parts(database)) == 1
    events = store.events("s", 0, 1000)
    assert consecutive(events)[-1] == filled + extra + 3 and [e.data["tag"] for e in events[-3:]] == ["late"] * 3


def test_a_long_save_overtaken_by_another_save_plans_again_and_stores_only_its_own(database: Database[Any]) -> None:
    """A save of a transcript too long for the document has inserted its pages when another process's save
    lands (a write of messages: ``edits`` moves). Its update is refused for room; it deletes its pages,
    plans again on what is stored now, and replaces it (a plain save replaces); no page of either plan that
    the document does not name stays."""
    drop(database)
    store = mongodb.Store(database)
    store.save("s", [agent.Message.user("first")])
    writer = mongodb.Store(database)
    writer.mongo.parts = paused = Paused(writer.mongo.parts, "insert_many")  # type: ignore[assignment]
    long = [agent.Message.user(f"m{i}") for i in range(2 * mongodb.PAGE + 3)]
    saving = Outcome(lambda: writer.save("s", long))
    assert paused.there.wait(30)
    first = parts(database)
    assert len(first) == 2
    store.save("s", [agent.Message.user("first"), agent.Message.assistant("meanwhile")])
    paused.go.set()
    assert saving.join().error is None
    assert mongodb.Store(database).messages("s") == long
    only_named_parts_stay(database, "s")
    assert len(parts(database)) == 2 and not set(first) & set(parts(database))


def test_a_writer_fenced_out_mid_append_writes_nothing_readable(database: Database[Any]) -> None:
    """Two writers: A has written its page (the tail was full) when its lease lapses and B takes the session
    and appends; A's update, fenced by its token and epoch, is refused: LeaseLost, and its page goes."""
    drop(database)
    store = mongodb.Store(database)
    a = store.acquire("s", agent.Holder("a", 1, "a" * 32, 0.0), 0.3)
    store.save_fenced("s", a, [agent.Message.user("q")], take_steers=False)
    filled = full_tail(store, "s", a)
    writer_a = mongodb.Store(database)
    writer_a.mongo.parts = paused = Paused(writer_a.mongo.parts, "insert_many")  # type: ignore[assignment]
    appending = Outcome(lambda: writer_a.append_events("s", a, note("late a", 3), keep=10_000))
    assert paused.there.wait(30)
    assert len(parts(database)) == 1 and named(database, "s") == []  # written, named by nothing
    wait_for(lambda: store.holder("s") is None, "A's lease to lapse")
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
    only_named_parts_stay(database, "s")  # A took its page back
    assert mongodb.Store(database).messages("s") == [agent.Message.user("q")]


def test_a_writer_killed_between_its_page_and_its_update_leaves_no_gap(database: Database[Any]) -> None:
    """A process writes its page, then is killed (SIGKILL) before the update that would number its events
    and name the page. Nothing was numbered: the next append takes the next number, a follower that was
    waiting sees no gap and nothing of the dead writer's, and the session's next planned write deletes the
    page it left."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 60)
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
        assert parts(database) == written and named(database, "s") == []
    finally:
        child.kill()
        child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert the_doc(database, "s")["last_seq"] == filled  # it numbered nothing
    last = store.append_events("s", held, note("after", 2), keep=10_000)  # a planned write: the tail is full
    follower.join(60)
    assert last == filled + 2
    assert consecutive(seen)[-1] == last and "dead" not in {e.data["tag"] for e in seen}
    assert seen == mongodb.Store(database).events("s", 0, 1000)
    only_named_parts_stay(database, "s")
    assert written[0] not in parts(database)


@pytest.mark.parametrize("deleted", ["after its page", "before its page"])
def test_a_delete_racing_an_append_leaves_nothing_readable_and_no_page(database: Database[Any], deleted: str) -> None:
    """The session is deleted while a writer appends across a page boundary: after it wrote its page, or
    before it did (the writer's page lands after the delete). Its update is refused: LeaseLost; it takes
    its page back; the id started again reads only its own."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 60)
    old = full_tail(store, "s", held)
    writer = mongodb.Store(database)
    writer.mongo.parts = paused = Paused(  # type: ignore[assignment]
        writer.mongo.parts, "insert_many", after=deleted == "after its page")
    appending = Outcome(lambda: writer.append_events("s", held, note("late", 2), keep=10_000))
    assert paused.there.wait(30)
    assert store.delete("s", force=True) is True
    paused.go.set()
    assert isinstance(appending.join().error, agent.LeaseLost)
    wait_for(lambda: parts(database) == [], "the refused writer's page to go", timeout=10)
    assert store.events("s", 0, 100) == []
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
        assert store.events("s", 0, 100) == []
        wait_for(lambda: parts(database) == [], "the refused writers' pages to go", timeout=10)


def append_until_lost(store: mongodb.Store, held: agent.Holder) -> None:
    while True:
        store.append_events("s", held, note("go", 5), keep=40)


def test_the_cap_drops_whole_pages_in_the_same_write(database: Database[Any]) -> None:
    with counting(database) as (store, seen):
        held = store.acquire("s", HOLDER, 30)
        for i in range(10):
            last = store.append_events("s", held, note(f"a{i}", 20), keep=1000)
        before = [e["p"] for e in the_doc(database, "s")["event_pages"]]
        assert len(before) == 3 and len(the_doc(database, "s")["events"]) == 200 - 3 * mongodb.EVENT_PAGE
        seen.commands.clear()
        last = store.append_events("s", held, note("b", 70), keep=90)  # overflows: a planned write
        assert seen.commands == ["findAndModify", "insert", "findAndModify", "delete"]
        doc = the_doc(database, "s")
        assert doc["events_from"] == last - 89 and doc["last_seq"] == last
        after = [e["p"] for e in doc["event_pages"]]
        assert after[0] == before[2] and len(after) == 2  # the two wholly below the cap are gone
        only_named_parts_stay(database, "s")
        kept = store.events("s", 0, 1000)
        assert consecutive(kept) == list(range(last - 89, last + 1))
        last = store.append_events("s", held, note("c", 2), keep=5)  # the cap drops the pages: planned
        assert [e.seq for e in store.events("s", 0, 1000)] == list(range(last - 4, last + 1))
        seen.commands.clear()
        last = store.append_events("s", held, note("d", 2), keep=5)  # no page: one update, capped
        assert seen.commands == ["findAndModify"] and the_doc(database, "s")["event_pages"] == []
        assert [e.seq for e in store.events("s", 0, 1000)] == list(range(last - 4, last + 1))


def test_a_reader_racing_the_cap_reads_again_and_never_sees_a_hole(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 60)
    store.append_events("s", held, note("first"), keep=100)
    writing = Outcome(lambda: [store.append_events("s", held, note(f"w{i}", 13), keep=100) for i in range(120)])
    reader = mongodb.Store(database)
    reads = 0
    while writing.thread.is_alive():
        got = reader.events("s", 0, 1000)
        assert 1 <= len(got) <= 100
        consecutive(got)
        reads += 1
    assert writing.join().error is None and reads > 5
    assert len(reader.events("s", 0, 1000)) == 100
    only_named_parts_stay(database, "s")
    assert len(parts(database)) <= 3


def test_processes_appending_across_page_boundaries_never_share_a_number(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 120)
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
    only_named_parts_stay(database, "s")  # every loser took its page back


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


def test_a_page_that_could_not_be_written_numbers_nothing(database: Database[Any]) -> None:
    """Its insert failed: nothing was written that anything reads, so the error says it did not happen."""
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", HOLDER, 30)
    filled = full_tail(store, "s", held)
    failing = mongodb.Store(database)
    failing.mongo.parts = FailsToInsert(failing.mongo.parts)  # type: ignore[assignment]
    with pytest.raises(agent.StoreError, match="write of session 's' failed") as raised:
        failing.append_events("s", held, note("lost", 2), keep=100)
    assert not isinstance(raised.value, agent.OutcomeUnknown)
    assert the_doc(database, "s")["last_seq"] == filled and parts(database) == []
    again = failing.append_events("s", held, note("again", 2), keep=100)  # the next try goes through
    assert again == filled + 2 and consecutive(store.events("s", 0, 100))[-1] == again


def test_delete_and_prune_take_the_log_and_its_pages(database: Database[Any]) -> None:
    drop(database)
    store = mongodb.Store(database)
    held = store.acquire("s", agent.Holder("h", 1, "a" * 32, 0.0), 30)
    store.append_events("s", held, note("s", 40), keep=1000)
    store.append_events("s", held, note("s", 40), keep=1000)
    other = store.acquire("t", agent.Holder("h", 1, "b" * 32, 0.0), 30)
    store.append_events("t", other, note("t", 40), keep=1000)
    store.append_events("t", other, note("t", 40), keep=1000)
    assert len(parts(database)) == 2
    t_pages = named(database, "t")
    assert store.delete("s", force=True) is True
    assert parts(database) == t_pages and store.events("s", 0, 100) == []
    store.release("t", other)
    time.sleep(0.05)
    assert store.prune(idle_for=0.01) == 1
    assert parts(database) == []
