"""The collections, and what the caller's migration runs: ``create_indexes`` (the indexes beyond ``_id``
that the store's queries use) and, for a database written by an older version, ``upgrade``.

Every query of a run is by ``_id``; listing and pruning walk ``(updated, _id)``; the event log reads and
deletes by ``(session, seq)``.
"""

from __future__ import annotations

from typing import Any

from pymongo.collection import Collection
from pymongo.database import Database

from agent_sessions import lifecycle

from .document import tags_of

SESSIONS = "agent_sessions"
PAGES = "agent_pages"
EVENTS = "agent_events"
COLLECTIONS = (SESSIONS, PAGES, EVENTS)

INDEXES: list[tuple[str, list[tuple[str, int]], dict[str, Any]]] = [
    (SESSIONS, [("updated", -1), ("_id", -1)], {"name": "updated_id"}),
    (SESSIONS, [("tags", 1), ("updated", -1), ("_id", -1)], {"name": "tags_updated_id"}),
    (EVENTS, [("session", 1), ("seq", 1)], {"name": "session_seq", "unique": True}),
]
"""(collection, keys, options) for each index beyond ``_id`` the store's queries use: ``updated_id`` for
``list_sessions`` newest first (keyset pages on ``(updated, _id)``) and for ``prune`` (oldest first, a
range on ``updated``); ``tags_updated_id``, multikey, for a listing filtered by metadata (``where``);
``session_seq`` for reading a session's events in order and deleting them by range, and, unique, so no two
events of a session ever share a number."""


def create_indexes(database: Database[Any]) -> None:
    """Create ``INDEXES`` (idempotent: an index already there is left as it is)."""
    for collection, keys, options in INDEXES:
        database[collection].create_index(keys, **options)


def upgrade(database: Database[Any]) -> None:
    """Bring a database written by agent-sessions 0.1 up to date, for the caller's migration: leases
    (``agent_runs``) and tool journals (``agent_journals``) move onto their session's document, where one
    update both checks a run's lease and writes. Safe to run again. Run it with no run in flight: a lease
    moves with epoch 1, which no run of the old version carries. 0.3's event log needs only its index
    (``agent_events``' ``session_seq``): a session's first claim starts its log."""
    sessions = database[SESSIONS]
    for doc in database["agent_journals"].find():
        sessions.update_one({"_id": doc["_id"]}, {"$set": {"journal": doc["body"]}}, upsert=True)
    for doc in database["agent_runs"].find():
        lease = {k: doc.get(k) for k in ("host", "pid", "token", "expires")}
        sessions.update_one(
            {"_id": doc["_id"]},
            {"$set": {**lease, "cancelled": bool(doc.get("cancelled"))}, "$max": {"epoch": 1}},
            upsert=True,
        )
    database.drop_collection("agent_journals")
    database.drop_collection("agent_runs")
    _backfill_lifecycle(sessions)
    for collection, keys, options in INDEXES:  # the event log's unique index, which no two seqs may break
        if collection == EVENTS:
            database[collection].create_index(keys, **options)


def _backfill_lifecycle(sessions: Collection[Any]) -> None:
    """agent-sessions 0.2 (no lifecycle): a session's document gains ``created`` and ``updated``, both the
    upgrade's time on the server's clock (0.2 kept no such time), and ``tags`` from its ``metadata``. A
    document that was written (a transcript, a lease now or before, a journal) is a session; one holding
    only steers is not, as before."""
    written = {"$or": [{"version": {"$exists": True}}, {"epoch": {"$exists": True}},
                       {"journal": {"$exists": True}}]}
    sessions.update_many({"created": {"$exists": False}, **written},
                         [{"$set": {"created": {"$ifNull": ["$updated", "$$NOW"]},
                                    "updated": {"$ifNull": ["$updated", "$$NOW"]}}}])
    for doc in sessions.find({"metadata": {"$type": "string"}, "tags": {"$exists": False}}, {"metadata": 1}):
        tags = tags_of(lifecycle.decode_metadata(doc["metadata"]))
        sessions.update_one({"_id": doc["_id"], "metadata": doc["metadata"]}, {"$set": {"tags": tags}})
