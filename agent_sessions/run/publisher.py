"""Publishing a run's events to its session's log (``Spec(publish_events=True)``; ``eventlog`` has the log).

With ``publish_events=False`` (the default) none of this module runs: no object is built, nothing written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, ClassVar, Literal

from ..eventlog import POINTING, digest, encode, encode_flat, part, pointer
from ..events import Sink
from ..messages import Content, Message
from ..result import Result

log = logging.getLogger(__name__)

TEXT_CHARS = 4096
TEXT_SECONDS = 0.1
"""Model text is published in batches: a ``text`` event once this much has arrived, or this long after its
first piece (checked as pieces arrive), whichever comes first; the rest with the reply."""
FLUSH_SECONDS = 0.1
WATCHER_JOIN = 5.0
"""Buffered events older than this are appended with the next event (a slow tool's call with its end)."""
LOOKBACK = 64
"""How far from the end of a save's messages a pointing event's message is looked for; beyond it (it never
is, in a run) the event is written whole."""


class Pointing:
    """An event about a message (``eventlog.POINTING``: the model's reply, a call of it, a result) not yet
    written: in a write that stores the message it points at it (``eventlog.pointer``), in any other it
    carries it whole (``eventlog.part``), as ``render`` decides. The publisher makes one of the subclasses
    below, each writing its kind's text by a template of its own (``text``); its fields are slots, not a
    dict, as one is made for each reply, call and result of a run."""

    __slots__ = ("at", "step", "target")
    kind: ClassVar[str]
    target: Message | Content
    step: int
    at: float

    def render(self, msgs: Sequence[Message] | None, digests: dict[int, str], start: int = 0) -> str:
        """The event's text for a write that stores ``msgs`` (``None``: no message), the transcript from index
        ``start`` on; ``digests`` those of the messages pointed at in this write so far, by place."""
        target = self.target
        if msgs is not None:
            index = _place(target, msgs)
            if index is not None:
                digested = digests.get(index)
                if digested is None:
                    digested = digests[index] = digest(msgs[index])
                call = "" if isinstance(target, Message) else target.id or target.tool_call_id
                return self.text(pointer(start + index, digested, call))
        return encode(self.kind, self.data(part(target)), self.at)

    def data(self, whole: dict[str, Any]) -> dict[str, Any]:
        """The event's data carrying its message (or call, or result) ``whole`` (``eventlog.POINTING``'s
        field), for a write that does not store it."""
        raise NotImplementedError

    def text(self, ref: str) -> str:
        """``eventlog.encode(kind, data, at)`` with ``data["ref"]`` the ``pointer`` text ``ref``, the same text,
        written by the kind's own template: a step writes three of these on the run's path, where
        ``json.dumps`` cost three times the text and a general writer (a loop over ``data``) twice."""
        raise NotImplementedError


class _Replied(Pointing):
    """``model_response``: ``{step, ref, seconds}``."""

    __slots__ = ("seconds",)
    kind = "model_response"

    def __init__(self, step: int, message: Message, seconds: float) -> None:
        self.step, self.target, self.seconds, self.at = step, message, seconds, time.time()

    def data(self, whole: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.step, POINTING[self.kind]: whole, "seconds": self.seconds}

    def text(self, ref: str) -> str:
        return (f'{{"kind":"model_response","at":{self.at!r},"data":{{"step":{self.step!r},"ref":{ref},'
                f'"seconds":{self.seconds!r}}}}}')


class _Called(Pointing):
    """``tool_called``: ``{step, ref}``."""

    __slots__ = ()
    kind = "tool_called"

    def __init__(self, step: int, call: Content) -> None:
        self.step, self.target, self.at = step, call, time.time()

    def data(self, whole: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.step, POINTING[self.kind]: whole}

    def text(self, ref: str) -> str:
        return f'{{"kind":"tool_called","at":{self.at!r},"data":{{"step":{self.step!r},"ref":{ref}}}}}'


class _Finished(Pointing):
    """``tool_finished``: ``{step, call_id, name, ref, seconds}``."""

    __slots__ = ("call", "seconds")
    kind = "tool_finished"

    def __init__(self, step: int, call: Content, result: Content, seconds: float) -> None:
        self.step, self.call, self.target, self.seconds, self.at = step, call, result, seconds, time.time()

    def data(self, whole: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.step, "call_id": self.call.id, "name": self.call.name, POINTING[self.kind]: whole,
                "seconds": self.seconds}

    def text(self, ref: str) -> str:
        call = self.call
        return (f'{{"kind":"tool_finished","at":{self.at!r},"data":{{"step":{self.step!r},'
                f'"call_id":{encode_basestring_ascii(call.id)},"name":{encode_basestring_ascii(call.name)},'
                f'"ref":{ref},"seconds":{self.seconds!r}}}}}')


def _place(target: Message | Content, msgs: Sequence[Message]) -> int | None:
    """Where ``target`` is among the last ``LOOKBACK`` of ``msgs`` (by identity: the very object the loop
    reported, which the transcript holds), or ``None``. Plain loops, from the end, where it is found at
    once: this runs for each of a step's events about a message."""
    stop = max(len(msgs) - 1 - LOOKBACK, -1)
    if isinstance(target, Message):
        for index in range(len(msgs) - 1, stop, -1):
            if msgs[index] is target:
                return index
        return None
    for index in range(len(msgs) - 1, stop, -1):
        for content in msgs[index].content:
            if content is target:
                return index
    return None


class Publisher(Sink):
    """The sink of a run with ``publish_events``: each event goes to the run's own sink (the user's
    callback, or ``SILENT``) and into a buffer the log gets.

    The buffer goes to the store: with the save before each model request and the final save (riding in
    them, ``Leased`` takes it under ``lock``), and on its own (``append``) when the run is about to wait on
    something the follower should see first: the model request, if events came after the save (steers it
    took); a batch of model text (``TEXT_CHARS`` / ``TEXT_SECONDS``); and, from a watcher thread (``start``),
    whatever has waited ``FLUSH_SECONDS``: a tool that takes its time is seen being called while it runs,
    and the usual quick tool's events ride in the next save, at no write of their own.

    The events about a message (``Pointing``) stay objects in the buffer until a write takes them
    (``take``): one riding in the save that stores their message points at it, any other carries it whole
    (``render``); a write that fails puts the objects back (``restore``), to be rendered for the next."""

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
        self.buffer: list[str | Pointing] = []
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

    def take(self) -> list[str | Pointing]:
        """Everything buffered, the text batch closed: what rides in a save (``render`` it for the save's
        messages; ``restore`` it if the save fails). The caller holds ``lock`` until the save is done."""
        with self.lock:
            if self.text:
                self._close_text()
            out, self.buffer = self.buffer, []
            return out

    @staticmethod
    def render(records: Sequence[str | Pointing], msgs: Sequence[Message] | None = None, start: int = 0) -> list[str]:
        """The texts of ``records`` for a write storing ``msgs`` (the transcript from index ``start`` on): an
        event whose message is among them points at it, any other carries its message whole (so does every
        event of a write storing none)."""
        digests: dict[int, str] = {}
        return [r if isinstance(r, str) else r.render(msgs, digests, start) for r in records]

    def restore(self, records: Sequence[str | Pointing]) -> None:
        """Put back what a write that failed had taken, ahead of what came since."""
        with self.lock:
            self.buffer[:0] = records

    def flush(self) -> None:
        with self.lock:
            records = self.take()
            if records:
                try:
                    self.append(self.render(records))
                except BaseException:
                    self.restore(records)
                    raise

    def add(self, kind: str, data: Mapping[str, Any]) -> str:
        record = encode_flat(kind, data)
        self.add_record(record)
        return record

    def add_record(self, record: str | Pointing) -> None:
        with self.lock:
            if self.text:
                self._close_text()
            self._add(record)

    def _add(self, record: str | Pointing) -> None:
        now = time.monotonic()
        if not self.buffer:
            self.oldest = now
        self.buffer.append(record)
        if now - self.oldest >= FLUSH_SECONDS:
            self.flush()

    def _close_text(self) -> None:
        """The model text so far as one ``text`` event (the callers check that there is any)."""
        text, self.text, self.text_chars = "".join(self.text), [], 0
        self._add(encode_flat("text", {"step": self.text_step, "text": text}, self.text_at))

    def finishing(self, result: Result) -> str:
        """The run returns ``result``: its ``finished`` event (returned), which rides in the final save."""
        return self.add("finished", {
            "stop_reason": result.stop_reason, "steps": result.steps, "text": result.text,
            "usage": dict(result.usage), "pending_approvals": [p.call_id for p in result.pending_approvals],
        })

    def failing(self, error: BaseException) -> None:
        """Best effort, before the lease is released: a run whose lease was lost cannot write it. (The add
        may flush too, when what a failed write put back is old enough: that failure is as harmless.)"""
        try:
            self.add("failed", {"type": f"{type(error).__module__}.{type(error).__qualname__}",
                                "message": str(error)})
            self.flush()
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one that propagates
            log.warning("the failed event could not be published (%s: %s)", type(exc).__name__, exc)

    # The Sink

    def step_started(self, step: int) -> None:
        self.inner.step_started(step)
        # ``encode_flat("step_started", {"step": step})``, the same text: one on every step's path
        self.add_record(f'{{"kind":"step_started","at":{time.time()!r},"data":{{"step":{int(step)!r}}}}}')

    def steer_applied(self, step: int, text: str, index: int, source: Literal["run", "session"]) -> None:
        self.inner.steer_applied(step, text, index, source)
        self.add("steer_applied", {"step": step, "text": text, "index": index, "source": source})

    def saved(self, step: int, messages: int) -> None:
        self.inner.saved(step, messages)

    def compacted(self, step: int, start: int, end: int, index: int, before: int, after: int) -> None:
        self.inner.compacted(step, start, end, index, before, after)
        self.add("compacted", {"step": step, "start": start, "end": end, "index": index, "tokens_before": before,
                               "tokens_after": after})

    def model_request(self, step: int, messages: int) -> float:
        self.inner.model_request(step, messages)
        if self.buffer or self.text:  # (usually empty: the save before the request took them)
            self.flush()  # a follower sees what led to the request while the model thinks
        return time.perf_counter()

    def model_response(self, step: int, message: Message, started: float) -> None:
        self.inner.model_response(step, message, started)
        seconds = round(time.perf_counter() - started, 6)
        self.add_record(_Replied(step, message, seconds))

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
        self.add_record(_Called(step, call))
        return time.perf_counter()

    def tool_finished(self, step: int, call: Content, result: Content, seconds: float) -> None:
        self.inner.tool_finished(step, call, result, seconds)
        self.add_record(_Finished(step, call, result, round(seconds, 6)))

    def approval_requested(self, step: int, call: Content) -> None:
        self.inner.approval_requested(step, call)
        self.add("approval_requested", {"step": step, "call": part(call)})

    def approval_decided(self, step: int, call: Content, approved: bool, reason: str, by: str) -> None:
        self.inner.approval_decided(step, call, approved, reason, by)
        self.add("approval_decided", {"step": step, "call": part(call), "approved": approved, "reason": reason,
                                      "by": by})

    def finished(self, result: Result) -> None:
        self.inner.finished(result)  # the log's own was written with the final save (``finishing``)

    def failed(self, error: BaseException) -> None:
        self.inner.failed(error)  # the log's own was written before the lease went (``failing``)
