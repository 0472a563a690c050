"""The collections, their indexes and the schema's version: what the caller's migration runs
(``create_indexes``, or ``upgrade``, which also brings a database of an older schema up to this one).

The schema is a document of ``agent_schema``: ``{_id: "schema", version, identity}``, made by whichever
comes first, ``create_indexes``, ``upgrade`` or a store's first need of ``identity`` (the random token that
names the database: ``Backend.identity``). A store refuses a database whose schema is newer than it knows.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from pymongo import ReturnDocument
from pymongo.database import Database

from agent_sessions.errors import StoreError

SESSIONS = "agent_sessions"
"""One document per session: its row, the waiting steers and queue, the accepted keys, the newest messages
and events, and the list of its parts."""
PARTS = "agent_parts"
"""What does not fit a session's document: pages of messages, pages of events, long steers and queued
messages. Each is written before the update of the session's document that names it, and read only
through that document."""
SCHEMA = "agent_schema"
COLLECTIONS = (SESSIONS, PARTS, SCHEMA)
SCHEMA_VERSION = 1

INDEXES: list[tuple[str, list[tuple[str, int]], dict[str, Any]]] = [
    (SESSIONS, [("updated", -1), ("_id", -1)], {"name": "updated_id"}),
    (SESSIONS, [("tags", 1), ("updated", -1), ("_id", -1)], {"name": "tags_updated_id"}),
    (SESSIONS, [("open_since", 1), ("_id", 1)], {"name": "open_since_id", "sparse": True}),
    (PARTS, [("session", 1), ("generation", 1), ("seal", 1)], {"name": "session_generation_seal"}),
]
"""(collection, keys, options) of each index beyond ``_id`` (docs/stores/mongodb.md says which query reads
which); ``open_since_id`` is sparse: only the open sessions have the field."""

UPGRADES: dict[int, Callable[[Database[Any]], None]] = {}
"""``UPGRADES[n]`` brings a database of schema ``n`` to ``n + 1`` (none yet: schema 1 is the first)."""


def create_indexes(database: Database[Any]) -> None:
    """Create ``INDEXES`` and the schema's document (idempotent: what is there stays as it is)."""
    for collection, keys, options in INDEXES:
        database[collection].create_index(keys, **options)
    schema_of(database)


def upgrade(database: Database[Any]) -> None:
    """Bring ``database`` to ``SCHEMA_VERSION`` (each step of ``UPGRADES`` in turn), then ``create_indexes``.
    Safe to run again; run it with no run of an older version in flight."""
    version = int(schema_of(database)["version"])
    while version < SCHEMA_VERSION:
        UPGRADES[version](database)
        version += 1
        database[SCHEMA].update_one({"_id": "schema"}, {"$set": {"version": version}})
    create_indexes(database)


def schema_of(database: Database[Any]) -> dict[str, Any]:
    """The schema's document, made now if the database has none (a new database is of this schema)."""
    doc = database[SCHEMA].find_one_and_update(
        {"_id": "schema"}, {"$setOnInsert": {"version": SCHEMA_VERSION, "identity": uuid.uuid4().hex}},
        upsert=True, return_document=ReturnDocument.AFTER)
    assert doc is not None  # upserted
    if int(doc["version"]) > SCHEMA_VERSION:
        raise StoreError(f"MongoDB store: database {database.name!r} is of schema {doc['version']}, newer than "
                         f"this agent-sessions knows ({SCHEMA_VERSION}): upgrade agent-sessions")
    return dict(doc)
