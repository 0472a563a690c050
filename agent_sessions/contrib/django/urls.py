"""The app's URLs, for a project to ``include`` (nothing is served unless it does):

    urlpatterns = [..., path("agent/", include("agent_sessions.contrib.django.urls"))]

Whoever can reach these URLs can read every session's events: include them behind your project's
authorization, or route to ``views.events`` through a view of yours that checks it (docs/django.md).
"""

from __future__ import annotations

from django.urls import path  # type: ignore[import-untyped]

from . import views

urlpatterns = [
    path("sessions/<str:session_id>/events", views.events, name="agent_sessions_events"),
]
