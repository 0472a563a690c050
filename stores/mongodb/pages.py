"""A transcript's storage: the tail in the session's document and the pages beside it (what lies where:
layout.py), read whole, and written by an append (a ``$push`` onto the tail, the pages it fills written
first) or by a rewrite into a new generation, each only while the caller's guard still matches the
document. Messages are kept as JSON strings, not sub-documents, so a model's tool arguments come back
byte for byte.

An append costs the same at 10 messages as at 10,000: it rewrites at most the tail. The update that writes
also drops the journal, takes the steers it is told to, sets ``updated``, and may store events of the
event log with their numbers (a ``Claim``: eventlayout.py, events.py).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import BulkWriteError

from agent_sessions import Message, MessageError, StoreError

from .._known import common_prefix
from .base import StoreBase
from .document import STAMP, TOUCH, opened_since, opening
from .eventlayout import Claim, guarded
from .layout import MESSAGE_LIMITS, Layout


class Pages(StoreBase):
    """The transcript's reads and writes, under a guard the caller gives (store.py's saves and fork)."""

    def _append(
        self,
        session: str,
        known: tuple[str, tuple[Message, ...]],
        items: tuple[Message, ...],
        guard: dict[str, Any],
        pull: Sequence[str] = (),
        claim: Claim | None = None,
        offset: int = 0,
        pop_queue: bool = False,
    ) -> bool:
        """Write ``items`` as the known transcript plus what follows it, and the events of ``claim``; ``False``
        when the stored transcript is no longer the known one (or ``items`` does not extend it), or the guards
        no longer match. ``offset``: both are the transcript from that index on, at or before the first
        message of the document's tail (an append rewrites the tail, so it needs all of it). A page already
        taken by other messages (a writer that lost a race, was refused, or died after writing it) makes it
        a rewrite into a new generation, under the same guard. The same update
        drops the journal, takes the steers whose ids are ``pull`` and sets ``updated``: a run's usual step
        stays one write (a pipeline's when it claims events, as the cap is an expression, or opens or closes
        the turn: an open mark is kept where a message queued or a steer set it, ``document.OPEN``, and a close
        looks at what waits, ``document.CLOSED``). ``pop_queue``: the same
        update takes the oldest queued message (``take_queued``, which claims no events)."""
        assert not (pop_queue and claim is not None), "take_queued claims no events"
        version, old = known
        length = offset + len(old)
        if common_prefix(old, items) < len(old):
            return False
        layout = Layout.of(version)
        if layout.base < offset:
            return False  # the tail begins before what is known: the caller reads the document
        tail = _bodies(items[layout.base - offset:])
        pushed: list[str] | None = None  # onto the tail, or the tail replaced by ``rest``
        rest: list[str] = []
        if MESSAGE_LIMITS.overflows(tail):  # the tail fills pages: write them first, as no version reaches them yet
            pages, rest = MESSAGE_LIMITS.cut(tail)
            if not self._put_pages(layout.generation, layout.pages, pages, fresh=False):
                whole = self._whole(session, version, items, offset)
                if whole is None:
                    return False
                return self._rewrite(session, whole, {**guard, "_id": session, "version": version}, pull, claim,
                                     pop_queue)
            layout = Layout(layout.generation, offset + len(items), layout.base + len(tail) - len(rest),
                            layout.pages + len(pages))
        else:
            layout = Layout(layout.generation, offset + len(items), layout.base, layout.pages)
            pushed = tail[length - layout.base:]
        new_version = layout.version()
        where = {**guard, "_id": session, "version": version}
        turned = opening(items, old)
        if claim is None and turned is None:
            change: dict[str, Any] = {"$set": {"version": new_version}, "$unset": {"journal": ""},
                                      "$currentDate": dict(TOUCH)}
            if pushed is None:
                change["$set"]["tail"] = rest
            else:
                change["$push"] = {"tail": {"$each": pushed}}
            if pull:
                change["$pull"] = {"steers": {"id": {"$in": list(pull)}}}
            if pop_queue:
                change["$pop"] = {"queued": -1}
            written = self._sessions.update_one(where, change).matched_count == 1
        else:
            fields: dict[str, Any] = {
                "tail": {"$literal": rest} if pushed is None else
                {"$concatArrays": [{"$ifNull": ["$tail", []]}, {"$literal": pushed}]},
                "version": {"$literal": new_version}, "journal": "$$REMOVE", "updated": "$$NOW",
                **(claim.fields if claim else {})}
            if pull:
                fields["steers"] = _without(pull)
            if pop_queue:
                fields["queued"] = _POPPED
            stages = [{"$set": fields}]
            if turned is not None:  # a stage of its own: a close looks at the arrays this write left
                stages.append({"$set": {turned[0]: turned[1]}})
            written = self._committing(
                claim, lambda: self._sessions.update_one(guarded(where, claim), stages).matched_count == 1)
        if written:
            self._known.put(session, new_version, items, start=offset)
        return written

    def _whole(self, session: str, version: str, items: tuple[Message, ...], offset: int) -> tuple[Message, ...] | None:
        """``items`` (the transcript from ``offset`` on) with the stored messages before them, for a rewrite;
        ``None`` when the session is no longer at ``version``."""
        if not offset:
            return items
        doc = self._sessions.find_one({"_id": session}, {"version": 1, "tail": 1})
        bodies = None if doc is None or doc.get("version") != version else self._bodies(doc)
        if bodies is None:
            return None
        try:
            return (*(Message.from_json(body) for body in bodies[:offset]), *items)
        except (MessageError, TypeError) as exc:
            raise StoreError(f"MongoDB store: session {session!r} holds a corrupt message: {exc}") from exc

    def _rewrite(
        self, session: str, items: tuple[Message, ...], guard: dict[str, Any], pull: Sequence[str] = (),
        claim: Claim | None = None, pop_queue: bool = False,
    ) -> bool:
        """Write ``items`` as a new generation and point the session at it, with the events of ``claim``, if
        ``guard`` still matches. A pipeline update, since it may create the session (``created`` on the
        server's clock); it drops the journal and takes the steers whose ids are ``pull``."""
        version, tail = self._new_generation(_bodies(items))
        fields: dict[str, Any] = {"version": {"$literal": version}, "tail": {"$literal": tail},
                                  "journal": "$$REMOVE", **STAMP, **(claim.fields if claim else {})}
        if pull:
            fields["steers"] = _without(pull)
        if pop_queue:
            fields["queued"] = _POPPED
        stages = [{"$set": fields}, {"$set": {"open_since": opened_since(items)}}]
        upsert = guard == {"_id": session}
        before = self._committing(claim, lambda: self._sessions.find_one_and_update(
            guarded({**guard, "_id": session}, claim), stages, projection={"version": 1}, upsert=upsert,
            return_document=ReturnDocument.BEFORE,
        ), lambda found: found is not None or upsert)
        if before is None and not upsert:
            self._drop_pages(version)
            return False
        self._known.put(session, version, items)
        if before is not None and "version" in before:
            self._drop_pages(before["version"])
        return True

    def _new_generation(self, bodies: list[str]) -> tuple[str, list[str]]:
        """Write ``bodies`` as the pages of a new generation; its version and the tail left over."""
        pages, tail = MESSAGE_LIMITS.cut(bodies) if MESSAGE_LIMITS.overflows(bodies) else ([], bodies)
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


def _bodies(msgs: Sequence[Message]) -> list[str]:
    return [m.to_json() for m in msgs]


_ALL = 2**31 - 1
"""What ``$slice`` takes for "to the end"."""
_POPPED = {"$slice": [{"$ifNull": ["$queued", []]}, 1, _ALL]}
"""The queue less its head, in a pipeline."""


def _without(pull: Sequence[str]) -> dict[str, Any]:
    """The steers but those whose ids are ``pull``, in a pipeline (mongoeco knows no $not: "not in" is $in
    compared with false)."""
    return {"$filter": {"input": {"$ifNull": ["$steers", []]},
                        "cond": {"$eq": [{"$in": ["$$this.id", list(pull)]}, False]}}}
