"""The event log (``EventStore``), in the session's document and the pages it names (eventlayout.py).

A write of events is one update of the session's document, fenced by the run's lease, that claims their
numbers and stores them at once: pushed onto the document's events tail (a ``Claim`` made ``blind``, the
usual step: no read first), or, when the tail would overflow, with the document read first and the tail cut
into pages inserted before the update (``planned``). So a superseded run writes nothing readable, no number
is given without its event (no gap), and the cap is applied in the same update (``events_from``). Reads take
the document, then only the pages the numbers asked for are in. A save's own update carries the claim
(store.py, pages.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pymongo import ReturnDocument

from agent_sessions import Holder, Message, Saved, StoredEvent, StoreError, eventlog, validate

from .base import RETRIES, StoreBase
from .eventlayout import LOG, Claim, begin, blind, guarded, is_legacy, is_paged, page_id, planned, upgrade_log
from .layout import EVENT_PAGE
from .lease import LEASE, lost


class EventLog(StoreBase):
    """``EventStore``: the claim of the numbers is the write of the events."""

    if TYPE_CHECKING:  # what this part needs of the store that joins it, for the type checker only
        def _save_fenced(
            self, session: str, holder: Holder, msgs: Sequence[Message], take_steers: bool, replace: bool,
            events: Sequence[str] = (), keep: int = 0, start: int = 0,
        ) -> Saved:
            """The store's fenced save, its one update also claiming ``events`` (store.py)."""
            ...

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        """One fenced update of the session's document pushes the events onto its tail and claims their
        numbers (a log that has none begins at the server's clock); when the tail is full, the document is
        read first and the update is ``planned`` (pages cut off the tail, inserted before it). A superseded
        holder's update matches nothing: ``LeaseLost``, and nothing is written."""
        validate.session_id(session)
        records = eventlog.check_append(events, keep)
        fence = {"_id": session, "token": holder.token, "epoch": holder.epoch}
        with self._failing("append_events", session):
            claim = blind(records, keep)
            for _ in range(RETRIES):
                if claim is not None:
                    last = self._claim(fence, claim)
                    if last is not None:
                        return last
                doc = self._sessions.find_one({"_id": session}, {**LEASE, **LOG})
                if doc is None or doc.get("token") != holder.token or doc.get("epoch") != holder.epoch:
                    raise lost(session, holder, doc)
                claim = self._log_claim(session, fence, doc, records, keep)
        raise StoreError(f"MongoDB store: append_events of session {session!r} kept racing with other writers")

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int, start: int = 0,
    ) -> Saved:
        """The save's own update claims the numbers and stores the events (store.py), so a
        ``TranscriptConflict`` or ``LeaseLost`` writes neither."""
        records = eventlog.check_append(events, keep) if events else []
        eventlog.check_keep(keep)
        return self._save_fenced(session, holder, msgs, take_steers, replace, records, keep, start)

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        """The session's document says which numbers its log holds (``events_from`` to ``events_last``),
        the newest of them in its tail; the older ones are read from the pages it names, only those the
        numbers asked for are in. So a deleted session's events are gone with its document, and a page no
        update named (a writer refused, or dead before its update) is never read."""
        validate.session_id(session)
        after, limit = eventlog.check_read(after, limit)
        with self._failing("events", session):
            for _ in range(RETRIES):
                doc = self._sessions.find_one({"_id": session}, LOG)
                if doc is None or "events_last" not in doc:
                    return []
                found = self._legacy_events(session, doc, after, limit) if is_legacy(doc) else \
                    self._read(doc, after, limit)
                if found is not None:
                    break
            else:
                raise StoreError(f"MongoDB store: events of session {session!r} kept racing with the cap")
        try:
            return [eventlog.decode(seq, text) for seq, text in found]
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"MongoDB store: session {session!r} holds a corrupt event: {exc}") from exc

    def _log_claim(
        self, session: str, fence: dict[str, Any], doc: Mapping[str, Any], texts: Sequence[str], keep: int
    ) -> Claim | None:
        """The claim of ``texts`` on the log of ``doc`` (read with ``LOG``), or ``None`` after making the
        log one a claim can be planned on (begun, or moved out of ``agent_events``): read again."""
        if is_legacy(doc):
            upgrade_log(self._sessions, self._event_pages, self._events, session)
            return None
        if not is_paged(doc):
            start = begin(keep)
            self._sessions.update_one(guarded(fence, start), [{"$set": start.fields}])
            return None
        return planned(session, doc, texts, keep)

    def _claim(self, where: dict[str, Any], claim: Claim) -> int | None:
        """The claim alone, by one update of the document ``where`` finds: the last number given, or
        ``None`` when nothing matched."""
        doc = self._committing(claim, lambda: self._sessions.find_one_and_update(
            guarded(where, claim), [{"$set": claim.fields}], projection={"events_last": 1},
            return_document=ReturnDocument.AFTER))
        return None if doc is None else int(doc["events_last"])

    def _read(self, doc: Mapping[str, Any], after: int, limit: int) -> list[tuple[int, str]] | None:
        """Up to ``limit`` events numbered above ``after`` of a paged log: from the pages that hold the
        first of them (as many as could be needed per read, more if they fall short: a page moved out of
        ``agent_events`` may have gaps), then the tail. ``None`` when a page went meanwhile (the cap dropped it
        after the document was read: read it again)."""
        last, tail = int(doc["events_last"]), list(doc["events_tail"])
        low, tail_first = max(after + 1, int(doc["events_from"])), last - len(tail) + 1
        entries = doc.get("events_pages") or []
        found: list[tuple[int, str]] = []
        k = max(0, bisect.bisect_right([int(f) for f, _ in entries], low) - 1)
        while low < tail_first and k < len(entries) and len(found) < limit:
            batch = entries[k:k + math.ceil((limit - len(found)) / EVENT_PAGE) + 1]
            ids = [page_id(doc["events_log"], key) for _, key in batch]
            pages = {p["_id"]: p["texts"] for p in self._event_pages.find({"_id": {"$in": ids}}, {"texts": 1})}
            if len(pages) < len(ids):
                return None
            for (first, _), page in zip(batch, ids, strict=True):
                found.extend((int(first) + i, text) for i, text in enumerate(pages[page])
                             if low <= int(first) + i < tail_first)
            k += len(batch)
        found.extend((tail_first + i, text) for i, text in enumerate(tail) if tail_first + i >= low)
        return found[:limit]

    def _legacy_events(
        self, session: str, doc: Mapping[str, Any], after: int, limit: int
    ) -> list[tuple[int, str]]:
        """A log of the earlier layout, one document per event in ``agent_events``, not yet moved (``upgrade``,
        or its session's next write of events, moves it): those documents, within the document's numbers."""
        found = self._events.find(
            {"session": session, "seq": {"$gt": max(after, int(doc["events_from"]) - 1),
                                         "$lte": int(doc["events_last"])}},
            {"_id": 0, "seq": 1, "text": 1},
        ).sort("seq", 1).limit(limit)
        return [(int(e["seq"]), e["text"]) for e in found]
