"""What a run, a caller and a tool of the library ask of a store: the protocols, in one place.

Every store of the library is a ``BackedStore`` (``backed.py``, where what each method means is said) over
a backend (``backend.py``, what a store author writes). ``RunStore`` is what a ``BackedStore`` offers; the
old capability names (``LifecycleStore``, ...) are aliases of it. ``Store`` is the four methods a store of
one's own may offer instead (a run over it takes no lease). ``CancelWatcher`` and ``EventWaiter`` are the
pushes a store adds where its database can (PostgreSQL's ``LISTEN``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Protocol, TypeAlias, TypeGuard, runtime_checkable

from .messages import Message
from .values import Decision, Holder, PendingApproval, Saved, Scalar, SessionInfo, SessionPage, StoredEvent, when

__all__ = [
    "ApprovalStore",
    "CancelWatch",
    "CancelWatcher",
    "Decision",
    "EventStore",
    "EventWaiter",
    "Holder",
    "LifecycleStore",
    "PendingApproval",
    "QueueStore",
    "RunSession",
    "RunStore",
    "Saved",
    "Scalar",
    "Session",
    "SessionInfo",
    "SessionPage",
    "SteerKeyStore",
    "Store",
    "StoredEvent",
    "TailStore",
    "is_run_session",
    "when",
]

# -- a plain store -----------------------------------------------------------------------------------------


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


# -- a store of the library ----------------------------------------------------------------------------------


@runtime_checkable
class RunStore(Store, Protocol):
    """What every ``BackedStore`` offers, each method one atomic step or a read (``backed.py`` says what
    each means). **The fencing rule**: a write carrying a ``holder`` is applied only while the session's
    lease still has its token and epoch, checked in the write's own step; else ``LeaseLost``."""

    # the lease
    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder: ...
    def renew(self, session: str, holder: Holder, ttl: float) -> None: ...
    def release(self, session: str, holder: Holder) -> None: ...
    def holder(self, session: str) -> Holder | None: ...
    def cancel(self, session: str, *, once: str | None = None) -> bool: ...
    def check(self, session: str, holder: Holder) -> bool: ...

    # a run's writes
    def save_fenced(self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool,
                    replace: bool = False, start: int = 0, closes: bool = False) -> Saved: ...
    def save_fenced_events(self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool,
                           replace: bool = False, events: Sequence[str], keep: int, start: int = 0,
                           closes: bool = False) -> Saved: ...
    def give_back(self, session: str, holder: Holder, steers: Sequence[str]) -> list[str]: ...
    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int: ...

    # the journal and decisions
    def journal(self, session: str) -> str | None: ...
    def journal_as_taken(self, session: str, holder: Holder) -> str | None: ...
    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool: ...
    def swap_journal(self, session: str, expected: str, journal: str) -> bool: ...

    # steers sent again, and the queue of a busy session
    def add_steer_once(self, session: str, text: str, key: str) -> bool: ...
    def enqueue(self, session: str, key: str, text: str) -> int: ...
    def queued(self, session: str) -> list[str]: ...
    def take_queued(self, session: str, holder: Holder, *, append: bool = True) -> Message | None: ...
    def withdraw(self, session: str, key: str) -> bool: ...

    # reading
    def read_back(self, session: str, stop: int | None, count: int) -> tuple[int, list[Message]]: ...
    def tail(self, session: str, last: int) -> list[Message]: ...
    def pending_steers(self, session: str) -> list[str]: ...
    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]: ...

    # the lifecycle
    def list_sessions(self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50,
                      after: str | None = None, *, stranded: bool = False, grace: float = 0.0) -> SessionPage: ...
    def info(self, session: str) -> SessionInfo | None: ...
    def set_metadata(self, session: str, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]: ...
    def delete(self, session: str, *, force: bool = False) -> bool: ...
    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int: ...
    def mark_finished(self, session: str, holder: Holder, journal: str | None) -> bool: ...
    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None: ...


# The capabilities a store once offered apart: every store of the library offers them all (``RunStore``).
LifecycleStore: TypeAlias = RunStore
ApprovalStore: TypeAlias = RunStore
EventStore: TypeAlias = RunStore
SteerKeyStore: TypeAlias = RunStore
QueueStore: TypeAlias = RunStore
TailStore: TypeAlias = RunStore


# -- pushes a store may add ------------------------------------------------------------------------------------


class CancelWatch(Protocol):
    """One run's watch of its lease for cancels (``CancelWatcher.watch_cancel``), asked by that run alone."""

    def listening(self) -> object | None:
        """Asked immediately before each read the run makes of its cancel flag: a value naming the store's
        listening as it is now, equal for as long as it goes on without a break and never again after one;
        ``None`` while the store does not listen. Every cancel committed from then on is pushed to it."""

    def cancelled(self, since: object | None) -> bool | None:
        """``True`` when a cancel of this lease was pushed since the watch began; ``False`` when none was and
        the listening ``since`` names goes on; ``None`` otherwise: the run reads the flag."""

    def close(self) -> None:
        """The run returns: forget the watch."""


@runtime_checkable
class CancelWatcher(RunStore, Protocol):
    """A store that pushes a cancel to the process whose run holds the lease (PostgreSQL: NOTIFY on the cancel's
    commit), so the check before an idempotent tool reads a flag in this process instead of the lease. Every
    cancel must push after it commits, never before; a cancel that could not be pushed leaves the listening
    broken, so the run reads (docs/runs/leases.md)."""

    def watch_cancel(self, session: str, holder: Holder) -> CancelWatch:
        """Begin keeping, in this process, whether a cancel of ``holder``'s lease of ``session`` was pushed."""


@runtime_checkable
class EventWaiter(Protocol):
    """A store that wakes followers when an event is appended rather than have them poll (PostgreSQL:
    LISTEN/NOTIFY). Optional: ``follow`` polls with backoff without it."""

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        """Return once the session may have an event numbered above ``after`` (``True``), or after ``timeout``
        seconds (``False``). Waking without one is allowed: the follower reads again."""


# -- a session: one conversation of a store --------------------------------------------------------------------


@runtime_checkable
class Session(Protocol):
    def save(self, msgs: Sequence[Message]) -> None: ...

    def messages(self) -> list[Message]: ...

    def steer(self, text: str) -> object: ...

    def take_steers(self) -> list[str]: ...


@runtime_checkable
class RunSession(Session, Protocol):
    """A session over a RunStore: what a run needs to hold a lease on it and fence its writes. Any class
    with these attributes qualifies, not only ``StoreSession``."""

    @property
    def id(self) -> str: ...

    @property
    def store(self) -> RunStore: ...


def is_run_session(session: Session) -> TypeGuard[RunSession]:
    """Checked once per run: is this session addressed in a RunStore, so the run is leased and fenced?"""
    return isinstance(getattr(session, "id", None), str) and isinstance(getattr(session, "store", None), RunStore)
