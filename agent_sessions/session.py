"""Store and Session: where a run's state lives when it must outlive, or be reached from outside, its process.

A Store is a backend holding many conversations; a Session is one of them, already addressed, so nothing
in the loop threads an id around. Both are Protocols: a third-party store needs no base class, only the
four methods (and passing ``storetest``).

RunStore is the second, optional protocol: fork, the tool journal, the run lease and cancel. A store that
lacks it keeps working; its sessions just cannot fork, be cancelled from afar, or be held by one run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from . import validate
from .errors import ArgumentError, Unsupported
from .lease import Holder
from .messages import Message


@runtime_checkable
class Store(Protocol):
    def save(self, session: str, msgs: Sequence[Message]) -> None:
        """Replace the stored transcript of ``session`` with ``msgs``, atomically."""

    def messages(self, session: str) -> list[Message]:
        """The stored transcript, or ``[]`` for a session never saved."""

    def add_steer(self, session: str, text: str) -> None:
        """Leave a steer for the session's next model request, whichever process makes it."""

    def take_steers(self, session: str) -> list[str]:
        """Remove and return the waiting steers, oldest first; each is handed over exactly once."""


@runtime_checkable
class RunStore(Store, Protocol):
    """What a store adds so runs can be forked, journalled, leased and cancelled across processes.

    Each method is one atomic step; the logic around them (when to take a lease, what a journal means)
    lives in the library, once, so every store behaves alike.
    """

    def save_with_steers(self, session: str, msgs: Sequence[Message]) -> list[str]:
        """Take the steers waiting for ``session``, append them to ``msgs`` as user messages and save the
        result, in one atomic step; return the steers taken. A run that dies at any point has then either
        not taken a steer (it waits for the next run) or saved it: none is lost between take and save."""

    def fork(self, source: str, target: str, at: int | None) -> None:
        """Copy the transcript of ``source`` (whole, or its first ``at`` messages) to the new session
        ``target``, atomically; steers stay behind. ``ArgumentError`` when ``source`` has no transcript or
        ``at`` is outside ``0..len``, ``SessionExists`` when ``target`` has one."""

    def journal(self, session: str) -> str | None:
        """The session's tool journal as stored, or ``None``."""

    def put_journal(self, session: str, journal: str | None) -> None:
        """Replace the tool journal (``None`` deletes it)."""

    def acquire(self, session: str, holder: Holder, now: float) -> Holder:
        """Take or renew the lease and return who holds it after this call: ``holder`` (keeping a
        renewal's ``cancelled`` flag) if the lease was free, expired at ``now`` or already had its token;
        otherwise the live holder, unchanged."""

    def release(self, session: str, token: str) -> None:
        """Drop the lease if ``token`` still holds it."""

    def holder(self, session: str) -> Holder | None:
        """The stored lease, live or expired, or ``None``."""

    def cancel(self, session: str, now: float) -> bool:
        """Mark the lease live at ``now`` as cancelled; ``False`` when no lease is live."""


@runtime_checkable
class Session(Protocol):
    def save(self, msgs: Sequence[Message]) -> None: ...

    def messages(self) -> list[Message]: ...

    def steer(self, text: str) -> None: ...

    def take_steers(self) -> list[str]: ...


class StoreSession:
    """The Session ``open`` returns: one conversation of one store."""

    __slots__ = ("id", "store")

    def __init__(self, id: str, store: Store) -> None:
        self.id = id
        self.store = store

    def save(self, msgs: Sequence[Message]) -> None:
        self.store.save(self.id, msgs)

    def messages(self) -> list[Message]:
        return self.store.messages(self.id)

    def steer(self, text: str) -> None:
        self.store.add_steer(self.id, validate.steer_text(text))

    def take_steers(self) -> list[str]:
        return self.store.take_steers(self.id)

    def fork(self, new_id: str, at: int | None = None) -> StoreSession:
        """Start ``new_id`` from this transcript (the first ``at`` messages, or all of it). The two then
        diverge; steers waiting here stay here."""
        validate.session_id(new_id, "Session.fork(new_id)")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
            raise ArgumentError(f"Session.fork(at=) must be None or an int >= 0, got {at!r}")
        self._run_store("fork").fork(self.id, new_id, at)
        return StoreSession(new_id, self.store)

    def holder(self) -> Holder | None:
        """Who runs this session now, and until when; ``None`` when no live run holds it."""
        held = self._run_store("holder").holder(self.id)
        return held if held is not None and held.live() else None

    def cancel(self) -> bool:
        """Ask the run holding this session, in whatever process, to stop before its next model request
        or tool call. ``False`` when no run holds it (nothing is remembered for a later run)."""
        return self._run_store("cancel").cancel(self.id, time.time())

    def _run_store(self, op: str) -> RunStore:
        if not isinstance(self.store, RunStore):
            raise Unsupported(
                f"Session.{op}() needs a store implementing agent_sessions.RunStore; {self.store!r} does not"
            )
        return self.store

    def __repr__(self) -> str:
        return f"StoreSession({self.id!r}, {self.store!r})"


def open(session_id: str, store: Store) -> StoreSession:
    """Address one conversation of ``store``. Opening touches nothing: the session may not exist yet."""
    validate.session_id(session_id, "agent.open(session_id)")
    if not isinstance(store, Store):
        raise ArgumentError(
            f"agent.open(store) needs a Store (save, messages, add_steer, take_steers), "
            f"got {type(store).__name__}"
        )
    return StoreSession(session_id, store)
