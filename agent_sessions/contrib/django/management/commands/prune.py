"""manage.py prune --idle-for 30d [--limit N]: the retention job, to schedule (cron, Celery beat)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent

from ..base import StoreCommand, duration, lifecycle


class Command(StoreCommand):
    help = ("Delete the sessions not updated for --idle-for (30d, 12h, 15m, 90s or a sum: 1d12h) that no live run "
            "holds, in bounded batches, each its own transaction; at most --limit of them.")

    def arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--idle-for", type=duration, required=True, metavar="DURATION",
                            help="30d, 12h, 15m, 90s, or a sum such as 1d12h")
        parser.add_argument("--limit", type=int, default=None, help="delete at most this many in all")

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        deleted = lifecycle(store, "prune").prune(options["idle_for"], limit=options["limit"])
        return {"deleted": deleted, "idle_for": options["idle_for"].total_seconds()}

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        return [f"deleted {result['deleted']} session{'' if result['deleted'] == 1 else 's'} "
                f"not updated for {result['idle_for']:g} s"]
