"""A store that lives as long as the process: for tests, scripts and single-process services."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from agent_sessions import Message, validate


class Store:
    """Thread-safe; one lock guards everything, since every operation is a few dict and deque steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transcripts: dict[str, tuple[Message, ...]] = {}
        self._steers: dict[str, deque[str]] = {}

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        items = validate.messages(msgs)
        with self._lock:
            self._transcripts[session] = items

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)
        with self._lock:
            return list(self._transcripts.get(session, ()))

    def add_steer(self, session: str, text: str) -> None:
        validate.session_id(session)
        validate.steer_text(text)
        with self._lock:
            self._steers.setdefault(session, deque()).append(text)

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        with self._lock:
            waiting = self._steers.pop(session, None)
        return list(waiting) if waiting else []

    def __repr__(self) -> str:
        return "memory.Store()"


__all__ = ["Store"]
