"""A store in MongoDB, over the caller's pymongo ``Database``.

It relies only on what a standalone mongod gives: single-document atomicity, no transactions. So a
session is one document holding both its transcript (messages kept as JSON strings, not sub-documents,
so a model's tool arguments come back byte for byte) and the steers waiting for it: taking steers and
saving the transcript they join is then one update of one document, which a crash cannot split.
``INDEXES`` and ``create_indexes(database)`` are for the caller's migration (there are none today: every
query is by ``_id``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

try:
    from pymongo import ReturnDocument
    from pymongo.database import Database
    from pymongo.errors import DuplicateKeyError, PyMongoError
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.mongodb requires pymongo. Install it with: pip install 'agent-sessions[mongodb]'"
    ) from exc

from agent_sessions import ArgumentError, Holder, Message, MessageError, SessionExists, StoreError, validate

from .._known import Known, common_prefix

SESSIONS = "agent_sessions"
RUNS = "agent_runs"
JOURNALS = "agent_journals"
COLLECTIONS = (SESSIONS, RUNS, JOURNALS)

INDEXES: list[tuple[str, list[tuple[str, int]], dict[str, Any]]] = []
"""(collection, keys, options) for each index beyond ``_id`` the store's queries use: none."""

_TAKE_RETRIES = 1000  # each miss means another taker took something: progress, never a livelock


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
        self._runs = database[RUNS]
        self._journals = database[JOURNALS]
        self._known = Known(remember)

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        known = self._known.get(session)
        items = validate.messages(msgs, trusted=known[1] if known is not None else ())
        version = uuid.uuid4().hex
        try:
            appended = False
            if known is not None and common_prefix(known[1], items) == len(known[1]):
                new = [m.to_json() for m in items[len(known[1]):]]
                result = self._sessions.update_one(
                    {"_id": session, "version": known[0]},
                    {"$push": {"bodies": {"$each": new}}, "$set": {"version": version}},
                )
                appended = result.matched_count == 1
            if not appended:
                self._sessions.update_one(
                    {"_id": session},
                    {"$set": {"version": version, "bodies": [m.to_json() for m in items]}},
                    upsert=True,
                )
        except PyMongoError as exc:
            self._known.forget(session)
            raise StoreError(f"MongoDB store: save of session {session!r} failed: {exc}") from exc
        self._known.put(session, version, items)

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)
        try:
            doc = self._sessions.find_one({"_id": session})
        except PyMongoError as exc:
            raise StoreError(f"MongoDB store: messages of session {session!r} failed: {exc}") from exc
        if doc is None or "bodies" not in doc:  # never saved (a document may hold only steers)
            return []
        try:
            items = tuple(Message.from_json(body) for body in doc["bodies"])
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
            for _ in range(_TAKE_RETRIES):
                waiting = self._waiting(session)
                if not waiting:
                    return []
                if self._sessions.update_one(*_taking(session, waiting)).modified_count == 1:
                    return [w["text"] for w in waiting]
        raise StoreError(f"MongoDB store: take_steers of session {session!r} kept racing with other takers")

    def save_with_steers(self, session: str, msgs: Sequence[Message]) -> list[str]:
        """The steers are pulled and the transcript holding them set in one update, guarded on those
        steers still being there: of two concurrent takers one matches, the other reads again."""
        validate.session_id(session)
        known = self._known.get(session)
        items = validate.messages(msgs, trusted=known[1] if known is not None else ())  # checks only what is new
        with self._failing("save", session):
            for _ in range(_TAKE_RETRIES):
                waiting = self._waiting(session)
                if not waiting:
                    break
                saved = items + tuple(Message.user(w["text"]) for w in waiting)
                version = uuid.uuid4().hex
                where, pull = _taking(session, waiting)
                update = {**pull, "$set": {"version": version, "bodies": [m.to_json() for m in saved]}}
                if self._sessions.update_one(where, update).modified_count == 1:
                    self._known.put(session, version, saved)
                    return [w["text"] for w in waiting]
        self.save(session, items)
        return []

    def _waiting(self, session: str) -> list[dict[str, str]]:
        doc = self._sessions.find_one({"_id": session}, {"steers": 1})
        return list(doc.get("steers") or []) if doc is not None else []

    # -- RunStore: each step one single-document operation, atomic without transactions ---------------

    def fork(self, source: str, target: str, at: int | None) -> None:
        validate.session_id(source)
        validate.session_id(target)
        with self._failing("fork", source):
            doc = self._sessions.find_one({"_id": source})
            if doc is None or "bodies" not in doc:
                raise ArgumentError(f"cannot fork session {source!r}: it has no transcript")
            bodies = doc.get("bodies", [])
            validate.fork_index(at, len(bodies), source)
            try:  # the target may already hold steers, but not a transcript
                self._sessions.update_one(
                    {"_id": target, "bodies": {"$exists": False}},
                    {"$set": {"version": uuid.uuid4().hex, "bodies": bodies if at is None else bodies[:at]}},
                    upsert=True,
                )
            except DuplicateKeyError:
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


def _holder(doc: dict[str, Any]) -> Holder:
    return Holder(doc["host"], doc["pid"], doc["token"], doc["expires"], bool(doc.get("cancelled", False)))


__all__ = ["COLLECTIONS", "INDEXES", "JOURNALS", "RUNS", "SESSIONS", "Store", "create_indexes"]
