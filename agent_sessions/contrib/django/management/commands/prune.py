"""manage.py prune --idle-for 30d [--limit N]: the retention job, to schedule (cron, Celery beat)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent

from ..base import StoreCommand, duration, lifecycle


class Command(StoreCommand):
    help = ("Delete the sessions not updated for --idle-for (30d, 12h, 90m, 45s or seconds) that no live run "
            "holds, in bounded batches, each its own transaction; at most --limit of them.")

    def arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--idle-for", type=duration, required=True, help="e.g. 30d, 12h, 90m")
        parser.add_argument("--limit", type=int, default=None, help="delete at most this many")

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        pruned = lifecycle(store, "prune").prune(options["idle_for"], limit=options["limit"])
        return {"pruned": pruned, "idle_for": options["idle_for"].total_seconds()}

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        return [f"pruned {result['pruned']} session{'' if result['pruned'] == 1 else 's'} "
                f"idle for more than {result['idle_for']:g} s"]
