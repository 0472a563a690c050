"""The contract: what a store must do, in one place. A store author reads this file and ``storetest``.

A Store is a backend holding many conversations. ``Store`` is the one required protocol: four methods.
Every other protocol is an optional capability a store may add, each a sub-protocol checked once with
``isinstance`` (they are ``runtime_checkable``), never by a store's class:

- ``RunStore``: the run lease and its fenced writes, the tool journal, cancel and fork. A store that lacks
  it keeps working; its sessions just cannot fork, be cancelled from afar, or be held by one run, and two
  runs of one session there are not kept apart (see docs/runs/leases.md).
- ``LifecycleStore``: list, inspect, label, delete and retain sessions (docs/lifecycle.md).
- ``ApprovalStore``: a journal a process holding no lease can swap, which is how decisions on tool calls
  are stored (docs/runs/approvals.md).
- ``EventStore`` (and the optional ``EventWaiter``): a durable log of each session's events
  (docs/runs/events.md).
- ``CancelWatcher``: a RunStore that pushes a cancel to the process holding the lease (PostgreSQL), or can
  tell that nothing was committed since the run last read its flag (SQLite), so a run checks before an
  idempotent tool without a round trip (docs/runs/leases.md).
- ``SteerKeyStore``: steers left under a caller's key, each key stored once per session, so a steer whose
  answer was lost can be sent again as it is (docs/sessions.md).
- ``QueueStore``: messages queued, under their turn keys, for a session that is busy; each is taken into the
  transcript by the lease's holder, in the order they were accepted, as a turn of its own (docs/runs/turns.md).

Each method is one atomic step; the logic around them (when to take a lease, what a journal means, the
checks every store makes on its arguments) lives in the library, once, in the module of its capability
(``lease``, ``journal``, ``lifecycle``, ``approvals``, ``eventlog``), so every store behaves alike. The
value types the protocols exchange are in ``values`` and re-exported here. A Session is one conversation
of a store, already addressed, so nothing in the loop threads an id around: ``Session`` and ``RunSession``
are what a run needs of it (``agent.open`` makes one).

This module imports only the messages, the errors' values and nothing above them: everything else of the
library builds on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Protocol, TypeGuard, runtime_checkable

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

# -- the one required protocol ---------------------------------------------------------------------------------


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


# -- steers sent again: a key per steer --------------------------------------------------------------------------


@runtime_checkable
class SteerKeyStore(Store, Protocol):
    """A store that remembers the keys of the steers it took, per session, for as long as the session exists
    (``delete`` and ``prune`` forget them with it; a steer delivered keeps its key). A sender whose
    ``add_steer`` failed without an answer (``OutcomeUnknown``: the steer may be stored) sends it again with
    the same key, and it is stored once: what ``Runner.turn``'s key is to a turn's message."""

    def add_steer_once(self, session: str, text: str, key: str) -> bool:
        """``add_steer``, unless a steer with ``key`` was already accepted for ``session``: the check and the
        insert are one atomic step, so of any number of concurrent calls with one key exactly one stores
        its steer. ``True``: stored now; ``False``: the key was there, and nothing was written (whatever
        the text: a key names one steer). Use ``validate.steer_key`` for the key."""


# -- runs: leases, fenced writes, the journal, cancel, fork ----------------------------------------------------


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
        (the save holds the reply and its results now); one with nothing to write writes nothing.
        ``take_steers`` and ``replace`` are bools: anything else is an ``ArgumentError`` before anything is
        read or written (``validate.save_start``)."""

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


# -- messages queued for a busy session ------------------------------------------------------------------------


@runtime_checkable
class QueueStore(RunStore, Protocol):
    """A RunStore that keeps, per session, the user messages that arrived while it was busy (``Runner.turn``
    with ``if_busy="queue"``), each under its turn key, in the order they were accepted. A queued message is
    not a steer: no run's ``take_steers`` takes it. The lease's holder takes them one at a time, each as a
    turn of its own. A key once accepted is remembered for as long as the session exists, taken or not
    (``delete`` and ``prune`` forget the queue with the session), so a message sent again is queued once."""

    def enqueue(self, session: str, key: str, text: str) -> int:
        """Queue ``text`` under ``key`` unless that key was accepted for ``session`` before, in one atomic step;
        return the message's position among those waiting (1: the next to be taken), or 0 when it was taken
        into the transcript already. ``ArgumentError`` when the key was accepted with another text (a key
        names one message; a store may check that only while the message waits). Use ``validate.turn_key`` for
        the key. It makes the session exist, as a save does (and moves its ``updated`` on)."""

    def queued(self, session: str) -> list[str]:
        """The keys of the messages waiting, in the order they were accepted."""

    def take_queued(self, session: str, holder: Holder, *, append: bool = True) -> Message | None:
        """Move the oldest waiting message to the end of the transcript, as ``Message.user(text, key=key)``,
        fenced by ``holder`` (``LeaseLost`` otherwise, writing nothing), in one atomic step that, as a save
        that writes does, drops the journal; return it, or ``None`` (nothing written) when none waits. With
        ``append=False`` the message is only taken off the queue (its key is in the transcript already: it
        was delivered another way), and the transcript and journal are left as they are."""


# -- reading the end of a long transcript ----------------------------------------------------------------------


@runtime_checkable
class TailStore(RunStore, Protocol):
    """A RunStore that reads a transcript from its end, and lets a run that read only its end save: how a
    run resumes a long, compacted session reading about what follows its newest compaction record
    (``context.read_recent``), not the whole of it (docs/runs/context.md).

    Its ``save_fenced`` (and, on an EventStore, ``save_fenced_events``) take a keyword ``start: int = 0``:
    ``msgs`` are then the transcript from index ``start`` on. The stored transcript must hold at least
    ``start`` messages, and its messages from ``start`` on must be a prefix of ``msgs``
    (``TranscriptConflict`` otherwise, naming both lengths counted from 0); the new ones are appended
    after them. The messages before ``start`` are neither read nor written, and ``replace`` is refused
    with a ``start``. A save with nothing new still reads only from ``start``."""

    def read_back(self, session: str, stop: int | None, count: int) -> tuple[int, list[Message]]:
        """The messages of the transcript before index ``stop`` (``None``: its end), at most ``count`` of
        them, the last ones; and the index of the first of them (``(0, [])`` when there are none). Reads
        only those, by the messages' index: one page of a read from the end."""

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        start: int = 0,
    ) -> Saved:
        """``RunStore.save_fenced``, of the transcript from index ``start`` on (above)."""


# -- cancels pushed to the holder ------------------------------------------------------------------------------


class CancelWatch(Protocol):
    """One run's watch of its lease for cancels (``CancelWatcher.watch_cancel``), asked by that run alone."""

    def listening(self) -> object | None:
        """Asked immediately before each read the run makes of its cancel flag (a fenced save, a journal
        write, ``check``): a value naming the store's listening as it is now, equal for as long as it goes
        on without a break and never again after one (a new connection, say); ``None`` while the store
        does not listen. Whatever it names must have been listening already: every cancel of the session
        committed from now on is pushed to it, or makes ``cancelled`` with this value answer ``None``
        (SQLite: any commit but the connection's own moves its ``data_version``)."""

    def cancelled(self, since: object | None) -> bool | None:
        """``True`` when a cancel of this lease (its session and epoch) was pushed to this process since
        the watch began. ``False`` when none was, ``since`` (a value of ``listening``) is not ``None`` and
        the listening it names goes on, and nothing else heard asks for a read (a cancel of a later
        lease of the session: this one passed on). ``None`` otherwise: the run reads the flag."""

    def close(self) -> None:
        """The run returns: forget the watch."""


@runtime_checkable
class CancelWatcher(RunStore, Protocol):
    """A RunStore that pushes a cancel to the process whose run holds the lease (PostgreSQL: NOTIFY on the
    cancel's commit, heard by the store's LISTEN connection), so the check before an idempotent tool reads
    a flag in this process instead of the lease; or that can tell nothing at all was committed since the
    run's last read (SQLite: ``PRAGMA data_version`` of the run's connection), so no cancel can have been.
    Optional, checked once per run: without it the run reads the lease (``check``) before each idempotent
    tool. It never stands in for a write's own check: the journal write before a non-idempotent tool still
    reads the flag atomically with its write.

    The run relies on this (``persistence.Leased``): it reads nothing before an idempotent tool when the
    last read of its flag found none, and the watch then answers ``False`` with the ``listening()`` taken
    just before that read. So every ``cancel`` (and whatever else sets the flag) must push to the
    listeners after it commits, never before; a cancel that could not be pushed must leave the listening
    broken, so the run reads. (SQLite pushes nothing: every commit of another connection breaks the
    listening it names, and the store's own cancels on the run's connection replace a mark it names.)"""

    def watch_cancel(self, session: str, holder: Holder) -> CancelWatch:
        """Begin keeping, in this process, whether a cancel of ``holder``'s lease of ``session`` was
        pushed here (and start listening, if the store is not yet); the run closes it when it returns."""


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


# -- the lifecycle ---------------------------------------------------------------------------------------------


@runtime_checkable
class LifecycleStore(Store, Protocol):
    """What a store adds so conversations can be managed: listed, inspected, labelled, deleted, retained.

    A session exists once something wrote its row: a save, a run's lease, ``set_metadata`` or a fork.
    Steers left for a session that does not exist yet wait for it, as always, and do not make it exist.
    """

    def list_sessions(
        self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50, after: str | None = None,
        *, stranded: bool = False, grace: float = 0.0,
    ) -> SessionPage:
        """Sessions whose id starts with ``prefix`` and whose metadata has every ``where`` key with that
        value, ordered by ``updated`` then id, newest first; at most ``limit``, after the cursor ``after``
        (a page's ``next``). Use ``check_listing`` for the arguments and ``encode_cursor``/``decode_cursor``.

        ``stranded``: instead, the sessions whose turn has been open (``SessionInfo.open_since``) for at
        least ``grace`` seconds, whose lease is free or lapsed and not cancelled, unless a queued message
        waits (``QueueStore``: a cancel stops a run, not the messages queued behind it) (store clock), oldest
        ``open_since`` first, then by id (the cursor holds those two); ``prefix`` and ``where`` must be left
        out (``check_stranded``). Read through an index holding only the open sessions: a store of finished
        sessions answers without reading them. Every save keeps ``open_since``: ``COALESCE(open_since, now)``
        when it leaves the turn open (``messages.turn_open``, or input waiting: a steer), ``NULL`` when it
        closes it; ``add_steer_once`` and ``ApprovalStore.swap_journal`` set it as open; ``acquire``,
        ``renew``, ``release`` and ``put_journal`` leave it."""

    def info(self, session: str) -> SessionInfo | None:
        """The session as ``list_sessions`` would show it, or ``None`` when it does not exist."""

    def set_metadata(self, session: str, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        """Merge ``changes`` into the session's metadata (a ``None`` value removes its key), creating the
        session if it does not exist, in one atomic step; return the metadata as stored. Use
        ``merge_metadata``, which checks the changes and the merged result."""

    def delete(self, session: str, *, force: bool = False) -> bool:
        """Remove everything kept for the session (transcript, steers and their keys, journal, lease,
        metadata) in one atomic step; ``False`` when there was nothing. While a live run holds the lease this raises
        ``SessionBusy`` unless ``force``: then the run's next write fails with ``LeaseLost`` (its lease is
        gone with the session), and nothing it writes afterwards brings the session back."""

    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int:
        """Delete sessions whose ``updated`` is more than ``idle_for`` (seconds, or a timedelta) ago and
        that no live run holds, in batches each of its own transaction (never one huge one), at most ``limit`` in all;
        return how many were deleted."""

    def tail(self, session: str, last: int) -> list[Message]:
        """The last ``last`` messages of the transcript (all of it when shorter), without reading the rest."""

    def pending_steers(self, session: str) -> list[str]:
        """The steers waiting for the session's next model request, oldest first, left where they are."""

    def mark_finished(self, session: str, holder: Holder, journal: str | None) -> bool:
        """Clear the session's ``open_since``: ``agent.recover`` looked under ``holder``'s lease and found the
        turn finished (or waiting for a person's decision). One atomic step, fenced by ``holder``
        (``LeaseLost`` otherwise), that writes only while the journal is still ``journal`` (the text read)
        and no steer waits: nothing that reopened the turn came meanwhile. Returns whether it wrote."""


# -- approvals -------------------------------------------------------------------------------------------------


@runtime_checkable
class ApprovalStore(RunStore, Protocol):
    """A RunStore whose journal can be swapped by a process holding no lease: how decisions are stored."""

    def swap_journal(self, session: str, expected: str, journal: str) -> bool:
        """Replace the session's journal with ``journal`` if it is still exactly ``expected``, in one
        atomic step; ``False`` (nothing written) otherwise. Not fenced by a lease: the text is the guard."""


# -- the event log ---------------------------------------------------------------------------------------------


@runtime_checkable
class EventStore(RunStore, Protocol):
    """A RunStore that keeps a log of events per session. Each method is one atomic step.

    Retention: a session's ``delete`` (and ``prune``) removes its log with it; ``keep`` bounds it."""

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        """Append ``events`` (non-empty; each an ``encode``d text, stored verbatim) to the session's log,
        fenced by ``holder`` (``LeaseLost`` otherwise, writing nothing), giving them the next consecutive
        numbers (``first_seq`` of the store's clock for a log that has none yet); drop the oldest events
        beyond the newest ``keep``, in the same step. Returns the last number given."""

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int,
    ) -> Saved:
        """``save_fenced`` and ``append_events`` in one atomic step (the events may be empty): how a step's
        events ride in the save it makes anyway. The events are appended even when the save has nothing to
        write; a ``TranscriptConflict`` or ``LeaseLost`` writes neither."""

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        """The session's events numbered above ``after``, oldest first, at most ``limit`` (``decode``), as
        stored: the library joins the events that point at a message with it (``eventlog.resolve``)."""


@runtime_checkable
class EventWaiter(Protocol):
    """What a store offers so followers wake when an event is appended rather than poll (PostgreSQL:
    LISTEN/NOTIFY). Optional: ``follow`` polls with backoff without it."""

    def wait_for_events(self, session: str, after: int, timeout: float) -> bool:
        """Return once the session may have an event numbered above ``after`` (``True``), or after
        ``timeout`` seconds (``False``). Waking without one is allowed: the follower reads again."""
