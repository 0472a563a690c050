"""What the SQL stores share: the Core tables, and the one store logic. Only true dialect differences
live in ``stores.sqlite``, ``stores.postgres`` and ``stores.mysql``."""

from .store import SQLStore
from .tables import TABLES, ddl, metadata

__all__ = ["TABLES", "SQLStore", "ddl", "metadata"]
