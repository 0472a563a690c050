"""A session's durable event log (docs/runs/events.md): its format, its checks, reading and following it,
and serving it as server-sent events.

A log's numbers start at the store's clock in microseconds (``backend.first_seq``), so a session deleted and
made again numbers above its old log and a follower's ``after`` stays good. An event about a message the same
write stores holds a pointer to it (``ref``), which ``resolve`` joins back on reading, or marks
``unresolved``: never joined to another message.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, get_args

from .contract import EventStore, EventWaiter
from .errors import ArgumentError
from .events import Event, Reported
from .messages import Content, ContentType, Message
from .values import StoredEvent, when

log = logging.getLogger(__name__)

KINDS: dict[str, type[Reported]] = {kind.kind: kind for kind in get_args(Event) if kind.kind}
"""What a run publishes, by name, each the event class that declares it (``events.Reported``): its ``data``
and whether it points at a message. docs/runs/events.md lists them."""
ENDS = frozenset({"finished", "failed"})
"""The last event of a run; a session's log goes on with its next run."""

MAX_READ = 1000
"""The most events one ``events()`` call returns."""
MAX_SEQ = 2**63 - 1
"""The largest seq: every store keeps seqs as signed 64-bit integers (BIGINT, SQLite INTEGER, BSON int64)."""
WAKE_SECONDS = 5.0
"""The longest ``follow`` waits in a store's ``wait_for_events`` before it reads again anyway."""


def encode(kind: str, data: Mapping[str, Any], at: float | None = None) -> str:
    """An event's stored text: compact JSON the store keeps verbatim. ASCII-only, as a stored message is, so
    whatever str a tool gives (a lone surrogate from ``os.listdir``) is an escape, not a driver's failure."""
    return json.dumps({"kind": kind, "at": time.time() if at is None else at, "data": data},
                      separators=(",", ":"))


def decode(seq: int, text: str) -> StoredEvent:
    """The event stored as ``text`` under ``seq``: what a store's ``events`` returns."""
    raw = json.loads(text)
    return StoredEvent(seq, raw["kind"], when(raw["at"]), raw["data"])


def digest(message: Message) -> str:
    """What a pointer checks its message by: a 128-bit BLAKE2b of its stored JSON, as hex."""
    return hashlib.blake2b(message.to_json().encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def pointer(index: int, digested: str, call: str = "") -> dict[str, Any]:
    """An event's ``ref``: the message's ``index`` and ``digest``, and ``id``, the call of it an event is about."""
    return {"index": index, "digest": digested, "id": call} if call else {"index": index, "digest": digested}


def record(event: Reported, at: float | None = None, ref: Mapping[str, Any] | None = None) -> str:
    """``event``'s stored text: its ``data()``, messages as ``part`` writes them, floats to the microsecond;
    with ``ref`` (a ``pointer``), that in place of the field the event ``points`` at."""
    data: dict[str, Any] = {}
    for name, value in event.data().items():
        if ref is not None and name == event.points:
            data["ref"] = ref
        elif isinstance(value, (Message, Content)):
            data[name] = part(value)
        elif isinstance(value, float):
            data[name] = round(value, 6)
        else:
            data[name] = value
    return encode(event.kind, data, at)


def part(item: Message | Content) -> dict[str, Any]:
    """What an event carries of ``item``: a message's ``to_dict()``; a tool call's ``{id, name, arguments}``;
    a tool result's ``{text, is_error}``."""
    if isinstance(item, Message):
        return item.to_dict()
    if item.type is ContentType.TOOL_CALL:
        return {"id": item.id, "name": item.name, "arguments": item.arguments}
    return {"text": item.text, "is_error": item.is_error}


# -- the checks every EventStore makes -------------------------------------------------------------------


def check_append(events: object, keep: object) -> list[str]:
    if isinstance(events, str) or not isinstance(events, Sequence) or not events:
        raise ArgumentError("append_events(events=) must be a non-empty sequence of str")
    for i, text in enumerate(events):
        if not isinstance(text, str):
            raise ArgumentError(f"each event must be a str (its JSON text), got {type(text).__name__}")
        if "\x1e" in text:
            raise ArgumentError(f"events[{i}] holds a raw U+001E, which no JSON text does (a control character is "
                                "escaped inside a string and not allowed outside one); SQL stores separate a "
                                "write's events by it")
    check_keep(keep)
    return list(events)


def check_keep(keep: object) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ArgumentError(f"keep= must be an int >= 1, got {keep!r}")
    return keep


def check_read(after: object, limit: object) -> tuple[int, int]:
    """Checked before any query: an ``after`` above ``MAX_SEQ`` would overflow the store's driver (SQLite's
    OverflowError, PostgreSQL's out-of-range error) rather than find nothing."""
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= MAX_SEQ:
        raise ArgumentError(f"events(after=) must be an int from 0 to {MAX_SEQ} (a seq), got {_shown(after)}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_READ:
        raise ArgumentError(f"events(limit=) must be an int from 1 to {MAX_READ}, got {limit!r}")
    return after, limit


def _shown(value: object) -> str:
    """``value`` for an error message: an int too long to print (``repr`` refuses 4,300 digits) by its size."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


# -- joining the events that point at a message ---------------------------------------------------------

POINTING = {name: kind.points for name, kind in KINDS.items() if kind.points}
"""The kinds whose ``data`` may hold a ``ref`` where the field named here goes, and that field."""
GONE = "gone"
"""``unresolved`` reason: the transcript no longer reaches the message (deleted, pruned, cut short)."""
REPLACED = "replaced"
"""``unresolved`` reason: another message stands where the event's was (the transcript was replaced)."""


def resolve(store: EventStore, session: str, events: list[StoredEvent]) -> list[StoredEvent]:
    """``events`` with each pointer joined: the message (or its call, its result) read where its ``ref``
    says and checked against its digest; one that cannot be joined gets ``None`` and ``unresolved: {index,
    reason}``. The messages are read after the events, from the end (``info`` and ``tail``); should a digest
    not match there (the transcript changed between the two reads), the whole transcript, read once, decides."""
    refs = {e.seq: ref for e in events if e.kind in POINTING and (ref := _ref(e.data)) is not None}
    if not refs:
        return events
    wanted = {ref[:2] for ref in refs.values()}
    found = _tail(store, session, min(index for index, _ in wanted))
    good = {ref for ref in wanted if _matches(found.get(ref[0]), ref[1])}
    if good != wanted:
        found = dict(enumerate(store.messages(session)))
        good = {ref for ref in wanted if _matches(found.get(ref[0]), ref[1])}
    return [e if (ref := refs.get(e.seq)) is None else _joined(e, ref, found.get(ref[0]), ref[:2] in good)
            for e in events]


def _ref(data: Mapping[str, Any]) -> tuple[int, str, str] | None:
    """The event's pointer: (index, digest, the call's id or "")."""
    ref = data.get("ref")
    if not isinstance(ref, Mapping):
        return None
    index, want, call = ref.get("index"), ref.get("digest"), ref.get("id", "")
    if (isinstance(index, bool) or not isinstance(index, int) or index < 0 or not isinstance(want, str)
            or not isinstance(call, str)):
        return None
    return index, want, call


def _tail(store: EventStore, session: str, lowest: int) -> dict[int, Message]:
    """The messages from ``lowest`` on, by their place, as far as two reads (not one atomic step) can say."""
    info = store.info(session)
    if info is None or info.messages <= lowest:
        return {}
    tail = store.tail(session, info.messages - lowest)
    return {lowest + i: m for i, m in enumerate(tail)} if len(tail) == info.messages - lowest else {}


def _matches(message: Message | None, want: str) -> bool:
    """Its stored JSON as the pointer's digest says; for a store that does not keep a message's text verbatim,
    its JSON as this library writes it."""
    if message is None:
        return False
    return digest(message) == want or digest(Message(message.role, message.content, key=message.key)) == want


def _joined(event: StoredEvent, ref: tuple[int, str, str], message: Message | None, good: bool) -> StoredEvent:
    field = POINTING[event.kind]
    value: dict[str, Any] | None = None
    if message is not None and good:
        item: Message | Content | None = message
        if field == "call":
            item = next((c for c in message.tool_calls if c.id == ref[2]), None)
        elif field == "result":
            item = next((c for c in message.content if c.type is ContentType.TOOL_RESULT and c.tool_call_id == ref[2]),
                        None)
        value = None if item is None else part(item)
    data = {(field if k == "ref" else k): (value if k == "ref" else v) for k, v in event.data.items()}
    if value is None:
        data["unresolved"] = {"index": ref[0], "reason": GONE if message is None else REPLACED}
    return StoredEvent(event.seq, event.kind, event.at, data)


# -- reading as they arrive ------------------------------------------------------------------------------


def follow(store: EventStore, session: str, after: int = 0, timeout: float | None = None,
           poll: tuple[float, float] = (0.02, 0.5), limit: int = 100) -> Iterator[StoredEvent]:
    """Yield the session's events above ``after`` as they arrive, until ``timeout`` seconds have passed
    (``None``: until the caller stops; a session has many runs, so ``finished`` does not end it). Between
    reads it waits in the store's ``wait_for_events`` (``WAKE_SECONDS`` at most) or sleeps ``poll[0]``
    seconds doubling up to ``poll[1]``. The arguments are checked at the call, not at the first event."""
    after, limit = check_read(after, limit)
    first, most = _poll(poll)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 <= timeout < math.inf):
        raise ArgumentError(f"follow(timeout=) must be None or finite seconds >= 0, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    return _following(store, session, after, limit, deadline, first, most)


def _following(store: EventStore, session: str, after: int, limit: int, deadline: float | None, first: float,
               most: float) -> Iterator[StoredEvent]:
    waiter = store if isinstance(store, EventWaiter) else None
    pause = first
    while True:
        batch = resolve(store, session, store.events(session, after, limit))
        for event in batch:
            yield event
            after = event.seq
        if len(batch) == limit:
            continue  # more waiting: read on at once
        if batch:
            pause = first
        left = math.inf if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return
        if waiter is not None:
            waiter.wait_for_events(session, after, min(left, WAKE_SECONDS))
        else:
            time.sleep(min(pause, left))
            pause = min(pause * 2, most)


def _poll(poll: object) -> tuple[float, float]:
    if (isinstance(poll, tuple) and len(poll) == 2
            and all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in poll)
            and 0 < poll[0] <= poll[1] < math.inf):
        return float(poll[0]), float(poll[1])
    raise ArgumentError(f"follow(poll=) must be (first, most) seconds with 0 < first <= most, got {poll!r}")


# -- as server-sent events (text/event-stream) ------------------------------------------------------------

SSE_RETRY_MS = 500
"""What a stream's ``retry:`` tells the browser: come back this soon after the stream ends, for what follows."""


def sse_after(last_event_id: str | None, after: str | None) -> int:
    """Where a stream starts: the ``Last-Event-ID`` header (a reconnecting ``EventSource``'s) or else
    ``?after=``, each a ``seq``; 0 without either. Anything else is an ``ArgumentError`` before the stream
    starts, so a web front can answer 400."""
    seen = last_event_id or after or "0"
    # isdigit alone accepts "²" and other non-ASCII digits; the length is checked before int(), which refuses
    # more than 4,300 digits with a ValueError, and a seq has at most 19 (MAX_SEQ), leading zeros aside.
    digits = seen.lstrip("0") or "0"
    if not (seen.isascii() and seen.isdigit()) or len(digits) > len(str(MAX_SEQ)) or int(digits) > MAX_SEQ:
        shown = seen if len(seen) <= 40 else f"{seen[:20]}... ({len(seen)} characters)"
        raise ArgumentError(f"Last-Event-ID and ?after= must be an event's seq, from 0 to {MAX_SEQ}, got {shown!r}")
    return int(digits)


def sse_event(event: StoredEvent) -> str:
    """One event as a ``text/event-stream`` block: ``id: <seq>``, ``event: <kind>``, ``data: <to_dict JSON>``.
    The JSON is one line (``json.dumps`` escapes newlines), as the format needs."""
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {json.dumps(event.to_dict())}\n\n"


def sse_stream(following: Iterable[StoredEvent], retry_ms: int = SSE_RETRY_MS) -> Iterator[str]:
    """The body of a ``text/event-stream`` response over ``following`` (a ``session.follow(...)``):
    ``retry:``, then each event, ending after a ``finished`` or ``failed`` one; the browser reconnects with
    the last id and follows the session's next run, on any replica."""
    yield f"retry: {retry_ms}\n\n"
    for event in following:
        yield sse_event(event)
        if event.kind in ENDS:
            return
