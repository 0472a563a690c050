"""What the console shows, as plain data for the templates (which escape it). Nothing here reads in
proportion to the store: a list page is one page of ``list_sessions``, a filter no store indexes reads at
most ``SCAN`` sessions, a transcript page is one ``read_back``, the newest events a few one-row reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import agent_sessions as agent
from agent_sessions import lifecycle
from agent_sessions.cli import value, waits_on
from agent_sessions.contract import LifecycleStore
from agent_sessions.journal import EXPIRED, Journal
from agent_sessions.messages import ContentType

PAGE = 50  # sessions a list page shows
MESSAGES = 50  # messages a transcript page shows
EVENTS = 30  # events of the log a session page shows before it follows the log live
SCAN = 500
"""Sessions a request reads at most to fill a page of a filter no store indexes (a state other than
stranded, a spec) or the approvals inbox; the page then offers to go on from where it stopped."""
GRACE = 10.0
"""Seconds a turn may be open with no run on it before the console calls it stranded: ``agent.recover``'s
default, so what the console calls stranded is what a sweep would take."""

STATES = {
    "running": "running",
    "cancelling": "cancel asked",
    "waiting": "waiting for approval",
    "decided": "decided, not yet run",
    "queued": "messages queued",
    "stranded": "stranded",
    "cancelled": "cancelled",
    "open": "turn open",
    "idle": "idle",
}
"""A session's state at a glance (the list's filter and badge), and how the page names it."""


@dataclass(frozen=True)
class Call:
    """A call of the journal's reply: what the model asked, and how far it got."""

    id: str
    tool: str
    arguments: str
    status: str
    """``waiting``, ``expired`` (undecided past its deadline), ``approved``, ``denied``, ``running`` (started, no
    result yet), ``done``, ``not started``."""
    detail: str = ""
    """The decision's reason and who took it, or the result's text."""
    is_error: bool = False


@dataclass(frozen=True)
class Look:
    """One session as the console shows it: the store's ``SessionInfo`` and everything waiting on it."""

    info: agent.SessionInfo
    state: str
    holder: agent.Holder | None = None
    steers: list[str] = field(default_factory=list)
    queued: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    pending: list[agent.PendingApproval] = field(default_factory=list)

    @property
    def label(self) -> str:
        return STATES[self.state]

    @property
    def recoverable(self) -> bool:
        """An open turn no run holds and nothing else waits on: ``agent.recover`` would take it."""
        return self.state in ("stranded", "open", "decided")

    @property
    def expires(self) -> datetime | None:
        """When the run's lease ends unless renewed (the store's clock)."""
        return None if self.holder is None else agent.contract.when(self.holder.expires)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [(k, json.dumps(v, ensure_ascii=False)) for k, v in sorted(self.info.metadata.items())]


def look(store: LifecycleStore, info: agent.SessionInfo, stranded: Stranded | None = None) -> Look:
    holder = store.holder(info.id)
    waits = waits_on(agent.open(info.id, store))
    state = state_of(info, holder, waits.queued, waits.journal, waits.approvals, stranded or Stranded.of(store, info))
    calls = [] if waits.journal is None else in_flight(waits.journal)
    return Look(info, state, holder, waits.steers, waits.queued, calls, waits.approvals)


def state_of(info: agent.SessionInfo, holder: agent.Holder | None, queued: Sequence[str], journal: Journal | None,
             pending: Sequence[agent.PendingApproval], stranded: Stranded) -> str:
    """The one word for a session's state; the first that holds, in this order."""
    if holder is not None:
        return "cancelling" if holder.cancelled else "running"
    if pending:
        return "waiting"
    if journal is not None and journal.approvals:
        return "decided"
    if queued:
        return "queued"
    if info.open_since is None:
        return "idle"
    if time.time() - info.open_since.timestamp() < GRACE:
        return "open"
    if info.id in stranded.ids:
        return "stranded"
    return "cancelled" if stranded.complete else "open"


@dataclass(frozen=True)
class Stranded:
    """The stranded sessions, as one page of the index of open sessions holds them; ``complete``: it held
    them all, so an open turn past ``GRACE`` not among them was cancelled."""

    ids: frozenset[str]
    complete: bool

    @classmethod
    def of(cls, store: LifecycleStore, *infos: agent.SessionInfo) -> Stranded:
        """One indexed query of the open sessions, made only when one of ``infos`` could be stranded."""
        now = time.time()
        if not any(i.open_since is not None and now - i.open_since.timestamp() >= GRACE for i in infos):
            return cls(frozenset(), False)
        page = store.list_sessions(limit=lifecycle.MAX_PAGE, stranded=True, grace=GRACE)
        return cls(frozenset(i.id for i in page), page.next is None)


def in_flight(journal: Journal) -> list[Call]:
    """The journal's reply, call by call (``Journal.stages``); a call past its approval deadline can no
    longer be decided: the next run denies it."""
    calls = []
    for stage in journal.stages(time.time()):
        call, decision = stage.call, stage.decision
        if stage.result is not None:
            calls.append(Call(call.id, call.name, call.arguments, "done", stage.result.text, stage.result.is_error))
        elif decision is not None:
            why = f"by {decision.by}" + (f": {decision.reason}" if decision.reason else "")
            calls.append(Call(call.id, call.name, call.arguments, stage.name, why))
        else:
            calls.append(Call(call.id, call.name, call.arguments, stage.name,
                              EXPIRED if stage.name == "expired" else ""))
    return calls


# -- the list ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """A page of the list; ``scanned``: for a filter no store indexes, the sessions read to fill it."""

    rows: list[Look]
    next: str | None
    scanned: int | None = None


@dataclass(frozen=True)
class Query:
    """What the list is asked for: ``prefix`` and ``where`` are indexed; ``state`` and ``spec`` are read
    session by session (``stranded`` has its own index)."""

    prefix: str = ""
    where: Mapping[str, agent.contract.Scalar] = field(default_factory=dict)
    state: str = ""
    spec: str = ""


def parse_search(text: str) -> tuple[str, dict[str, agent.contract.Scalar]]:
    """The search box: ``key=value`` terms filter by metadata (values read as the command line's ``--where``
    reads them), any other term is the start of the id (one at most)."""
    prefix, where = "", dict[str, Any]()
    for term in text.split():
        key, sep, raw = term.partition("=")
        if sep and key:
            where[key] = value(raw)
        elif prefix:
            raise agent.ArgumentError(f"search by one id prefix at a time, got {prefix!r} and {term!r}")
        else:
            prefix = term
    return prefix, where


def listing(store: LifecycleStore, query: Query, after: str | None) -> Listing:
    if query.state == "stranded":
        return _stranded_page(store, query, after)
    if not query.state and not query.spec:
        page = store.list_sessions(query.prefix, dict(query.where) or None, PAGE, after)
        stranded = Stranded.of(store, *page.sessions)
        return Listing([look(store, info, stranded) for info in page.sessions], page.next)
    rows: list[Look] = []
    scanned = 0
    cursor = after
    while len(rows) < PAGE and scanned < SCAN:
        page = store.list_sessions(query.prefix, dict(query.where) or None, min(100, SCAN - scanned), cursor)
        scanned += len(page)
        candidates = [i for i in page.sessions if not query.spec or i.spec == query.spec]
        stranded = Stranded.of(store, *candidates)
        rows += [found for found in (look(store, info, stranded) for info in candidates)
                 if not query.state or found.state == query.state]
        cursor = page.next
        if cursor is None:
            break
    return Listing(rows, cursor, scanned)


def _stranded_page(store: LifecycleStore, query: Query, after: str | None) -> Listing:
    """Stranded sessions, oldest open first, through their own index; a search narrows the page."""
    page = store.list_sessions(limit=PAGE, after=after, stranded=True, grace=GRACE)
    known = Stranded(frozenset(i.id for i in page), False)
    infos = [i for i in page.sessions if i.id.startswith(query.prefix) and (not query.spec or i.spec == query.spec)
             and all(k in i.metadata and json.dumps(i.metadata[k]) == json.dumps(v) for k, v in query.where.items())]
    return Listing([look(store, info, known) for info in infos], page.next)


# -- a transcript, a page at a time from its end -----------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    kind: str
    """``text``, ``call``, ``result`` or ``summary``."""
    text: str = ""
    call_id: str = ""
    tool: str = ""
    arguments: str = ""
    """A call's arguments, indented when they parse as JSON, else as the model wrote them."""
    result: str | None = None
    """A call's result, when the transcript read holds it."""
    is_error: bool = False
    covers: tuple[int, int] = (0, 0)
    """A summary's range of message numbers, first and last (numbers count from 1, as the CLI's)."""


@dataclass(frozen=True)
class Shown:
    """One message of a transcript page."""

    number: int
    role: str
    blocks: list[Block]
    key: str = ""
    steer: bool = False
    """A user's text that landed in a turn already under way (after a tool's results, or after the
    turn's input): a steer, taken by the run before its next model request."""
    results_of: int = 0
    """For a message of tool results all shown with their calls: the number of the calls' message."""
    summarised_by: int = 0
    """The number of a summary on this page that covers this message."""


@dataclass(frozen=True)
class Transcript:
    """A page of a transcript, newest first, and where the pages beside it begin."""

    messages: list[Shown]
    total: int
    first: int
    """The index of the oldest message shown."""
    older: int | None
    """``before=`` of the page of older messages (``None``: this page reaches the first)."""
    has_newer: bool
    newer: int | None
    """``before=`` of the page of newer messages (``None`` with ``has_newer``: the newest page)."""

    @property
    def numbers(self) -> tuple[int, int]:
        """The numbers of the oldest and the newest message shown (they count from 1)."""
        return self.first + 1, self.first + len(self.messages)


def transcript(store: LifecycleStore, session: str, before: int | None, total: int) -> Transcript:
    """The ``MESSAGES`` messages before index ``before`` (``None``: the newest), read with one more on each
    side (whether the first is a steer; the results of the last's calls) in one ``read_back``. ``total``:
    the length ``info`` gave."""
    if before is not None and (isinstance(before, bool) or not isinstance(before, int) or before < 0):
        raise agent.ArgumentError(f"before= must be an int >= 0, got {before!r}")
    if before is None:
        start, msgs = store.read_back(session, None, MESSAGES + 1)
        end = start + len(msgs)
    else:
        start, msgs = store.read_back(session, before + 1, MESSAGES + 2)
        end = min(before, start + len(msgs))
    window = {start + i: m for i, m in enumerate(msgs)}
    first = max(0, end - MESSAGES)
    shown = [_shown(window, i) for i in range(first, end)]
    _fold(shown)
    total = end if before is None else max(total, end)
    newer = None if before is None or end + MESSAGES >= total else end + MESSAGES
    return Transcript(list(reversed(shown)), total, first, first if first > 0 else None, before is not None and
                      end < total, newer)


def _shown(window: Mapping[int, agent.Message], index: int) -> Shown:
    message = window[index]
    following = window.get(index + 1)
    results = {} if following is None else {c.tool_call_id: c for c in following.content
                                             if c.type is ContentType.TOOL_RESULT}
    blocks: list[Block] = []
    for c in message.content:
        if c.type is ContentType.TEXT:
            blocks.append(Block("text", c.text))
        elif c.type is ContentType.TOOL_CALL:
            result = results.get(c.id)
            blocks.append(Block("call", call_id=c.id, tool=c.name, arguments=pretty(c.arguments),
                                result=None if result is None else result.text,
                                is_error=False if result is None else result.is_error))
        elif c.type is ContentType.TOOL_RESULT:
            blocks.append(Block("result", c.text, call_id=c.tool_call_id, is_error=c.is_error))
        else:
            blocks.append(Block("summary", c.text, covers=(c.start + 1, c.end)))
    previous = window.get(index - 1)
    calls = set() if previous is None else {c.id for c in previous.tool_calls}
    result_ids = [b.call_id for b in blocks if b.kind == "result"]
    paired = bool(result_ids) and len(result_ids) == len(blocks) and set(result_ids) <= calls
    steer = (message.role is agent.Role.USER and not message.key and previous is not None
             and previous.role is agent.Role.USER and bool(blocks) and all(b.kind == "text" for b in blocks))
    return Shown(index + 1, message.role.value, blocks, message.key, steer, index if paired else 0)


def _fold(shown: list[Shown]) -> None:
    """Mark the messages a summary on the page covers, so the page folds them under it."""
    covered: dict[int, int] = {}
    for m in shown:
        for b in m.blocks:
            if b.kind == "summary":
                for number in range(b.covers[0], b.covers[1] + 1):
                    covered.setdefault(number, m.number)
    for i, m in enumerate(shown):
        if m.number in covered:
            shown[i] = replace(m, summarised_by=covered[m.number])


def pretty(arguments: str) -> str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(parsed, (dict, list)):
        return arguments
    return json.dumps(parsed, indent=2, ensure_ascii=False)


# -- the event log -----------------------------------------------------------------------------------------------


def newest_events(store: LifecycleStore, session: str, count: int = EVENTS) -> tuple[list[agent.StoredEvent], int]:
    """The session's ``count`` newest events and the seq of the newest (0: none), without reading the log
    from its start: its seqs are consecutive, so the newest is found by about 2 log2(length) one-row reads."""
    oldest = store.events(session, 0, 1)
    if not oldest:
        return [], 0
    newest = _newest(lambda seq: bool(store.events(session, seq - 1, 1)), oldest[0].seq)
    after = max(oldest[0].seq - 1, newest - count)
    return agent.open(session, store).events(after=after, limit=count), newest


def _newest(exists: Callable[[int], bool], known: int) -> int:
    """The largest seq for which ``exists`` holds, from ``known``: doubling steps up, then a binary search."""
    step = 1
    while known + step <= agent.eventlog.MAX_SEQ and exists(known + step):
        known += step
        step *= 2
    high = min(known + step, agent.eventlog.MAX_SEQ + 1)  # does not hold (or is past the largest seq)
    while high - known > 1:
        middle = (known + high) // 2
        if exists(middle):
            known = middle
        else:
            high = middle
    return known


def event_line(kind: str, data: Mapping[str, Any]) -> str:
    """An event in a few words, as console.js's ``describe`` says those it follows live."""
    call = data.get("call") or {}
    result = data.get("result") or {}
    if kind == "step_started":
        return f"step {data.get('step')} started"
    if kind == "steer_applied":
        return f"steer landed at #{int(data.get('index', 0)) + 1}: {data.get('text', '')}"
    if kind == "text":
        return f"text: {data.get('text', '')}"
    if kind == "model_response":
        message = data.get("message") or {}
        content = message.get("content", [])
        names = [c.get("name", "") for c in content if c.get("type") == "tool_call"]
        texts = [c.get("text", "") for c in content if c.get("type") == "text"]
        return "model replied" + (f": calls {', '.join(names)}" if names else f": {' '.join(texts)}")
    if kind == "tool_called":
        return f"running {call.get('name', '')} ({call.get('id', '')})"
    if kind == "tool_finished":
        error = " with an error" if result.get("is_error") else ""
        return f"{data.get('name', '')} finished{error}: {result.get('text', '')}"
    if kind == "approval_requested":
        return f"asks approval for {call.get('name', '')} ({call.get('id', '')})"
    if kind == "approval_decided":
        verb = "approved" if data.get("approved") else "denied"
        return f"{call.get('name', '')} {verb} by {data.get('by', '')}" + (
            f": {data['reason']}" if data.get("reason") else "")
    if kind == "compacted":
        return f"compacted #{int(data.get('start', 0)) + 1} to #{data.get('end', 0)}"
    if kind == "finished":
        return f"finished ({data.get('stop_reason', '')}): {data.get('text', '')}"
    if kind == "failed":
        return f"failed: {data.get('type', '')}: {data.get('message', '')}"
    return kind


# -- the approvals inbox -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Asked:
    """A call waiting for a decision, with the conversation that led to it."""

    session: str
    call: agent.PendingApproval
    arguments: str
    context: list[Shown]
    """The messages before the reply, oldest first, and the reply's own text."""
    reply: str


@dataclass(frozen=True)
class Inbox:
    calls: list[Asked]
    scanned: int
    next: str | None
    """Where the next request goes on reading sessions (``None``: every session was read)."""


CONTEXT = 3
"""Messages before a waiting reply the inbox shows."""


def inbox(store: LifecycleStore, after: str | None) -> Inbox:
    """Every call waiting for a decision among up to ``SCAN`` sessions from ``after``, oldest asked first:
    no store indexes them, so each session's journal is read."""
    found: list[Asked] = []
    scanned = 0
    cursor = after
    while scanned < SCAN:
        page = store.list_sessions(limit=min(100, SCAN - scanned), after=cursor)
        scanned += len(page)
        for info in page.sessions:
            found += _asked(store, info.id)
        cursor = page.next
        if cursor is None:
            break
    found.sort(key=lambda a: (a.call.asked, a.session, a.call.call_id))
    return Inbox(found, scanned, cursor)


def _asked(store: LifecycleStore, session: str) -> Iterator[Asked]:
    text = store.journal(session)
    if text is None:
        return
    journal = Journal.from_json(text, f"session {session!r}")
    if not any(a.decision is None for a in journal.approvals.values()):
        return
    waiting = agent.open(session, store).pending_approvals()
    if not waiting:
        return
    start, msgs = store.read_back(session, journal.at, CONTEXT + 1)
    window = {start + i: m for i, m in enumerate(msgs)}
    indexes = sorted(window)
    context = [_shown(window, i) for i in (indexes[1:] if len(indexes) > CONTEXT else indexes)]
    reply = " ".join(c.text for c in journal.reply.content if c.type is ContentType.TEXT)
    for call in waiting:
        yield Asked(session, call, pretty(call.arguments), context, reply)
