"""The agent of the example: its tool, its spec and its model endpoint. The store is the app's
(``agent_sessions.contrib.django.store()``: built once per process from DATABASES)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

import agent_sessions as agent
from agent_sessions.contrib.django import store


def endpoint() -> agent.Endpoint:
    return agent.endpoints.OpenAIChat(settings.AGENT_MODEL_URL, settings.AGENT_MODEL)


CODEBASE = Path(__file__).resolve().parents[2] / "sessions" / "codebase"


@agent.tool
def read_file(path: str) -> str:
    """Read a file of the code under review.

    Args:
        path: a file name, e.g. lease.go
    """
    target = (CODEBASE / path).resolve()
    if target.parent != CODEBASE:
        raise agent.ToolError(f"{path!r} is not a file of the code under review")
    return target.read_text()


def spec(session_id: str) -> agent.Spec:
    # Publish the turn's events where the store keeps them: GET /sessions/<id>/events streams them.
    return agent.Spec(session=agent.open(session_id, store()), max_steps=8, tools=[read_file],
                      system="You are a code reviewer.", publish_events=isinstance(store(), agent.EventStore))
