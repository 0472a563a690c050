"""agent-sessions 0.1's tables (schema 1) upgraded to schema 2: the lease and the tool journal move onto
the session's row. A database that 0001 created with today's SCHEMA has nothing to upgrade (it has no
agent_runs table); SQLite needs nothing here either (stores.sqlite upgrades its file when it opens it)."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def upgrade(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor not in ("postgresql", "mysql"):
        return
    if "agent_runs" not in connection.introspection.table_names():
        return
    from stores import mysql, postgres

    for statement in (postgres if connection.vendor == "postgresql" else mysql).MIGRATIONS[2]:
        schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("turns", "0001_agent_sessions")]
    operations = [migrations.RunPython(upgrade, migrations.RunPython.noop)]
