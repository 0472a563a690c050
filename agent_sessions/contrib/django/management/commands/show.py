"""manage.py show SESSION [--last N | --all]: the end of a transcript (or all of it), who runs it, and
the steers waiting for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandError, CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.cli import holder_doc, info_doc, safe

from ..base import StoreCommand

LAST = 20


class Command(StoreCommand):
    help = (f"Show a session: its last messages (--last N, {LAST} by default; --all for every one), the run "
            f"holding it, and the steers waiting for its next model request.")

    def arguments(self, parser: CommandParser) -> None:
        parser.add_argument("session")
        shown = parser.add_mutually_exclusive_group()
        shown.add_argument("--last", type=int, default=LAST, metavar="N", help=f"the last N messages ({LAST})")
        shown.add_argument("--all", action="store_true", help="every message")

    def run(self, store: agent.Store, options: Mapping[str, Any]) -> dict[str, Any]:
        session = agent.open(options["session"], store)
        info: agent.SessionInfo | None = None
        pending: list[str] | None = None
        if isinstance(store, agent.LifecycleStore):  # the tail alone is read
            info = session.info()
            if info is None:
                raise CommandError(f"no session {session.id!r}")
            pending = session.pending_steers()
            total = info.messages
            msgs = session.messages() if options["all"] else session.messages(last=options["last"])
        else:  # a store that cannot count without reading: read it all, once
            every = session.messages()
            total = len(every)
            msgs = every if options["all"] else every[total - agent.lifecycle.last_count(options["last"]):]
        holder = session.holder() if isinstance(store, agent.RunStore) else None
        return {
            "id": session.id,
            "info": None if info is None else info_doc(info),
            "holder": holder_doc(holder),
            "pending_steers": pending,
            "total": total,
            "first": total - len(msgs),
            "messages": [m.to_dict() for m in msgs],
        }

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        info, total, first = result["info"], result["total"], result["first"]
        head = f"session {safe(result['id'])}: {total} message{'' if total == 1 else 's'}"
        if info is not None:
            head += f", created {_time(info['created'])}, updated {_time(info['updated'])} UTC"
        out = [head]
        if info is not None and info["metadata"]:
            out.append(f"metadata: {safe(str(info['metadata']))}")
        holder = result["holder"]
        if holder is not None:
            out.append(f"run: pid {holder['pid']} on {safe(holder['host'])}, epoch {holder['epoch']}"
                       + (", asked to cancel" if holder["cancelled"] else ""))
        if result["pending_steers"]:
            out.append(f"steers waiting: {len(result['pending_steers'])}")
            out.extend(f"  {safe(text)}" for text in result["pending_steers"])
        if first:
            out.append(f"... {first} earlier message{'' if first == 1 else 's'} (--all shows them)")
        for number, message in enumerate(result["messages"], start=first + 1):
            key = f" (key {safe(message['key'])})" if message.get("key") else ""
            out.append(f"#{number} {message['role']}{key}:")
            out.extend(f"  {safe(line)}" for part in message["content"] for line in _text(part).splitlines() or [""])
        return out


def _time(iso: str) -> str:
    return iso[:19].replace("T", " ")


def _text(part: Mapping[str, Any]) -> str:
    """A content block as the CLI prints it: tool arguments exactly as the model wrote them."""
    if part["type"] == "tool_call":  # a name or id is one field (escaped); arguments and texts are lines
        return f"tool call {safe(part['name'])} [{safe(part['id'])}] {part['arguments']}"
    if part["type"] == "tool_result":
        error = " (error)" if part["is_error"] else ""
        return f"tool result [{safe(part['tool_call_id'])}]{error}: {part['text']}"
    return str(part["text"])
