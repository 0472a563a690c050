"""manage.py show SESSION [--last N | --all]: the end of a transcript (or all of it), who runs it, and
the steers waiting for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.management.base import CommandError, CommandParser  # type: ignore[import-untyped]

import agent_sessions as agent

from ..base import StoreCommand, info_dict

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
        if isinstance(store, agent.LifecycleStore):
            info = session.info()
            if info is None:
                raise CommandError(f"no session {session.id!r}")
            pending = session.pending_steers()
            total = info.messages
            msgs = session.messages() if options["all"] else session.messages(last=options["last"])
        else:  # a store that cannot count without reading: read it all, once
            every = session.messages()
            total = len(every)
            msgs = every if options["all"] else every[len(every) - agent.lifecycle.last_count(options["last"]):]
        holder = session.holder() if isinstance(store, agent.RunStore) else None
        return {
            "session": session.id,
            "info": None if info is None else info_dict(info),
            "holder": None if holder is None else {"host": holder.host, "pid": holder.pid, "epoch": holder.epoch,
                                                   "expires": holder.expires, "cancelled": holder.cancelled},
            "pending_steers": pending,
            "total": total,
            "first": total - len(msgs),
            "messages": [m.to_dict() for m in msgs],
        }

    def lines(self, result: Mapping[str, Any]) -> list[str]:
        info = result["info"]
        head = f"session {result['session']}: {result['total']} message{'' if result['total'] == 1 else 's'}"
        if info is not None:
            head += f", created {info['created'][:19]}Z, updated {info['updated'][:19]}Z"
        out = [head]
        if info is not None and info["metadata"]:
            out.append(f"metadata: {info['metadata']}")
        holder = result["holder"]
        if holder is not None:
            out.append(f"running: pid {holder['pid']} on {holder['host']}, epoch {holder['epoch']}"
                       + (", cancelled" if holder["cancelled"] else ""))
        if result["pending_steers"]:
            out.append(f"steers waiting: {len(result['pending_steers'])}")
            out.extend(f"  > {text}" for text in result["pending_steers"])
        if result["first"]:
            out.append(f"... {result['first']} earlier message{'' if result['first'] == 1 else 's'} (--all shows them)")
        for n, message in enumerate(result["messages"], start=result["first"] + 1):
            out.append(f"#{n} {message['role']}:")
            out.extend(f"  {line}" for part in message["content"] for line in _content(part).splitlines() or [""])
        return out


def _content(part: Mapping[str, Any]) -> str:
    if part["type"] == "tool_call":
        return f"-> {part['name']}({part.get('arguments', '')})  [{part['id']}]"
    if part["type"] == "tool_result":
        error = " error" if part.get("is_error") else ""
        return f"<- [{part['tool_call_id']}]{error} {part.get('text', '')}"
    return str(part.get("text", ""))
