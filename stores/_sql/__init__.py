"""What the SQL stores share: the Core tables, and the one store logic. Only true dialect differences
live in ``stores.sqlite``, ``stores.postgres`` and ``stores.mysql``.

The store reads as the MongoDB store does, one module per part: ``store.py`` (``SQLStore``: the transcript,
steers, the fenced save, the journal, fork), ``lease.py``, ``events.py``, ``lifecycle.py`` and
``approvals.py`` (mixins ``SQLStore`` joins), all on ``base.py`` (the engine, transactions, fork safety);
beside them ``tables.py`` (the schema), ``statements.py`` (the prebuilt statements), ``listing.py`` (the
statements of a filtered listing and the choice between them), ``driver.py`` (running
them on the DB-API cursor) and ``clock.py`` (the database's clock in SQL).
"""

from .lifecycle import PRUNE_BATCH
from .store import SQLStore
from .tables import SCHEMA_VERSION, TABLES, ddl, metadata

__all__ = ["PRUNE_BATCH", "SCHEMA_VERSION", "TABLES", "SQLStore", "ddl", "metadata"]
