"""The app's Celery tasks: Celery's ``app.autodiscover_tasks()`` imports this module of every installed app,
so a Django project that runs Celery has the turn task and the sweep of ``agent_sessions.contrib.celery``
registered, and each of its workers watching for turns nobody answers, with nothing more to write."""

from __future__ import annotations

from agent_sessions.contrib.celery import sweep, turn

__all__ = ["sweep", "turn"]
