"""The app's system checks (``manage.py check``, and before ``runserver``, ``migrate`` and ``test``): a
project whose own package is named ``stores`` hides the library's stores, and every command that builds
the store would fail with a bare ImportError; the check says so before, with what to do."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error  # type: ignore[import-untyped]

from agent_sessions.shadowing import foreign_stores

STORES_SHADOWED = "agent_sessions.E001"


def stores_not_shadowed(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    shadowed = foreign_stores()
    if shadowed is None:
        return []
    return [Error(
        f"a package named 'stores' ({shadowed.found}) hides agent-sessions' stores ({shadowed.expected})",
        hint="Rename the project's 'stores' package (e.g. to 'shop') and its imports: agent-sessions imports "
             "its stores as 'stores.<backend>', and the project's directory comes first on sys.path.",
        id=STORES_SHADOWED)]


__all__ = ["STORES_SHADOWED", "stores_not_shadowed"]
