"""What the SQL stores share: the Core tables, and the one store logic. Only true dialect differences
live in ``stores.sqlite``, ``stores.postgres`` and ``stores.mysql``."""

from .store import PRUNE_BATCH, SQLStore
from .tables import SCHEMA_VERSION, TABLES, ddl, metadata

__all__ = ["PRUNE_BATCH", "SCHEMA_VERSION", "TABLES", "SQLStore", "ddl", "metadata"]
