"""The MongoDB backend: a session's document is its row, and every write is one ``find_one_and_update`` of it.

The guard is evaluated by the server inside the update's pipeline (``pipeline``), so the filter is the id
alone and a refused write costs the one round trip too, answered with the document and why (``write``:
this write's token, its ``spill`` mark, or neither). No transaction: a standalone mongod has none.
What does not fit the document is a part (``layout``), inserted before the update that names it: a part
no document names is never read. A refused write deletes its parts; what writers that died between their
parts and their update left, or a refused one could not delete, goes with the session's next planned write
(the parts planned at its seal or before that the document does not name), or with the session.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC
from typing import Any

from bson.errors import BSONError
from pymongo import ReturnDocument, WriteConcern
from pymongo.database import Database
from pymongo.errors import AutoReconnect, DuplicateKeyError, PyMongoError, ServerSelectionTimeoutError

from agent_sessions.backend import (
    Acquire,
    Change,
    Guard,
    Idle,
    Open,
    Queued,
    Recent,
    Row,
    Snapshot,
    Steer,
    Want,
    Written,
    new_incarnation,
)
from agent_sessions.errors import OutcomeUnknown, StoreError

from . import layout, pipeline
from .pipeline import ANSWER, NOW, ROW
from .schema import PARTS, SESSIONS, schema_of

log = logging.getLogger("stores.mongodb")
ATTEMPTS = 20
"""Tries of a write whose plan another write made stale, or of a read whose parts a write dropped."""


class Backend:
    """Sessions in the caller's ``Database``: ``agent_sessions`` and ``agent_parts`` (``schema``)."""

    def __init__(self, database: Database[Any]) -> None:
        self.database = database
        self.documents = database[SESSIONS]
        self.parts = database[PARTS]
        self._forget = self.parts.with_options(write_concern=WriteConcern(w=0))
        """Deletes of parts nothing names, unacknowledged: best effort, and no round trip waited for."""
        self._identity: str | None = None

    @property
    def identity(self) -> str:
        if self._identity is None:
            with self._failing("identity", ""):
                self._identity = str(schema_of(self.database)["identity"])
        return self._identity

    # -- writes ----------------------------------------------------------------------------------------------

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        if change.delete:
            return self._delete(session, guard)
        if change.empty:
            return self._check(session, guard)
        fresh = (uuid.uuid4().hex, new_incarnation())
        plan = self._plan(session, change) if layout.needs_parts(change) else None
        for _ in range(ATTEMPTS):
            if plan is not None and plan.parts:
                with self._failing("write", session):  # parts nothing names yet: nothing happened
                    self.parts.insert_many(plan.parts, ordered=False)
            token = uuid.uuid4().hex
            update = pipeline.update(guard, change, token, token + ":spill", fresh, plan)
            doc = self._update(session, update, upsert=plan is None and pipeline.holds_on_nothing(guard))
            mark = None if doc is None else doc.get("write")
            if mark == token:
                assert doc is not None
                if isinstance(change.lease, Acquire) and "taken_from" in doc:
                    was = doc["taken_from"]
                    log.info("MongoDB store: session %r: the lease of pid %s on %s (token %s…) had expired; taken "
                             "over at epoch %s", session, was.get("pid"), was.get("host"), str(was.get("token"))[:8],
                             doc.get("epoch"))
                if plan is not None:  # what this write's plan dropped, and what writers before it left
                    self._left(session, plan.generation, plan.seal, plan.named)
                return Written(True, _row(session, doc, float(doc["at"])))
            if plan is not None and plan.parts:
                self._left(session, plan.generation, plan.seal, [], [p["_id"] for p in plan.parts])
            if mark == token + ":spill" or (plan is not None and doc is None):
                plan = self._plan(session, change)  # the guard held; the layout did not fit, or moved
                continue
            return Written(False, None if doc is None else _row(session, doc, float(doc.get("at") or 0.0)))
        raise StoreError(f"MongoDB store: a write of session {session!r} was planned {ATTEMPTS} times, each time "
                         f"overtaken by another write")

    def _update(self, session: str, update: list[Any], upsert: bool) -> dict[str, Any] | None:
        with self._failing("write", session, writes=True):
            for _ in range(ATTEMPTS):
                try:
                    return self.documents.find_one_and_update({"_id": session}, update, ANSWER, upsert=upsert,
                                                             return_document=ReturnDocument.AFTER)
                except DuplicateKeyError:
                    continue  # two upserts made the document at once: the other's is there now
        raise StoreError(f"MongoDB store: session {session!r}: its document kept being made under this write")

    def _plan(self, session: str, change: Change) -> layout.Plan:
        """Read the document's layout (making a document for the session if it has none, so the plan has a
        generation to be committed in), and plan ``change`` on it."""
        with self._failing("write", session):
            doc = self.documents.find_one_and_update(
                {"_id": session}, [{"$set": {"generation": {"$ifNull": ["$generation", uuid.uuid4().hex]}}}],
                projection=layout.LAYOUT, upsert=True, return_document=ReturnDocument.AFTER)
        assert doc is not None  # upserted
        return layout.plan(session, doc, change)

    def _left(self, session: str, generation: str, seal: int, named: list[str],
              ids: list[str] | None = None) -> None:
        """Delete parts nothing names: ``ids``, or the session's parts planned at ``seal`` or before that
        are not ``named`` (their writers can no longer commit them)."""
        where: dict[str, Any] = {"_id": {"$in": ids}} if ids is not None else {
            "session": session, "generation": generation, "seal": {"$lte": seal}, "_id": {"$nin": named}}
        try:
            self._forget.delete_many(where)
        except PyMongoError as exc:
            log.warning("MongoDB store: parts of session %r were not deleted: %s", session, exc)

    def _check(self, session: str, guard: Guard) -> Written:
        """A change of nothing: the guard, evaluated, and the row."""
        found = self._aggregate(session, [{"$match": {"_id": session}}, {"$project": {**ROW, "_now": NOW,
                                                                                      "_ok": pipeline.holds(guard)}}])
        if not found:
            return Written(pipeline.holds_on_nothing(guard), None)
        doc = found[0]
        row = _row(session, doc, float(doc["_now"]))
        return Written(bool(doc["_ok"]) if row is not None else pipeline.holds_on_nothing(guard), row)

    def _delete(self, session: str, guard: Guard) -> Written:
        """One ``find_one_and_delete`` filtered by the guard; refused (it then finds no document), a read says
        whether the guard failed or there was nothing to delete. Then the session's parts."""
        for _ in range(ATTEMPTS):
            with self._failing("delete", session, writes=True):
                doc = self.documents.find_one_and_delete({"_id": session, "$expr": pipeline.holds(guard)},
                                                        projection=ANSWER)
            if doc is not None:
                if "generation" in doc:
                    with self._failing("delete", session):  # the session is gone: its parts are unreadable
                        self.parts.delete_many({"session": session, "generation": doc["generation"]})
                return Written(True, _row(session, doc, float(doc.get("at") or 0.0)))
            checked = self._check(session, guard)
            if not checked.done or checked.row is None:
                return checked
        raise StoreError(f"MongoDB store: delete of session {session!r} kept racing with its writers")

    # -- reads -----------------------------------------------------------------------------------------------

    def read(self, session: str, want: Want) -> Snapshot | None:
        messages = want.start is not None or want.last is not None
        fields: dict[str, Any] = {**ROW, "_now": NOW}
        if messages:
            fields.update(tail=1, pages=1)
        for kind, whole in (("steers", want.steers), ("queue", want.queue)):
            if whole:  # the items whole, not only their ids
                del fields[f"{kind}.id"]
                fields[kind] = 1
        for _ in range(ATTEMPTS):
            found = self._aggregate(session, [{"$match": {"_id": session}}, {"$project": fields}])
            if not found:
                return None
            doc = found[0]
            row = _row(session, doc, float(doc["_now"]))
            if row is None:
                return None
            start, stop = 0, 0
            if messages:
                stop = row.length if want.stop is None else min(want.stop, row.length)
                start = want.start if want.start is not None else max(stop - (want.last or 0), 0)
            wanted = [e for e in doc.get("pages") or [] if e["f"] < stop and e["f"] + e["n"] > start]
            items = [x for kind in ("steers", "queue") for x in doc.get(kind) or [] if "ref" in x]
            parts = self._parts(session, [e["p"] for e in wanted] + [x["ref"] for x in items])
            if parts is None:
                continue  # a write dropped a part after the document was read: read again
            texts: list[str] = []
            if messages:
                tail = list(doc.get("tail") or [])
                numbered = [(e["f"] + i, t) for e in wanted for i, t in enumerate(parts[e["p"]][:e["n"]])]
                numbered += [(row.length - len(tail) + i, t) for i, t in enumerate(tail)]
                texts = [t for i, t in numbered if start <= i < stop]
                if len(texts) != max(stop - start, 0):
                    raise StoreError(f"MongoDB store: session {session!r} should hold messages {start} to {stop} "
                                     f"but its pages and tail hold {len(texts)} of them")
            return Snapshot(row, start, texts,
                            [Steer(x["id"], _text(x, parts), x.get("key")) for x in doc.get("steers") or []]
                            if want.steers else [],
                            [Queued(x["id"], x["key"], _text(x, parts)) for x in doc.get("queue") or []]
                            if want.queue else [])
        raise StoreError(f"MongoDB store: a read of session {session!r} kept racing with writes that dropped parts")

    def _parts(self, session: str, ids: list[str]) -> dict[str, list[str]] | None:
        """The texts of parts ``ids``; ``None`` when one is gone (dropped since the document was read)."""
        if not ids:
            return {}
        with self._failing("read", session):
            found = {p["_id"]: list(p["texts"]) for p in self.parts.find({"_id": {"$in": ids}}, {"texts": 1})}
        return found if len(found) == len(set(ids)) else None

    def events(self, session: str, after: int, limit: int) -> list[tuple[int, str]]:
        fields = {"last_seq": 1, "events": 1, "event_pages": 1, "events_start": 1, "events_from": 1}
        for _ in range(ATTEMPTS):
            with self._failing("events", session):
                doc = self.documents.find_one({"_id": session}, fields)
            last = 0 if doc is None else int(doc.get("last_seq") or 0)
            low = max(after + 1, int(doc.get("events_from") or 0)) if doc is not None else 0
            if not last or low > last:
                return []
            assert doc is not None
            high = min(low + limit - 1, last)
            start, tail = int(doc["events_start"]), list(doc.get("events") or [])
            wanted = [e for e in doc.get("event_pages") or []
                      if start + e["f"] <= high and start + e["f"] + e["n"] > low]
            parts = self._parts(session, [e["p"] for e in wanted])
            if parts is None:
                continue
            numbered = [(start + e["f"] + i, text) for e in wanted for i, text in enumerate(parts[e["p"]][:e["n"]])]
            numbered += [(last - len(tail) + 1 + i, text) for i, text in enumerate(tail)]
            return [(seq, text) for seq, text in numbered if low <= seq <= high]
        raise StoreError(f"MongoDB store: a read of session {session!r}'s events kept racing with the cap")

    def sessions(self, query: Recent | Open | Idle) -> list[Row]:
        match: dict[str, Any] = {"exists": True}
        if isinstance(query, Recent):
            if query.prefix:
                match["_id"] = {"$regex": "^" + re.escape(query.prefix)}  # anchored: the index serves it
            if query.where:
                match["tags"] = {"$all": [f"{k}={v}" for k, v in query.where]}
            if query.after is not None:
                u, last = query.after
                match["$or"] = [{"updated": {"$lt": u}}, {"updated": u, "_id": {"$lt": last}}]
            stages: list[Any] = [{"$match": match}, {"$sort": {"updated": -1, "_id": -1}}, {"$limit": query.limit}]
        elif isinstance(query, Open):
            match["open_since"] = {"$exists": True}
            if query.after is not None:
                since, last = query.after
                match["$or"] = [{"open_since": {"$gt": since}}, {"open_since": since, "_id": {"$gt": last}}]
            stages = [{"$match": match}, {"$sort": {"open_since": 1, "_id": 1}},
                      {"$match": {"$expr": {"$lte": ["$open_since", {"$subtract": [NOW, query.grace]}]}}},
                      {"$limit": query.limit}]
        else:  # the server's clock first, so the index's range ends at the cut-off: none past it is read
            with self._failing("read", ""):
                now = self.database.client.admin.command("hello")["localTime"].replace(tzinfo=UTC).timestamp()
            match["updated"] = {"$lt": now - query.idle_for}
            stages = [{"$match": match}, {"$sort": {"updated": 1, "_id": 1}}, {"$limit": query.limit}]
        found = self._aggregate("", [*stages, {"$project": {**ROW, "_now": NOW}}])
        return [row for doc in found if (row := _row(str(doc["_id"]), doc, float(doc["_now"]))) is not None]

    def _aggregate(self, session: str, stages: list[Any]) -> list[dict[str, Any]]:
        with self._failing("read", session):
            return list(self.documents.aggregate(stages))

    def close(self) -> None:
        pass  # the database's client is the caller's

    @contextmanager
    def _failing(self, what: str, session: str, *, writes: bool = False) -> Iterator[None]:
        """The driver's errors as ``StoreError``; ``OutcomeUnknown`` for a write whose command may have
        reached the server (its connection failed after a server was chosen)."""
        try:
            yield
        except (PyMongoError, BSONError) as exc:  # BSONError: a document over 16 MB
            of = f" of session {session!r}" if session else ""
            if writes and isinstance(exc, AutoReconnect) and not isinstance(exc, ServerSelectionTimeoutError):
                raise OutcomeUnknown(f"MongoDB store: {what}{of} may have happened: the connection failed before "
                                     f"the server answered ({exc})") from exc
            raise StoreError(f"MongoDB store: {what}{of} failed: {exc}") from exc

    def __repr__(self) -> str:
        return f"mongodb database {self.database.name!r}"


def _row(session: str, doc: dict[str, Any], now: float) -> Row | None:
    """The row of a session's document; ``None`` for one no write has changed yet (only planned on)."""
    if not doc.get("version"):
        return None
    since = doc.get("open_since")
    return Row(session, bool(doc.get("exists")), doc.get("incarnation") or "", float(doc.get("created") or 0.0),
               float(doc.get("updated") or 0.0), int(doc["version"]), int(doc.get("length") or 0),
               int(doc.get("edits") or 0), doc.get("token"), int(doc.get("epoch") or 0),
               float(doc.get("expires") or 0.0), doc.get("host") or "", int(doc.get("pid") or 0), doc.get("spec"),
               doc.get("turn"), bool(doc.get("cancelled")), doc.get("cancelled_turn"), bool(doc.get("handed")),
               doc.get("journal"),
               None if since is None else float(since), doc.get("metadata") or "{}", int(doc.get("last_seq") or 0),
               len(doc.get("steers") or ()), len(doc.get("queue") or ()), now)


def _text(item: dict[str, Any], parts: dict[str, list[str]]) -> str:
    return str(item["text"]) if "ref" not in item else parts[item["ref"]][0]


