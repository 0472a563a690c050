"""The store's tables, in Django's own migration history: the DDL the SQL stores export (they never run
it themselves). SQLite needs nothing: stores.sqlite creates its tables when it opens the file."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def create(apps: Any, schema_editor: Any) -> None:
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        from stores import postgres

        schema_editor.execute(postgres.SCHEMA)
    elif vendor == "mysql":
        from stores import mysql

        for statement in mysql.SCHEMA:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(create, migrations.RunPython.noop)]
