"""The app's system checks: what would otherwise fail at the store's first use (a project's own package
named ``stores`` hiding the library's, ``settings.AGENT_SESSIONS`` wrong) is said before, with what to do."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]

from agent_sessions.shadowing import foreign_stores

STORES_SHADOWED = "agent_sessions.E001"
SETTINGS_INVALID = "agent_sessions.E002"
FUNCTION_MISSING = "agent_sessions.E003"


def settings_valid(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """``settings.AGENT_SESSIONS`` as ``options()`` reads it at the store's first use, and the functions it
    names (``STORE``, ``RESOLVE``) importable and callable."""
    from . import function, options

    try:
        options()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), hint="The keys and their values: docs/django.md, Settings.", id=SETTINGS_INVALID)]
    errors = []
    for key in ("STORE", "RESOLVE"):
        try:
            function(key)
        except ImproperlyConfigured as exc:
            errors.append(Error(str(exc), id=FUNCTION_MISSING))
    return errors


def stores_not_shadowed(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    shadowed = foreign_stores()
    if shadowed is None:
        return []
    return [Error(
        f"a package named 'stores' ({shadowed.found}) hides agent-sessions' stores ({shadowed.expected})",
        hint="Rename the project's 'stores' package (e.g. to 'shop') and its imports: agent-sessions imports "
             "its stores as 'stores.<backend>', and the project's directory comes first on sys.path.",
        id=STORES_SHADOWED)]


__all__ = ["FUNCTION_MISSING", "SETTINGS_INVALID", "STORES_SHADOWED", "settings_valid", "stores_not_shadowed"]
