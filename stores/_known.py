"""What a store process last knew of each session, shared by the SQL and MongoDB stores.

A store that remembers the transcript it last wrote or read, with the version token that went with it,
can turn a save that only adds messages into an append. Driver-free, so any store may use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from agent_sessions import Message, validate

REMEMBER = 1024
"""Sessions a store remembers by default."""
REMEMBER_BYTES = 64 * 2**20
"""What those transcripts may hold by default, counted as their stored JSON (the objects take about
twice that). A transcript larger than this alone is not remembered: each of its saves then reads it."""


class Known:
    """An LRU of session -> (version, transcript), bounded by sessions and by bytes, so a long-lived
    worker that sees many long transcripts does not grow. A transcript may be known from an index on
    (``start``: what a ``TailStore`` save from there wrote), and is then known only to a save from there."""

    def __init__(self, size: int = REMEMBER, max_bytes: int = REMEMBER_BYTES) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[str, tuple[Message, ...], int, int]] = OrderedDict()

    def get(self, session: str, start: int = 0) -> tuple[str, tuple[Message, ...]] | None:
        """The version and the transcript from ``start`` on, if that is how the session is known."""
        with self._lock:
            item = self._items.get(session)
            if item is None or item[3] != start:
                return None
            self._items.move_to_end(session)
            return item[0], item[1]

    def covering(self, session: str, start: int) -> tuple[str, tuple[Message, ...], int] | None:
        """The version, the transcript known and the index it is known from, if that is at or before
        ``start`` and it reaches ``start``: a save from ``start`` extends it (MongoDB's, which keeps a
        transcript known from the first message of its document's tail)."""
        with self._lock:
            item = self._items.get(session)
            if item is None or not item[3] <= start <= item[3] + len(item[1]):
                return None
            self._items.move_to_end(session)
            return item[0], item[1], item[3]

    def put(self, session: str, version: str, msgs: tuple[Message, ...], after: tuple[Message, ...] = (),
            start: int = 0) -> None:
        """``after``: the transcript ``get`` returned, when ``msgs`` extends it (an append), so only the new
        messages are counted; without it, ``msgs`` is compared with what is known. ``start``: ``msgs`` is
        the transcript from that index on."""
        with self._lock:
            old = self._items.get(session)
            if old is not None and old[1] is after and old[3] == start:  # an append: count the new ones only
                weight = old[2]
                for i in range(len(after), len(msgs)):  # (every step comes here: no generator, no slice)
                    weight += len(msgs[i].to_json())
                if weight <= self.max_bytes:
                    self._items[session] = (version, msgs, weight, start)
                    self._items.move_to_end(session)
                    self.bytes += weight - old[2]
                    if self.bytes > self.max_bytes:  # as many sessions as before: only the bytes can be over
                        self._evict()
                    return
            old = self._items.pop(session, None)
            if old is not None:
                self.bytes -= old[2]
            extends = old is not None and old[3] == start and (old[1] is after or validate.is_extension(old[1], msgs))
            counted, weight = (len(old[1]), old[2]) if old is not None and extends else (0, 0)
            weight += sum(len(m.to_json()) for m in msgs[counted:])
            if weight > self.max_bytes:
                return
            self._items[session] = (version, msgs, weight, start)
            self.bytes += weight
            self._evict()

    def _evict(self) -> None:
        """The least recently used dropped while there are too many, or too many bytes (the lock held)."""
        while len(self._items) > self.size or self.bytes > self.max_bytes:
            _, (_, _, dropped, _) = self._items.popitem(last=False)
            self.bytes -= dropped

    def forget(self, session: str) -> None:
        with self._lock:
            old = self._items.pop(session, None)
            if old is not None:
                self.bytes -= old[2]


def common_prefix(known: tuple[Message, ...], msgs: tuple[Message, ...]) -> int:
    """How many leading messages the two transcripts share. The loop's saves pass the very objects it
    saved last time plus new ones, so one tuple comparison (in C) settles the usual case."""
    if validate.is_extension(known, msgs):
        return len(known)
    n = min(len(known), len(msgs))
    for i in range(n):
        a, b = known[i], msgs[i]
        if a is not b and a != b:
            return i
    return n
