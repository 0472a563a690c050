"""The in-memory steer box a Run owns: ``Run.steer`` puts, the loop drains before every request."""

from __future__ import annotations

import threading

from .. import validate
from ..errors import RunFinished


class SteerBox:
    __slots__ = ("_closed", "_items", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[str] = []
        self._closed = False

    def put(self, text: str) -> None:
        validate.steer_text(text, "Run.steer")
        with self._lock:
            if self._closed:
                raise RunFinished("the run has already returned; steer its session instead")
            self._items.append(text)

    def drain(self) -> list[str]:
        with self._lock:
            items, self._items = self._items, []
        return items

    def close(self) -> list[str]:
        """Stop taking steers and return those that never reached a request."""
        with self._lock:
            self._closed = True
        return self.drain()
