"""A store that lives as long as the process: for tests, scripts and single-process services."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from agent_sessions import ArgumentError, Holder, Message, SessionExists, validate


class Store:
    """Thread-safe; one lock guards everything, since every operation is a few dict and deque steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transcripts: dict[str, tuple[Message, ...]] = {}
        self._steers: dict[str, deque[str]] = {}
        self._journals: dict[str, str] = {}
        self._leases: dict[str, Holder] = {}

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        items = validate.messages(msgs, trusted=self._transcripts.get(session, ()))
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

    # -- RunStore --------------------------------------------------------------------------------------

    def save_with_steers(self, session: str, msgs: Sequence[Message]) -> list[str]:
        validate.session_id(session)
        items = validate.messages(msgs, trusted=self._transcripts.get(session, ()))
        with self._lock:
            waiting = self._steers.pop(session, None)
            taken = list(waiting) if waiting else []
            self._transcripts[session] = items + tuple(Message.user(t) for t in taken)
        return taken

    # -- -----------------------------------------------------------------------------------

    def fork(self, source: str, target: str, at: int | None) -> None:
        validate.session_id(source)
        validate.session_id(target)
        with self._lock:
            if source not in self._transcripts:
                raise ArgumentError(f"cannot fork session {source!r}: it has no transcript")
            msgs = self._transcripts[source]
            validate.fork_index(at, len(msgs), source)
            if target in self._transcripts:
                raise SessionExists(f"cannot fork {source!r} into {target!r}: {target!r} already has a transcript")
            self._transcripts[target] = msgs if at is None else msgs[:at]

    def journal(self, session: str) -> str | None:
        validate.session_id(session)
        with self._lock:
            return self._journals.get(session)

    def put_journal(self, session: str, journal: str | None) -> None:
        validate.session_id(session)
        with self._lock:
            if journal is None:
                self._journals.pop(session, None)
            else:
                self._journals[session] = journal

    def acquire(self, session: str, holder: Holder, now: float) -> Holder:
        validate.session_id(session)
        with self._lock:
            current = self._leases.get(session)
            if current is not None and current.token == holder.token:
                holder = replace(holder, cancelled=current.cancelled)
            elif current is not None and current.live(now):
                return current
            else:
                holder = replace(holder, cancelled=False)
            self._leases[session] = holder
            return holder

    def release(self, session: str, token: str) -> None:
        validate.session_id(session)
        with self._lock:
            current = self._leases.get(session)
            if current is not None and current.token == token:
                del self._leases[session]

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        with self._lock:
            return self._leases.get(session)

    def cancel(self, session: str, now: float) -> bool:
        validate.session_id(session)
        with self._lock:
            current = self._leases.get(session)
            if current is None or not current.live(now):
                return False
            self._leases[session] = replace(current, cancelled=True)
            return True

    def __repr__(self) -> str:
        return "memory.Store()"


__all__ = ["Store"]
