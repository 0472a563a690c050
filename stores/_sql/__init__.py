"""What the SQL stores share: the tables of schema 1 (``tables.py``), the backend over a SQLAlchemy Engine
(``backend.py``) and the database's clock in SQL (``clock.py``). Only true dialect differences live in
``stores.sqlite``, ``stores.postgres`` and ``stores.mysql``."""

from agent_sessions.errors import SchemaMismatch

from .backend import SQLBackend
from .tables import SCHEMA_VERSION, TABLES, ddl, metadata

__all__ = ["SCHEMA_VERSION", "TABLES", "SQLBackend", "SchemaMismatch", "ddl", "metadata"]
