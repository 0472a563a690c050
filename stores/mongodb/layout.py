"""What lies where, and the plan of a write that needs parts (docs/stores/mongodb.md tells why).

A session's document holds the newest messages (``tail``: fewer than ``PAGE``, at most ``TAIL_BYTES``) and
the list of the pages before them (``pages``: ``{p: part id, f: index of its first message, n: how many of
its messages count}``); likewise the newest events (``events``: fewer than ``EVENT_PAGE``, at most
``EVENT_TAIL_BYTES``) and ``event_pages`` (``f`` counted from ``events_start``, the log's first number). A
steer or queued message longer than ``ITEM_BYTES`` is a part too (``ref`` in place of its ``text``). Parts
are written once and never changed: a page no longer wholly used is named with a smaller ``n``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_sessions.backend import Change
from agent_sessions.errors import StoreError

PAGE = 32
"""Messages a page holds at most; the tail holds fewer."""
PAGE_BYTES = 4 * 2**20
"""Bytes a page holds at most (a longer message gets a page of its own): a document is at most 16 MB."""
TAIL_BYTES = 2**20
"""Bytes of messages the session's document holds at most."""
MAX_MESSAGE_BYTES = 15 * 2**20
"""The longest message (its stored JSON): alone in a page, under the 16 MB limit."""
EVENT_PAGE = 64
"""Events an event page holds at most; the document's tail holds fewer."""
EVENT_TAIL_BYTES = 256 * 2**10
"""Bytes of events the session's document holds at most."""
ITEM_BYTES = 64 * 2**10
"""The longest steer or queued message kept in the session's document; a longer one is a part."""


def size(text: str) -> int:
    """The bytes ``text`` takes in BSON (UTF-8)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def cut(texts: Sequence[str], most: int, tail_bytes: int) -> tuple[list[list[str]], list[str]]:
    """Pages from the front of ``texts`` (each up to ``most`` texts and ``PAGE_BYTES``, or one longer text
    alone) until what is left has fewer than ``most`` texts and at most ``tail_bytes``."""
    pages: list[list[str]] = []
    rest = list(texts)
    while len(rest) >= most or sum(map(size, rest)) > tail_bytes:
        total, n = 0, 0
        while n < len(rest) and n < most and (n == 0 or total + size(rest[n]) <= PAGE_BYTES):
            total += size(rest[n])
            n += 1
        pages.append(rest[:n])
        rest = rest[n:]
    return pages, rest


def needs_parts(change: Change) -> bool:
    """Whether ``change`` could not fit even an empty document: then it is planned before its first try."""
    if change.splice is not None:
        texts = change.splice[1]
        if len(texts) >= PAGE or sum(map(size, texts)) > TAIL_BYTES:
            return True
    if change.events and (len(change.events) >= EVENT_PAGE or sum(map(size, change.events)) > EVENT_TAIL_BYTES):
        return True
    return bool(long_items(change))


def long_items(change: Change) -> dict[str, str]:
    """The change's steer and queued message too long for the document, by the array they join."""
    items = {"steers": None if change.add_steer is None else change.add_steer[0],
             "queue": None if change.push is None else change.push[1]}
    return {kind: text for kind, text in items.items() if text is not None and size(text) > ITEM_BYTES}


LAYOUT = {"generation": 1, "seal": 1, "edits": 1, "length": 1, "tail": 1, "pages": 1, "last_seq": 1, "events": 1,
          "event_pages": 1, "events_start": 1, "events_from": 1, "steers.ref": 1, "queue.ref": 1}
"""What a plan reads of the session's document."""


@dataclass
class Plan:
    """A write's parts and the fields that commit them, planned on the document at ``generation`` and
    ``seal`` (and ``edits``, ``last_seq``, when the plan depends on them: else ``None``). ``fields`` are set
    as they are (``$literal``) beside the rest of the change; ``items``: the part of the steer or queued
    message the write adds, by the array it joins; ``named``: the parts the document names after the write
    (the session's others planned at ``seal`` or before are left over)."""

    generation: str
    seal: int
    edits: int | None = None
    last_seq: int | None = None
    parts: list[dict[str, Any]] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    items: dict[str, str] = field(default_factory=dict)
    named: list[str] = field(default_factory=list)

    def part(self, session: str, texts: list[str]) -> str:
        key = uuid.uuid4().hex
        self.parts.append({"_id": key, "session": session, "generation": self.generation, "seal": self.seal,
                           "texts": texts})
        return key


def plan(session: str, doc: dict[str, Any], change: Change) -> Plan:
    """The plan of ``change`` on ``doc`` (its ``LAYOUT``)."""
    p = Plan(str(doc["generation"]), int(doc.get("seal") or 0))
    pages = list(doc.get("pages") or [])
    if change.splice is not None:
        p.edits = int(doc.get("edits") or 0)
        pages = _messages(session, p, doc, pages, *change.splice)
    event_pages = list(doc.get("event_pages") or [])
    if change.events:
        p.last_seq = int(doc.get("last_seq") or 0)
        event_pages = _events(session, p, doc, event_pages, change.events, change.keep)
    p.items = {kind: p.part(session, [text]) for kind, text in long_items(change).items()}
    taken = {*change.take_steers, *(() if change.pop is None else (change.pop,))}
    refs = [x["ref"] for kind in ("steers", "queue") for x in doc.get(kind) or []
            if "ref" in x and x.get("id") not in taken]
    p.named = [e["p"] for e in [*pages, *event_pages]] + refs + list(p.items.values())
    return p


def _messages(session: str, p: Plan, doc: dict[str, Any], pages: list[dict[str, Any]], at: int,
              texts: Sequence[str]) -> list[dict[str, Any]]:
    """``texts`` from index ``at`` on: the pages wholly before ``at`` kept (the one it falls in, shortened),
    the tail's messages before ``at`` and ``texts`` cut into new pages until the rest fits the tail."""
    tail, length = list(doc.get("tail") or []), int(doc.get("length") or 0)
    base = length - len(tail)
    if at > length:
        raise StoreError(f"MongoDB store: session {session!r} holds {length} messages; a write at {at} was refused")
    if at >= base:
        body, first = [*tail[:at - base], *texts], base
    else:
        pages = [e if e["f"] + e["n"] <= at else {**e, "n": at - e["f"]} for e in pages if e["f"] < at]
        body, first = list(texts), at
    chunks, rest = cut(body, PAGE, TAIL_BYTES)
    for chunk in chunks:
        pages.append({"p": p.part(session, chunk), "f": first, "n": len(chunk)})
        first += len(chunk)
    p.fields.update(tail=rest, tail_bytes=sum(map(size, rest)), pages=pages)
    return pages


def _events(session: str, p: Plan, doc: dict[str, Any], pages: list[dict[str, Any]], texts: Sequence[str],
            keep: int) -> list[dict[str, Any]]:
    """The log's tail and ``texts``, less what the cap drops, cut into pages until the rest fits the tail;
    the pages wholly below the cap dropped. Numbers are counted from the log's first (``events_start``): a
    log begun by this write starts at the server's clock, which only the update knows."""
    last = int(doc.get("last_seq") or 0)
    if last:
        start, tail = int(doc["events_start"]), list(doc.get("events") or [])
        first, floor = last - len(tail) + 1 - start, int(doc["events_from"]) - start
    else:
        tail, first, floor = [], 0, 0
    body = [*tail, *texts]
    floor = max(floor, first + len(body) - keep)
    if floor > first:
        body, first = body[floor - first:], floor
    pages = [e for e in pages if e["f"] + e["n"] > floor]
    chunks, rest = cut(body, EVENT_PAGE, EVENT_TAIL_BYTES)
    for chunk in chunks:
        pages.append({"p": p.part(session, chunk), "f": first, "n": len(chunk)})
        first += len(chunk)
    p.fields.update(events=rest, events_bytes=sum(map(size, rest)), event_pages=pages, events_floor=floor)
    return pages
