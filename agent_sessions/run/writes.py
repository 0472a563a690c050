"""A leased run's writes to its session and its reads of its cancel flag, every one fenced by its lease.

The events the run publishes ride in its saves (``Publisher``); a write whose answer was lost
(``OutcomeUnknown``) is read back, and the run goes on as if the answer had come when it landed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from .. import eventlog
from ..contract import CancelWatch, CancelWatcher, EventStore, RunStore, Saved
from ..errors import AgentError, LeaseLost, OutcomeUnknown, TranscriptConflict
from ..journal import Journal
from ..lease import Lease
from ..messages import Message
from ..values import StoredEvent
from .publisher import Publisher

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class Writes:
    """The run's writes, fenced by ``lease``; ``start``: the index of the run's first message in the stored
    transcript (a ``Tail``'s), ``replace``: its first save replaces the history (``Spec.replace_transcript``)."""

    def __init__(self, store: RunStore, session: str, lease: Lease, start: int, replace: bool,
                 events_kept: int) -> None:
        self.store = store
        self.session = session
        self.lease = lease
        self.start = start
        self.replace = replace
        self.events_kept = events_kept
        self.written = -1
        """The length of the transcript as the run last wrote it; -1 before its first write (the CAS)."""
        self.publisher: Publisher | None = None
        self.held = True
        """Events wait for the first write (``append_events``) unless the run fails otherwise."""
        self.seq_floor = 0
        """The number the log gave the run's last append of events alone: where a read-back starts."""
        self.watch: CancelWatch | None = None
        self.since: object | None = None
        """What ``watch.listening()`` said immediately before the run's last read of its cancel flag, if that
        read found none; ``None`` otherwise (no watch, no such read yet, or the read found a cancel)."""

    @property
    def _from(self) -> dict[str, int]:
        """The keyword of a save of a ``Tail`` (``TailStore``): none for a whole transcript."""
        return {"start": self.start} if self.start else {}

    # -- the cancel flag ---------------------------------------------------------------------------------------

    def start_watching(self) -> None:
        """Where the store pushes cancels (``CancelWatcher``), watch this lease: checked once per run."""
        if isinstance(self.store, CancelWatcher):
            self.watch = self.store.watch_cancel(self.session, self.lease.holder)

    def stop_watching(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def _listening(self) -> object | None:
        return None if self.watch is None else self.watch.listening()

    def cancelled(self) -> bool:
        """The check before an idempotent tool. Where the store pushes cancels, what it pushed, when that
        answers (a cancel of this lease was heard, or none can have been committed since the run's last read
        of the flag without being heard: docs/runs/leases.md); otherwise a read of the lease."""
        if self.watch is not None:
            pushed = self.watch.cancelled(self.since)
            if pushed is not None:
                return pushed
        return self.check()

    def check(self) -> bool:
        since = self._listening()
        cancelled = self.store.check(self.session, self.lease.holder)
        self.since = None if cancelled else since
        return cancelled

    # -- saves ---------------------------------------------------------------------------------------------------

    def save(self, msgs: Sequence[Message], take_steers: bool, replace: bool | None = None,
             closes: bool = False) -> Saved:
        """``replace``: by default, the spec's, for the run's first write only. The events buffered so far ride
        in it. ``closes``: it closes the cancelled turn the run was handed (``BackedStore.save_fenced``)."""
        if replace is None:
            replace = self.replace and self.written < 0
        since = self._listening()
        if self.publisher is None:
            saved = self.store.save_fenced(self.session, self.lease.holder, msgs, take_steers=take_steers,
                                           replace=replace, closes=closes, **self._from)
        else:
            events = self.store
            with self.publisher.lock:  # no event is written by the watcher between these and after them
                records = self.publisher.take()
                try:
                    # A save whose answer was lost is settled by the store (``BackedStore._landed``): read
                    # back, landed or written again. What reaches here failed, or may have: the run fails.
                    saved = events.save_fenced_events(
                        self.session, self.lease.holder, msgs, take_steers=take_steers, replace=replace,
                        events=self.publisher.render(records, msgs, self.start), keep=self.events_kept,
                        closes=closes, **self._from)
                except BaseException:
                    self.publisher.restore(records)  # not written: the next write (or ``failed``'s) takes them
                    raise
        self.since = None if saved.cancelled else since
        self.written = len(msgs) + len(saved.steers)
        return saved

    def is_stored(self, msgs: Sequence[Message]) -> bool:
        """The compare-and-swap of a run that finishes a journalled reply: ``msgs`` must be exactly what is
        stored, so nothing is written; ``False`` when it is not but the run replaces the history on purpose."""
        try:
            self.save(msgs, take_steers=False, replace=False)
        except TranscriptConflict:
            if self.replace:
                return False
            raise
        return True

    # -- the journal -------------------------------------------------------------------------------------------

    def put_journal(self, text: str, *, unless_cancelled: bool = False, listen: bool = True) -> bool:
        """Store the journal; whether the run was asked to stop (with ``unless_cancelled``: then nothing
        was written)."""
        since = self._listening() if listen else None
        try:
            cancelled = self.store.put_journal(self.session, self.lease.holder, text,
                                               unless_cancelled=unless_cancelled)
        except OutcomeUnknown as exc:
            cancelled = self._journalled(text, exc, unless_cancelled)
        self.since = None if cancelled else since
        return cancelled

    def _journalled(self, text: str, exc: OutcomeUnknown, unless_cancelled: bool) -> bool:
        """A journal write that went unanswered: read the journal back, then the lease, and answer as the
        write would have. Landed: the run goes on (a call it marked started runs now, once). Not landed and
        the run cancelled, for a write that would not land once it was: cancelled. Otherwise ``exc``."""
        def read() -> tuple[bool, bool]:
            return written(self.store.journal(self.session), text), self.store.check(self.session, self.lease.holder)

        landed, cancelled = self._read_back("a journal write", exc, read)
        if landed:
            log.warning("session %r: a journal write went unanswered (%s); read back, it had landed: the run "
                        "goes on", self.session, exc)
            return cancelled and not unless_cancelled  # it was written, so it was not refused for a cancel
        if unless_cancelled and cancelled:
            return True
        raise exc

    def _read_back(self, what: str, exc: OutcomeUnknown, read: Callable[[], _T]) -> _T:
        """``read`` the session back after ``what`` went unanswered (``exc``). A lease taken over meanwhile is
        ``LeaseLost``; a read that fails too leaves the run no way to tell, so ``exc`` fails it."""
        try:
            return read()
        except LeaseLost:
            raise
        except AgentError as again:
            log.warning("session %r: %s went unanswered (%s), and reading it back failed too (%s)",
                        self.session, what, exc, again)
            raise exc from None

    # -- events alone ------------------------------------------------------------------------------------------

    def append_events(self, records: list[str]) -> None:
        """The publisher's append of events that rode in no save (a slow tool's call, ``failed``)."""
        assert self.publisher is not None
        if self.held and self.written < 0:  # the run's events wait for its first write (the compare-and-swap)
            self.publisher.restore(records)
            return
        events = self.store
        try:
            self.seq_floor = events.append_events(self.session, self.lease.holder, records, keep=self.events_kept)
        except OutcomeUnknown as exc:
            if not self._logged(events, records):
                raise
            log.warning("session %r: an append of %d event(s) went unanswered (%s); read back, it had landed",
                        self.session, len(records), exc)

    def _logged(self, events: EventStore, records: list[str]) -> bool:
        """After an append of ``records`` went unanswered: are they the log's last events? ``False`` when the read
        fails too, and the caller writes them again rather than lose them."""
        tail: list[StoredEvent] = []
        after = self.seq_floor
        try:
            while True:
                page = events.events(self.session, after, eventlog.MAX_READ)
                tail = [*tail, *page][-len(records):]
                if len(page) < eventlog.MAX_READ:
                    break
                after = page[-1].seq
        except AgentError:
            return False
        wanted = [eventlog.decode(0, record) for record in records]
        return [(e.kind, e.at) for e in tail] == [(w.kind, w.at) for w in wanted]


def holds(stored: Sequence[Message], msgs: Sequence[Message]) -> bool:
    """Does ``stored`` begin with ``msgs`` (as far as a save that may have landed can tell: its length and its
    last message; before the save the session held fewer)?"""
    return bool(msgs) and len(stored) >= len(msgs) and stored[len(msgs) - 1] == msgs[-1]


def written(stored: str | None, text: str) -> bool:
    """Does the stored journal hold the journal ``text`` a run wrote: that very text, or it with decisions
    people made since on the calls it asked approval for (``ApprovalStore.swap_journal``)?"""
    if stored == text or stored is None:
        return stored == text
    ours, theirs = Journal.from_json(text, "written"), Journal.from_json(stored, "stored")
    for call, approval in theirs.approvals.items():
        if call in ours.approvals and ours.approvals[call].decision is None:
            approval.decision = None
    return theirs.to_json() == ours.to_json()
