"""The store's tables in Django's migrations. A migration must do tomorrow what it did the day it was
written, so the app's migrations run DDL frozen in a file beside them (``0001_initial.json``), rather than
the stores' DDL of the day, generated from the stores, never written by hand:

    python -m agent_sessions.contrib.django.schema > agent_sessions/contrib/django/migrations/0001_initial.json

tests/test_django_app.py fails when the stores' DDL differs from the frozen one: a schema change then
needs the migration regenerated or, once released, a new migration running the upgrade statements.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent_sessions.errors import StoreError

log = logging.getLogger(__name__)

VENDORS = ("postgresql", "mysql", "sqlite")
_CREATE = re.compile(r"CREATE (?:UNIQUE )?(TABLE|INDEX) (?:IF NOT EXISTS )?(\w+)(?: ON (\w+))?")

Operation = Callable[[Any, Any], None]  # what migrations.RunPython calls: (apps, schema_editor)


def create(statements: Mapping[str, Sequence[str]]) -> Operation:
    """The forward operation: run the vendor's statements on the AGENT_SESSIONS database, skipping each
    table or index that exists already (tables made before the app was installed, from the same exported
    DDL, are kept as they are, on every vendor: MySQL has no CREATE INDEX IF NOT EXISTS). A statement that
    is not a CREATE (SQLite's ``PRAGMA user_version``) runs only when a table was created."""

    def forward(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        if not _ours(connection, statements):
            return
        with connection.cursor() as cursor:
            tables = set(connection.introspection.table_names(cursor))
            if "agent_sessions" in tables and "agent_store" not in tables:
                raise StoreError(f"DATABASES[{connection.alias!r}] has tables of an earlier development schema of "
                                 "agent-sessions (agent_sessions without agent_store), which this version does not "
                                 "read: drop them (or point AGENT_SESSIONS at a new database), then migrate again")
            created = False
            for statement in statements[connection.vendor]:
                found = _CREATE.match(statement)
                if found is None:
                    if not created:
                        continue
                elif found[1] == "TABLE":
                    if found[2] in tables:
                        log.info("agent-sessions: table %s exists already; kept", found[2])
                        continue
                    created = True
                elif found[3] in tables and found[2] in connection.introspection.get_constraints(cursor, found[3]):
                    continue
                schema_editor.execute(statement, params=None)

    return forward


def drop(statements: Mapping[str, Sequence[str]]) -> Operation:
    """The reverse operation: drop the tables (and with them every transcript they hold)."""

    def backward(apps: Any, schema_editor: Any) -> None:
        if _ours(schema_editor.connection, statements):
            for statement in statements[schema_editor.connection.vendor]:
                schema_editor.execute(statement, params=None)

    return backward


def _ours(connection: Any, statements: Mapping[str, Sequence[str]]) -> bool:
    """Whether the tables belong in this database: the AGENT_SESSIONS alias, unless a STORE function or a URL
    makes the store (then no table is created anywhere); ``ImproperlyConfigured`` for a vendor without them."""
    from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]

    from . import options

    conf = options()
    if conf["STORE"] is not None or conf["URL"] is not None or connection.alias != conf["DATABASE"]:
        return False
    if connection.vendor not in statements:
        raise ImproperlyConfigured(f"agent-sessions has no tables for a {connection.vendor!r} database "
                                   f"(DATABASES[{connection.alias!r}]); it supports {', '.join(VENDORS)}")
    return True


# -- the generator ------------------------------------------------------------------------------------------


def current() -> tuple[int, dict[str, list[str]]]:
    """The schema version and, per vendor, the CREATE statements the stores export today: PostgreSQL's
    ``SCHEMA`` split into its statements, MySQL's ``SCHEMA``, and for SQLite what ``stores.sqlite.open``
    creates in a new file, with the ``PRAGMA user_version`` (the schema) it stamps the file with."""
    from sqlalchemy.dialects import sqlite as sqlite_dialect

    from stores import mysql, postgres
    from stores._sql.tables import SCHEMA_VERSION, ddl

    pg = [s.strip() for s in postgres.SCHEMA.strip().removesuffix(";").split(";\n\n")]
    assert ";\n\n".join(pg) + ";\n" == postgres.SCHEMA, "postgres.SCHEMA is no longer split by ';\\n\\n'"
    lite = [*ddl(sqlite_dialect.dialect()), f"PRAGMA user_version = {SCHEMA_VERSION}"]
    return SCHEMA_VERSION, {"postgresql": pg, "mysql": list(mysql.SCHEMA), "sqlite": lite}


def drops(create: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Each vendor's DROP statements: the tables ``create`` makes, last first; on SQLite, the file's
    ``user_version`` back to 0, as a new file's."""
    out: dict[str, list[str]] = {}
    for vendor, statements in create.items():
        tables = [m[2] for m in map(_CREATE.match, statements) if m is not None and m[1] == "TABLE"]
        out[vendor] = [f"DROP TABLE IF EXISTS {table}" for table in reversed(tables)]
        if vendor == "sqlite":
            out[vendor].append("PRAGMA user_version = 0")
    return out


def frozen(version: int, statements: Mapping[str, Sequence[str]]) -> str:
    """``0001_initial.json``: ``statements`` frozen, with their DROPs to reverse them, each statement as its
    lines (ends kept), so the file reads as the SQL does and its diff shows the lines that changed."""

    def lines(by_vendor: Mapping[str, Sequence[str]]) -> dict[str, list[list[str]]]:
        return {v: [s.splitlines(keepends=True) for s in by_vendor[v]] for v in VENDORS}

    document = {"schema_version": version, "create": lines(statements), "drop": lines(drops(statements))}
    return json.dumps(document, indent=1, ensure_ascii=False) + "\n"


def thawed(path: Path) -> tuple[int, dict[str, list[str]], dict[str, list[str]]]:
    """What ``frozen`` wrote to ``path``: the schema version, and per vendor its CREATE and DROP statements."""
    document = json.loads(path.read_text(encoding="utf-8"))

    def statements(key: str) -> dict[str, list[str]]:
        return {vendor: ["".join(lines) for lines in items] for vendor, items in document[key].items()}

    return document["schema_version"], statements("create"), statements("drop")


if __name__ == "__main__":
    sys.stdout.write(frozen(*current()))
