from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from pymongo.database import Database

import agent_sessions as agent
import storetest
from stores import mongodb
from tests import servers

MONGO_URL = servers.MONGO_URL
DATABASE = "agent_sessions_test"


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
    assert doc is not None and doc["bodies"] == [call.to_json()]


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
