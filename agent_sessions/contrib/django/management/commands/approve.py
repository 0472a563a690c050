"""manage.py approve SESSION [CALL_ID] [--deny --reason TEXT]: decide on a tool call a turn waits for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.cli import safe

from ..base import StoreCommand


class Command(StoreCommand):
    help = ("Approve (or with --deny, deny) a tool call the session's turn waits for; without CALL_ID, list the "
            "calls waiting. A decision is taken once: a call decided already is an error saying how. The next run "
            "of the session runs an approved call (once) or gives a denied one the reason.")

    def arguments(self, parser: CommandParser) -> None:
        parser.add_argument("session")
        parser.add_argument("call_id", nargs="?", help="the call to decide on; omit it to list the calls waiting")
        parser.add_argument("--deny", action="store_true", help="deny the call instead of approving it")
        parser.add_argument("--reason", default="", help="why (the model reads it with a denied call's result)")

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        session = agent.open(options["session"], store)
        if options["call_id"] is None:
            return {"id": session.id, "waiting": [
                {"call_id": p.call_id, "tool": p.tool, "arguments": p.arguments, "asked": p.asked.isoformat(),
                 "deadline": None if p.deadline is None else p.deadline.isoformat()}
                for p in session.pending_approvals()]}
        if options["deny"]:
            decision = session.deny(options["call_id"], options["reason"])
        else:
            decision = session.approve(options["call_id"])
        return {"id": session.id, "call_id": options["call_id"], "approved": decision.approved,
                "reason": decision.reason}

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        if "waiting" in result:
            if not result["waiting"]:
                return [f"{safe(result['id'])}: no call waits for a decision"]
            return [f"{safe(w['call_id'])}  {safe(w['tool'])}({safe(w['arguments'])})  asked {w['asked']}"
                    + (f", deadline {w['deadline']}" if w["deadline"] else "") for w in result["waiting"]]
        verb = "approved" if result["approved"] else "denied"
        return [f"{verb} {safe(result['call_id'])} of {safe(result['id'])}; the session's next run acts on it"]
