"""How a session's event log lies in MongoDB, as its transcript does (layout.py): the newest events in the
session's document (the events tail), the older ones in write-once pages in ``agent_event_pages`` that the
document names. The document's fields:

- ``events_from``, ``events_last``: the numbers a read returns (the cap raises ``events_from``);
- ``events_tail``: the texts of the newest events, numbered up to ``events_last`` (under ``EVENT_PAGE``
  events and ``EVENT_TAIL_BYTES``), and ``events_bytes``, their size;
- ``events_pages``: ``[[first, key], ...]``, oldest first: page ``"<events_log>:<key>"`` holds events
  numbered from ``first`` on, below the next page's ``first`` (the last page: below the tail's first);
- ``events_log``: a random id of this log, which its pages' ids start with (a deleted session's log is
  deleted by it, the pages no update named included); a document with ``events_last`` but no ``events_log``
  has a log of the earlier layout, one document per event in ``agent_events``;
- ``events_legacy``: on a log that was moved out of ``agent_events`` (one document per event), the
  last number those documents hold: they are no longer read, and go with the session.

Numbers and texts change together in one update of the document, guarded by the run's lease: so the claim
of the numbers is the write of the events, and no number is ever given without its event. A ``Claim`` is
what that update adds: a pipeline's fields and a guard, and, when the tail fills, pages to insert before it
(no version of the document names them until it commits) and pages to delete after it (the cap's).

Only what lies where (writing and reading it is events.py's), and ``upgrade_log``, which moves a log of
the earlier layout into it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pymongo.collection import Collection

from .layout import EVENT_LIMITS, EVENT_PAGE, EVENT_TAIL_BYTES

LOG_START = {"$multiply": [{"$toLong": "$$NOW"}, 1000]}
"""``eventlog.first_seq`` on the server's clock (microseconds; ``$$NOW`` counts milliseconds)."""
LOG = {"events_from": 1, "events_last": 1, "events_tail": 1, "events_pages": 1, "events_log": 1}
"""What a read of the log needs of the session's document."""
GONE = {"events_last": 1, "events_log": 1, "events_legacy": 1}
"""What deleting a session's log needs of its document."""
NOT_THE_LOG = {"events_tail": 0, "events_pages": 0}
"""A projection leaving the log's texts out: for the reads of the document that are not the log's."""


def page_id(log: str, key: str) -> str:
    return f"{log}:{key}"


def is_paged(doc: Mapping[str, Any]) -> bool:
    """Has the document a log in this layout (as opposed to none, or one of the earlier layout)?"""
    return "events_log" in doc


def is_legacy(doc: Mapping[str, Any]) -> bool:
    """Is the document's log of the earlier layout, one document per event in ``agent_events``?"""
    return "events_last" in doc and "events_log" not in doc


@dataclass(frozen=True, slots=True)
class Claim:
    """What one update of the session's document adds to claim numbers of its log and store their events:
    ``guard`` joins the filter, ``fields`` the pipeline's ``$set`` (they see the document before it);
    ``pages`` are inserted before the update, ``dropped`` (page ids) deleted after it. ``last``: the last
    number given, when known before the update."""

    guard: dict[str, Any]
    fields: dict[str, Any]
    pages: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    last: int | None = None


def blind(texts: Sequence[str], keep: int) -> Claim | None:
    """The claim of a write that has not read the document: the events pushed onto the tail, matched only
    while the tail has room for them (or there is no log yet: it begins, at ``LOG_START``), and the cap
    raising ``events_from``. ``None`` when the events could never fit the tail."""
    n, size = len(texts), sum(EVENT_LIMITS.size(t) for t in texts)
    if n >= EVENT_PAGE or size > EVENT_TAIL_BYTES:
        return None
    room = {f"events_tail.{EVENT_PAGE - n - 1}": {"$exists": False},
            "$or": [{"events_bytes": {"$lte": EVENT_TAIL_BYTES - size}}, {"events_last": {"$exists": False}}]}
    return Claim(room, _pushed(texts, size, keep))


def begin(keep: int) -> Claim:
    """Start an empty log on a document that has none (a write that read it, and claims nothing yet)."""
    return Claim({"events_last": {"$exists": False}}, _pushed([], 0, keep))


def _pushed(texts: Sequence[str], size: int, keep: int) -> dict[str, Any]:
    """The fields that push ``texts`` (``size`` bytes) onto the tail and claim their numbers, beginning the
    log if there is none, and raise ``events_from`` to the cap."""
    n = len(texts)
    before = {"$ifNull": ["$events_last", {"$subtract": [LOG_START, 1]}]}
    return {"events_from": {"$max": [{"$ifNull": ["$events_from", LOG_START]}, {"$add": [before, n + 1 - keep]}]},
            "events_last": {"$add": [before, n]},
            "events_tail": {"$concatArrays": [{"$ifNull": ["$events_tail", []]}, {"$literal": list(texts)}]},
            "events_bytes": {"$add": [{"$ifNull": ["$events_bytes", 0]}, size]},
            "events_pages": {"$ifNull": ["$events_pages", []]},
            "events_log": {"$ifNull": ["$events_log", {"$literal": uuid.uuid4().hex}]}}


def guarded(where: dict[str, Any], claim: Claim | None) -> dict[str, Any]:
    """``where`` and the claim's guard, both."""
    if claim is None:
        return where
    if "$or" in where and "$or" in claim.guard:
        return {"$and": [where, claim.guard]}
    return {**where, **claim.guard}


def planned(session: str, doc: Mapping[str, Any], texts: Sequence[str], keep: int) -> Claim:
    """The claim of a write that read the document's log (``LOG``): its tail and the events, less what the
    cap drops, cut into pages from the front while they would overflow the tail; the pages wholly below the
    cap dropped from the list. Guarded by ``events_last`` (every change of the log moves it) and the log's
    id, so it applies to the log as read or not at all."""
    last, log = int(doc["events_last"]), str(doc["events_log"])
    tail, entries = list(doc["events_tail"]), [(int(f), str(k)) for f, k in doc["events_pages"]]
    new_last = last + len(texts)
    floor = max(int(doc["events_from"]), new_last - keep + 1)
    first = last - len(tail) + 1
    body = [*tail, *texts]
    if floor > first:
        body, first = body[floor - first:], floor
    chunks, rest = EVENT_LIMITS.cut(body)
    ends = [f - 1 for f, _ in entries[1:]] + [last - len(tail)] * bool(entries)
    kept: list[list[Any]] = [[f, k] for (f, k), end in zip(entries, ends, strict=True) if end >= floor]
    dropped = [page_id(log, k) for (f, k), end in zip(entries, ends, strict=True) if end < floor]
    pages: list[dict[str, Any]] = []
    for chunk in chunks:
        pages.append(_page(session, log, first, chunk, kept))
        first += len(chunk)
    return Claim(
        guard={"events_last": last, "events_log": log},
        fields={name: {"$literal": value} for name, value in (
            ("events_from", floor), ("events_last", new_last), ("events_tail", rest),
            ("events_bytes", sum(EVENT_LIMITS.size(t) for t in rest)), ("events_pages", kept))},
        pages=pages, dropped=dropped, last=new_last,
    )


def _page(session: str, log: str, first: int, texts: list[str], entries: list[list[Any]]) -> dict[str, Any]:
    """A new page of the log ``log`` holding ``texts`` numbered from ``first``; its entry joins ``entries``."""
    key = uuid.uuid4().hex[:12]
    entries.append([first, key])
    return {"_id": page_id(log, key), "session": session, "first": first, "texts": texts}


def upgrade_log(sessions: Collection[Any], event_pages: Collection[Any], events: Collection[Any],
                session: str) -> bool:
    """Move a session's log out of ``agent_events`` (one document per event) into pages, by one update
    guarded by the log being as read and still there (another process may be moving it too: then its pages
    go). The numbers stay as they were, gaps included (a page holds a run of consecutive numbers); the old
    documents are left, unread, for ``upgrade`` or the session's deletion to remove. Whether the log is
    now moved (by this call or an earlier one; or its session is gone): ``False`` if it changed meanwhile, or
another process moved it (call again to know which)."""
    doc = sessions.find_one({"_id": session}, {"events_from": 1, "events_last": 1, "events_log": 1})
    if doc is None or not is_legacy(doc):
        return True
    low, last = int(doc["events_from"]), int(doc["events_last"])
    found = events.find({"session": session, "seq": {"$gte": low, "$lte": last}},
                        {"_id": 0, "seq": 1, "text": 1}).sort("seq", 1)
    runs: list[tuple[int, list[str]]] = []
    for e in found:
        seq = int(e["seq"])
        if runs and runs[-1][0] + len(runs[-1][1]) == seq:
            runs[-1][1].append(e["text"])
        else:
            runs.append((seq, [e["text"]]))
    log = uuid.uuid4().hex
    pages: list[dict[str, Any]] = []
    entries: list[list[Any]] = []
    for first, texts in runs:
        chunks, rest = EVENT_LIMITS.cut(texts)
        for chunk in [*chunks, rest] if rest else chunks:
            pages.append(_page(session, log, first, chunk, entries))
            first += len(chunk)
    if pages:
        event_pages.insert_many(pages, ordered=True)
    moved = sessions.update_one(
        {"_id": session, "events_last": last, "events_log": {"$exists": False}},
        {"$set": {"events_from": pages[0]["first"] if pages else last + 1, "events_tail": [], "events_bytes": 0,
                  "events_pages": entries, "events_log": log, "events_legacy": last}},
    )
    if moved.matched_count != 1 and pages:
        event_pages.delete_many({"_id": {"$in": [p["_id"] for p in pages]}})
    return moved.matched_count == 1
