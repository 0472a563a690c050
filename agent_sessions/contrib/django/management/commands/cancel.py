"""manage.py cancel SESSION: ask the run holding the session, in whatever process, to stop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.cli import safe

from ..base import StoreCommand


class Command(StoreCommand):
    help = ("Ask the run holding a session to stop before its next model request or tool call. Nothing is "
            "remembered when no run holds it.")

    def arguments(self, parser: CommandParser) -> None:
        parser.add_argument("session")

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        cancelled = agent.open(options["session"], store).cancel()
        return {"id": options["session"], "cancelled": cancelled}

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        if result["cancelled"]:
            return [f"cancelled {safe(result['id'])}: its run stops before its next model request or tool call"]
        return [f"{safe(result['id'])}: no run holds it; nothing to cancel"]
