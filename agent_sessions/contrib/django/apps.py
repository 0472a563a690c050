"""The app's configuration: label ``agent_sessions`` (``manage.py migrate agent_sessions``)."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig  # type: ignore[import-untyped]
from django.core.signals import setting_changed  # type: ignore[import-untyped]


class AgentSessionsConfig(AppConfig):  # type: ignore[misc]
    name = "agent_sessions.contrib.django"
    label = "agent_sessions"
    verbose_name = "agent sessions"

    def ready(self) -> None:
        setting_changed.connect(_settings_changed, dispatch_uid="agent_sessions.contrib.django")
        from django.core.checks import register  # type: ignore[import-untyped]

        from .checks import settings_valid, stores_not_shadowed

        register(stores_not_shadowed)
        register(settings_valid)


def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    """A test's override_settings of the store's settings builds the store again on next use."""
    if setting in ("AGENT_SESSIONS", "DATABASES"):
        from . import reset

        reset()
