"""Store and Session: where a run's state lives when it must outlive, or be reached from outside, its process.

A Store is a backend holding many conversations; a Session is one of them, already addressed, so nothing
in the loop threads an id around. Both are Protocols: a third-party store needs no base class, only the
four methods (and passing ``storetest``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from . import validate
from .errors import ArgumentError
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
