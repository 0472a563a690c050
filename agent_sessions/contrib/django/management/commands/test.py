"""``manage.py test``: Django's, with the project's test runner wrapped so the tests may use the store as
they use the ORM: each test that used it has it emptied after it, and it is closed before the test
databases are dropped (``testing.StoreRunner``; without it PostgreSQL refuses to drop a test database the
store's pool still holds). The project's ``TEST_RUNNER`` and ``--testrunner`` are honoured: the runner they
name gets the mixin put before it."""

from __future__ import annotations

from typing import Any

from django.core.management.commands.test import Command as DjangoTestCommand  # type: ignore[import-untyped]

from ...testing import runner_for


class Command(DjangoTestCommand):  # type: ignore[misc]
    def handle(self, *test_labels: str, **options: Any) -> None:
        options["testrunner"] = runner_for(options.get("testrunner"))
        super().handle(*test_labels, **options)
