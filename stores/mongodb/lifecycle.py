"""``LifecycleStore``, on the session's document: ``created`` and ``updated`` (dates on the server's clock,
set by the very update that writes the document, so a run's usual step is still one write), ``metadata``
(its JSON text) and ``tags`` (``"key=<value's JSON>"``, which ``where`` matches, so values compare by their
JSON form). Deleting the document is the one step that ends a session: its pages and its event log's go
after it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pymongo.errors import DuplicateKeyError

from agent_sessions import Holder, Message, MessageError, SessionBusy, StoreError, lifecycle, validate
from agent_sessions.contract import Scalar, SessionInfo, SessionPage

from .base import RETRIES
from .document import STAMP, aware, mark, tags_of
from .eventlayout import GONE, is_legacy
from .layout import PAGE, Layout
from .lease import LEASE, LIVE, NOT_LIVE, holder_of
from .pages import Pages

PRUNE_BATCH = 500
"""Sessions ``prune`` picks per query; each is then deleted by its own single-document delete."""
_EXISTS = {"created": {"$exists": True}}
"""A session exists once a save, a lease, set_metadata or a fork wrote ``created``; a document holding only
steers (``add_steer`` upserts) is one that does not exist yet."""


class Lifecycle(Pages):
    """Sessions listed, inspected, labelled, deleted and pruned; a transcript's last messages; the steers
    waiting."""

    def list_sessions(
        self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50, after: str | None = None,
        *, stranded: bool = False, grace: float = 0.0,
    ) -> SessionPage:
        """One query on ``(updated, _id)`` descending (the ``updated_id`` index, or ``tags_updated_id``
        with ``where``): the prefix is an anchored regex of the escaped prefix (the ``_id`` index serves
        it), ``where`` is ``tags: {$all: ["key=<value's JSON>", ...]}`` so values compare by their JSON
        form as in every store, and the cursor is a keyset bound, so a page costs the same deep in."""
        if stranded:
            return self._stranded(lifecycle.check_stranded(prefix, where, limit, after, grace), limit, after)
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

    if TYPE_CHECKING:  # the lease's (a mixin beside this one in the store's class)
        def check(self, session: str, holder: Holder) -> bool: ...

    def _stranded(self, grace: float, limit: int, after: str | None) -> SessionPage:
        """The sparse index ``open_since`` holds only the open sessions; its range up to now less ``grace``
        (the server's clock), oldest first, the live ones left out, and the cancelled ones unless a message
        is queued (a cancel stops a run, not the queue)."""
        with self._failing("list_sessions"):
            until = self._server_now() - timedelta(seconds=grace)
            where: list[dict[str, Any]] = [{"open_since": {"$lte": until}}, _EXISTS, NOT_LIVE,
                                           {"$or": [{"cancelled": {"$ne": True}}, {"queued.0": {"$exists": True}}]}]
            if after is not None:
                seconds, last = lifecycle.decode_cursor(after)
                date = _date(seconds)
                where.append({"$or": [{"open_since": {"$gt": date}}, {"open_since": date, "_id": {"$gt": last}}]})
            docs = list(self._sessions.find({"$and": where}, _INFO)
                        .sort([("open_since", 1), ("_id", 1)]).limit(limit + 1))
        return lifecycle.page([(_seconds(doc["open_since"]), _info(doc)) for doc in docs], limit)

    def mark_finished(self, session: str, holder: Holder, journal: str | None) -> bool:
        validate.session_id(session)
        where: dict[str, Any] = {"_id": session, "token": holder.token, "epoch": holder.epoch,
                                 "journal": journal if journal is not None else {"$exists": False},
                                 "steers.0": {"$exists": False}, "queued.0": {"$exists": False}}
        with self._failing("mark_finished", session):
            if self._sessions.update_one(where, {"$unset": {"open_since": ""}}).matched_count == 1:
                return True
            self.check(session, holder)  # LeaseLost when the lease is not the caller's; else input came
        return False

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
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": session}, {"metadata": 1})
                stored = None if doc is None else doc.get("metadata")
                merged = lifecycle.merge_metadata(lifecycle.decode_metadata(stored), changes)
                change = [{"$set": {"metadata": {"$literal": lifecycle.encode_metadata(merged)},
                                    "tags": {"$literal": tags_of(merged)}, **STAMP}}]
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
            for _ in range(RETRIES):
                where = {"_id": session} if force else {"_id": session, **NOT_LIVE}
                doc = self._sessions.find_one_and_delete(where, projection={"version": 1, **GONE})
                if doc is not None:
                    self._gone(session, doc)
                    return True
                if force:  # nothing was there to delete; a run making the session since made a new one
                    self._known.forget(session)
                    return False
                live = self._sessions.find_one({"_id": session, **LIVE}, LEASE)
                if live is not None:
                    held = holder_of(live)
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
                                                             projection={"version": 1, **GONE})
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
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": session}, {"version": 1, "tail": 1, "created": 1})
                if doc is None or "version" not in doc:
                    return []
                bodies = self._last_bodies(doc, last)
                if bodies is not None:
                    items = _messages(session, bodies)
                    mark(items, doc)
                    return items
        raise StoreError(f"MongoDB store: tail of session {session!r} kept racing with rewrites")

    def read_back(self, session: str, stop: int | None, count: int) -> tuple[int, list[Message]]:
        """``TailStore.read_back``: the document, and the newest pages back to the first message asked for
        (``_last_bodies``: the pages' lengths vary, so a read that stops before the end reads those after it too)."""
        validate.session_id(session)
        validate.read_back(stop, count)
        with self._failing("read_back", session):
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": session}, {"version": 1, "tail": 1, "created": 1})
                if doc is None or "version" not in doc:
                    return 0, []
                length = Layout.of(doc["version"]).length
                end = length if stop is None else min(stop, length)
                first = max(end - count, 0)
                if end <= first:
                    return 0, []
                bodies = self._last_bodies(doc, length - first)
                if bodies is not None:
                    items = _messages(session, bodies[:end - first])
                    mark(items, doc)
                    return first, items
        raise StoreError(f"MongoDB store: read_back of session {session!r} kept racing with rewrites")

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
        """After the session's document was deleted: its pages, which nothing names any more, and its event
        log's pages, every one whose id starts with the log's (those no update named too; a log begun since
        is another). A log of the earlier layout, or one moved out of it: its documents in ``agent_events``,
        up to the last number it gave there (a log begun since numbers above it: never those)."""
        self._known.forget(session)
        if "version" in doc:
            self._drop_pages(doc["version"])
        if "events_log" in doc:
            self._event_pages.delete_many({"_id": {"$regex": f"^{re.escape(doc['events_log'])}:"}})
        legacy = doc["events_last"] if is_legacy(doc) else doc.get("events_legacy")
        if legacy is not None:
            self._events.delete_many({"session": session, "seq": {"$lte": int(legacy)}})


def _messages(session: str, bodies: Sequence[str]) -> list[Message]:
    try:
        return [Message.from_json(body) for body in bodies]
    except (MessageError, TypeError) as exc:
        raise StoreError(f"MongoDB store: session {session!r} holds a corrupt message: {exc}") from exc


_INFO = {"created": 1, "updated": 1, "metadata": 1, "version": 1, "spec": 1, "open_since": 1}


def _info(doc: dict[str, Any]) -> SessionInfo:
    length = Layout.of(doc["version"]).length if "version" in doc else 0
    since = doc.get("open_since")
    return SessionInfo(doc["_id"], aware(doc["created"]), aware(doc["updated"]), length,
                       lifecycle.decode_metadata(doc.get("metadata")), doc.get("spec"),
                       None if since is None else aware(since))


def _seconds(value: datetime) -> float:
    """A stored date (milliseconds) as the cursor's seconds, exactly: ``_date`` gives back the same date."""
    return round(aware(value).timestamp() * 1000) / 1000


def _date(seconds: float) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=round(seconds * 1000))
