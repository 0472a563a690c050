"""The event log (``EventStore``), in ``agent_events``, numbered by the session's document.

``events_last``, the last number given, is claimed by the fenced update (the save's own, or one of its
own), then the events are inserted into ``agent_events``. The claim is the atomic step: a superseded run
claims nothing, so it inserts nothing; a writer that dies between the two leaves a gap in the numbers,
which readers skip as they skip the ones the cap and deletes leave. Reads take the range
``events_from``..``events_last`` from the document, so events outlive their session's document only
unread. A save's own update claims by the fields ``claiming`` gives and reads back a ``Log`` (store.py,
pages.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import ReturnDocument
from pymongo.errors import PyMongoError

from agent_sessions import Holder, Message, Saved, StoredEvent, StoreError, eventlog, validate

from .base import StoreBase, log
from .lease import LEASE, lost

_LOG_START = {"$multiply": [{"$toLong": "$$NOW"}, 1000]}
"""``eventlog.first_seq`` on the server's clock (microseconds; ``$$NOW`` counts milliseconds)."""
HAS_LOG = {"events_last": {"$exists": True}}
LOG = {"events_from": 1, "events_last": 1}


def claiming(n: int) -> dict[str, Any]:
    """The fields of a pipeline ``$set`` that claim ``n`` numbers of the session's event log: ``events_last``
    (the last number given) goes up by ``n``, and a log that has none starts at ``_LOG_START``, which
    ``events_from`` records (both expressions see the document as it was before the stage)."""
    return {"events_from": {"$ifNull": ["$events_from", _LOG_START]},
            "events_last": {"$add": [{"$ifNull": ["$events_last", {"$subtract": [_LOG_START, 1]}]}, n]}}


@dataclass(frozen=True, slots=True)
class Log:
    """The numbers a session's event log has given: from ``first`` (its start) to ``last``."""

    first: int
    last: int

    @classmethod
    def of(cls, doc: Mapping[str, Any], more: int = 0) -> Log:
        """The log a session document records, with ``more`` numbers claimed since it was read."""
        return cls(int(doc["events_from"]), int(doc["events_last"]) + more)


NO_LOG = Log(0, 0)
"""What a write that claimed no number returns."""


class EventLog(StoreBase):
    """``EventStore``: the claim is the atomic step."""

    if TYPE_CHECKING:  # what this part needs of the store that joins it, for the type checker only
        def _save_fenced(
            self, session: str, holder: Holder, msgs: Sequence[Message], take_steers: bool, replace: bool, claim: int
        ) -> tuple[Saved, Log]:
            """The store's fenced save, claiming ``claim`` numbers in its own update (store.py)."""
            ...

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        """One fenced update of the session's document claims the numbers (``events_last``; the first log's
        start on the server's clock), then one insert stores the events, then the cap deletes the oldest. A
        superseded holder's claim matches nothing: ``LeaseLost``, and nothing is written."""
        validate.session_id(session)
        records = eventlog.check_append(events, keep)
        with self._failing("append_events", session):
            log_after = self._claim({"_id": session, "token": holder.token, "epoch": holder.epoch}, len(records),
                                    begin=True)
            if log_after is None:
                raise lost(session, holder, self._sessions.find_one({"_id": session}, LEASE))
            return self._insert_events(session, log_after, records, keep)

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int,
    ) -> Saved:
        """The numbers are claimed by the save's own update (its ``$inc`` beside the ``$push``, or in the
        rewrite's pipeline), so a ``TranscriptConflict`` or ``LeaseLost`` claims none and writes nothing;
        the events are inserted after it, as in ``append_events``."""
        records = eventlog.check_append(events, keep) if events else []
        eventlog.check_keep(keep)
        saved, log_after = self._save_fenced(session, holder, msgs, take_steers, replace, len(records))
        if records:
            with self._failing("save_fenced_events", session):
                self._insert_events(session, log_after, records, keep)
        return saved

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        """Two reads: the session's document says which numbers its log holds (``events_from`` to
        ``events_last``), then the events in that range above ``after``, by the ``session_seq`` index. So
        a deleted session's events are gone at the deletion of its document, before they are, and events a
        writer stored after its session was deleted (it claimed before) are never read."""
        validate.session_id(session)
        after, limit = eventlog.check_read(after, limit)
        with self._failing("events", session):
            doc = self._sessions.find_one({"_id": session}, LOG)
            if doc is None or "events_last" not in doc:
                return []
            log_now = Log.of(doc)
            found = list(self._events.find(
                {"session": session, "seq": {"$gt": max(after, log_now.first - 1), "$lte": log_now.last}},
                {"_id": 0, "seq": 1, "text": 1},
            ).sort("seq", 1).limit(limit))
        try:
            return [eventlog.decode(int(e["seq"]), e["text"]) for e in found]
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"MongoDB store: session {session!r} holds a corrupt event: {exc}") from exc

    def _claim(self, where: dict[str, Any], n: int, *, begin: bool = False) -> Log | None:
        """Claim ``n`` numbers by one update of the document ``where`` finds; the log's numbers after it,
        or ``None`` when nothing matched. ``begin``: a pipeline that starts a log that has none (on the
        server's clock); otherwise an ``$inc``, for a filter that requires the log to have begun."""
        change: Any = [{"$set": claiming(n)}] if begin else {"$inc": {"events_last": n}}
        doc = self._sessions.find_one_and_update(where, change, projection=LOG, return_document=ReturnDocument.AFTER)
        return None if doc is None else Log.of(doc)

    def _insert_events(self, session: str, log_after: Log, records: list[str], keep: int) -> int:
        """Store ``records`` under the last ``len(records)`` numbers claimed, then apply the cap. A writer
        that dies before the insert leaves those numbers unused: a gap, which readers skip. An insert that
        fails part way takes back what it stored, so the caller may append the events again without any
        being read twice; the cap's delete failing only leaves the log longer until the next append."""
        first = log_after.last - len(records) + 1
        try:
            self._events.insert_many(
                [{"session": session, "seq": first + i, "text": text} for i, text in enumerate(records)], ordered=True)
        except PyMongoError:
            try:
                self._events.delete_many({"session": session, "seq": {"$gte": first, "$lte": log_after.last}})
            except PyMongoError as exc:
                log.warning("MongoDB store: events %d..%d of session %r were partly stored and could not be "
                            "taken back: %s", first, log_after.last, session, exc)
            raise
        oldest_kept = log_after.last - keep + 1
        if oldest_kept > log_after.first:
            try:
                self._events.delete_many({"session": session, "seq": {"$lt": oldest_kept}})
            except PyMongoError as exc:
                log.warning("MongoDB store: the cap of session %r's events was not applied this time: %s",
                            session, exc)
        return log_after.last
