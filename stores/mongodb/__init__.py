"""A store in MongoDB, over the caller's pymongo ``Database``.

It relies only on what a standalone mongod gives: single-document atomicity, no transactions. A session's
document is its commit point: it holds the steers waiting for it, the transcript's version and its last few
messages, the tool journal, the run lease, the lifecycle's fields and the event log's numbers, so every
write of a leased run is one update of that document whose filter carries the run's token and epoch.

One module per part, read in this order:

- ``store.py``: ``Store``, the transcript (save, messages, fork), the steers, the fenced save and the journal;
  the parts below joined in as mixins;
- ``lease.py``: the run lease (acquire, renew, release, holder, cancel, check);
- ``pages.py``: a transcript's reads and writes, the tail in the session's document and the pages beside
  it; ``layout.py``: what lies where (``Layout``, ``PAGE``), and the version that names it;
- ``events.py``: the event log (``EventStore``): its events and their numbers in the session's document, the
  older ones in pages it names; ``eventlayout.py``: what lies where, and the update that claims numbers;
- ``lifecycle.py``: ``LifecycleStore`` (list, info, metadata, delete, prune, tail, pending steers);
- ``approvals.py``: ``ApprovalStore``'s journal swap;
- ``document.py``: what every part writes on the session's document alike; ``base.py``: the collections,
  the server's clock, errors;
- ``schema.py``: the collections, ``INDEXES``, ``create_indexes`` and ``upgrade``, for the caller's migration.
"""

from __future__ import annotations

try:  # the driver first, so that a missing one says how to install it, whichever module needs it
    import pymongo  # noqa: F401
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        "stores.mongodb requires pymongo. Install it with: pip install 'stored-agent-sessions[mongodb]'"
    ) from exc

from .layout import EVENT_PAGE as EVENT_PAGE
from .layout import EVENT_PAGE_BYTES as EVENT_PAGE_BYTES
from .layout import EVENT_TAIL_BYTES as EVENT_TAIL_BYTES
from .layout import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from .layout import PAGE
from .layout import PAGE_BYTES as PAGE_BYTES
from .layout import TAIL_BYTES as TAIL_BYTES
from .layout import Layout as Layout
from .lifecycle import PRUNE_BATCH as PRUNE_BATCH
from .schema import COLLECTIONS, EVENT_PAGES, EVENTS, INDEXES, PAGES, SESSIONS, create_indexes, upgrade
from .store import Store

__all__ = ["COLLECTIONS", "EVENTS", "EVENT_PAGES", "INDEXES", "PAGE", "PAGES", "SESSIONS", "Store", "create_indexes",
           "upgrade"]
