"""The store's tables, schema 1: the DDL the stores exported when it was generated, per vendor, frozen in
``0001_initial.json`` beside this file (``python -m agent_sessions.contrib.django.schema``; never edited
by hand).

Tables or indexes that exist already are kept; reversing drops the tables and every session in them.
"""

from __future__ import annotations

from pathlib import Path

from django.db import migrations  # type: ignore[import-untyped]

from agent_sessions.contrib.django import schema

SCHEMA_VERSION, CREATE, DROP = schema.thawed(Path(__file__).with_suffix(".json"))


class Migration(migrations.Migration):  # type: ignore[misc]
    initial = True
    dependencies: list[tuple[str, str]] = []
    # Not in one transaction of its own: MySQL commits DDL as it goes (Django refuses DDL inside an atomic
    # block there), and a failed statement leaves the earlier tables, which the next migrate keeps. On
    # PostgreSQL and SQLite the whole migration is one transaction anyway.
    operations = [migrations.RunPython(schema.create(CREATE), schema.drop(DROP), atomic=False)]
