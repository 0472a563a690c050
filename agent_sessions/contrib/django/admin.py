"""The operator's console on the Django admin, registered on the default site (``register(site)`` for
another). The sessions are the store's, not ORM rows, so each ModelAdmin replaces every URL the admin would
give its model with the console's pages, each wrapped in ``admin_site.admin_view`` (login, staff status and
CSRF as the admin has them), and nothing ever queries the models' (absent) tables.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin  # type: ignore[import-untyped]
from django.urls import path  # type: ignore[import-untyped]

from .console import views
from .models import Approval, Session


class _Console(admin.ModelAdmin):  # type: ignore[misc]
    """A model of the console's: its rows are the store's, never added or changed through the admin."""

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False


class SessionAdmin(_Console):
    """URL names follow the admin's (``admin:agent_sessions_session_change`` is a session's page), so the
    admin's "Recent actions" link to the session each entry is about."""

    def get_urls(self) -> list[Any]:
        def wrap(view: Any) -> Any:
            def console_view(request: Any, *args: Any, **kwargs: Any) -> Any:
                return view(self, request, *args, **kwargs)

            return self.admin_site.admin_view(console_view)

        name = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("", wrap(views.sessions), name=f"{name}_changelist"),
            path("log/", wrap(views.log), name=f"{name}_log"),
            path("<str:object_id>/change/", wrap(views.session), name=f"{name}_change"),
            path("<str:object_id>/events/", wrap(views.events), name=f"{name}_events"),
            *(path(f"<str:object_id>/{action}/", wrap(view), name=f"{name}_{action}")
              for action, view in views.ACTIONS.items()),
            path("<str:object_id>/", wrap(views.to_session)),
        ]


class ApprovalAdmin(_Console):
    """The approvals inbox, under ``admin/agent_sessions/approval/``: seen with ``view_session``."""

    def get_urls(self) -> list[Any]:
        def inbox(request: Any) -> Any:
            return views.inbox(self, request)

        return [path("", self.admin_site.admin_view(inbox),
                     name=f"{self.opts.app_label}_{self.opts.model_name}_changelist")]

    def has_view_permission(self, request: Any, obj: Any = None) -> bool:
        return bool(request.user.has_perm("agent_sessions.view_session"))

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False


def register(site: Any) -> None:
    """Put the console on ``site`` (an ``AdminSite``): what this module does for ``admin.site``."""
    site.register(Session, SessionAdmin)
    site.register(Approval, ApprovalAdmin)


register(admin.site)

__all__ = ["ApprovalAdmin", "SessionAdmin", "register"]
