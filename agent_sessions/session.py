"""Store and Session: where a run's state lives when it must outlive, or be reached from outside, its process.

A Store is a backend holding many conversations; a Session is one of them, already addressed, so nothing
in the loop threads an id around. Both are Protocols: a third-party store needs no base class, only the
four methods (and passing ``storetest``).

RunStore is the second, optional protocol: the run lease and its fenced writes, the tool journal, cancel
and fork. A store that lacks it keeps working; its sessions just cannot fork, be cancelled from afar, or
be held by one run, and two runs of one session there are not kept apart (see docs/runs/leases.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

from . import validate
from .errors import ArgumentError, Unsupported
from .lease import Holder
from .messages import Message

if TYPE_CHECKING:
    from .approvals import ApprovalStore, PendingApproval
    from .eventlog import EventStore, StoredEvent
    from .journal import Decision
    from .lifecycle import LifecycleStore, Scalar, SessionInfo


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


@dataclass(frozen=True, slots=True)
class Saved:
    """What a fenced save did beside saving: the steers it took (appended to the transcript, in order) and
    whether somebody asked the run to stop."""

    steers: list[str]
    cancelled: bool


@runtime_checkable
class RunStore(Store, Protocol):
    """What a store adds so runs can be leased, fenced, journalled, cancelled and forked across processes.

    Each method is one atomic step; the logic around them (when to take a lease, what a journal means)
    lives in the library, once, so every store behaves alike.

    **The fencing rule.** ``holder`` in a write is the run's lease as ``acquire`` returned it. The store
    applies the write only if the session's stored lease still has ``holder.token`` and ``holder.epoch``,
    checked inside the write's own atomic step; otherwise it writes nothing and raises ``LeaseLost``.
    Expiry does not enter into it: a lapsed lease that nobody took over is still its holder's. Expiry is
    decided by the store's own clock (the database's, where it has one).
    """

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        """Take the lease for ``holder`` (its host, pid and token; the rest is ignored) if it is free or
        expired, raising the session's epoch, and return it as stored (its ``expires`` = now + ``ttl`` and
        its new ``epoch``); otherwise return the live holder, unchanged.

        **A cancel is handed on.** The new lease starts without a cancel, but when the lease it replaces
        (released, or expired) had one, the returned holder says ``cancelled=True``: the run that takes the
        session learns that the turn it may be about to continue was cancelled (``persistence``)."""

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        """Extend the lease to now + ``ttl`` if it still has ``holder``'s token and epoch (even if it had
        expired meanwhile, since nobody took it); otherwise raise ``LeaseLost``."""

    def release(self, session: str, holder: Holder) -> None:
        """Free the lease if it still has ``holder``'s token and epoch; the epoch is kept, and so is a cancel
        it had, for the next holder (``acquire``)."""

    def holder(self, session: str) -> Holder | None:
        """The live lease, or ``None`` when the session is free or its lease has expired."""

    def cancel(self, session: str) -> bool:
        """Mark the lease as cancelled; ``False`` when nobody holds it. A lapsed lease nobody took over is
        still held: its run may be alive and renewing late. The mark stays when the lease is released or
        taken over, for the next holder (``acquire``)."""

    def check(self, session: str, holder: Holder) -> bool:
        """Whether the run was asked to stop; ``LeaseLost`` if the lease is no longer ``holder``'s."""

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False
    ) -> Saved:
        """A leased run's save, in one atomic step, fenced by ``holder``. Unless ``replace``, the stored
        transcript must be a prefix of ``msgs`` (``TranscriptConflict`` otherwise, naming both lengths):
        the new messages are appended. With ``take_steers`` the waiting steers are taken and appended after
        ``msgs`` as user messages, in the same step. A save that writes anything also deletes the journal
        (the save holds the reply and its results now); one with nothing to write writes nothing."""

    def journal(self, session: str) -> str | None:
        """The session's tool journal as stored, or ``None``."""

    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        """Store the tool journal, fenced by ``holder``; return whether the run was asked to stop. With
        ``unless_cancelled`` nothing is written once it was: a call about to start, which then will not,
        must not be recorded as started."""

    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None:
        """Copy the transcript of ``source`` (whole, or its first ``at`` messages) to the new session
        ``target``, atomically; steers, journal and lease stay behind. ``ArgumentError`` when ``source`` has
        no transcript, ``at`` is outside ``0..len``, or (unless ``allow_unanswered``) message ``at - 1`` has
        tool calls (``validate.fork_cut``); ``SessionExists`` when ``target`` has one."""


@runtime_checkable
class Session(Protocol):
    def save(self, msgs: Sequence[Message]) -> None: ...

    def messages(self) -> list[Message]: ...

    def steer(self, text: str) -> None: ...

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


class StoreSession:
    """The Session ``open`` returns: one conversation of one store."""

    __slots__ = ("id", "store")

    def __init__(self, id: str, store: Store) -> None:
        self.id = id
        self.store = store

    def save(self, msgs: Sequence[Message]) -> None:
        self.store.save(self.id, msgs)

    def messages(self, last: int | None = None) -> list[Message]:
        """The stored transcript; with ``last``, only its last ``last`` messages, which a store offering
        the lifecycle protocol reads without loading the rest (a UI showing a long conversation)."""
        if last is None:
            return self.store.messages(self.id)
        from .lifecycle import LifecycleStore, last_count

        last = last_count(last)
        if isinstance(self.store, LifecycleStore):
            return self.store.tail(self.id, last)
        return self.store.messages(self.id)[-last:] if last else []

    def steer(self, text: str) -> None:
        self.store.add_steer(self.id, validate.steer_text(text))

    def take_steers(self) -> list[str]:
        return self.store.take_steers(self.id)

    def pending_steers(self) -> list[str]:
        """The steers waiting for the next model request, oldest first, without taking them."""
        return self._lifecycle("pending_steers").pending_steers(self.id)

    def info(self) -> SessionInfo | None:
        """When the session was created and last updated, its length and metadata; ``None`` when it does
        not exist (nothing saved, ran on, or labelled it)."""
        return self._lifecycle("info").info(self.id)

    def set_metadata(self, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        """Merge ``changes`` into the session's metadata (``None`` removes a key); return it as stored.
        Creates the session if it does not exist yet: label a conversation before its first run."""
        return self._lifecycle("set_metadata").set_metadata(self.id, changes)

    def delete(self, *, force: bool = False) -> bool:
        """Remove the session and everything kept for it, at once (see ``LifecycleStore.delete``)."""
        return self._lifecycle("delete").delete(self.id, force=force)

    def fork(self, new_id: str, at: int | None = None, *, allow_unanswered: bool = False) -> StoreSession:
        """Start ``new_id`` from this transcript (the first ``at`` messages, or all of it). The two then
        diverge; steers waiting here stay here. A cut that would leave tool calls without their results is
        refused unless ``allow_unanswered`` (see docs/runs/fork.md)."""
        validate.session_id(new_id, "Session.fork(new_id)")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
            raise ArgumentError(f"Session.fork(at=) must be None or an int >= 0, got {at!r}")
        self._run_store("fork").fork(self.id, new_id, at, allow_unanswered=allow_unanswered)
        return StoreSession(new_id, self.store)

    def holder(self) -> Holder | None:
        """Who runs this session now, and until when; ``None`` when no live run holds it."""
        return self._run_store("holder").holder(self.id)

    def cancel(self) -> bool:
        """Cancel the session's turn: the run holding the session, in whatever process, stops before its
        next model request or tool call, and no run that goes on with that turn afterwards (a resume after
        its worker died, a redelivered ``Runner.turn``) starts one either; a turn waiting for approvals is
        closed (its calls get error results saying they were not run, and deciding them raises
        ``AlreadyDecided``). ``True`` when there was a run or a waiting turn to cancel: then no call of
        that turn starts after this returns. ``False`` when there was neither; a new turn is never
        cancelled by an earlier cancel. See ``approvals.cancel``."""
        from .approvals import cancel

        return cancel(self._run_store("cancel"), self.id)

    def pending_approvals(self) -> list[PendingApproval]:
        """The calls waiting for a person's decision, in the order the model made them."""
        from .approvals import pending

        return pending(self._approval_store("pending_approvals"), self.id)

    def approve(self, call_id: str) -> Decision:
        """Approve the waiting call ``call_id``; the session's next run runs it (once). Exactly one of
        concurrent decisions on a call is stored: the others raise ``AlreadyDecided``, as does a call
        past its deadline; an id that waits for nothing raises ``UnknownApproval``."""
        from .approvals import decide

        return decide(self._approval_store("approve"), self.id, call_id, True, "")

    def deny(self, call_id: str, reason: str = "") -> Decision:
        """Deny the waiting call ``call_id``: the next run gives it an error result carrying ``reason``,
        and the model is asked again. Errors as ``approve``."""
        from .approvals import decide

        return decide(self._approval_store("deny"), self.id, call_id, False, reason)

    def events(self, after: int = 0, limit: int = 100) -> list[StoredEvent]:
        """The events of the session's log numbered above ``after``, oldest first, at most ``limit``
        (runs with ``Spec(publish_events=True)`` write them; see docs/runs/events.md)."""
        from .eventlog import check_read

        after, limit = check_read(after, limit)
        return self._event_store("events").events(self.id, after, limit)

    def follow(self, after: int = 0, timeout: float | None = None,
               poll: tuple[float, float] = (0.02, 0.5)) -> Iterator[StoredEvent]:
        """Yield the session's events above ``after`` as they arrive, from whichever process writes them,
        for ``timeout`` seconds (``None``: until you stop iterating; a session has many runs, so a
        ``finished`` event does not end it). Come back with the last ``seq`` you saw as ``after``: you miss
        nothing and see nothing twice. Waits are bounded: ``poll`` is the backoff (first, most seconds)
        for a store that cannot wake followers (see ``eventlog.follow``)."""
        from .eventlog import follow

        return follow(self._event_store("follow"), self.id, after, timeout, poll)

    def _event_store(self, op: str) -> EventStore:
        from .eventlog import EventStore

        if not isinstance(self.store, EventStore):
            raise Unsupported(
                f"Session.{op}() needs a store implementing agent_sessions.EventStore; {self.store!r} does not"
            )
        return self.store

    def _lifecycle(self, op: str) -> LifecycleStore:
        from .lifecycle import LifecycleStore

        if not isinstance(self.store, LifecycleStore):
            raise Unsupported(
                f"Session.{op}() needs a store implementing agent_sessions.LifecycleStore; {self.store!r} does not"
            )
        return self.store

    def _approval_store(self, op: str) -> ApprovalStore:
        from .approvals import ApprovalStore

        if not isinstance(self.store, ApprovalStore):
            raise Unsupported(
                f"Session.{op}() needs a store implementing agent_sessions.approvals.ApprovalStore; "
                f"{self.store!r} does not"
            )
        return self.store

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
