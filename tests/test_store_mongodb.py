from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import bson
import pymongo
import pytest
from pymongo.database import Database

import agent_sessions as agent
import storetest
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
    call = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c", "f", storetest.contract.ODD_JSON)])
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
