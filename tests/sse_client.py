"""What a browser does with ``text/event-stream``, for the tests of the Flask and Django event routes."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

TURN_KINDS = ["step_started", "model_response", "tool_called", "tool_finished", "step_started", "model_response",
              "finished"]
"""The events of a turn with one tool call and an answer, in order."""


def sse(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """The events of a ``text/event-stream``, each as its fields (``id``, ``event``, ``data``, ``retry``)."""
    event: dict[str, str] = {}
    for line in lines:
        if line == "":
            if event:
                yield event
            event = {}
            continue
        if line.startswith(":"):  # a comment: no field of any event (the Django view explains a silence so)
            continue
        name, _, value = line.partition(":")
        event[name] = value[1:] if value.startswith(" ") else value


def check_event(event: dict[str, str]) -> dict[str, Any]:
    """The event's data, after checking its ``id`` and ``event`` fields say the same as its data."""
    data = json.loads(event["data"])
    assert event["id"] == str(data["seq"]) and event["event"] == data["kind"]
    return dict(data)
