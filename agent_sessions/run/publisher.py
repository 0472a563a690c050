"""Publishing a run's events to its session's log (``Spec(publish_events=True)``; ``eventlog`` has the log).

With ``publish_events=False`` (the default) none of this module runs: no object is built, nothing written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ..eventlog import digest, pointer, record
from ..events import SILENT, Event, Events, Failed, Finished, ModelRequest, Reported, Sink, TextDelta
from ..messages import Content, Message
from ..result import Result

log = logging.getLogger(__name__)

TEXT_CHARS = 4096
TEXT_SECONDS = 0.1
"""Model text is published in batches: a ``text`` event once this much has arrived, or this long after its
first piece (checked as pieces arrive), whichever comes first; the rest with the reply."""
FLUSH_SECONDS = 0.1
"""Buffered events older than this are appended with the next event (a slow tool's call with its end)."""
WATCHER_JOIN = 5.0
LOOKBACK = 64
"""How far from the end of a save's messages a pointing event's message is looked for; beyond it (it never
is, in a run) the event is written whole."""


class Pointing:
    """An event about a message (its kind ``points`` at one: the model's reply, a call of it, a result) not
    yet written: in a write that stores the message it points at it (``eventlog.pointer``), in any other it
    carries it whole, as ``render`` decides."""

    __slots__ = ("at", "event")

    def __init__(self, event: Reported) -> None:
        self.event, self.at = event, time.time()

    def render(self, msgs: Sequence[Message] | None, digests: dict[int, str], start: int = 0) -> str:
        """The event's text for a write that stores ``msgs`` (``None``: no message), the transcript from index
        ``start`` on; ``digests`` those of the messages pointed at in this write so far, by place."""
        event = self.event
        target = event.data()[event.points]
        index = None if msgs is None else _place(target, msgs)
        if index is None:
            return record(event, self.at)
        assert msgs is not None
        digested = digests.get(index)
        if digested is None:
            digested = digests[index] = digest(msgs[index])
        call = "" if isinstance(target, Message) else target.id or target.tool_call_id
        return record(event, self.at, pointer(start + index, digested, call))


def _place(target: Message | Content, msgs: Sequence[Message]) -> int | None:
    """Where ``target`` is among the last ``LOOKBACK`` of ``msgs`` (by identity: the very object the loop
    reported), or ``None``. Plain loops from the end, where it is found at once."""
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
    """The sink of a run with ``publish_events``: each event goes to the run's own listener and into a buffer
    the log gets. The buffer rides in the run's saves, and goes on its own (``append``) when the run is about
    to wait on something a follower should see first: the model request, a batch of model text, and (from a
    watcher thread) whatever has waited ``FLUSH_SECONDS``, so a slow tool is seen being called while it runs
    and a quick tool's events ride in the next save. A write that fails puts what it took back
    (``restore``)."""

    __slots__ = (
        "append",
        "buffer",
        "listener",
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
        super().__init__(self._publish)
        self.listener: Events | None = None if inner is SILENT else inner.events
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
        event whose message is among them points at it, any other carries its message whole."""
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

    def add(self, entry: str | Pointing) -> None:
        with self.lock:
            if self.text:
                self._close_text()
            self._add(entry)

    def _add(self, entry: str | Pointing) -> None:
        now = time.monotonic()
        if not self.buffer:
            self.oldest = now
        self.buffer.append(entry)
        if now - self.oldest >= FLUSH_SECONDS:
            self.flush()

    def _close_text(self) -> None:
        """The model text so far as one ``text`` event (the callers check that there is any)."""
        text, self.text, self.text_chars = "".join(self.text), [], 0
        self._add(record(TextDelta(self.text_step, text), self.text_at))

    def finishing(self, result: Result) -> str:
        """The run returns ``result``: its ``finished`` event (returned), which rides in the final save."""
        finished = record(Finished(result))
        self.add(finished)
        return finished

    def failing(self, error: BaseException) -> None:
        """Best effort, before the lease is released: a run whose lease was lost cannot write it. (The add
        may flush too, when what a failed write put back is old enough: that failure is as harmless.)"""
        try:
            self.add(record(Failed(error)))
            self.flush()
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one that propagates
            log.warning("the failed event could not be published (%s: %s)", type(exc).__name__, exc)

    # What the Sink reports

    def _publish(self, event: Event) -> None:
        """Each event the loop reports: to the run's own listener, then to the log as its kind says
        (``Finished`` and ``Failed`` are written by ``finishing`` and ``failing``). A model request flushes
        what came after the save, so a follower sees it while the model thinks."""
        if self.listener is not None:
            self.listener(event)
        if isinstance(event, TextDelta):
            self._text_delta(event)
        elif isinstance(event, ModelRequest):
            if self.buffer or self.text:  # (usually empty: the save before the request took them)
                self.flush()
        elif event.kind and not isinstance(event, (Finished, Failed)):
            self.add(Pointing(event) if event.points else record(event))

    def _text_delta(self, event: TextDelta) -> None:
        now = time.monotonic()
        with self.lock:
            if not self.text:
                self.text_step, self.text_at, self.text_started = event.step, time.time(), now
                if not self.buffer:
                    self.oldest = now
            self.text.append(event.text)
            self.text_chars += len(event.text)
            if self.text_chars >= TEXT_CHARS or now - self.text_started >= TEXT_SECONDS:
                self.flush()
