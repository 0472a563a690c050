"""The MongoDB store: a session's transcript (save, messages, fork), its steers, a leased run's fenced
save and its tool journal; the other capabilities joined in as mixins of their own modules.

It relies only on what a standalone mongod gives: single-document atomicity, no transactions. A session's
document is its commit point (document.py): it holds the steers waiting for it, the transcript's version
and its last few messages (the tail; the older ones in pages: pages.py, layout.py), the tool journal, and
the run lease (lease.py). So every write of a leased run is one update of that document whose filter
carries the run's token and epoch: the fencing check and the write are one atomic step. The usual step
(append a few messages, take no steer) is one ``$push`` onto the tail, guarded by the version this process
knows and by no steer waiting, and it costs the same at 10 messages as at 10,000; taking steers and saving
the transcript they join is still one update of one document.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from pymongo.errors import DuplicateKeyError

from agent_sessions import (
    ArgumentError,
    Holder,
    Message,
    MessageError,
    Saved,
    SessionExists,
    StoreError,
    TranscriptConflict,
    validate,
)

from .._known import common_prefix
from .approvals import Approvals
from .base import RETRIES
from .document import STAMP, TOUCH, mark
from .eventlayout import NOT_THE_LOG, blind
from .events import EventLog
from .layout import MAX_MESSAGE_BYTES, Layout
from .lease import Lease, lost
from .lifecycle import Lifecycle
from .pages import Pages

_NO_STEER = {"steers.0": {"$exists": False}}
_NO_KEYS = {"steer_keys": 0, "queue_keys": 0, "queued": 0}
_NOT_STEERS = {"steers": 0, **_NO_KEYS, **NOT_THE_LOG}
"""A projection for the reads of the transcript: the steers waiting, the keys of the steers sent with one
(as many as were ever sent: they are kept as long as the session), the queue and its keys (the same) and the
log's texts left out."""


class Store(Lifecycle, EventLog, Approvals, Lease, Pages):
    """A store in MongoDB, over the caller's pymongo ``Database``: ``Store``, ``RunStore``, ``EventStore``
    (events.py), ``LifecycleStore`` (lifecycle.py) and ``ApprovalStore`` (approvals.py)."""

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        known = self._known.get(session)
        items, shared = validate.messages_after(msgs, known[1] if known is not None else ())
        validate.stored_size(items, shared, MAX_MESSAGE_BYTES, "MongoDB store")
        with self._failing("save", session):
            if known is None or not self._append(session, known, items, {}):
                self._rewrite(session, items, {"_id": session})

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)
        with self._failing("messages", session):
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": session}, _NOT_STEERS)
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
        mark(items, doc)
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

    def add_steer_once(self, session: str, text: str, key: str) -> bool:
        """``add_steer``'s ``$push``, of the key onto the document's ``steer_keys`` too, filtered on the key
        not being there: the check and the write are one update of one document. When the key is there the
        filter matches nothing and the upsert's insert collides with the document's ``_id``
        (``DuplicateKeyError``); so does one racing another sender's upsert of a new document, which a read
        of the key tells apart: then the update is made again."""
        validate.session_id(session)
        validate.steer_text(text)
        validate.steer_key(key)
        validate.deliverable_steer(text, MAX_MESSAGE_BYTES, "MongoDB store")
        steer = {"id": uuid.uuid4().hex, "text": text}
        with self._failing("add_steer", session):
            for _ in range(RETRIES):
                try:
                    # Input waits: the turn is open (``open_since``, as the store's clock has it now).
                    self._sessions.update_one({"_id": session, "steer_keys": {"$ne": key}},
                                              {"$push": {"steers": steer, "steer_keys": key},
                                               "$currentDate": {"open_since": True}}, upsert=True)
                    return True
                except DuplicateKeyError:
                    if self._sessions.find_one({"_id": session, "steer_keys": key}, {"_id": 1}) is not None:
                        return False
        raise StoreError(f"MongoDB store: add_steer of session {session!r} kept racing with deletes")

    # -- QueueStore: ``queued`` ({key, text} oldest first) and ``queue_keys`` (every key accepted) -----------

    def enqueue(self, session: str, key: str, text: str) -> int:
        """One pipeline update of the session's document, filtered on the key not being among the keys it
        accepted: it appends the message and its key, and makes the session exist (``created``), as a save
        would. A key that is there makes the upsert collide (``add_steer_once``); then a read says where it
        stands. Pushes onto one document apply one after another: that is the acceptance order."""
        validate.session_id(session)
        validate.turn_key(key)
        validate.steer_text(text, "queued message")
        validate.deliverable_steer(text, MAX_MESSAGE_BYTES, "MongoDB store")
        item = {"key": key, "text": text}
        add = [{"$set": {
            "queued": {"$concatArrays": [{"$ifNull": ["$queued", []]}, [{"$literal": item}]]},
            "queue_keys": {"$concatArrays": [{"$ifNull": ["$queue_keys", []]}, [{"$literal": key}]]},
            "open_since": {"$ifNull": ["$open_since", "$$NOW"]},  # a message waits: the turn is open
            **STAMP}}]
        with self._failing("enqueue", session):
            for _ in range(RETRIES):
                try:
                    self._sessions.update_one({"_id": session, "queue_keys": {"$ne": key}}, add, upsert=True)
                except DuplicateKeyError:
                    pass
                doc = self._sessions.find_one({"_id": session, "queue_keys": key}, {"queued": 1})
                if doc is None:
                    continue  # a racing upsert made the document first, or a delete took it: again
                waiting = list(doc.get("queued") or [])
                for position, queued in enumerate(waiting, 1):
                    if queued["key"] == key:
                        if queued["text"] != text:
                            raise validate.queued_text_differs(session, key)
                        return position
                return 0
        raise StoreError(f"MongoDB store: enqueue of session {session!r} kept racing with deletes")

    def queued(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._failing("queued", session):
            doc = self._sessions.find_one({"_id": session}, {"queued": 1})
        return [] if doc is None else [str(q["key"]) for q in doc.get("queued") or []]

    def take_queued(self, session: str, holder: Holder, *, append: bool = True) -> Message | None:
        """The document read, the fence checked; then one update, guarded by the fence, the version read and
        the head's key, appends the head to the transcript and pops it (``Pages._append``)."""
        validate.session_id(session)
        with self._failing("take_queued", session):
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": session}, {**NOT_THE_LOG, "steer_keys": 0, "queue_keys": 0})
                if doc is None or doc.get("token") != holder.token or doc.get("epoch") != holder.epoch:
                    raise lost(session, holder, doc)
                waiting = list(doc.get("queued") or [])
                if not waiting:
                    return None
                message = Message.user(waiting[0]["text"], key=waiting[0]["key"])
                where: dict[str, Any] = {"token": holder.token, "epoch": holder.epoch,
                                         "queued.0.key": waiting[0]["key"]}
                if not append:
                    written = self._sessions.update_one(
                        {"_id": session, **where}, {"$pop": {"queued": -1}, "$currentDate": TOUCH}).matched_count == 1
                elif "version" not in doc:
                    written = self._rewrite(session, (message,), {**where, "version": {"$exists": False}},
                                            pop_queue=True)
                else:
                    bodies = self._bodies(doc)
                    if bodies is None:
                        continue  # a rewrite removed the pages between the two reads
                    stored = tuple(Message.from_json(body) for body in bodies)
                    written = self._append(session, (doc["version"], stored), (*stored, message), where,
                                           pop_queue=True)
                if written:
                    return message
        raise StoreError(f"MongoDB store: take_queued of session {session!r} kept racing with other writers")

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._failing("take_steers", session):
            for _ in range(RETRIES):
                waiting = self._waiting(session)
                if not waiting:
                    return []
                where, pull = _taking(session, waiting)
                if self._sessions.update_one(where, pull).modified_count == 1:
                    return [w["text"] for w in waiting]
        raise StoreError(f"MongoDB store: take_steers of session {session!r} kept racing with other takers")

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        start: int = 0,
    ) -> Saved:
        """The usual step is one update: the append, matched only while the lease is the run's and not
        cancelled, and (when taking steers) no steer waits. Otherwise the document is read, the fence and
        the stored transcript checked, and the steers pulled and the transcript holding them written in one
        update, guarded on the lease, the version and those steers still being there."""
        return self._save_fenced(session, holder, msgs, take_steers, replace, start=start)

    def _save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], take_steers: bool, replace: bool,
        events: Sequence[str] = (), keep: int = 0, start: int = 0,
    ) -> Saved:
        """``save_fenced``, whose one update of the session's document also stores ``events`` in its event
        log and claims their numbers, the cap ``keep`` applied (a ``Claim``: pushed onto the log's tail in
        the usual step, planned on the document read when the tail is full).

        A save from ``start`` (``TailStore``) is made a save from ``offset``, at or before the first
        message of the document's tail, whose messages before ``start`` this process knows (or reads from
        the document): an append rewrites the document's tail, so it needs all of it."""
        validate.session_id(session)
        offset = validate.save_start(start, replace, take_steers)
        known = self._known.get(session) if not offset else None
        if offset:
            covered = self._known.covering(session, offset)
            if covered is not None:  # known from ``since``: from the document tail's first message on will do
                version, old, since = covered
                offset = max(since, min(start, Layout.of(version).base))
                msgs = (*old[offset - since:start - since], *msgs)
                known = version, old[offset - since:]
        items, shared = validate.messages_after(msgs, known[1] if known is not None else ())  # checks what is new
        validate.stored_size(items, shared, MAX_MESSAGE_BYTES, "MongoDB store")
        fence: dict[str, Any] = {"token": holder.token, "epoch": holder.epoch}
        with self._failing("save", session):
            claim = blind(events, keep) if events else None
            if known is not None and not replace and len(items) > len(known[1]) and (claim or not events):
                guard = {**fence, "cancelled": False, **(_NO_STEER if take_steers else {})}
                if self._append(session, known, items, guard, claim=claim, offset=offset):
                    return Saved([], False)
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": session}, _NO_KEYS if events else {**NOT_THE_LOG, **_NO_KEYS})
                if doc is None or doc.get("token") != holder.token or doc.get("epoch") != holder.epoch:
                    raise lost(session, holder, doc)
                if offset:
                    items, offset = self._from_tail(session, doc, items, offset, start)
                if events:
                    claim = self._log_claim(session, {"_id": session, **fence}, doc, events, keep)
                    if claim is None:
                        continue  # the log begun, or moved out of agent_events (by this write or another): read again
                stored = 0 if replace else self._stored_prefix(session, doc, items, offset)
                if stored is None:
                    continue  # a rewrite removed the pages between the two reads
                waiting = list(doc.get("steers") or []) if take_steers else []
                saved = items + tuple(Message.user(w["text"]) for w in waiting)
                done = Saved([w["text"] for w in waiting], bool(doc.get("cancelled")))
                where: dict[str, Any] = {**fence}
                if not replace and stored == len(saved):  # nothing to write but the events, if any
                    if claim is None:
                        return done
                    where["version"] = doc["version"] if "version" in doc else {"$exists": False}
                    if self._claim({**where, "_id": session, **(_NO_STEER if take_steers else {})}, claim) is not None:
                        return done
                    continue  # the transcript, its steers, the log or the lease changed since the read
                pull = [w["id"] for w in waiting]
                if waiting:
                    where.update(_taking(session, waiting)[0])
                if "version" in doc and not replace:
                    written = self._append(session, (doc["version"], items[:stored]), saved, where, pull, claim,
                                           offset)
                else:
                    where["version"] = doc["version"] if "version" in doc else {"$exists": False}
                    written = self._rewrite(session, saved, {**where, "_id": session}, pull, claim)
                if written:
                    return done
        raise StoreError(f"MongoDB store: save of session {session!r} kept racing with other takers")

    def _from_tail(
        self, session: str, doc: dict[str, Any], items: tuple[Message, ...], offset: int, start: int,
    ) -> tuple[tuple[Message, ...], int]:
        """``items``, the transcript from ``offset`` on, as a save from no later than the first message of
        the document's tail: the messages of the tail before ``offset`` put before them. ``TranscriptConflict``
        when the document holds fewer than ``start`` messages."""
        layout = Layout.of(doc["version"]) if "version" in doc else None
        if layout is None or layout.length < start:
            raise TranscriptConflict(session, 0 if layout is None else layout.length, offset + len(items))
        if offset <= layout.base:
            return items, offset
        head = doc.get("tail") or []
        try:
            before = tuple(Message.from_json(body) for body in head[:offset - layout.base])
        except (MessageError, TypeError) as exc:
            raise StoreError(f"MongoDB store: session {session!r} holds a corrupt message: {exc}") from exc
        return (*before, *items), layout.base

    def _stored_prefix(
        self, session: str, doc: dict[str, Any], items: tuple[Message, ...], offset: int = 0,
    ) -> int | None:
        """How many messages the document holds from ``offset`` on, checking they are the first ones of
        ``items`` (``TranscriptConflict`` if not); ``None`` when its pages went meanwhile (read it again)."""
        if "version" not in doc:
            return 0
        known = self._known.get(session, offset)
        if known is not None and doc["version"] == known[0] and common_prefix(known[1], items) == len(known[1]):
            return len(known[1])  # a version names one transcript: the one this process knows
        if offset:
            bodies = self._last_bodies(doc, Layout.of(doc["version"]).length - offset)
        else:
            bodies = self._bodies(doc)
        if bodies is None:
            return None
        if len(bodies) > len(items) or any(items[i].to_json() != body for i, body in enumerate(bodies)):
            raise TranscriptConflict(session, offset + len(bodies), offset + len(items))
        return len(bodies)

    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None:
        validate.session_id(source)
        validate.session_id(target)
        with self._failing("fork", source):
            bodies = None
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": source}, _NOT_STEERS)
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
                    [{"$set": {"version": {"$literal": version}, "tail": {"$literal": tail}, **STAMP}}],
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
                                         {"$set": {"journal": journal}, "$currentDate": TOUCH}).matched_count == 1:
                return False
            self.check(session, holder)  # raises LeaseLost when the lease is not the run's: then it is cancelled
            if not unless_cancelled:
                if self._sessions.update_one(
                        fence, {"$set": {"journal": journal}, "$currentDate": TOUCH}).matched_count != 1:
                    self.check(session, holder)  # taken over in between
            return True

    def __repr__(self) -> str:
        return f"mongodb.Store({self.database.name!r})"


def _taking(session: str, waiting: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The filter and the update that take exactly ``waiting``: matched only while all of them are there."""
    ids = [w["id"] for w in waiting]
    return {"_id": session, "steers.id": {"$all": ids}}, {"$pull": {"steers": {"id": {"$in": ids}}}}
