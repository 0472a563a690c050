"""A session's durable event log: what its runs did, readable and followable from any process.

A run with ``Spec(publish_events=True)`` writes its events (step started, steers applied, the model's text
and replies, tool calls, approvals, finished or failed) to the session's store, through ``EventStore``, the
optional store protocol of ``contract``. A browser connected to replica B can then show a run
going on on replica A: ``session.follow(after=seq)`` yields the events as they arrive, and a follower that
comes back with the last sequence number it saw misses nothing and sees nothing twice.

**Sequence numbers.** The store gives each event of a session the next number, atomically with the write
that stores it: within a log they are consecutive and only grow. A log starts at a number taken from the
store's clock, in microseconds (``first_seq``), not at 1: so a session deleted and made again starts
above every number its old log used, and a follower keeping its ``after`` across the delete carries on
without seeing anything twice. A gap in the numbers a follower reads means it missed events: the cap
dropped them (it was more than ``Spec.events_kept`` behind), or the session was deleted meanwhile.

**Writes.** Every append is fenced by the run's lease, as every write of a leased run is: a run that lost
its lease writes no event. Events ride in the writes a step makes anyway where they can (the save before
each model request, the final save: ``EventStore.save_fenced_events``); otherwise the run's ``Publisher``
(``run.publisher``) appends them on its own, at a few points, and model text in batches, never a write per
token. This module is the log's format, its checks, reading and following it, and serving it as
server-sent events.

With ``publish_events=False`` (the default) none of this module runs: no object is built, nothing written.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from .contract import EventStore, EventWaiter
from .errors import ArgumentError
from .values import StoredEvent, when

log = logging.getLogger(__name__)

KINDS = (
    "step_started", "steer_applied", "text", "model_response", "tool_called", "tool_finished",
    "approval_requested", "approval_decided", "finished", "failed",
)
"""What a run publishes, each with its own ``data`` (docs/runs/events.md lists them)."""
ENDS = frozenset({"finished", "failed"})
"""The last event of a run; a session's log goes on with its next run."""

MAX_READ = 1000
"""The most events one ``events()`` call returns."""
MAX_SEQ = 2**63 - 1
"""The largest seq: every store keeps seqs as signed 64-bit integers (BIGINT, SQLite INTEGER, BSON int64)."""
WAKE_SECONDS = 5.0
"""The longest ``follow`` waits in a store's ``wait_for_events`` before it reads again anyway."""


def encode(kind: str, data: Mapping[str, Any], at: float | None = None) -> str:
    """An event's stored text: compact JSON the store keeps verbatim (it never parses it). ASCII-only, as a
    stored message is (``Message.to_json``): one encoding for everything stored, so whatever str a tool or a
    person gives (a lone surrogate from ``os.listdir``, say) is an escape, not a failure inside a driver."""
    return json.dumps({"kind": kind, "at": time.time() if at is None else at, "data": data},
                      separators=(",", ":"))


def decode(seq: int, text: str) -> StoredEvent:
    """The event stored as ``text`` under ``seq``: what a store's ``events`` returns."""
    raw = json.loads(text)
    return StoredEvent(seq, raw["kind"], when(raw["at"]), raw["data"])


def first_seq(now: float) -> int:
    """The first number of a new log, from the store's clock ``now`` (seconds): see the module docstring."""
    return int(now * 1_000_000)


# -- the checks every EventStore makes -------------------------------------------------------------------


def check_append(events: object, keep: object) -> list[str]:
    if isinstance(events, str) or not isinstance(events, Sequence) or not events:
        raise ArgumentError("append_events(events=) must be a non-empty sequence of str")
    for text in events:
        if not isinstance(text, str):
            raise ArgumentError(f"each event must be a str (its JSON text), got {type(text).__name__}")
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


# -- reading as they arrive ------------------------------------------------------------------------------


def follow(store: EventStore, session: str, after: int = 0, timeout: float | None = None,
           poll: tuple[float, float] = (0.02, 0.5), limit: int = 100) -> Iterator[StoredEvent]:
    """Yield the session's events above ``after`` as they arrive, until ``timeout`` seconds have passed
    (``None``: until the caller stops iterating). A session has many runs, so a ``finished`` event does not
    end it. Between reads it waits in the store's ``wait_for_events`` (at most ``WAKE_SECONDS`` at a time)
    or, without one, sleeps ``poll[0]`` seconds doubling up to ``poll[1]``, back to ``poll[0]`` after each
    event. Every wait is bounded by what is left of ``timeout``. The arguments are checked here, at the
    call, not at the first event."""
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
        batch = store.events(session, after, limit)
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
    """Where a stream starts: the ``Last-Event-ID`` header (what a reconnecting ``EventSource`` sends) or
    else the ``?after=`` parameter, each a ``seq`` (ASCII digits, at most ``MAX_SEQ``); 0 (the whole log)
    without either. Anything else is an ``ArgumentError``, raised before the stream starts so that a web
    front can answer 400."""
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
    """The body of a ``text/event-stream`` response over ``following`` (a ``session.follow(...)``, bounded by
    its ``timeout``): ``retry:`` first, then each event, ending after a ``finished`` or ``failed`` one. The
    browser then reconnects with that event's id and follows the session's next run, on any replica; a
    stream that ends because ``following`` did (its timeout) is picked up the same way."""
    yield f"retry: {retry_ms}\n\n"
    for event in following:
        yield sse_event(event)
        if event.kind in ENDS:
            return
