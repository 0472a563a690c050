"""What every part of the MongoDB store stands on: the caller's ``Database`` and the store's
collections, what this process last knew of each transcript (``Known``), the server's clock, and the one
way a driver's error becomes a ``StoreError``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

from bson.errors import BSONError
from pymongo.database import Database
from pymongo.errors import AutoReconnect, PyMongoError, ServerSelectionTimeoutError

from agent_sessions import ArgumentError, OutcomeUnknown, StoreError

from .._known import REMEMBER, REMEMBER_BYTES, Known
from .document import aware
from .eventlayout import Claim
from .schema import EVENT_PAGES, EVENTS, PAGES, SESSIONS

log = logging.getLogger("stores.mongodb")
"""One logger for all of the store's modules, named after the package (as when it was one module)."""

RETRIES = 1000  # each miss means another writer or taker got there first: progress, never a livelock
_T = TypeVar("_T")


class StoreBase:
    """The collections and the plumbing that the store's parts (store.py, lease.py, pages.py, events.py,
    lifecycle.py, approvals.py) share."""

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
        self._events = database[EVENTS]  # the earlier event log, a document per event: read until moved
        self._event_pages = database[EVENT_PAGES]
        self._known = Known(remember, remember_bytes)

    def _waiting(self, session: str) -> list[dict[str, str]]:
        """The steers waiting in the session's document, oldest first (``take_steers`` takes them,
        ``pending_steers`` shows them)."""
        doc = self._sessions.find_one({"_id": session}, {"steers": 1})
        return list(doc.get("steers") or []) if doc is not None else []

    def _server_now(self) -> datetime:
        """The server's clock (``hello`` reports it), the one ``updated`` and lease expiry are on."""
        return aware(self.database.client.admin.command("hello")["localTime"])

    def _committing(
        self, claim: Claim | None, write: Callable[[], _T], matched: Callable[[_T], bool] = bool
    ) -> _T:
        """``write``, the update that commits ``claim`` (when ``matched`` says it did): the event pages it
        names are inserted first, as nothing reads a page before an update names it; after it, the pages
        the cap dropped from the list are deleted, or, when it matched nothing, its own pages. Best effort:
        a page no update names, or that the list no longer names, is never read, and goes with its log."""
        if claim is None or not (claim.pages or claim.dropped):
            return write()
        if claim.pages:
            self._event_pages.insert_many(claim.pages, ordered=True)
        done = write()
        gone = claim.dropped if matched(done) else [p["_id"] for p in claim.pages]
        if gone:
            try:
                self._event_pages.delete_many({"_id": {"$in": gone}})
            except PyMongoError as exc:
                log.warning("MongoDB store: event pages %s were not deleted: %s", gone, exc)
        return done

    @contextmanager
    def _failing(self, op: str, session: str | None = None) -> Iterator[None]:
        try:
            yield
        except (PyMongoError, BSONError) as exc:  # BSONError: DocumentTooLarge, a document over 16 MB
            of = "" if session is None else f" of session {session!r}"
            if _may_have_written(op, exc):
                raise OutcomeUnknown(f"MongoDB store: {op}{of} may have happened: the connection failed before "
                                     f"the server answered ({exc})") from exc
            raise StoreError(f"MongoDB store: {op}{of} failed: {exc}") from exc


_READS = frozenset({"events", "holder", "check", "list_sessions", "info", "tail", "pending_steers", "messages",
                    "journal", "queued"})
"""The operations that only read: a network failure during one of them changed nothing."""


def _may_have_written(op: str, exc: BaseException) -> bool:
    """A write whose request may have reached the server: the connection failed after it was chosen (not
    a server that could not be selected, which means nothing was sent)."""
    return op not in _READS and isinstance(exc, AutoReconnect) and not isinstance(exc, ServerSelectionTimeoutError)
