"""A store in MongoDB, over the caller's pymongo ``Database``: ``mongodb.Store(db)``. It needs only what a
standalone mongod gives: single-document atomicity, no transactions (``backend``, ``pipeline``, ``layout``).
The collections, indexes and schema: ``schema`` (``create_indexes``, ``upgrade``).
"""

from __future__ import annotations

from typing import Any

try:  # the driver first, so that a missing one says how to install it
    from pymongo.database import Database
except ImportError as exc:  # pragma: no cover - the extra's job
    raise ImportError(
        "stores.mongodb requires pymongo. Install it with: pip install 'stored-agent-sessions[mongodb]'"
    ) from exc

from agent_sessions.backed import BackedStore
from agent_sessions.errors import ArgumentError

from .backend import Backend
from .layout import EVENT_PAGE, EVENT_TAIL_BYTES, ITEM_BYTES, MAX_MESSAGE_BYTES, PAGE, PAGE_BYTES, TAIL_BYTES
from .schema import COLLECTIONS, INDEXES, PARTS, SCHEMA, SCHEMA_VERSION, SESSIONS, create_indexes, upgrade


class Store(BackedStore):
    """Sessions in ``database`` (yours: the store never closes its client)."""

    def __init__(self, database: Database[Any]) -> None:
        if not isinstance(database, Database):
            raise ArgumentError(
                f"mongodb.Store needs a pymongo Database (client['name']), got {type(database).__name__}")
        self.database = database
        self.mongo = Backend(database)
        super().__init__(self.mongo, max_message_bytes=MAX_MESSAGE_BYTES, name="MongoDB store")

    def __repr__(self) -> str:
        return f"mongodb.Store({self.backend!r})"


__all__ = ["COLLECTIONS", "EVENT_PAGE", "EVENT_TAIL_BYTES", "INDEXES", "ITEM_BYTES", "MAX_MESSAGE_BYTES", "PAGE",
           "PAGE_BYTES", "PARTS", "SCHEMA", "SCHEMA_VERSION", "SESSIONS", "TAIL_BYTES", "Backend", "Store",
           "create_indexes", "upgrade"]
