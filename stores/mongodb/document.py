"""The session's document, the store's commit point: one per session in ``agent_sessions``, holding the
steers waiting for it, its transcript's version and tail, its tool journal, its run lease, its lifecycle
fields and its event log's numbers. So every step of a run is one update of one document, atomic without
transactions.

Here is what every part of the store writes on it and reads back from it alike: the times of its updates
on the server's clock, the mark a read puts on the messages it returns, the metadata's tags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from agent_sessions import Message, lifecycle
from agent_sessions.contract import Scalar
from agent_sessions.messages import read_from, turn_open

TOUCH = {"updated": True}
"""``$currentDate`` of a classic update: ``updated`` is the server's clock, as the lease's ``$$NOW``."""
STAMP = {"created": {"$ifNull": ["$created", "$$NOW"]}, "updated": "$$NOW"}
"""The same in a pipeline update, which may create the session: ``created`` once, ``updated`` every time."""


def opening(items: Sequence[Message], before: Sequence[Message] | None) -> tuple[str, Any] | None:
    """What a save of ``items`` over ``before`` (the transcript it replaces; ``None``: not known) does to the
    session's ``open_since``, as a pipeline ``$set`` of it: kept (or now) when ``items`` leaves the turn open
    (``messages.turn_open``), removed when it closes it; ``None`` when the known transcript was in the same
    state, so the stored mark already says it (the usual step writes nothing more)."""
    if before is not None and turn_open(before) == turn_open(items):
        return None
    return "open_since", opened_since(items)


OPEN = {"$ifNull": ["$open_since", "$$NOW"]}
"""The turn is open: the mark kept, or set now."""
CLOSED = {"$cond": [{"$or": [{"$gt": [{"$size": {"$ifNull": ["$queued", []]}}, 0]},
                             {"$gt": [{"$size": {"$ifNull": ["$steers", []]}}, 0]}]}, OPEN, "$$REMOVE"]}
"""A write that closes the turn: the mark removed, unless a queued message or a steer waits (the SQL stores'
``WAITING``). A stage of its own after the write's, so it sees the arrays the write left."""


def opened_since(items: Sequence[Message]) -> Any:
    """A rewrite's ``open_since``: ``opening`` of a transcript whose predecessor is not known."""
    return OPEN if turn_open(items) else CLOSED


def mark(items: Sequence[Message], doc: dict[str, Any]) -> None:
    """Mark what a read returns with the session's incarnation, its ``created`` as ``info`` shows it
    (``messages.read_from``)."""
    if "created" in doc:
        read_from(items, doc["_id"], aware(doc["created"]))


def tags_of(metadata: Mapping[str, Scalar]) -> list[str]:
    """``"key=<the value's JSON>"`` per key: what ``where`` matches with ``$all`` (keys have no ``=``)."""
    return [f"{k}={lifecycle.metadata_value(k, v)}" for k, v in metadata.items()]


def aware(value: datetime) -> datetime:
    """pymongo returns naive UTC datetimes unless the client was made with ``tz_aware=True``."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
