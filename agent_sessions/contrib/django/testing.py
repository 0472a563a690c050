"""Django tests that use the store: each test starts from an empty store, and the test database can be
dropped at the end.

    from django.test import TestCase
    from agent_sessions.contrib.django.testing import StoreTestMixin

    class ReviewTests(StoreTestMixin, TestCase):
        ...

Why a mixin: Django's ``TestCase`` undoes a test's writes by rolling back a transaction on Django's own
connection, and ``TransactionTestCase`` by flushing the tables of Django's models. The store writes through
an engine of its own (its transactions, its listener and its lease heartbeat need connections of their
own: see the app's module docstring), and its tables are not models, so neither reaches its rows: without
the mixin a session saved in one test is still there in the next. And the engine keeps connections to the
test database open in its pool, so PostgreSQL refuses to drop it ("is being accessed by other users")
unless the store is closed first, which the mixin does at the end of each test class.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.test.runner import DiscoverRunner as _DjangoRunner  # type: ignore[import-untyped]

import agent_sessions as agent

from . import options, reset, store

log = logging.getLogger(__name__)


def empty_store() -> int:
    """Delete everything the app's store keeps (sessions, transcripts, steers, events), for a test to
    start from nothing; return how many rows (or sessions) went. Only under Django's test runner: it
    refuses a database that is not a test database, so a stray call cannot wipe a real one."""
    made = store()
    engine = getattr(made, "engine", None) if options()["STORE"] is None else None  # the app built it
    if engine is not None:
        _refuse_unless_test_database(engine.url.database)
        from stores._sql import metadata

        deleted = 0
        with engine.begin() as conn:
            for table in reversed(metadata.sorted_tables):  # children first
                deleted += conn.execute(table.delete()).rowcount
        return deleted
    if not isinstance(made, agent.LifecycleStore):
        raise ImproperlyConfigured(
            f"the store of AGENT_SESSIONS['STORE'] ({type(made).__name__}) cannot list its sessions, so "
            f"StoreTestMixin cannot empty it: return a new store from {options()['STORE']} for each test "
            "(agent_sessions.contrib.django.reset() makes the app ask again)")
    deleted = 0
    while page := made.list_sessions(limit=100).sessions:
        for info in page:
            deleted += made.delete(info.id, force=True)
    return deleted


def _refuse_unless_test_database(name: str | None) -> None:
    from django.db import connections  # type: ignore[import-untyped]

    connection = connections[options()["DATABASE"]]
    expected = connection.creation._get_test_db_name()
    if name is None or str(name) != str(expected) or connection.settings_dict.get("NAME") != expected:
        raise ImproperlyConfigured(
            f"empty_store() deletes every session; it runs only on Django's test database ({expected!r}), "
            f"and the store's database is {name!r}: run it under `manage.py test`")


class StoreTestMixin:
    """Put it before ``TestCase`` (or ``TransactionTestCase``): before each test the store is emptied, and
    at the end of the class the store is emptied again and closed (its pool disposed, PostgreSQL's
    listener stopped), so no row leaks into the next test and the runner can drop the test database."""

    def setUp(self) -> None:
        empty_store()
        super().setUp()  # type: ignore[misc]

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            empty_store()
        finally:
            reset()
            super().tearDownClass()  # type: ignore[misc]


class DiscoverRunner(_DjangoRunner):  # type: ignore[misc]
    """Django's runner, closing the store before it drops the test databases: for a project whose tests
    use the store outside ``StoreTestMixin`` (``TEST_RUNNER = "agent_sessions.contrib.django.testing.
    DiscoverRunner"``), which would otherwise leave its pool holding the test database open."""

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        reset()
        super().teardown_databases(old_config, **kwargs)


__all__ = ["DiscoverRunner", "StoreTestMixin", "empty_store"]
