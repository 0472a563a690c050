"""A store in MongoDB, over the caller's pymongo ``Database``.

It relies only on what a standalone mongod gives: single-document atomicity, no transactions. A
session's document is its commit point: it holds the steers waiting for it, the transcript's version and
its last few messages (the tail, under ``PAGE``). Older messages sit in pages of exactly ``PAGE``
messages, in ``agent_pages``, which the document's version names but which are written before it. So
the usual step (append a few messages, take no steer) is one ``$push`` onto the tail, guarded by the
version this process knows and by no steer waiting, and it costs the same at 10 messages as at 10,000;
taking steers and saving the transcript they join is still one update of one document.

Messages are kept as JSON strings, not sub-documents, so a model's tool arguments come back byte for
byte. ``INDEXES`` and ``create_indexes(database)`` are for the caller's migration (there are none today:
every query is by ``_id``).

The version is ``"<generation>:<length>"``. A rewrite starts a new generation; within one, messages
only ever follow those committed, and the page holding positions ``k*PAGE ..`` is written once, so a
version names one transcript. Pages of a generation a rewrite replaced are deleted after it commits;
a page a writer left behind when it died before committing is harmless (no version reaches it).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

try:
    from pymongo import ReturnDocument
    from pymongo.database import Database
    from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.mongodb requires pymongo. Install it with: pip install 'stored-agent-sessions[mongodb]'"
    ) from exc

from agent_sessions import ArgumentError, Holder, Message, MessageError, SessionExists, StoreError, validate

from .._known import Known, common_prefix

SESSIONS = "agent_sessions"
PAGES = "agent_pages"
RUNS = "agent_runs"
JOURNALS = "agent_journals"
COLLECTIONS = (SESSIONS, PAGES, RUNS, JOURNALS)

INDEXES: list[tuple[str, list[tuple[str, int]], dict[str, Any]]] = []
"""(collection, keys, options) for each index beyond ``_id`` the store's queries use: none."""

PAGE = 32
"""Messages per page. The tail stays under it, so an append rewrites at most this many on the server."""

_RETRIES = 1000  # each miss means another writer or taker got there first: progress, never a livelock
_NO_STEER = {"steers.0": {"$exists": False}}


def create_indexes(database: Database[Any]) -> None:
    for collection, keys, options in INDEXES:
        database[collection].create_index(keys, **options)


class Store:
    def __init__(self, database: Database[Any], *, remember: int = 1024) -> None:
        if not isinstance(database, Database):
            raise ArgumentError(
                f"mongodb.Store needs a pymongo Database (client['name']), got {type(database).__name__}"
            )
        self.database = database
        self._sessions = database[SESSIONS]
        self._pages = database[PAGES]
        self._runs = database[RUNS]
        self._journals = database[JOURNALS]
        self._known = Known(remember)

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        known = self._known.get(session)
        items = validate.messages(msgs, trusted=known[1] if known is not None else ())
        with self._failing("save", session):
            if known is None or self._append(session, known, items, {}) is None:
                self._rewrite(session, items, {"_id": session}, {})

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
        self._known.put(session, doc["version"], items)
        return list(items)

    def add_steer(self, session: str, text: str) -> None:
        """A ``$push`` onto the session's document: pushes onto one document apply one after another,
        so steers keep the order they arrived in, whichever process sent them."""
        validate.session_id(session)
        validate.steer_text(text)
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

    def save_with_steers(self, session: str, msgs: Sequence[Message]) -> list[str]:
        """The usual step is one update: the append, matched only while no steer waits. Otherwise the
        steers are pulled and the transcript holding them written in one update, guarded on those steers
        still being there: of two concurrent takers one matches, the other reads again."""
        validate.session_id(session)
        known = self._known.get(session)
        items = validate.messages(msgs, trusted=known[1] if known is not None else ())  # checks only what is new
        with self._failing("save", session):
            if known is not None and self._append(session, known, items, _NO_STEER) is not None:
                return []
            for _ in range(_RETRIES):
                waiting = self._waiting(session)
                if not waiting:
                    self.save(session, items)
                    return []
                saved = items + tuple(Message.user(w["text"]) for w in waiting)
                where, pull = _taking(session, waiting)
                known = self._known.get(session)
                if known is not None and self._append(session, known, saved, where, pull) is not None:
                    return [w["text"] for w in waiting]
                if self._rewrite(session, saved, where, pull):
                    return [w["text"] for w in waiting]
        raise StoreError(f"MongoDB store: save of session {session!r} kept racing with other takers")

    # -- the transcript: a tail in the session's document, full pages beside it -------------------------

    def _append(
        self,
        session: str,
        known: tuple[str, tuple[Message, ...]],
        items: tuple[Message, ...],
        guard: dict[str, Any],
        also: dict[str, Any] | None = None,
    ) -> str | None:
        """Write ``items`` as the known transcript plus what follows it; the new version, or ``None``
        when the stored transcript is no longer the known one (or ``items`` does not extend it)."""
        version, old = known
        length = len(old)
        if common_prefix(old, items) < length:
            return None
        generation = version.split(":", 1)[0]
        base, new_base = _base(length), _base(len(items))
        if new_base > base:  # the tail fills pages: write them first, as no version reaches them yet
            if not self._put_pages(generation, items, base, new_base, fresh=False):
                return None
            change: dict[str, Any] = {"$set": {"tail": _bodies(items[new_base:])}}
        else:
            change = {"$push": {"tail": {"$each": _bodies(items[length:])}}}
        new_version = f"{generation}:{len(items)}"
        change.setdefault("$set", {})["version"] = new_version
        for op, fields in (also or {}).items():
            change.setdefault(op, {}).update(fields)
        if self._sessions.update_one({**guard, "_id": session, "version": version}, change).matched_count != 1:
            return None
        self._known.put(session, new_version, items)
        return new_version

    def _rewrite(self, session: str, items: tuple[Message, ...], guard: dict[str, Any], also: dict[str, Any]) -> bool:
        """Write ``items`` as a new generation and point the session at it, if ``guard`` still matches."""
        generation = uuid.uuid4().hex
        base = _base(len(items))
        self._put_pages(generation, items, 0, base, fresh=True)
        version = f"{generation}:{len(items)}"
        change: dict[str, Any] = {"$set": {"version": version, "tail": _bodies(items[base:])}}
        for op, fields in also.items():
            change.setdefault(op, {}).update(fields)
        upsert = guard == {"_id": session}
        before = self._sessions.find_one_and_update(
            {**guard, "_id": session}, change, projection={"version": 1}, upsert=upsert,
            return_document=ReturnDocument.BEFORE,
        )
        if before is None and not upsert:
            self._drop_pages(version)
            return False
        self._known.put(session, version, items)
        if before is not None and "version" in before:
            self._drop_pages(before["version"])
        return True

    def _put_pages(self, generation: str, items: tuple[Message, ...], start: int, end: int, *, fresh: bool) -> bool:
        """Insert the full pages covering ``start..end``. A page already there is a writer's that lost a
        race or died: usable only when it holds the same messages."""
        pages = [{"_id": f"{generation}:{k}", "bodies": _bodies(items[k * PAGE:(k + 1) * PAGE])}
                 for k in range(start // PAGE, end // PAGE)]
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
        generation, length = _parse(doc["version"])
        count = _base(length) // PAGE
        ids = [f"{generation}:{k}" for k in range(count)]
        pages = {p["_id"]: p["bodies"] for p in self._pages.find({"_id": {"$in": ids}})} if ids else {}
        if len(pages) < count:
            return None
        bodies = [body for page_id in ids for body in pages[page_id]]
        bodies.extend(doc.get("tail") or [])
        if len(bodies) != length:
            raise StoreError(
                f"MongoDB store: session {doc['_id']!r} should hold {length} messages but holds {len(bodies)}"
            )
        return bodies

    def _drop_pages(self, version: str) -> None:
        generation, length = _parse(version)
        ids = [f"{generation}:{k}" for k in range(length // PAGE + 1)]  # one more: a dead writer's, if any
        self._pages.delete_many({"_id": {"$in": ids}})

    def _waiting(self, session: str) -> list[dict[str, str]]:
        doc = self._sessions.find_one({"_id": session}, {"steers": 1})
        return list(doc.get("steers") or []) if doc is not None else []

    # -- RunStore: each step one single-document operation, atomic without transactions ---------------

    def fork(self, source: str, target: str, at: int | None) -> None:
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
            bodies = bodies if at is None else bodies[:at]
            generation = uuid.uuid4().hex
            base = _base(len(bodies))
            pages = [{"_id": f"{generation}:{k}", "bodies": bodies[k * PAGE:(k + 1) * PAGE]}
                     for k in range(base // PAGE)]
            if pages:
                self._pages.insert_many(pages)
            version = f"{generation}:{len(bodies)}"
            try:  # the target may already hold steers, but not a transcript
                self._sessions.update_one(
                    {"_id": target, "version": {"$exists": False}},
                    {"$set": {"version": version, "tail": bodies[base:]}},
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
            doc = self._journals.find_one({"_id": session})
        return None if doc is None else str(doc["body"])

    def put_journal(self, session: str, journal: str | None) -> None:
        validate.session_id(session)
        with self._failing("put_journal", session):
            if journal is None:
                self._journals.delete_one({"_id": session})
            else:
                self._journals.replace_one({"_id": session}, {"body": journal}, upsert=True)

    def acquire(self, session: str, holder: Holder, now: float) -> Holder:
        validate.session_id(session)
        fields = {"host": holder.host, "pid": holder.pid, "token": holder.token, "expires": holder.expires}
        with self._failing("acquire", session):
            for _ in range(3):
                renewed = self._runs.find_one_and_update(
                    {"_id": session, "token": holder.token}, {"$set": fields}, return_document=ReturnDocument.AFTER
                )
                if renewed is not None:
                    return _holder(renewed)
                try:
                    # Matches a missing or an expired lease; a live one makes the upsert collide on _id.
                    taken = self._runs.find_one_and_update(
                        {"_id": session, "expires": {"$lte": now}},
                        {"$set": {**fields, "cancelled": False}},
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                    if taken is not None:
                        return _holder(taken)
                except DuplicateKeyError:
                    pass
                current = self._runs.find_one({"_id": session})
                if current is not None:
                    return _holder(current)
        raise StoreError(f"MongoDB store: acquire of session {session!r} kept racing with another process")

    def release(self, session: str, token: str) -> None:
        validate.session_id(session)
        with self._failing("release", session):
            self._runs.delete_one({"_id": session, "token": token})

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        with self._failing("holder", session):
            doc = self._runs.find_one({"_id": session})
        return None if doc is None else _holder(doc)

    def cancel(self, session: str, now: float) -> bool:
        validate.session_id(session)
        with self._failing("cancel", session):
            result = self._runs.update_one({"_id": session, "expires": {"$gt": now}}, {"$set": {"cancelled": True}})
        return result.matched_count == 1

    @contextmanager
    def _failing(self, op: str, session: str) -> Iterator[None]:
        try:
            yield
        except PyMongoError as exc:
            raise StoreError(f"MongoDB store: {op} of session {session!r} failed: {exc}") from exc

    def __repr__(self) -> str:
        return f"mongodb.Store({self.database.name!r})"


def _taking(session: str, waiting: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The filter and the update that take exactly ``waiting``: matched only while all of them are there."""
    ids = [w["id"] for w in waiting]
    return {"_id": session, "steers.id": {"$all": ids}}, {"$pull": {"steers": {"id": {"$in": ids}}}}


def _base(length: int) -> int:
    """How many of ``length`` messages are in pages: the rest are the tail."""
    return length - length % PAGE


def _bodies(msgs: Sequence[Message]) -> list[str]:
    return [m.to_json() for m in msgs]


def _parse(version: str) -> tuple[str, int]:
    generation, _, length = version.partition(":")
    return generation, int(length)


def _holder(doc: dict[str, Any]) -> Holder:
    return Holder(doc["host"], doc["pid"], doc["token"], doc["expires"], bool(doc.get("cancelled", False)))


__all__ = ["COLLECTIONS", "INDEXES", "JOURNALS", "PAGE", "PAGES", "RUNS", "SESSIONS", "Store", "create_indexes"]
