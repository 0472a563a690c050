"""manage.py steer SESSION TEXT: leave a steer for the session's run, wherever it runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.cli import safe

from ..base import StoreCommand


class Command(StoreCommand):
    help = ("Leave a steer for a session: its run, in any process, takes it before its next model request "
            "(a session with no run yet gets it in its next one).")

    def arguments(self, parser: CommandParser) -> None:
        parser.add_argument("session")
        parser.add_argument("text")

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        agent.open(options["session"], store).steer(options["text"])
        return {"id": options["session"], "steered": True}

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        return [f"steered {safe(result['id'])}"]
