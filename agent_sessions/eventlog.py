"""A session's durable event log: what its runs did, readable and followable from any process.

A run with ``Spec(publish_events=True)`` writes its events (step started, steers applied, the model's text
and replies, tool calls, approvals, finished or failed) to the session's store, through ``EventStore``, the
fourth store protocol, optional like ``ApprovalStore``. A browser connected to replica B can then show a run
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
each model request, the final save: ``EventStore.save_fenced_events``); otherwise the ``Publisher`` appends
them on its own, at a few points (see its docstring), and model text in batches, never a write per token.

With ``publish_events=False`` (the default) none of this module runs: no object is built, nothing written.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from .errors import ArgumentError
from .events import Sink
from .lease import Holder
from .lifecycle import when
from .messages import Content, Message
from .session import RunStore, Saved

if TYPE_CHECKING:
    from .runner import Result

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
TEXT_CHARS = 4096
TEXT_SECONDS = 0.1
"""Model text is published in batches: a ``text`` event once this much has arrived, or this long after its
first piece (checked as pieces arrive), whichever comes first; the rest with the reply."""
FLUSH_SECONDS = 0.1
WATCHER_JOIN = 5.0
"""Buffered events older than this are appended with the next event (a slow tool's call with its end)."""
WAKE_SECONDS = 5.0
"""The longest ``follow`` waits in a store's ``wait_for_events`` before it reads again anyway."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as its log holds it: ``seq`` given by the store, ``at`` when the run reported it (its
    host's clock, an aware UTC datetime), ``data`` the kind's JSON object (docs/runs/events.md)."""

    seq: int
    kind: str
    at: datetime
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form: what the SSE route sends as ``data``."""
        return {"seq": self.seq, "kind": self.kind, "at": self.at.isoformat(), "data": dict(self.data)}


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


@runtime_checkable
class EventStore(RunStore, Protocol):
    """A RunStore that keeps a log of events per session. Each method is one atomic step.

    Retention: a session's ``delete`` (and ``prune``) removes its log with it; ``keep`` bounds it."""

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        """Append ``events`` (non-empty; each an ``encode``d text, stored verbatim) to the session's log,
        fenced by ``holder`` (``LeaseLost`` otherwise, writing nothing), giving them the next consecutive
        numbers (``first_seq`` of the store's clock for a log that has none yet); drop the oldest events
        beyond the newest ``keep``, in the same step. Returns the last number given."""

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int,
    ) -> Saved:
        """``save_fenced`` and ``append_events`` in one atomic step (the events may be empty): how a step's
        events ride in the save it makes anyway. The events are appended even when the save has nothing to
        write; a ``TranscriptConflict`` or ``LeaseLost`` writes neither."""

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        """The session's events numbered above ``after``, oldest first, at most ``limit`` (``decode``)."""


@runtime_checkable
class EventWaiter(Protocol):
    """What a store offers so followers wake when an event is appended rather than poll (PostgreSQL:
    LISTEN/NOTIFY). Optional: ``follow`` polls with backoff without it."""

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        """Return once the session may have an event numbered above ``after`` (``True``), or after
        ``timeout`` seconds (``False``). Waking without one is allowed: the follower reads again."""


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


# -- publishing a run's events ---------------------------------------------------------------------------


class Publisher(Sink):
    """The sink of a run with ``publish_events``: each event goes to the run's own sink (the user's
    callback, or ``SILENT``) and into a buffer the log gets.

    The buffer goes to the store: with the save before each model request and the final save (riding in
    them, ``Leased`` drains it under ``lock``), and on its own (``append``) when the run is about to wait on
    something the follower should see first: the model request, if events came after the save (steers it
    took); a batch of model text (``TEXT_CHARS`` / ``TEXT_SECONDS``); and, from a watcher thread (``start``),
    whatever has waited ``FLUSH_SECONDS``: a tool that takes its time is seen being called while it runs,
    and the usual quick tool's events ride in the next save, at no write of their own."""

    __slots__ = (
        "append",
        "buffer",
        "inner",
        "lock",
        "oldest",
        "stopping",
        "text",
        "text_at",
        "text_chars",
        "text_started",
        "text_step",
        "watcher",
    )

    def __init__(self, inner: Sink, append: Callable[[list[str]], object]) -> None:
        self.inner = inner
        self.append = append
        self.buffer: list[str] = []
        self.oldest = 0.0
        self.text: list[str] = []
        self.text_chars = 0
        self.text_step = 0
        self.text_at = 0.0
        self.text_started = 0.0
        self.lock = threading.RLock()
        """Held over every change to the buffer and over each write that drains it, so events reach the
        store in the order they happened, whichever thread writes them."""
        self.stopping = threading.Event()
        self.watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start the watcher that writes events left waiting ``FLUSH_SECONDS`` (a slow tool's)."""
        self.watcher = threading.Thread(target=self._watch, name="agent-events", daemon=True)
        self.watcher.start()

    def close(self) -> None:
        """Stop the watcher; bounded, like every join of the library."""
        self.stopping.set()
        if self.watcher is not None:
            self.watcher.join(WATCHER_JOIN)
            if self.watcher.is_alive():
                log.warning("the event watcher did not stop within %s s (a store write hangs?)", WATCHER_JOIN)

    def _watch(self) -> None:
        while not self.stopping.wait(FLUSH_SECONDS):
            with self.lock:
                if (self.buffer or self.text) and time.monotonic() - self.oldest >= FLUSH_SECONDS:
                    try:
                        self.flush()
                    except Exception as exc:  # noqa: BLE001 - the run's own next write says what is wrong
                        log.warning("the run's events could not be written yet (%s: %s); they ride in its next "
                                    "save", type(exc).__name__, exc)

    # What the store gets

    def drain(self) -> list[str]:
        """Everything buffered, the text batch closed: what rides in a save (``restore`` if it fails).
        The caller holds ``lock`` until the save is done."""
        with self.lock:
            self._close_text()
            out, self.buffer = self.buffer, []
            return out

    def restore(self, records: list[str]) -> None:
        """Put back what a write that failed had drained, ahead of what came since."""
        with self.lock:
            self.buffer[:0] = records

    def flush(self) -> None:
        with self.lock:
            records = self.drain()
            if records:
                try:
                    self.append(records)
                except BaseException:
                    self.restore(records)
                    raise

    def add(self, kind: str, data: Mapping[str, Any]) -> str:
        return self.add_record(encode(kind, data))

    def add_record(self, record: str) -> str:
        with self.lock:
            self._close_text()
            self._add(record)
        return record

    def _add(self, record: str) -> None:
        now = time.monotonic()
        if not self.buffer:
            self.oldest = now
        self.buffer.append(record)
        if now - self.oldest >= FLUSH_SECONDS:
            self.flush()

    def _close_text(self) -> None:
        if self.text:
            text, self.text, self.text_chars = "".join(self.text), [], 0
            self._add(encode("text", {"step": self.text_step, "text": text}, self.text_at))

    def finishing(self, result: Result) -> str:
        """The run returns ``result``: its ``finished`` event (returned), which rides in the final save."""
        return self.add("finished", {
            "stop_reason": result.stop_reason, "steps": result.steps, "text": result.text,
            "usage": dict(result.usage), "pending_approvals": [p.call_id for p in result.pending_approvals],
        })

    def failing(self, error: BaseException) -> None:
        """Best effort, before the lease is released: a run whose lease was lost cannot write it."""
        self.add("failed", {"type": f"{type(error).__module__}.{type(error).__qualname__}", "message": str(error)})
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one that propagates
            log.warning("the failed event could not be published (%s: %s)", type(exc).__name__, exc)

    # The Sink

    def step_started(self, step: int) -> None:
        self.inner.step_started(step)
        self.add("step_started", {"step": step})

    def steer_applied(self, step: int, text: str, index: int, source: Literal["run", "session"]) -> None:
        self.inner.steer_applied(step, text, index, source)
        self.add("steer_applied", {"step": step, "text": text, "index": index, "source": source})

    def saved(self, step: int, messages: int) -> None:
        self.inner.saved(step, messages)

    def model_request(self, step: int, messages: int) -> float:
        self.inner.model_request(step, messages)
        self.flush()  # a follower sees what led to the request while the model thinks
        return time.perf_counter()

    def model_response(self, step: int, message: Message, started: float) -> None:
        self.inner.model_response(step, message, started)
        seconds = round(time.perf_counter() - started, 6)
        # The message as the save stores it (to_json, cached there): the same value as to_dict, unencoded twice.
        self.add_record(f'{{"kind":"model_response","at":{time.time()!r},"data":{{"step":{step},'
                        f'"message":{message.to_json()},"seconds":{seconds!r}}}}}')

    def text_delta(self, step: int, text: str) -> None:
        self.inner.text_delta(step, text)
        now = time.monotonic()
        with self.lock:
            if not self.text:
                self.text_step, self.text_at, self.text_started = step, time.time(), now
                if not self.buffer:
                    self.oldest = now
            self.text.append(text)
            self.text_chars += len(text)
            if self.text_chars >= TEXT_CHARS or now - self.text_started >= TEXT_SECONDS:
                self.flush()

    def tool_called(self, step: int, call: Content) -> float:
        self.inner.tool_called(step, call)
        self.add("tool_called", {"step": step, "call": _call(call)})
        return time.perf_counter()

    def tool_finished(self, step: int, call: Content, result: Content, seconds: float) -> None:
        self.inner.tool_finished(step, call, result, seconds)
        self.add("tool_finished", {"step": step, "call_id": call.id, "name": call.name,
                                   "result": {"text": result.text, "is_error": result.is_error},
                                   "seconds": round(seconds, 6)})

    def approval_requested(self, step: int, call: Content) -> None:
        self.inner.approval_requested(step, call)
        self.add("approval_requested", {"step": step, "call": _call(call)})

    def approval_decided(self, step: int, call: Content, approved: bool, reason: str, by: str) -> None:
        self.inner.approval_decided(step, call, approved, reason, by)
        self.add("approval_decided", {"step": step, "call": _call(call), "approved": approved, "reason": reason,
                                      "by": by})

    def finished(self, result: Result) -> None:
        self.inner.finished(result)  # the log's own was written with the final save (``finishing``)

    def failed(self, error: BaseException) -> None:
        self.inner.failed(error)  # the log's own was written before the lease went (``failing``)


def _call(call: Content) -> dict[str, str]:
    return {"id": call.id, "name": call.name, "arguments": call.arguments}
