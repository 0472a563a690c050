"""``manage.py test``: Django's, with the project's test runner (``TEST_RUNNER``, ``--testrunner``) wrapped
in ``testing.StoreRunner``, so the tests may use the store as they use the ORM.
"""

from __future__ import annotations

from typing import Any

from django.core.management.commands.test import Command as DjangoTestCommand  # type: ignore[import-untyped]

from ...testing import runner_for


class Command(DjangoTestCommand):  # type: ignore[misc]
    def handle(self, *test_labels: str, **options: Any) -> None:
        options["testrunner"] = runner_for(options.get("testrunner"))
        super().handle(*test_labels, **options)
