"""A store in MongoDB, over the caller's pymongo ``Database``.

It relies only on what a standalone mongod gives: single-document atomicity, no transactions. A
session's document is its commit point: it holds the steers waiting for it, the transcript's version and
its last few messages (the tail, under ``PAGE``), the tool journal, and the run lease (token, epoch,
expiry on the server's clock, ``$$NOW``). So every write of a leased run is one update of that document
whose filter carries the run's token and epoch: the fencing check and the write are one atomic step.
Older messages sit in pages of up to ``PAGE`` messages and ``PAGE_BYTES``, in ``agent_pages``, which the
document's version names but which are written before it. So the usual step (append a few messages,
take no steer) is one ``$push`` onto the tail, guarded by the version this process knows and by no
steer waiting, and it costs the same at 10 messages as at 10,000; taking steers and saving the
transcript they join is still one update of one document.

Messages are kept as JSON strings, not sub-documents, so a model's tool arguments come back byte for
byte. ``INDEXES`` and ``create_indexes(database)`` are for the caller's migration: every query of a run is
by ``_id``; listing and pruning walk ``(updated, _id)``.

The lifecycle lives on the same document: ``created`` and ``updated`` (dates on the server's clock, set
by the very update that writes the document, so a run's usual step is still one write), ``metadata``
(its JSON text) and ``tags`` (``"key=<value's JSON>"``, which ``where`` matches, so values compare by their
JSON form). Deleting the document is the one step that ends a session: its pages go after it.

The version is ``"<generation>:<length>:<in pages>:<pages>"`` (``Layout``). A rewrite starts a new
generation; within one, messages only ever follow those committed, and page ``k`` is written once, so a
version names one transcript. Pages of a generation a rewrite replaced are deleted after it commits;
a page a writer left behind when it died before committing is harmless (no version reaches it).

The event log (``EventStore``) is numbered by the same document: ``events_last``, the last number given,
is claimed by the fenced update (the save's own, or one of its own), then the events are inserted into
``agent_events``. The claim is the atomic step: a superseded run claims nothing, so it inserts nothing; a
writer that dies between the two leaves a gap in the numbers, which readers skip as they skip the ones the
cap and deletes leave. Reads take the range ``events_from``..``events_last`` from the document, so events
outlive their session's document only unread.
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

try:
    from bson.errors import BSONError
    from pymongo import ReturnDocument
    from pymongo.collection import Collection
    from pymongo.database import Database
    from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.mongodb requires pymongo. Install it with: pip install 'stored-agent-sessions[mongodb]'"
    ) from exc

from agent_sessions import (
    ArgumentError,
    Holder,
    LeaseLost,
    Message,
    MessageError,
    Saved,
    SessionBusy,
    SessionExists,
    StoredEvent,
    StoreError,
    TranscriptConflict,
    eventlog,
    lifecycle,
    validate,
)
from agent_sessions.contract import Scalar, SessionInfo, SessionPage
from agent_sessions.messages import read_from

from .._known import REMEMBER, REMEMBER_BYTES, Known, common_prefix

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

PRUNE_BATCH = 500
"""Sessions ``prune`` picks per query; each is then deleted by its own single-document delete."""
PAGE = 32
"""Messages a page holds at most. The tail stays under it, so an append rewrites at most this many on the
server."""
PAGE_BYTES = 4 * 2**20
"""Bytes of stored JSON a page holds at most (a larger message gets a page of its own): a document is at
most 16 MB."""
TAIL_BYTES = 4 * 2**20
"""Bytes of stored JSON the session document's tail holds at most, beside its steers and journal."""
MAX_MESSAGE_BYTES = 15 * 2**20
"""The largest stored message (its JSON): alone in a page, under the 16 MB document limit."""

log = logging.getLogger(__name__)

_RETRIES = 1000  # each miss means another writer or taker got there first: progress, never a livelock
_NO_STEER = {"steers.0": {"$exists": False}}
_TOUCH = {"updated": True}
"""``$currentDate`` of a classic update: ``updated`` is the server's clock, as the lease's ``$$NOW``."""
_STAMP = {"created": {"$ifNull": ["$created", "$$NOW"]}, "updated": "$$NOW"}
"""The same in a pipeline update, which may create the session: ``created`` once, ``updated`` every time."""
_EXISTS = {"created": {"$exists": True}}
"""A session exists once a save, a lease, set_metadata or a fork wrote ``created``; a document holding only
steers (``add_steer`` upserts) is one that does not exist yet."""
_NOW = {"$divide": [{"$toLong": "$$NOW"}, 1000]}
"""Seconds since 1970 on the server's clock (an aggregation expression: filters with $expr, pipeline updates)."""
_LIVE = {"token": {"$ne": None}, "$expr": {"$gt": ["$expires", _NOW]}}
_NOT_LIVE = {"$or": [{"token": None}, {"$expr": {"$lte": ["$expires", _NOW]}}]}
_LEASE = {"host": 1, "pid": 1, "token": 1, "expires": 1, "cancelled": 1, "epoch": 1}
_LOG_START = {"$multiply": [{"$toLong": "$$NOW"}, 1000]}
"""``eventlog.first_seq`` on the server's clock (microseconds; ``$$NOW`` counts milliseconds)."""
_HAS_LOG = {"events_last": {"$exists": True}}
_LOG = {"events_from": 1, "events_last": 1}


def _claiming(n: int) -> dict[str, Any]:
    """The fields of a pipeline ``$set`` that claim ``n`` numbers of the session's event log: ``events_last``
    (the last number given) goes up by ``n``, and a log that has none starts at ``_LOG_START``, which
    ``events_from`` records (both expressions see the document as it was before the stage)."""
    return {"events_from": {"$ifNull": ["$events_from", _LOG_START]},
            "events_last": {"$add": [{"$ifNull": ["$events_last", {"$subtract": [_LOG_START, 1]}]}, n]}}


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
        tags = _tags(lifecycle.decode_metadata(doc["metadata"]))
        sessions.update_one({"_id": doc["_id"], "metadata": doc["metadata"]}, {"$set": {"tags": tags}})


class Store:
    def __init__(
        self, database: Database[Any], *, remember: int = REMEMBER, remember_bytes: int = REMEMBER_BYTES
    ) -> None:
        if not isinstance(database, Database):
            raise ArgumentError(
                f"mongodb.Store needs a pymongo Database (client['name']), got {type(database).__name__}"
            )
        self.database = database
        self._sessions = database[SESSIONS]
        self._pages = database[PAGES]
        self._events = database[EVENTS]
        self._known = Known(remember, remember_bytes)

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        known = self._known.get(session)
        items, shared = validate.messages_after(msgs, known[1] if known is not None else ())
        validate.stored_size(items, shared, MAX_MESSAGE_BYTES, "MongoDB store")
        with self._failing("save", session):
            if known is None or self._append(session, known, items, {}) is None:
                self._rewrite(session, items, {"_id": session})

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)
        with self._failing("messages", session):
            for _ in range(_RETRIES):
                doc = self._sessions.find_one({"_id": session}, {"steers": 0})
                if doc is None or "version" not in doc:  # never saved (a document may hold only steers)
                    return []
                bodies = self._bodies(doc)
                if bodies is not None:
                    break
            else:
                raise StoreError(f"MongoDB store: messages of session {session!r} kept racing with rewrites")
        try:
            items = tuple(Message.from_json(body) for body in bodies)
        except (MessageError, TypeError) as exc:
            raise StoreError(f"MongoDB store: session {session!r} holds a corrupt message: {exc}") from exc
        _mark(items, doc)
        self._known.put(session, doc["version"], items)
        return list(items)

    def add_steer(self, session: str, text: str) -> None:
        """A ``$push`` onto the session's document: pushes onto one document apply one after another,
        so steers keep the order they arrived in, whichever process sent them."""
        validate.session_id(session)
        validate.steer_text(text)
        validate.deliverable_steer(text, MAX_MESSAGE_BYTES, "MongoDB store")
        with self._failing("add_steer", session):
            self._sessions.update_one(
                {"_id": session}, {"$push": {"steers": {"id": uuid.uuid4().hex, "text": text}}}, upsert=True
            )

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._failing("take_steers", session):
            for _ in range(_RETRIES):
                waiting = self._waiting(session)
                if not waiting:
                    return []
                where, pull = _taking(session, waiting)
                if self._sessions.update_one(where, pull).modified_count == 1:
                    return [w["text"] for w in waiting]
        raise StoreError(f"MongoDB store: take_steers of session {session!r} kept racing with other takers")

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False
    ) -> Saved:
        """The usual step is one update: the append, matched only while the lease is the run's and not
        cancelled, and (when taking steers) no steer waits. Otherwise the document is read, the fence and
        the stored transcript checked, and the steers pulled and the transcript holding them written in one
        update, guarded on the lease, the version and those steers still being there."""
        return self._save_fenced(session, holder, msgs, take_steers, replace, 0)[0]

    def _save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], take_steers: bool, replace: bool, claim: int
    ) -> tuple[Saved, _Log]:
        """``save_fenced``, whose one update of the session's document also claims ``claim`` numbers of its
        event log (``$inc`` of ``events_last``; the guard then needs the log to have begun, and the read path
        begins it, a write that claims nothing). Returns what was saved and the log's numbers after it."""
        validate.session_id(session)
        known = self._known.get(session)
        items, shared = validate.messages_after(msgs, known[1] if known is not None else ())  # checks what is new
        validate.stored_size(items, shared, MAX_MESSAGE_BYTES, "MongoDB store")
        fence: dict[str, Any] = {"token": holder.token, "epoch": holder.epoch, **(_HAS_LOG if claim else {})}
        with self._failing("save", session):
            if known is not None and not replace and len(items) > len(known[1]):
                guard = {**fence, "cancelled": False, **(_NO_STEER if take_steers else {})}
                log_after = self._append(session, known, items, guard, claim=claim)
                if log_after is not None:
                    return Saved([], False), log_after
            for _ in range(_RETRIES):
                doc = self._sessions.find_one({"_id": session})
                if doc is None or doc.get("token") != holder.token or doc.get("epoch") != holder.epoch:
                    raise _lost(session, holder, doc)
                if claim and "events_last" not in doc:
                    self._sessions.update_one({"_id": session, "token": holder.token, "epoch": holder.epoch},
                                              [{"$set": _claiming(0)}])
                    continue  # the log begun (by this write or another): read again
                stored = 0 if replace else self._stored_prefix(session, doc, items)
                if stored is None:
                    continue  # a rewrite removed the pages between the two reads
                waiting = list(doc.get("steers") or []) if take_steers else []
                saved = items + tuple(Message.user(w["text"]) for w in waiting)
                done = Saved([w["text"] for w in waiting], bool(doc.get("cancelled")))
                where: dict[str, Any] = {**fence}
                if not replace and stored == len(saved):  # nothing to write but the claim, if any
                    if not claim:
                        return done, _NO_LOG
                    where["version"] = doc["version"] if "version" in doc else {"$exists": False}
                    log_after = self._claim({**where, "_id": session, **(_NO_STEER if take_steers else {})}, claim)
                    if log_after is not None:
                        return done, log_after
                    continue  # the transcript, its steers or the lease changed since the read
                pull = [w["id"] for w in waiting]
                if waiting:
                    where.update(_taking(session, waiting)[0])
                if "version" in doc and not replace:
                    log_after = self._append(session, (doc["version"], items[:stored]), saved, where, pull, claim)
                else:
                    where["version"] = doc["version"] if "version" in doc else {"$exists": False}
                    log_after = self._rewrite(session, saved, {**where, "_id": session}, pull, claim)
                if log_after is not None:
                    return done, log_after
        raise StoreError(f"MongoDB store: save of session {session!r} kept racing with other takers")

    def _stored_prefix(self, session: str, doc: dict[str, Any], items: tuple[Message, ...]) -> int | None:
        """How many messages the document holds, checking they are the first ones of ``items``
        (``TranscriptConflict`` if not); ``None`` when its pages went meanwhile (read it again)."""
        if "version" not in doc:
            return 0
        known = self._known.get(session)
        if known is not None and doc["version"] == known[0] and common_prefix(known[1], items) == len(known[1]):
            return len(known[1])  # a version names one transcript: the one this process knows
        bodies = self._bodies(doc)
        if bodies is None:
            return None
        if len(bodies) > len(items) or any(items[i].to_json() != body for i, body in enumerate(bodies)):
            raise TranscriptConflict(session, len(bodies), len(items))
        return len(bodies)

    # -- the transcript: a tail in the session's document, full pages beside it -------------------------

    def _append(
        self,
        session: str,
        known: tuple[str, tuple[Message, ...]],
        items: tuple[Message, ...],
        guard: dict[str, Any],
        pull: Sequence[str] = (),
        claim: int = 0,
    ) -> _Log | None:
        """Write ``items`` as the known transcript plus what follows it; the event log's numbers after it
        (``claim`` more taken, by ``$inc``: ``guard`` then requires ``events_last``), or ``None`` when the
        stored transcript is no longer the known one (or ``items`` does not extend it). A page
        already taken by other messages (a writer that lost a race, was refused, or died after writing it)
        makes it a rewrite into a new generation, under the same guard. The same update drops the journal,
        takes the steers whose ids are ``pull`` and sets ``updated``: a run's usual step stays one write."""
        version, old = known
        length = len(old)
        if common_prefix(old, items) < length:
            return None
        layout = Layout.of(version)
        tail = _bodies(items[layout.base:])
        if _overflows(tail):  # the tail fills pages: write them first, as no version reaches them yet
            pages, rest = _cut(tail)
            if not self._put_pages(layout.generation, layout.pages, pages, fresh=False):
                return self._rewrite(session, items, {**guard, "_id": session, "version": version}, pull, claim)
            layout = Layout(layout.generation, len(items), layout.base + len(tail) - len(rest),
                            layout.pages + len(pages))
            change: dict[str, Any] = {"$set": {"tail": rest}}
        else:
            layout = Layout(layout.generation, len(items), layout.base, layout.pages)
            change = {"$push": {"tail": {"$each": tail[length - layout.base:]}}}
        new_version = layout.version()
        change.setdefault("$set", {})["version"] = new_version
        change.update({"$unset": {"journal": ""}, "$currentDate": _TOUCH})
        if pull:
            change["$pull"] = {"steers": {"id": {"$in": list(pull)}}}
        where = {**guard, "_id": session, "version": version}
        if claim:
            change["$inc"] = {"events_last": claim}
            after = self._sessions.find_one_and_update(where, change, projection=_LOG,
                                                       return_document=ReturnDocument.AFTER)
            if after is None:
                return None
            log_after = _Log.of(after)
        elif self._sessions.update_one(where, change).matched_count != 1:
            return None
        else:
            log_after = _NO_LOG
        self._known.put(session, new_version, items)
        return log_after

    def _rewrite(
        self, session: str, items: tuple[Message, ...], guard: dict[str, Any], pull: Sequence[str] = (),
        claim: int = 0,
    ) -> _Log | None:
        """Write ``items`` as a new generation and point the session at it, if ``guard`` still matches;
        the event log's numbers after it (``claim`` more taken: ``guard`` then requires ``events_last``), or
        ``None``. A pipeline update, since it may create the session (``created`` on the server's clock); it
        drops the journal and takes the steers whose ids are ``pull``."""
        version, tail = self._new_generation(_bodies(items))
        fields: dict[str, Any] = {"version": {"$literal": version}, "tail": {"$literal": tail},
                                  "journal": "$$REMOVE", **_STAMP}
        if pull:  # mongoeco knows no $not: "not in" is $in compared with false
            fields["steers"] = {"$filter": {"input": {"$ifNull": ["$steers", []]},
                                            "cond": {"$eq": [{"$in": ["$$this.id", list(pull)]}, False]}}}
        if claim:
            fields["events_last"] = {"$add": ["$events_last", claim]}
        upsert = guard == {"_id": session}
        before = self._sessions.find_one_and_update(
            {**guard, "_id": session}, [{"$set": fields}], projection={"version": 1, **_LOG}, upsert=upsert,
            return_document=ReturnDocument.BEFORE,
        )
        if before is None and not upsert:
            self._drop_pages(version)
            return None
        self._known.put(session, version, items)
        if before is not None and "version" in before:
            self._drop_pages(before["version"])
        return _Log.of(before, claim) if claim and before is not None else _NO_LOG

    def _new_generation(self, bodies: list[str]) -> tuple[str, list[str]]:
        """Write ``bodies`` as the pages of a new generation; its version and the tail left over."""
        pages, tail = _cut(bodies) if _overflows(bodies) else ([], bodies)
        generation = uuid.uuid4().hex
        self._put_pages(generation, 0, pages, fresh=True)
        return Layout(generation, len(bodies), len(bodies) - len(tail), len(pages)).version(), tail

    def _put_pages(self, generation: str, first: int, contents: list[list[str]], *, fresh: bool) -> bool:
        """Insert ``contents`` as the pages numbered from ``first``. A page already there is a writer's that
        lost a race or died: usable only when it holds the same messages."""
        pages = [{"_id": f"{generation}:{first + k}", "bodies": bodies} for k, bodies in enumerate(contents)]
        if not pages:
            return True
        try:
            self._pages.insert_many(pages, ordered=True)
            return True
        except BulkWriteError as exc:
            if fresh or any(e.get("code") != 11000 for e in exc.details.get("writeErrors", [])):
                raise
            done = exc.details.get("nInserted", 0)
        rest = pages[done:]
        found = {p["_id"]: p.get("bodies") for p in self._pages.find({"_id": {"$in": [p["_id"] for p in rest]}})}
        missing = [p for p in rest if p["_id"] not in found]
        if any(found[p["_id"]] != p["bodies"] for p in rest if p["_id"] in found):
            return False
        if missing:
            try:
                self._pages.insert_many(missing, ordered=True)
            except BulkWriteError:
                return False
        return True

    def _bodies(self, doc: dict[str, Any]) -> list[str] | None:
        """The stored transcript of a session document, or ``None`` when a rewrite removed its pages
        between the two reads (read the document again)."""
        layout = Layout.of(doc["version"])
        ids = [f"{layout.generation}:{k}" for k in range(layout.pages)]
        pages = {p["_id"]: p["bodies"] for p in self._pages.find({"_id": {"$in": ids}})} if ids else {}
        if len(pages) < layout.pages:
            return None
        bodies = [body for page_id in ids for body in pages[page_id]]
        if len(bodies) != layout.base or len(bodies) + len(doc.get("tail") or []) != layout.length:
            raise StoreError(f"MongoDB store: session {doc['_id']!r} should hold {layout.length} messages "
                             f"({layout.base} in {layout.pages} pages) but holds {len(bodies)} in pages and "
                             f"{len(doc.get('tail') or [])} in its tail")
        bodies.extend(doc.get("tail") or [])
        return bodies

    def _drop_pages(self, version: str) -> None:
        """Every page of the version's generation, a dead or stale writer's too (an anchored prefix of
        ``_id``: the index finds them)."""
        generation = Layout.of(version).generation
        self._pages.delete_many({"_id": {"$regex": f"^{re.escape(generation)}:"}})

    def _waiting(self, session: str) -> list[dict[str, str]]:
        doc = self._sessions.find_one({"_id": session}, {"steers": 1})
        return list(doc.get("steers") or []) if doc is not None else []

    # -- RunStore: each step one single-document operation, atomic without transactions ---------------

    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None:
        validate.session_id(source)
        validate.session_id(target)
        with self._failing("fork", source):
            bodies = None
            for _ in range(_RETRIES):
                doc = self._sessions.find_one({"_id": source}, {"steers": 0})
                if doc is None or "version" not in doc:
                    raise ArgumentError(f"cannot fork session {source!r}: it has no transcript")
                bodies = self._bodies(doc)
                if bodies is not None:
                    break
            if bodies is None:
                raise StoreError(f"MongoDB store: fork of session {source!r} kept racing with rewrites")
            validate.fork_index(at, len(bodies), source)
            if at:
                validate.fork_cut(Message.from_json(bodies[at - 1]), at, source, allow_unanswered)
            version, tail = self._new_generation(bodies if at is None else bodies[:at])
            try:  # the target may already hold steers, but not a transcript
                self._sessions.update_one(
                    {"_id": target, "version": {"$exists": False}},
                    [{"$set": {"version": {"$literal": version}, "tail": {"$literal": tail}, **_STAMP}}],
                    upsert=True,
                )
            except DuplicateKeyError:
                self._drop_pages(version)
                raise SessionExists(
                    f"cannot fork {source!r} into {target!r}: {target!r} already has a transcript"
                ) from None

    def journal(self, session: str) -> str | None:
        validate.session_id(session)
        with self._failing("journal", session):
            doc = self._sessions.find_one({"_id": session}, {"journal": 1})
        return None if doc is None or doc.get("journal") is None else str(doc["journal"])

    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        validate.session_id(session)
        fence = {"_id": session, "token": holder.token, "epoch": holder.epoch}
        with self._failing("put_journal", session):
            if self._sessions.update_one({**fence, "cancelled": {"$ne": True}},
                                         {"$set": {"journal": journal}, "$currentDate": _TOUCH}).matched_count == 1:
                return False
            self.check(session, holder)  # raises LeaseLost when the lease is not the run's: then it is cancelled
            if not unless_cancelled:
                if self._sessions.update_one(
                        fence, {"$set": {"journal": journal}, "$currentDate": _TOUCH}).matched_count != 1:
                    self.check(session, holder)  # taken over in between
            return True

    def swap_journal(self, session: str, expected: str, journal: str) -> bool:
        """One update whose filter holds the expected text: a decision on a waiting call (ApprovalStore)."""
        validate.session_id(session)
        with self._failing("swap_journal", session):
            return self._sessions.update_one({"_id": session, "journal": expected},
                                             {"$set": {"journal": journal}, "$currentDate": _TOUCH}).matched_count == 1

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        """One update with the server's clock: the lease is taken if free or expired, in a pipeline that
        raises the epoch; a live one makes the upsert collide on ``_id``, and then it is read."""
        validate.session_id(session)
        take = [{"$set": {
            "token": {"$literal": holder.token}, "host": {"$literal": holder.host}, "pid": holder.pid,
            "expires": {"$add": [_NOW, float(ttl)]}, "cancelled": False,
            "epoch": {"$add": [{"$ifNull": ["$epoch", 0]}, 1]},
            # The stage sees the old fields: who had it, and a cancel the new holder is handed.
            "taken_from": {"token": "$token", "host": "$host", "pid": "$pid", "cancelled": "$cancelled"},
            **_STAMP,
        }}]
        free = {"_id": session, "$or": [{"token": None}, {"$expr": {"$lte": ["$expires", _NOW]}}]}
        with self._failing("acquire", session):
            for _ in range(3):
                try:
                    taken = self._sessions.find_one_and_update(
                        free, take, upsert=True, projection={**_LEASE, "taken_from": 1},
                        return_document=ReturnDocument.AFTER,
                    )
                    if taken is not None:
                        before = taken.get("taken_from") or {}
                        if before.get("token") is not None:
                            log.info("MongoDB store: session %r: the lease of pid %s on %s (token %s…) had expired; "
                                     "taken over at epoch %s", session, before.get("pid"), before.get("host"),
                                     str(before["token"])[:8], taken.get("epoch"))
                        got = _holder(taken)
                        return replace(got, cancelled=True) if before.get("cancelled") else got
                except DuplicateKeyError:
                    pass
                current = self._sessions.find_one({"_id": session}, _LEASE)
                if current is not None and current.get("token") is not None:
                    return _holder(current)
        raise StoreError(f"MongoDB store: acquire of session {session!r} kept racing with another process")

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        validate.session_id(session)
        with self._failing("renew", session):
            renewed = self._sessions.update_one(
                {"_id": session, "token": holder.token, "epoch": holder.epoch},
                [{"$set": {"expires": {"$add": [_NOW, float(ttl)]}, "updated": "$$NOW"}}],
            )
            if renewed.matched_count != 1:
                raise _lost(session, holder, self._sessions.find_one({"_id": session}, _LEASE))

    def release(self, session: str, holder: Holder) -> None:
        validate.session_id(session)
        with self._failing("release", session):
            self._sessions.update_one(
                {"_id": session, "token": holder.token, "epoch": holder.epoch},
                {"$set": {"token": None, "host": None, "pid": None, "expires": None},  # a cancel stays: handed on
                 "$currentDate": _TOUCH},
            )

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        with self._failing("holder", session):
            doc = self._sessions.find_one({"_id": session, **_LIVE}, _LEASE)
        return None if doc is None else _holder(doc)

    def cancel(self, session: str) -> bool:
        validate.session_id(session)
        with self._failing("cancel", session):  # a lapsed lease nobody took is held too
            result = self._sessions.update_one({"_id": session, "token": {"$ne": None}},
                                               {"$set": {"cancelled": True}, "$currentDate": _TOUCH})
        return result.matched_count == 1

    def check(self, session: str, holder: Holder) -> bool:
        validate.session_id(session)
        with self._failing("check", session):
            doc = self._sessions.find_one({"_id": session}, _LEASE)
        if doc is None or doc.get("token") != holder.token or doc.get("epoch") != holder.epoch:
            raise _lost(session, holder, doc)
        return bool(doc.get("cancelled"))

    # -- EventStore: the claim is the atomic step --------------------------------------------------------

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
                raise _lost(session, holder, self._sessions.find_one({"_id": session}, _LEASE))
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
            doc = self._sessions.find_one({"_id": session}, _LOG)
            if doc is None or "events_last" not in doc:
                return []
            log_now = _Log.of(doc)
            found = list(self._events.find(
                {"session": session, "seq": {"$gt": max(after, log_now.first - 1), "$lte": log_now.last}},
                {"_id": 0, "seq": 1, "text": 1},
            ).sort("seq", 1).limit(limit))
        try:
            return [eventlog.decode(int(e["seq"]), e["text"]) for e in found]
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"MongoDB store: session {session!r} holds a corrupt event: {exc}") from exc

    def _claim(self, where: dict[str, Any], n: int, *, begin: bool = False) -> _Log | None:
        """Claim ``n`` numbers by one update of the document ``where`` finds; the log's numbers after it,
        or ``None`` when nothing matched. ``begin``: a pipeline that starts a log that has none (on the
        server's clock); otherwise an ``$inc``, for a filter that requires the log to have begun."""
        change: Any = [{"$set": _claiming(n)}] if begin else {"$inc": {"events_last": n}}
        doc = self._sessions.find_one_and_update(where, change, projection=_LOG, return_document=ReturnDocument.AFTER)
        return None if doc is None else _Log.of(doc)

    def _insert_events(self, session: str, log_after: _Log, records: list[str], keep: int) -> int:
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

    # -- LifecycleStore --------------------------------------------------------------------------------

    def list_sessions(
        self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50, after: str | None = None
    ) -> SessionPage:
        """One query on ``(updated, _id)`` descending (the ``updated_id`` index, or ``tags_updated_id``
        with ``where``): the prefix is an anchored regex of the escaped prefix (the ``_id`` index serves
        it), ``where`` is ``tags: {$all: ["key=<value's JSON>", ...]}`` so values compare by their JSON
        form as in every store, and the cursor is a keyset bound, so a page costs the same deep in."""
        wanted = lifecycle.check_listing(prefix, where, limit, after)
        query: dict[str, Any] = dict(_EXISTS)
        if prefix:
            query["_id"] = {"$regex": "^" + re.escape(prefix)}
        if wanted:
            query["tags"] = {"$all": [f"{k}={v}" for k, v in wanted.items()]}
        if after is not None:
            seconds, last = lifecycle.decode_cursor(after)
            date = _date(seconds)
            query["$or"] = [{"updated": {"$lt": date}}, {"updated": date, "_id": {"$lt": last}}]
        with self._failing("list_sessions"):
            docs = list(self._sessions.find(query, _INFO).sort([("updated", -1), ("_id", -1)]).limit(limit + 1))
        return lifecycle.page([(_seconds(doc["updated"]), _info(doc)) for doc in docs], limit)

    def info(self, session: str) -> SessionInfo | None:
        """One read of the session's document: the length is its version's, not a count of messages."""
        validate.session_id(session)
        with self._failing("info", session):
            doc = self._sessions.find_one({"_id": session, **_EXISTS}, _INFO)
        return None if doc is None else _info(doc)

    def set_metadata(self, session: str, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        """Read the metadata, merge, and write it with one update guarded by the metadata read (its JSON
        text, or its absence): a concurrent change makes the guard miss (or the upsert collide on
        ``_id``), and the merge is done again on what that change stored, so no key is lost."""
        validate.session_id(session)
        with self._failing("set_metadata", session):
            for _ in range(_RETRIES):
                doc = self._sessions.find_one({"_id": session}, {"metadata": 1})
                stored = None if doc is None else doc.get("metadata")
                merged = lifecycle.merge_metadata(lifecycle.decode_metadata(stored), changes)
                change = [{"$set": {"metadata": {"$literal": lifecycle.encode_metadata(merged)},
                                    "tags": {"$literal": _tags(merged)}, **_STAMP}}]
                try:  # "metadata": None matches a document without metadata, and none at all (upsert)
                    result = self._sessions.update_one({"_id": session, "metadata": stored}, change,
                                                       upsert=doc is None)
                except DuplicateKeyError:
                    continue  # created meanwhile, with metadata
                if result.matched_count == 1 or result.upserted_id is not None:
                    return merged
        raise StoreError(f"MongoDB store: set_metadata of session {session!r} kept racing with other writers")

    def delete(self, session: str, *, force: bool = False) -> bool:
        """The atomic step is the deletion of the session's document, which holds everything but the
        older pages: transcript version and tail, steers, journal, lease, metadata. Once it is gone no
        version names those pages, a run's fenced writes (filtered on its token and epoch) match nothing,
        and a save or lease starts the id again from nothing. The pages go after it (a new session's
        pages are another generation: never these), so a crash in between leaves only unreachable pages."""
        validate.session_id(session)
        with self._failing("delete", session):
            for _ in range(_RETRIES):
                where = {"_id": session} if force else {"_id": session, **_NOT_LIVE}
                doc = self._sessions.find_one_and_delete(where, projection={"version": 1, **_LOG})
                if doc is not None:
                    self._gone(session, doc)
                    return True
                if force:  # nothing was there to delete; a run making the session since made a new one
                    self._known.forget(session)
                    return False
                live = self._sessions.find_one({"_id": session, **_LIVE}, _LEASE)
                if live is not None:
                    held = _holder(live)
                    raise SessionBusy(
                        f"session {session!r} is held by a live run ({held.host}, pid {held.pid}); "
                        f"delete(force=True) deletes it anyway and the run fails with LeaseLost", held)
                if self._sessions.find_one({"_id": session}, {"_id": 1}) is None:
                    self._known.forget(session)
                    return False
                # the lease lapsed between the two reads: delete again
        raise StoreError(f"MongoDB store: delete of session {session!r} kept racing with its runs")

    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int:
        """Batches of ``PRUNE_BATCH`` ids, oldest update first, picked on the server's clock (``hello``'s
        ``localTime``, read per batch); each is deleted by its own ``find_one_and_delete`` whose filter
        repeats the condition, so a session saved or leased since it was picked stays."""
        idle = lifecycle.idle_seconds(idle_for)
        limit = lifecycle.prune_limit(limit)
        deleted = 0
        with self._failing("prune"):
            while limit is None or deleted < limit:
                batch = PRUNE_BATCH if limit is None else min(PRUNE_BATCH, limit - deleted)
                now = self._server_now()
                idle_ones = {"updated": {"$lt": now - timedelta(seconds=idle)},
                             "$or": [{"token": None}, {"expires": {"$lte": now.timestamp()}}]}
                picked = [doc["_id"] for doc in
                          self._sessions.find(idle_ones, {"_id": 1}).sort([("updated", 1), ("_id", 1)]).limit(batch)]
                gone = 0
                for session in picked:
                    doc = self._sessions.find_one_and_delete({"_id": session, **idle_ones},
                                                             projection={"version": 1, **_LOG})
                    if doc is not None:
                        self._gone(session, doc)
                        gone += 1
                deleted += gone
                if len(picked) < batch or gone == 0:
                    break
        return deleted

    def tail(self, session: str, last: int) -> list[Message]:
        """The document's tail, and only the pages the rest of the last ``last`` messages are in, read from
        the newest page back."""
        validate.session_id(session)
        last = lifecycle.last_count(last)
        if last == 0:
            return []
        with self._failing("tail", session):
            for _ in range(_RETRIES):
                doc = self._sessions.find_one({"_id": session}, {"version": 1, "tail": 1, "created": 1})
                if doc is None or "version" not in doc:
                    return []
                bodies = self._last_bodies(doc, last)
                if bodies is not None:
                    items = _messages(session, bodies)
                    _mark(items, doc)
                    return items
        raise StoreError(f"MongoDB store: tail of session {session!r} kept racing with rewrites")

    def pending_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._failing("pending_steers", session):
            return [w["text"] for w in self._waiting(session)]

    def _last_bodies(self, doc: dict[str, Any], last: int) -> list[str] | None:
        """The last ``last`` stored messages of the document's transcript; ``None`` when a rewrite removed
        its pages meanwhile. Each page holds at most ``PAGE`` messages, so each read asks for as many of
        the newest pages as could be needed; a page cut short by ``PAGE_BYTES`` means one more read."""
        layout = Layout.of(doc["version"])
        tail = list(doc.get("tail") or [])
        need = min(last, layout.length) - len(tail)
        pages: list[list[str]] = []
        k = layout.pages
        while need > 0 and k > 0:
            ids = [f"{layout.generation}:{j}" for j in range(max(0, k - math.ceil(need / PAGE)), k)]
            found = {p["_id"]: p["bodies"] for p in self._pages.find({"_id": {"$in": ids}})}
            if len(found) < len(ids):
                return None
            pages[:0] = [found[page_id] for page_id in ids]
            need -= sum(len(found[page_id]) for page_id in ids)
            k -= len(ids)
        if need > 0 or len(tail) != layout.length - layout.base:
            raise StoreError(f"MongoDB store: session {doc['_id']!r} should hold {layout.length} messages "
                             f"({layout.base} in {layout.pages} pages) but its pages and tail fall short")
        bodies = [body for page in pages for body in page] + tail
        return bodies[-last:]

    def _gone(self, session: str, doc: dict[str, Any]) -> None:
        """After the session's document was deleted: its pages, which nothing names any more, and its
        events, up to the last number its log gave (a log begun since numbers above it: never those)."""
        self._known.forget(session)
        if "version" in doc:
            self._drop_pages(doc["version"])
        if "events_last" in doc:
            self._events.delete_many({"session": session, "seq": {"$lte": int(doc["events_last"])}})

    def _server_now(self) -> datetime:
        """The server's clock (``hello`` reports it), the one ``updated`` and lease expiry are on."""
        return _aware(self.database.client.admin.command("hello")["localTime"])

    @contextmanager
    def _failing(self, op: str, session: str | None = None) -> Iterator[None]:
        try:
            yield
        except (PyMongoError, BSONError) as exc:  # BSONError: DocumentTooLarge, a document over 16 MB
            of = "" if session is None else f" of session {session!r}"
            raise StoreError(f"MongoDB store: {op}{of} failed: {exc}") from exc

    def __repr__(self) -> str:
        return f"mongodb.Store({self.database.name!r})"


def _taking(session: str, waiting: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The filter and the update that take exactly ``waiting``: matched only while all of them are there."""
    ids = [w["id"] for w in waiting]
    return {"_id": session, "steers.id": {"$all": ids}}, {"$pull": {"steers": {"id": {"$in": ids}}}}


@dataclass(frozen=True, slots=True)
class _Log:
    """The numbers a session's event log has given: from ``first`` (its start) to ``last``."""

    first: int
    last: int

    @classmethod
    def of(cls, doc: Mapping[str, Any], more: int = 0) -> _Log:
        """The log a session document records, with ``more`` numbers claimed since it was read."""
        return cls(int(doc["events_from"]), int(doc["events_last"]) + more)


_NO_LOG = _Log(0, 0)
"""What a write that claimed no number returns."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What a version names: a generation of pages, the transcript's length, how many of its messages are
    in pages (the rest are the document's tail) and in how many pages. Written ``"g:length:base:pages"``;
    0.1's ``"g:length"`` had pages of exactly ``PAGE`` messages."""

    generation: str
    length: int
    base: int
    pages: int

    @classmethod
    def of(cls, version: str) -> Layout:
        generation, *numbers = version.split(":")
        if len(numbers) == 1:
            length = int(numbers[0])
            base = length - length % PAGE
            return cls(generation, length, base, base // PAGE)
        length, base, pages = (int(n) for n in numbers)
        return cls(generation, length, base, pages)

    def version(self) -> str:
        return f"{self.generation}:{self.length}:{self.base}:{self.pages}"


def _overflows(tail: list[str]) -> bool:
    """Would the document's tail hold too much: ``PAGE`` messages, or more than ``TAIL_BYTES``?"""
    return len(tail) >= PAGE or sum(len(b) for b in tail) > TAIL_BYTES


def _cut(bodies: list[str]) -> tuple[list[list[str]], list[str]]:
    """Pages from the front of ``bodies`` (each up to ``PAGE`` messages and ``PAGE_BYTES``, or one larger
    message alone) until what is left fits the tail."""
    pages: list[list[str]] = []
    rest = bodies
    while _overflows(rest):
        size, n = 0, 0
        while n < len(rest) and n < PAGE and (n == 0 or size + len(rest[n]) <= PAGE_BYTES):
            size += len(rest[n])
            n += 1
        pages.append(rest[:n])
        rest = rest[n:]
    return pages, rest


def _bodies(msgs: Sequence[Message]) -> list[str]:
    return [m.to_json() for m in msgs]


def _messages(session: str, bodies: Sequence[str]) -> list[Message]:
    try:
        return [Message.from_json(body) for body in bodies]
    except (MessageError, TypeError) as exc:
        raise StoreError(f"MongoDB store: session {session!r} holds a corrupt message: {exc}") from exc


def _mark(items: Sequence[Message], doc: dict[str, Any]) -> None:
    """Mark what a read returns with the session's incarnation, its ``created`` as ``info`` shows it
    (``messages.read_from``)."""
    if "created" in doc:
        read_from(items, doc["_id"], _aware(doc["created"]))


_INFO = {"created": 1, "updated": 1, "metadata": 1, "version": 1}


def _info(doc: dict[str, Any]) -> SessionInfo:
    length = Layout.of(doc["version"]).length if "version" in doc else 0
    return SessionInfo(doc["_id"], _aware(doc["created"]), _aware(doc["updated"]), length,
                       lifecycle.decode_metadata(doc.get("metadata")))


def _tags(metadata: Mapping[str, Scalar]) -> list[str]:
    """``"key=<the value's JSON>"`` per key: what ``where`` matches with ``$all`` (keys have no ``=``)."""
    return [f"{k}={lifecycle.metadata_value(k, v)}" for k, v in metadata.items()]


def _aware(value: datetime) -> datetime:
    """pymongo returns naive UTC datetimes unless the client was made with ``tz_aware=True``."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _seconds(value: datetime) -> float:
    """A stored date (milliseconds) as the cursor's seconds, exactly: ``_date`` gives back the same date."""
    return round(_aware(value).timestamp() * 1000) / 1000


def _date(seconds: float) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=round(seconds * 1000))


def _holder(doc: dict[str, Any]) -> Holder:
    return Holder(doc["host"], int(doc["pid"]), doc["token"], float(doc["expires"]), bool(doc.get("cancelled")),
                  int(doc.get("epoch", 0)))


def _lost(session: str, holder: Holder, doc: dict[str, Any] | None) -> LeaseLost:
    if doc is None:
        return LeaseLost.superseded(session, holder.epoch, None, None)
    return LeaseLost.superseded(session, holder.epoch, doc.get("token"), int(doc.get("epoch", 0)))


__all__ = ["COLLECTIONS", "EVENTS", "INDEXES", "PAGE", "PAGES", "SESSIONS", "Store", "create_indexes", "upgrade"]
