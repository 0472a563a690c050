"""Django tests that use the store (docs/django.md): each test starts from an empty store, and the test
database can be dropped at the end; ``manage.py test`` does both, another runner gets it from
``StoreTestMixin``. The store writes through an engine of its own and its tables are not models, so
neither ``TestCase``'s rollback nor ``TransactionTestCase``'s flush reaches its rows; and the engine's
pool keeps connections to the test database, which PostgreSQL then refuses to drop.
"""

from __future__ import annotations

import os
import unittest
from collections.abc import Iterator
from typing import Any

from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.test.runner import DiscoverRunner as _DjangoRunner  # type: ignore[import-untyped]

import agent_sessions as agent

from . import options, reset, store


def empty_store() -> int:
    """Delete everything the app's store keeps, for a test to start from nothing; how many rows (or
    sessions) went. It refuses a database that is not a test run's, so a stray call cannot wipe a real one."""
    made = store()
    conf = options()
    built = conf["STORE"] is None and conf["URL"] is None  # the app built it on DATABASES
    engine = getattr(made, "engine", None) if built else None
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
    """Under a test runner (``setup_test_environment`` ran), the connection's ``NAME`` is the test database
    it made and renamed in place: ``TEST["NAME"]`` or ``test_`` + the name (computed again from it, it would
    be ``test_test_...``)."""
    from django.core import mail  # type: ignore[import-untyped]
    from django.db import connections  # type: ignore[import-untyped]
    from django.db.backends.base.creation import TEST_DATABASE_PREFIX  # type: ignore[import-untyped]

    connection = connections[options()["DATABASE"]]
    current = connection.settings_dict.get("NAME")
    configured = (connection.settings_dict.get("TEST") or {}).get("NAME")
    under_test = hasattr(mail, "outbox")  # what django.test.utils.setup_test_environment sets up, and only it
    test_name = current is not None and (
        (configured is not None and str(current) == str(configured))
        or os.path.basename(str(current)).startswith(TEST_DATABASE_PREFIX))
    if not (under_test and test_name and name is not None and str(name) == str(current)):
        raise ImproperlyConfigured(
            f"empty_store() deletes every session; it runs only on the test database of a test run "
            f"(manage.py test, pytest-django), and the store's database is {name!r}"
            + ("" if under_test else ", with no test run set up"))


def empty_if_used() -> None:
    """``empty_store()``, when this process built the app's store: what ``StoreRunner`` does after each test."""
    from . import _store

    if _store is not None:
        empty_store()


class StoreTestMixin:
    """Put it before ``TestCase`` (or ``TransactionTestCase``): the store is emptied before each test, and
    emptied and closed at the end of the class, so the runner can drop the test database."""

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


class StoreRunner:
    """A test runner's mixin (before a ``DiscoverRunner``): each test that used the store has it emptied
    after it, and the store is closed before the test databases are dropped."""

    def build_suite(self, *args: Any, **kwargs: Any) -> Any:
        suite = super().build_suite(*args, **kwargs)  # type: ignore[misc]
        for test in _tests(suite):
            test.addCleanup(empty_if_used)  # a cleanup travels with its test to a parallel run's process
        return suite

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        reset()
        super().teardown_databases(old_config, **kwargs)  # type: ignore[misc]


def _tests(suite: Any) -> Iterator[unittest.TestCase]:
    """Every test of a suite, a parallel run's (its ``subsuites``) too."""
    for part in getattr(suite, "subsuites", None) or suite:
        if isinstance(part, unittest.TestCase):
            yield part
        else:
            yield from _tests(part)


class DiscoverRunner(StoreRunner, _DjangoRunner):  # type: ignore[misc]
    """Django's runner with ``StoreRunner``: what ``manage.py test`` runs when ``TEST_RUNNER`` is Django's.
    Name it in ``TEST_RUNNER`` for a ``test`` command that is not the app's (another app's coming first)."""


def runner_for(path: str | None) -> str:
    """The dotted path of the runner ``manage.py test`` runs: ``path``'s (else ``TEST_RUNNER``'s), with
    ``StoreRunner`` before it; Django imports it by its path, so a runner made here is ``ConfiguredRunner``."""
    from django.conf import settings  # type: ignore[import-untyped]
    from django.test.utils import get_runner  # type: ignore[import-untyped]

    runner = get_runner(settings, path)
    if issubclass(runner, StoreRunner):
        return path or str(settings.TEST_RUNNER)
    global ConfiguredRunner
    ConfiguredRunner = type(runner.__name__, (StoreRunner, runner), {"__module__": __name__,
                                                                      "__qualname__": "ConfiguredRunner"})
    return f"{__name__}.ConfiguredRunner"


ConfiguredRunner: type | None = None
"""The project's runner with ``StoreRunner`` before it, once ``runner_for`` made it."""


__all__ = ["DiscoverRunner", "StoreRunner", "StoreTestMixin", "empty_if_used", "empty_store", "runner_for"]
