"""What a store process last knew of each session, shared by the SQL and MongoDB stores.

A store that remembers the transcript it last wrote or read, with the version token that went with it,
can turn a save that only adds messages into an append. Driver-free, so any store may use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from agent_sessions import Message, validate


class Known:
    """A bounded LRU of session -> (version, transcript), so a long-lived worker does not grow."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[str, tuple[Message, ...]]] = OrderedDict()

    def get(self, session: str) -> tuple[str, tuple[Message, ...]] | None:
        with self._lock:
            item = self._items.get(session)
            if item is not None:
                self._items.move_to_end(session)
            return item

    def put(self, session: str, version: str, msgs: tuple[Message, ...]) -> None:
        with self._lock:
            self._items[session] = (version, msgs)
            self._items.move_to_end(session)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def forget(self, session: str) -> None:
        with self._lock:
            self._items.pop(session, None)


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
