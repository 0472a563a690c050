"""manage.py sessions [--prefix P] [--where k=v ...] [--limit N] [--after CURSOR]: the newest first."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.cli import info_doc, safe

from ..base import StoreCommand, lifecycle, metadata_filter


class Command(StoreCommand):
    help = ("List sessions, most recently updated first: one page, and the cursor of the next (--after). "
            "--where KEY=VALUE (repeatable) keeps those whose metadata has that value: a VALUE is read as JSON "
            "when it parses (17, true, \"17\"), else as plain text (u-17).")

    def arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--prefix", default="", help="only ids starting with this")
        parser.add_argument("--where", type=metadata_filter, action="append", default=[], metavar="KEY=VALUE",
                            help="a metadata key and value; repeatable")
        parser.add_argument("--limit", type=int, default=50, help="sessions per page (50)")
        parser.add_argument("--after", default=None, metavar="CURSOR", help="the cursor the previous page ended with")

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        page = lifecycle(store, "sessions").list_sessions(
            prefix=options["prefix"], where=dict(options["where"]) or None, limit=options["limit"],
            after=options["after"])
        return {"sessions": [info_doc(info) for info in page], "next": page.next}

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        if not result["sessions"]:
            return ["no sessions"]
        out = [f"{'ID':<30} {'UPDATED (UTC)':<19}  {'MESSAGES':>8}  METADATA"]
        for info in result["sessions"]:
            meta = json.dumps(info["metadata"], ensure_ascii=False, sort_keys=True) if info["metadata"] else ""
            out.append(f"{safe(info['id']):<30} {info['updated'][:19].replace('T', ' ')}  {info['messages']:>8}  "
                       f"{safe(meta)}")
        if result["next"]:
            out.append(f"next page: --after {safe(result['next'])}")
        return out
