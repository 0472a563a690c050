"""``python -m agent_sessions --store URL <command>``: look at and manage the sessions of a store from a shell.

An application on top of the library: the one module of ``agent_sessions`` allowed to import ``stores``
(setup.cfg), which it does only once a command needs a store, so ``import agent_sessions`` loads no driver.
Each command is a call or two of ``StoreSession`` or ``LifecycleStore``; the CLI adds opening a store from
a URL, printing, and exit codes a script can branch on (``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

from . import lifecycle
from .contract import Holder, RunStore, Scalar, SessionInfo, Store, when
from .endpoints import Endpoint
from .errors import ArgumentError, Conflict, SessionBusy, SessionExists, StoreError, UnknownApproval, Unsupported
from .journal import EXPIRED, Journal
from .messages import ContentType, Message
from .session import StoreSession
from .session import open as open_session
from .spec import Spec
from .stranded import Recovered, Resolve, recover
from .values import PendingApproval, SessionPage

PROG = "python -m agent_sessions"
ENV_STORE = "AGENT_SESSIONS_STORE"
CONNECT_TIMEOUT = 10
"""Seconds to wait for a database server to answer before giving up (exit code 4)."""
WORK_EVERY = 1.0
"""``work``: seconds between two looks for stranded turns (each one indexed query when none is)."""
WORK_GRACE = 1.0
"""``work``: a turn open for less is left to the caller that may be about to run it. Short, since in a
deployment without a task queue ``work`` is what answers a message handed over with ``Session.enqueue``."""
APPLICATION_NAME = "agent-sessions"
"""What the store's PostgreSQL connections say they are (``pg_stat_activity.application_name``)."""

OK, NOTHING, USAGE, MISSING_DRIVER, STORE_FAILED, CONFLICT = 0, 1, 2, 3, 4, 5
EXIT_CODES = {
    OK: "ok",
    NOTHING: "the session (or what was asked for: a run, a call waiting) does not exist, or there was nothing to do",
    USAGE: "bad usage or input: arguments, a store URL, a value the library refuses",
    MISSING_DRIVER: "the store cannot be imported: its driver is not installed (the message names the extra to "
                    "install), or a project's own package named 'stores' hides the library's (the message names it)",
    STORE_FAILED: "the store failed or cannot be reached (the message says which store), or cannot do this",
    CONFLICT: "a conflict: a live run holds the session (delete without --force), a fork's target exists, "
              "a call decided already",
}

log = logging.getLogger(__name__)


class Exit(Exception):
    """Ends a command with an exit code and one line for stderr."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


@dataclass
class Outcome:
    """What a command answers: ``doc`` for --json, ``lines`` for people, and with exit code 1 a ``note``
    for stderr saying what was not there."""

    doc: Any
    lines: list[str] = field(default_factory=list)
    code: int = OK
    note: str = ""


# -- store URLs: stores.urls opens them; what it raises is an exit code (classify) ------------------------------


def _urls() -> Any:
    """``stores.urls``, once ``check_stores`` found the library's ``stores`` (a project's own is not a missing
    extra: say what was found instead)."""
    from .shadowing import check_stores

    check_stores()
    import stores.urls

    return stores.urls


def scrub(text: str, url: str | None) -> str:
    """``text`` without the credentials of ``url``, when ``stores.urls`` can be imported to say which."""
    if not url:
        return text
    try:
        from stores.urls import scrub as scrubbed
    except ImportError:
        return text
    return scrubbed(text, url)


def open_store(url: str) -> Any:
    """Open the store ``url`` names (``stores.urls.Opened``). The CLI runs no DDL on a database server and
    creates no SQLite file: the tables are the application's (``schema`` prints them)."""
    urls = _urls()
    options = urls.Options(connect_timeout=CONNECT_TIMEOUT, application_name=f"{APPLICATION_NAME} cli", pool_size=1)
    return urls.open_url(url, options)


# -- parsing arguments ----------------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_UNIT = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def duration(text: str) -> float:
    """``30d``, ``12h``, ``15m``, ``90s`` or a sum of them (``1d12h``), in seconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30d, 12h, 15m, 90s or 1d12h")
    return sum(float(n) * _UNIT[u] for n, u in parts)


def value(text: str) -> Scalar | None:
    """A metadata value as typed: JSON when it parses (``17``, ``true``, ``"17"``), else the text itself."""
    try:
        parsed: Scalar | None = json.loads(text)
    except ValueError:
        return text
    return parsed


def pair(text: str) -> tuple[str, Scalar | None]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value")
    return key, None if raw == "" else value(raw)


def positive(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return number


def count(text: str) -> int:
    return 0 if text == "0" else positive(text)


VALUES = ("Each VALUE is read as JSON when it parses as JSON (17, 1.5, true, \"17\") and as a plain string "
          "otherwise (u-17), so quote it as a JSON string to keep digits or true as text: key='\"17\"'.")


def exit_codes() -> str:
    return "exit codes:\n" + "\n".join(f"  {code}  {text}" for code, text in EXIT_CODES.items())


def _common(store_option: bool = True) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name. SUPPRESS keeps a subcommand from
    overwriting what was given before its name with its default; each parser gets its own copy, since
    set_defaults changes the actions a parent shares."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    if store_option:  # not where the application gives the store (manage.py agent_sessions)
        common.add_argument("--store", metavar="URL", help=f"the store (default: ${ENV_STORE})")
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout, for scripts")
    common.add_argument("--debug", action="store_true", help="log at DEBUG and show tracebacks")
    return common


def build_parser(prog: str = PROG, store_option: bool = True) -> argparse.ArgumentParser:
    where = (f"The store is --store URL or ${ENV_STORE}: a SQLite file (./sessions.db, sqlite:///path.db), "
             "postgresql+psycopg://user@host/db, mysql+pymysql://user@host/db or mongodb://host:27017/db."
             if store_option else "The store is the application's (in Django, the one settings.AGENT_SESSIONS "
             "and DATABASES give agent_sessions.contrib.django.store()).")
    epilog = (where + "\n\n" + exit_codes()
              + "\n\nErrors are one line on stderr; --debug adds the traceback. See docs/cli.md.")
    parser = argparse.ArgumentParser(
        prog=prog, parents=[_common(store_option)], epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Look at and manage the sessions of an agent-sessions store.",
    )
    parser.set_defaults(store=os.environ.get(ENV_STORE), json=False, debug=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[..., Outcome], help: str, epilog: str = "", *args: str,
                **defaults: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[_common(store_option)], help=help, description=help,
                                  epilog=(epilog + "\n\n" if epilog else "") + exit_codes(),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(run=run, **defaults)
        for metavar in args:
            sub.add_argument("session" if metavar == "SID" else metavar.lower(), metavar=metavar)
        return sub

    def paged(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--limit", type=positive, default=50, help="sessions per page (default 50, at most 1000)")
        sub.add_argument("--after", metavar="CURSOR", help="the page after this cursor (printed by the previous page)")

    def sweeping(sub: argparse.ArgumentParser, limit: str, grace: float, grace_help: str) -> None:
        sub.add_argument("--resolve", metavar="MODULE:FUNCTION", type=resolver,
                         help="the application's function choosing the spec and endpoint, e.g. myapp.agent:resolve"
                              + ("" if store_option else " (default: settings.AGENT_SESSIONS['RESOLVE'])"))
        sub.add_argument("--limit", metavar="N", type=positive, default=100, help=limit)
        sub.add_argument("--grace", metavar="DURATION", type=duration, default=grace,
                         help=f"leave turns open for less than this ({grace_help}default {span(grace)})")

    sub = command("list", cmd_list, "list sessions, most recently updated first",
                  "Prints the cursor of the next page, if any: pass it as --after. " + VALUES)
    sub.add_argument("--prefix", default="", help="only sessions whose id starts with this")
    sub.add_argument("--where", metavar="KEY=VALUE", type=pair, action="append", default=[],
                     help="only sessions whose metadata has KEY set to VALUE (repeatable: all must match)")
    paged(sub)

    sub = command("show", cmd_show, "print a session: the end of its transcript (or all of it), its run, "
                  "the steers and the calls waiting", "Messages are numbered from #1, as they stand in the "
                  "transcript (fork --at N keeps #1 to #N).", "SID")
    shown = sub.add_mutually_exclusive_group()
    shown.add_argument("--last", metavar="N", type=count, default=20, help="the last N messages (default 20)")
    shown.add_argument("--all", action="store_true", help="the whole transcript")

    command("info", cmd_info, "when a session was created and updated, its length, metadata, run, and the "
                              "steers and calls waiting", "", "SID")

    sub = command("steer", cmd_steer, "leave a steer for the session's next model request, whichever process "
                  "makes it", "", "SID", "TEXT")
    sub.add_argument("--key", metavar="KEY", help="store it once: a steer with this key already left for the "
                                                 "session is not stored again (safe to run again after a failure)")

    command("cancel", cmd_cancel, "cancel the session's turn: its run stops, or the turn waiting for approval is "
                                  "closed (exit 1 when there is neither)", "", "SID")
    command("approvals", cmd_approvals, "list the tool calls the session's turn waits to have decided "
                                        "(exit 1 when none waits)", "", "SID")
    sub = command("approve", cmd_decide, "approve a call the session's turn waits for: its next run runs it",
                  "A decision is taken once: a call decided already exits 5; one that waits for nothing, 1.",
                  "SID", approved=True)
    sub.add_argument("call_id", metavar="CALL_ID", help="as `approvals` lists it")
    sub = command("deny", cmd_decide, "deny a call the session's turn waits for: its next run gives the model "
                                      "the reason instead", "Exit codes as approve.", "SID", approved=False)
    sub.add_argument("call_id", metavar="CALL_ID", help="as `approvals` lists it")
    sub.add_argument("--reason", metavar="TEXT", default="", help="why: the model reads it with the call's result")

    command("holder", cmd_holder, "who runs the session now, and until when (exit 1 when no live run)", "", "SID")

    sub = command("fork", cmd_fork, "start NEW_ID from SID's transcript (all of it, or its first N messages)", "",
                  "SID", "NEW_ID")
    sub.add_argument("--at", metavar="N", type=count, help="keep the first N messages: #1 to #N as show numbers them")
    sub.add_argument("--allow-unanswered", action="store_true",
                     help="cut even after a message whose tool calls have no results yet")

    sub = command("delete", cmd_delete, "delete a session and everything kept for it",
                  "Asks for confirmation on a terminal; elsewhere pass --yes.", "SID")
    sub.add_argument("--force", action="store_true",
                     help="delete even while a live run holds it (its next write fails with LeaseLost)")
    sub.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    sub = command("prune", cmd_prune, "delete the sessions nobody updated for a while and no live run holds",
                  "Deletes in batches, each its own transaction. Exit 0 even when none was idle: "
                  "schedule it as the retention job.")
    sub.add_argument("--idle-for", metavar="DURATION", type=duration, required=True,
                     help="not updated for this long: 30d, 12h, 15m, 90s, or a sum such as 1d12h")
    sub.add_argument("--limit", metavar="N", type=positive, help="delete at most N sessions")

    sub = command("metadata", cmd_metadata, "print a session's metadata, or change it",
                  "KEY=VALUE sets KEY; KEY= (nothing after =) or KEY=null removes it. Setting metadata "
                  "creates the session if it does not exist yet. " + VALUES, "SID")
    sub.add_argument("changes", metavar="KEY=VALUE", type=pair, nargs="*")

    sub = command("stranded", cmd_stranded, "list the stranded sessions: a turn left open, no live run on it "
                  "(its worker died), oldest first", "Read through an index of the open sessions alone: cheap "
                  "when none is stranded. `recover` finishes them.")
    paged(sub)
    sub.add_argument("--grace", metavar="DURATION", type=duration, default=10.0,
                     help="only turns open for at least this long (default 10s)")

    sweeping(command("recover", cmd_recover, "finish the turns of stranded sessions, each once, whoever else "
                     "sweeps at the same moment (agent.recover)",
                     "FUNCTION(info) returns (Spec, Endpoint) to finish a session with, or None to leave it; "
                     "info.spec names the spec its last run used. Exit 0 when every session was finished or left "
                     "(none stranded included: schedule it), 4 when a run failed (it is tried again next time)."),
             "look at most at N stranded sessions (default 100)", 10.0, "a caller may be about to run them; ")

    sub = command("work", cmd_work, "answer every message left to the sweep, until stopped: recover in a loop "
                  "(the worker of a deployment without a task queue)",
                  "Every --every it finishes what is stranded (agent.recover): messages handed over with "
                  "Session.enqueue or left queued by a caller that gave up, turns whose worker died (once their "
                  "lease has lapsed), turns whose calls were approved or denied. One line per session it acted on "
                  "(--json: one JSON document per line). SIGTERM or SIGINT stops it after the turn in progress "
                  "(a second one at once); --for stops it after a while. Run as many as you like: each turn is "
                  "finished once. Exit 0 when stopped so.")
    sweeping(sub, "sessions finished at most per look (default 100)", WORK_GRACE, "")
    sub.add_argument("--every", metavar="DURATION", type=duration, default=WORK_EVERY,
                     help=f"how often to look for stranded turns (default {span(WORK_EVERY)})")
    sub.add_argument("--for", metavar="DURATION", dest="run_for", type=duration,
                     help="stop after this long (default: run until stopped)")

    command("schema", cmd_schema, "print the DDL that creates the store's tables (the CLI runs none)",
            "For the operator's migration: python -m agent_sessions --store URL schema | psql ... "
            "Exit 1 when the store needs nothing created (SQLite creates its own tables).")
    return parser


# -- the commands --------------------------------------------------------------------------------------------
# Each takes the parsed arguments and the store (the session, for a command taking SID), and returns an
# Outcome or raises.


def cmd_list(args: argparse.Namespace, store: Store) -> Outcome:
    page = _lifecycle(store, "list").list_sessions(args.prefix, dict(args.where) or None, args.limit, args.after)
    return _page(page, ("UPDATED (UTC)", "METADATA"), "no sessions", info_doc,
                 lambda i: (i.updated, lifecycle.encode_metadata(i.metadata)))


def _page(page: SessionPage, columns: tuple[str, str], empty: str, doc: Callable[[SessionInfo], dict[str, Any]],
          row: Callable[[SessionInfo], tuple[datetime, str]]) -> Outcome:
    lines = [f"{'ID':<30} {columns[0]:<19}  {'MESSAGES':>8}  {columns[1]}"] if page.sessions else [empty]
    lines += [f"{safe(i.id):<30} {_time(row(i)[0])}  {i.messages:>8}  {safe(row(i)[1])}" for i in page.sessions]
    if page.next:
        lines.append(f"next page: --after {safe(page.next)}")
    return Outcome({"sessions": [doc(i) for i in page.sessions], "next": page.next}, lines)


def cmd_show(args: argparse.Namespace, session: StoreSession) -> Outcome:
    info: SessionInfo | None = None
    if isinstance(session.store, RunStore):  # the tail alone is read, and the length counted
        info = session.info()
        if info is None:
            return _absent(session, {"id": session.id, "messages": []})
        total = info.messages
        msgs = session.messages() if args.all else session.messages(last=args.last)
    else:  # a store that cannot count without reading: read it all, once
        every = session.messages()
        total = len(every)
        msgs = every if args.all else every[total - lifecycle.last_count(args.last):]
    holder = session.holder() if info is not None else None
    waits = waits_on(session)
    first = total - len(msgs)
    head = f"session {safe(session.id)}: {total} message{'' if total == 1 else 's'}"
    if info is not None:
        head += f", created {_time(info.created)}, updated {_time(info.updated)} UTC"
    lines = [head]
    if info is not None and info.metadata:
        lines.append(f"metadata: {safe(lifecycle.encode_metadata(info.metadata))}")
    if holder is not None:
        lines.append(f"run: {safe(holder.describe())}" + (", asked to cancel" if holder.cancelled else ""))
    lines += waits.lines()
    if first:
        lines.append(f"... {first} earlier message{'' if first == 1 else 's'} (--all shows them)")
    for number, message in enumerate(msgs, start=first + 1):
        lines += format_message(message, number)
    return Outcome({"id": session.id, "info": None if info is None else info_doc(info),
                    "holder": holder_doc(holder), **waits.doc(), "total": total, "first": first,
                    "messages": [m.to_dict() for m in msgs]}, lines)


def cmd_info(args: argparse.Namespace, session: StoreSession) -> Outcome:
    info = session.info()
    if info is None:
        return _absent(session, None)
    holder = session.holder()
    waits = waits_on(session)
    lines = [f"id:        {safe(info.id)}", f"created:   {_time(info.created)} UTC",
             f"updated:   {_time(info.updated)} UTC", f"messages:  {info.messages}",
             f"metadata:  {safe(lifecycle.encode_metadata(info.metadata))}",
             f"run:       {'none' if holder is None else safe(holder.describe())}", *waits.lines(every=True)]
    return Outcome({**info_doc(info), "holder": holder_doc(holder), **waits.doc()}, lines)


def cmd_steer(args: argparse.Namespace, session: StoreSession) -> Outcome:
    if not session.steer(args.text, key=args.key):
        return Outcome({"id": session.id, "steered": False},
                       [f"a steer with key {safe(args.key)} was left for session {safe(session.id)} already; "
                        "not stored again"])
    running = session.holder() is not None if isinstance(session.store, RunStore) else None
    if running:
        later = ": its run takes it before its next model request"
    elif args.key is not None:
        # A keyed steer is a message waiting for an answer (Runner.turn(if_busy="steer") leaves it so): with no
        # run to take it, it opens the session's turn, and the sweep answers it with a run of its own.
        later = ("; no run holds the session, so a keyed steer waits as a message of its own: the sweep "
                 "(recover: work, the Celery workers) runs the session to answer it")
    elif running is False and session.info() is None:
        later = " (it does not exist yet: the steer waits for its first run)"
    else:
        later = "; no run holds the session now: its next run takes it" if running is False else ""
    return Outcome({"id": session.id, "steered": True}, [f"steer left for session {safe(session.id)}{later}"])


def cmd_cancel(args: argparse.Namespace, session: StoreSession) -> Outcome:
    """What was cancelled is looked at first, so the line says which (a run, or a turn waiting for approval)."""
    running = session.holder() is not None
    waiting = 0 if running else len(session.pending_approvals())
    if not session.cancel():
        return Outcome({"id": session.id, "cancelled": False, "closed": False}, code=NOTHING,
                       note=f"no run holds session {session.id!r} and no turn of it waits for approval: "
                            "nothing to cancel")
    if running or not waiting:
        line = (f"asked the run holding session {safe(session.id)} to stop before its next model request or "
                "tool call")
    else:
        line = (f"closed the turn of session {safe(session.id)} that waited for approval: its "
                f"{waiting} call{'' if waiting == 1 else 's'} waiting will not run")
    return Outcome({"id": session.id, "cancelled": True, "closed": bool(waiting) and not running}, [line])


def cmd_approvals(args: argparse.Namespace, session: StoreSession) -> Outcome:
    waiting = session.pending_approvals()
    doc = {"id": session.id, "pending_approvals": [approval_doc(p) for p in waiting]}
    if not waiting:
        return Outcome(doc, code=NOTHING, note=f"no call of session {session.id!r} waits for a decision")
    return Outcome(doc, [approval_line(p) for p in waiting])


def cmd_decide(args: argparse.Namespace, session: StoreSession) -> Outcome:
    doc = {"id": session.id, "call_id": args.call_id, "decided": False}
    try:
        decision = session.approve(args.call_id) if args.approved else session.deny(args.call_id, args.reason)
    except UnknownApproval as exc:
        return Outcome(doc, code=NOTHING, note=str(exc))
    verb = "approved" if decision.approved else "denied"
    return Outcome({**doc, "decided": True, "approved": decision.approved, "reason": decision.reason},
                   [f"{verb} call {safe(args.call_id)} of session {safe(session.id)}: once no call waits, the turn "
                    f"goes on and {'runs it' if decision.approved else 'gives the model the reason'}, in the "
                    "session's next run or the sweep's (recover: work, the Celery workers)"])


def cmd_holder(args: argparse.Namespace, session: StoreSession) -> Outcome:
    holder = session.holder()
    if holder is None:
        return Outcome({"id": session.id, "holder": None}, code=NOTHING,
                       note=f"no live run holds session {session.id!r}")
    return Outcome({"id": session.id, "holder": holder_doc(holder)}, [safe(holder.describe())])


def cmd_fork(args: argparse.Namespace, session: StoreSession) -> Outcome:
    if not session.messages(last=1):
        return Outcome({"id": args.new_id, "source": session.id, "forked": False}, code=NOTHING,
                       note=f"session {session.id!r} has no transcript to fork")
    session.fork(args.new_id, args.at, allow_unanswered=args.allow_unanswered)
    kept = "all its messages" if args.at is None else f"its first {args.at} messages"
    return Outcome({"id": args.new_id, "source": session.id, "forked": True, "at": args.at},
                   [f"forked session {safe(session.id)} into {safe(args.new_id)} with {kept}"])


def cmd_delete(args: argparse.Namespace, session: StoreSession) -> Outcome:
    if not args.yes and not _confirm(f"delete session {session.id!r} and everything kept for it?"):
        return Outcome({"id": session.id, "deleted": False}, code=NOTHING, note="not deleted")
    try:
        deleted = session.delete(force=args.force)
    except SessionBusy as exc:
        raise Exit(CONFLICT, f"session {session.id!r} is held by a live run, {exc.holder.describe()}; --force "
                             "deletes it anyway (the run's next write then fails with LeaseLost)") from exc
    if not deleted:
        return _absent(session, {"id": session.id, "deleted": False})
    return Outcome({"id": session.id, "deleted": True}, [f"deleted session {safe(session.id)}"])


def cmd_prune(args: argparse.Namespace, store: Store) -> Outcome:
    deleted = _lifecycle(store, "prune").prune(args.idle_for, args.limit)
    return Outcome({"deleted": deleted, "idle_for": args.idle_for},
                   [f"deleted {deleted} session{'' if deleted == 1 else 's'} not updated for {span(args.idle_for)}"])


def cmd_metadata(args: argparse.Namespace, session: StoreSession) -> Outcome:
    if args.changes:
        metadata: Mapping[str, Scalar] = session.set_metadata(dict(args.changes))
    else:
        info = session.info()
        if info is None:
            return _absent(session, {"id": session.id, "metadata": None})
        metadata = info.metadata
    return Outcome({"id": session.id, "metadata": dict(metadata)},
                   [f"{safe(k)}={safe(json.dumps(v, ensure_ascii=False))}" for k, v in sorted(metadata.items())])


def cmd_stranded(args: argparse.Namespace, store: Store) -> Outcome:
    page = _lifecycle(store, "stranded").list_sessions(limit=args.limit, after=args.after, stranded=True,
                                                       grace=args.grace)
    return _page(page, ("OPEN SINCE (UTC)", "SPEC"), "no stranded sessions", stranded_doc,
                 lambda i: (i.open_since or i.updated, i.spec or "-"))


def _resolve(args: argparse.Namespace) -> Resolve:
    chosen: Resolve | None = getattr(args, "resolve", None) or args.default_resolve
    if chosen is None:
        raise Exit(USAGE, f"{args.command} needs --resolve MODULE:FUNCTION (the function choosing the spec and "
                          "endpoint of each session; in Django, AGENT_SESSIONS['RESOLVE'])")
    return chosen


def cmd_recover(args: argparse.Namespace, store: Store) -> Outcome:
    done = recover(_lifecycle(store, "recover"), _resolve(args), limit=args.limit, grace=args.grace)
    failed = [r for r in done if r.outcome == "failed"]
    lines = [f"{safe(r.session):<30} {r.outcome}{_recovered_detail(r)}" for r in done] or ["no stranded sessions"]
    doc = {"sessions": [_recovered_doc(r) for r in done]}
    if failed:
        return Outcome(doc, lines, code=STORE_FAILED, note=f"{len(failed)} of {len(done)} stranded turns failed; "
                                                         "the next recover tries them again")
    return Outcome(doc, lines)


def cmd_work(args: argparse.Namespace, store: Store) -> Outcome:
    """``recover`` every ``--every`` until a signal (or ``--for``) stops it. A sweep that fails (the database
    went away) is said on stderr and tried again at the next look: a worker outlives a database restart."""
    lifecycle_store, resolve, out = _lifecycle(store, "work"), _resolve(args), args.stdout
    stop = threading.Event()

    def resolving(info: SessionInfo) -> tuple[Spec, Endpoint] | None:  # once stopping, the rest of the page waits
        return None if stop.is_set() else resolve(info)

    ends = math.inf if args.run_for is None else time.monotonic() + args.run_for
    counts: dict[str, int] = {}
    log.info("work: looking for stranded turns every %s (grace %s)", span(args.every), span(args.grace))
    with _stopping_on_signals(stop):
        while not stop.is_set() and time.monotonic() < ends:
            started = time.monotonic()
            try:
                done = recover(lifecycle_store, resolving, limit=args.limit, grace=args.grace)
            except (StoreError, *args.failures) as exc:
                _say(args.stderr, f"{args.prog}: work: the sweep failed ({safe(_one_line(str(exc)))}); trying again")
                done = []
            for r in done:
                if r.outcome in ("busy", "skipped"):  # another worker has it, or it is not this application's
                    continue
                counts[r.outcome] = counts.get(r.outcome, 0) + 1
                if args.json:
                    _say(out, json.dumps({**_recovered_doc(r), "at": datetime.now(UTC).isoformat()}))
                else:
                    _say(out, f"{_time(datetime.now(UTC))} {safe(r.session):<30} {r.outcome}{_recovered_detail(r)}")
                out.flush()
            stop.wait(max(0.0, min(args.every - (time.monotonic() - started), ends - time.monotonic())))
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "nothing to do"
    return Outcome({"stopped": counts}, [], note=f"work stopped: {summary}")


@contextlib.contextmanager
def _stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` (the turn in progress ends first); a second one interrupts at once.
    Signals are the main thread's: elsewhere (``call_command`` on a thread) only ``--for`` stops it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        log.warning("work: %s: stopping after the turn in progress (again: at once)", signal.Signals(signum).name)
        stop.set()

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def _recovered_doc(r: Recovered) -> dict[str, Any]:
    return {"id": r.session, "outcome": r.outcome, "spec": r.spec,
            "stop_reason": None if r.result is None else r.result.stop_reason,
            "error": None if r.error is None else f"{type(r.error).__name__}: {r.error}"}


def _recovered_detail(r: Recovered) -> str:
    if r.result is not None:
        return f" ({r.result.stop_reason}, {r.result.steps} step{'' if r.result.steps == 1 else 's'})"
    return "" if r.error is None else f": {safe(type(r.error).__name__ + ': ' + str(r.error))}"


def resolver(text: str) -> Resolve:
    """``module:function``, imported: what ``recover --resolve`` calls for each stranded session."""
    module, _, name = text.partition(":")
    if not module or not name:
        raise argparse.ArgumentTypeError(f"expected MODULE:FUNCTION, got {text!r}")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot import {text!r}: {exc}") from exc
    if not callable(found):
        raise argparse.ArgumentTypeError(f"{text!r} is not callable")
    return found  # type: ignore[no-any-return]


def cmd_schema(args: argparse.Namespace, kind: Any) -> Outcome:
    """The DDL that creates the store's tables, as ``kind`` (``stores.urls.Kind``) exports it: the CLI runs none."""
    ddl = str(kind.schema())
    if not ddl:
        return Outcome({"store": kind.name, "ddl": ""}, code=NOTHING,
                       note=f"the {kind.name} store creates what it needs itself: there is no DDL to run")
    return Outcome({"store": kind.name, "ddl": ddl}, [ddl.rstrip("\n")])


# -- helpers -------------------------------------------------------------------------------------------------


def format_message(message: Message, number: int) -> list[str]:
    """A message for a terminal: its number, role (and key), then one indented line or more per block; tool
    arguments exactly as the model wrote them. Control characters are shown escaped, never sent."""
    lines = [f"#{number} {message.role.value}" + (f" (key {safe(message.key)})" if message.key else "") + ":"]
    for block in message.content:
        if block.type is ContentType.TEXT:
            text = block.text
        elif block.type is ContentType.TOOL_CALL:  # a name or id is one field; arguments and texts are lines
            text = f"tool call {safe(block.name)} [{safe(block.id)}] {block.arguments}"
        elif block.type is ContentType.COMPACTION:
            text = f"summary of messages #{block.start} to #{block.end - 1}: {block.text}"
        else:
            error = " (error)" if block.is_error else ""
            text = f"tool result [{safe(block.tool_call_id)}]{error}: {block.text}"
        lines += [f"  {safe(line)}" for line in (text.splitlines() or [""])]
    return lines


_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
"""C0 controls (line feed, carriage return and tab too), DEL and C1 controls (U+0085, a line end to some),
U+2028/U+2029 (line and paragraph separators), the bidirectional marks, embeddings, overrides and
isolates, and surrogates (a lone one cannot even be written as UTF-8)."""


def safe(text: str) -> str:
    """Text from the store is untrusted: it must print as one field on one line, never drive the terminal,
    start a line of its own (forging a row) or reorder what follows it (a bidi override)."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) <= 0x1f else f"\\u{ord(m.group()):04x}",
                       text)


def _time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def info_doc(info: SessionInfo) -> dict[str, Any]:
    return {"id": info.id, "created": info.created.isoformat(), "updated": info.updated.isoformat(),
            "messages": info.messages, "metadata": dict(info.metadata)}


def stranded_doc(info: SessionInfo) -> dict[str, Any]:
    return {**info_doc(info), "spec": info.spec,
            "open_since": None if info.open_since is None else info.open_since.isoformat()}


def holder_doc(holder: Holder | None) -> dict[str, Any] | None:
    """The lease without its token: the token is what a run's writes carry, not something to print."""
    if holder is None:
        return None
    return {"host": holder.host, "pid": holder.pid, "epoch": holder.epoch, "cancelled": holder.cancelled,
            "expires": when(holder.expires).isoformat()}


def approval_doc(pending: PendingApproval) -> dict[str, Any]:
    return {"call_id": pending.call_id, "tool": pending.tool, "arguments": pending.arguments,
            "asked": pending.asked.isoformat(),
            "deadline": None if pending.deadline is None else pending.deadline.isoformat()}


def approval_line(pending: PendingApproval) -> str:
    deadline = "" if pending.deadline is None else f", deadline {_time(pending.deadline)} UTC"
    return (f"{safe(pending.call_id)}  {safe(pending.tool)}({safe(pending.arguments)})  "
            f"asked {_time(pending.asked)} UTC{deadline}")


_STATES = {"running": "started, no result yet (if its run died: outcome unknown, not run again unless idempotent)",
           "waiting": "waits for a decision", "expired": EXPIRED, "not started": "not started"}
"""How ``show`` and ``info`` say where a call stands (``Journal.stages``), as the console does."""


@dataclass
class Waits:
    """Everything that waits on a session, as ``show`` and ``info`` print it."""

    steers: list[str] = field(default_factory=list)
    queued: list[str] = field(default_factory=list)
    journal: Journal | None = None
    approvals: list[PendingApproval] = field(default_factory=list)

    def calls(self) -> list[tuple[str, str, str]]:
        """Each call of the journal's reply: its id, its tool, and where it stands."""
        if self.journal is None:
            return []
        found = []
        for stage in self.journal.stages(time.time()):
            if stage.result is not None:
                state = "result kept" + (" (error)" if stage.result.is_error else "")
            elif stage.decision is not None:
                state = f"{stage.name} ({stage.decision.by}), not run yet"
            else:
                state = _STATES[stage.name]
            found.append((stage.call.id, stage.call.name, state))
        return found

    def lines(self, every: bool = False) -> list[str]:
        """A heading and its items per kind of wait: ``show``'s, the kinds that wait; ``info``'s (``every``),
        all four in columns, with their counts."""
        steers, queued, approvals, journal = len(self.steers), len(self.queued), len(self.approvals), self.journal
        order = " (each answered by a turn of its own, in this order)"
        calls = 0 if journal is None else len(journal.reply.tool_calls)
        flight = ("none" if journal is None else
                  f"a reply with {calls} tool call{'' if calls == 1 else 's'}, after message #{journal.at}")
        kinds = [
            (steers, f"steers waiting: {steers}", f"steers:    {steers} waiting", [safe(t) for t in self.steers]),
            (queued, f"messages queued: {queued}{order}", f"queued:    {queued} waiting{order if queued else ''}",
             [f"key {safe(k)}" for k in self.queued]),
            (journal is not None, f"in flight: {flight}", f"in flight: {flight}",
             [f"{safe(call)}  {safe(tool)}: {state}" for call, tool, state in self.calls()]),
            (approvals, f"calls waiting for a decision: {approvals} (approve SID CALL_ID, or deny)",
             f"approvals: {approvals} waiting"
             + (f" (approve or deny: {PROG} approve SID CALL_ID)" if approvals else ""),
             [approval_line(p) for p in self.approvals]),
        ]
        return [line for waits, shown, listed, items in kinds if every or waits
                for line in [listed if every else shown, *(f"  {item}" for item in items)]]

    def doc(self) -> dict[str, Any]:
        return {"pending_steers": self.steers, "queued": self.queued,
                "in_flight": None if self.journal is None else {
                    "after": self.journal.at,
                    "calls": [{"call_id": c, "tool": t, "state": st} for c, t, st in self.calls()]},
                "pending_approvals": [approval_doc(p) for p in self.approvals]}


def waits_on(session: StoreSession) -> Waits:
    """What waits on ``session``, as far as its store can tell (a capability it lacks waits on nothing)."""
    store = session.store
    if not isinstance(store, RunStore):
        return Waits()
    text = store.journal(session.id)
    journal = None if text is None else Journal.from_json(text, f"session {session.id!r}")
    pending = session.pending_approvals() if journal is not None and journal.approvals else []
    return Waits(session.pending_steers(), session.queued(), journal, pending)


def span(seconds: float) -> str:
    """Seconds as ``duration`` reads them back: 31536000.0 is ``365d``, 129600.0 ``1d12h``."""
    whole, rest = divmod(seconds, 1)
    parts, left = [], int(whole)
    for unit, size in _UNIT.items():
        amount, left = divmod(left, size)
        if amount:
            parts.append(f"{amount}{unit}")
    if rest:
        parts = parts[:-1] if parts and parts[-1].endswith("s") else parts
        parts.append(f"{(seconds % 60):g}s")
    return "".join(parts) or "0s"


def _lifecycle(store: Store, command: str) -> RunStore:
    if not isinstance(store, RunStore):
        raise Unsupported(f"{command} needs a store implementing agent_sessions.LifecycleStore; {store!r} does not")
    return store


def _absent(session: StoreSession, doc: Any) -> Outcome:
    return Outcome(doc, code=NOTHING, note=f"no session {session.id!r}")


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise Exit(USAGE, "delete asks for confirmation: pass --yes when not running it from a terminal")
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)  # stdout is for the answer (--json)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- running it ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, store: Store | None = None,
         make_store: Callable[[], Store] | None = None, prog: str = PROG,
         stdout: TextIO | None = None, stderr: TextIO | None = None, resolve: Resolve | None = None) -> int:
    """Run one command and return its exit code (``EXIT_CODES``). ``store``: this store instead of
    ``--store``'s; ``make_store``: the same, built once a command needs it (the Django app's, which may be
    misconfigured: it raises ``Exit``). ``prog`` names the front door in help and messages; ``resolve``:
    what ``recover`` and ``work`` use without ``--resolve`` (the Django app's ``AGENT_SESSIONS['RESOLVE']``)."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):  # argparse prints to sys.*
            args = build_parser(prog, store_option=make_store is None).parse_args(argv)
    except SystemExit as exc:  # argparse printed --help, or the usage error; returned, for an embedding caller
        return exc.code if isinstance(exc.code, int) else USAGE
    args.stdout, args.stderr, args.prog, args.default_resolve, args.failures = out, err, prog, resolve, ()
    level = logging.DEBUG if args.debug else logging.WARNING
    logging.basicConfig(level=level, format=f"{prog}: %(levelname)s %(name)s: %(message)s")  # no-op if configured
    try:
        given = store if store is not None or make_store is None or args.command == "schema" else make_store()
        return _emit(_run(args, given), args.json, prog, out, err)
    except KeyboardInterrupt:
        code, message = 130, "interrupted"
    except Exception as exc:  # noqa: BLE001 - every error ends as one line and an exit code, never a traceback
        code, message = classify(exc)
        if args.debug:
            traceback.print_exc(file=err)
    _say(err, f"{prog}: error: {safe(_one_line(scrub(message, getattr(args, 'store', None))))}")
    return code


def _say(stream: TextIO, text: str) -> None:
    """One write per line, its line end included: a stream that ends lines itself (Django's
    ``OutputWrapper``) adds none more."""
    stream.write(text + "\n")


def classify(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, Exit):
        return exc.code, str(exc)
    if isinstance(exc, ImportError):  # StoresShadowed, or a driver missing where the application builds the store
        return MISSING_DRIVER, str(exc)
    if isinstance(exc, Conflict | SessionExists):
        return CONFLICT, str(exc)
    if isinstance(exc, ArgumentError):
        return USAGE, str(exc)
    if isinstance(exc, StoreError | Unsupported):
        return STORE_FAILED, str(exc)
    # Not one of ours on purpose: a driver's error the store did not wrap, or a bug (--debug shows where).
    return STORE_FAILED, f"unexpected {type(exc).__name__}: {exc} (--debug shows the traceback)"


def _run(args: argparse.Namespace, given: Store | None) -> Outcome:
    if given is not None and args.command != "schema":
        return _call(args, given)
    if not args.store:
        raise Exit(USAGE, f"no store: pass --store URL or set ${ENV_STORE}")
    urls = _urls()
    kind, where = urls.kind_of(args.store), urls.shown(args.store)  # read without connecting
    if args.command == "schema":
        return cmd_schema(args, kind)
    opened = open_store(args.store)
    args.failures = opened.failures
    try:
        return _call(args, opened.store)
    except StoreError as exc:
        raise Exit(STORE_FAILED, f"store {where}: {exc}") from exc
    except opened.failures as exc:
        raise Exit(STORE_FAILED, f"store {where}: {type(exc).__name__}: {exc}") from exc
    finally:
        opened.close()


def _call(args: argparse.Namespace, store: Store) -> Outcome:
    given = open_session(args.session, store) if "session" in args else store
    return args.run(args, given)  # type: ignore[no-any-return]


def _emit(outcome: Outcome, as_json: bool, prog: str, out: TextIO, err: TextIO) -> int:
    try:
        if as_json:
            _say(out, json.dumps(outcome.doc))
        elif outcome.lines:
            _say(out, "\n".join(outcome.lines))
        out.flush()
    except BrokenPipeError:  # `... list | head`: the reader has what it wanted
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if outcome.note:
        _say(err, f"{prog}: {safe(_one_line(outcome.note))}")
    return outcome.code
