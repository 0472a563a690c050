"""The collections, and what the caller's migration runs: ``create_indexes`` (the indexes beyond ``_id``
that the store's queries use) and, for a database written by an older version, ``upgrade``.

Every query of a run is by ``_id`` (the event log's pages too: the session's document names them);
listing and pruning walk ``(updated, _id)``.
"""

from __future__ import annotations

from typing import Any

from pymongo.collection import Collection
from pymongo.database import Database

from agent_sessions import StoreError, lifecycle

from .document import tags_of
from .eventlayout import upgrade_log

SESSIONS = "agent_sessions"
PAGES = "agent_pages"
EVENT_PAGES = "agent_event_pages"
EVENTS = "agent_events"
"""The earlier event log, one document per event: read until ``upgrade`` (or the session's next write of events)
moves a log into pages, and dropped by ``upgrade``."""
COLLECTIONS = (SESSIONS, PAGES, EVENT_PAGES, EVENTS)
_TRIES = 100

INDEXES: list[tuple[str, list[tuple[str, int]], dict[str, Any]]] = [
    (SESSIONS, [("updated", -1), ("_id", -1)], {"name": "updated_id"}),
    (SESSIONS, [("tags", 1), ("updated", -1), ("_id", -1)], {"name": "tags_updated_id"}),
    # schema 5, stranded runs: only the open sessions have the field, so the sweep reads only them.
    (SESSIONS, [("open_since", 1)], {"name": "open_since", "sparse": True}),
]
"""(collection, keys, options) for each index beyond ``_id`` the store's queries use: ``updated_id`` for
``list_sessions`` newest first (keyset pages on ``(updated, _id)``) and for ``prune`` (oldest first, a
range on ``updated``); ``tags_updated_id``, multikey, for a listing filtered by metadata (``where``). The
event log needs none: its pages are read and deleted by ``_id``. ``open_since``, sparse, for
``list_sessions(stranded=True)``: it holds the sessions whose turn is open, none of the finished ones."""


def create_indexes(database: Database[Any]) -> None:
    """Create ``INDEXES`` (idempotent: an index already there is left as it is)."""
    for collection, keys, options in INDEXES:
        database[collection].create_index(keys, **options)


def upgrade(database: Database[Any]) -> None:
    """Bring a database written by an older agent-sessions up to date, for the caller's migration. Safe to
    run again. Run it with no run in flight: a lease moves with epoch 1, which no run of the old version
    carries, and a log moves as it was read.

    - 0.1: leases (``agent_runs``) and tool journals (``agent_journals``) move onto their session's
      document, where one update both checks a run's lease and writes;
    - 0.2: the lifecycle's fields (``_backfill_lifecycle``);
    - the earlier event log, one document per event in ``agent_events``: each session's log moves into pages
      (``eventlayout.upgrade_log``, numbers kept), then ``agent_events`` is dropped."""
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
    old_logs = [doc["_id"] for doc in sessions.find({"events_last": {"$exists": True},
                                                     "events_log": {"$exists": False}}, {"_id": 1})]
    for session in old_logs:
        for _ in range(_TRIES):
            if upgrade_log(sessions, database[EVENT_PAGES], database[EVENTS], session):
                break
        else:  # something keeps appending to it the old way: its events would be lost with agent_events
            raise StoreError(f"MongoDB upgrade: the event log of session {session!r} kept changing while it "
                             "was moved: is a run of the older version still writing?")
    database.drop_collection(EVENTS)  # what is left there no log reads: moved, capped, or of a deleted session
    sessions.update_many({"events_legacy": {"$exists": True}}, {"$unset": {"events_legacy": ""}})
    # -- stranded runs (schema 5): every session with a transcript is open since its last write, too many and
    # never too few; the first sweep (agent.recover) looks at each once and clears the finished ones.
    # Run again, it marks the finished ones again, and the next sweep clears them again.
    sessions.update_many({"version": {"$exists": True}, "open_since": {"$exists": False}},
                         [{"$set": {"open_since": "$updated"}}])


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
