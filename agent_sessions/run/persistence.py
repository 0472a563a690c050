"""How a run keeps its transcript, chosen once per run so the loop reads straight through.

- ``NOT_KEPT`` (``Spec.session is None``): every step is a no-op; no store call, no allocation.
- ``Kept`` (a plain Session): the waiting steers are taken and the transcript saved before every model
  request, and once more when the run returns.
- ``Leased`` (a session over a RunStore): the run holds the session's lease, and every write carries it
  (see ``lease``). Its first write is a compare-and-swap against the stored transcript; the write before
  each request also takes the steers and tells whether the run was cancelled; tool calls are journalled
  where that buys something (see ``journal``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, cast

from .. import approvals, eventlog
from ..contract import (
    ApprovalStore,
    CancelWatch,
    CancelWatcher,
    EventStore,
    LifecycleStore,
    PendingApproval,
    RunSession,
    Saved,
    Session,
    TailStore,
    is_run_session,
)
from ..errors import (
    AgentError,
    ArgumentError,
    AwaitingApproval,
    LeaseLost,
    OutcomeUnknown,
    StoreError,
    TranscriptConflict,
    TranscriptDeleted,
)
from ..events import Sink
from ..journal import NOT_RUN_SUPERSEDED, UNKNOWN_OUTCOME, Approval, Journal, fingerprint
from ..lease import Lease
from ..messages import Content, Message, Role, incarnations_read, turn_open, unanswered
from ..result import Result
from ..spec import Spec
from ..tools import Tool
from ..values import Decision, StoredEvent, when
from .publisher import Publisher

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_NOTHING: tuple[Sequence[str], bool] = ((), False)
_NO_APPROVALS: tuple[list[Content], bool] = ([], False)


class Keeping(Protocol):
    saves: bool
    """Whether ``before_request`` and ``finish`` write anything (for the Saved events)."""
    stopped: bool
    """Set by ``resume``: the turn this run goes on with was cancelled before it, so it starts nothing (not
    even the save before its first request, which would take the steers waiting for the next turn)."""

    def __enter__(self) -> Keeping: ...

    def __exit__(self, kind: object, exc: object, tb: object) -> None: ...

    @property
    def epoch(self) -> int | None:
        """The epoch of the lease the run holds (for its log lines); ``None`` when it holds none."""

    def publishing(self, emit: Sink) -> Sink:
        """The sink the loop reports to: ``emit``, or with ``Spec.publish_events`` a ``Publisher`` around it
        whose events go to the session's log."""

    def resume(self, transcript: list[Message]) -> None:
        """Before the loop starts: put back a reply whose tools a dead run was running."""

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        """Take the steers waiting, append them to ``transcript`` and save it; return those steers and
        whether somebody asked the run to stop."""

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        """The last message of ``transcript`` is a reply whose tool calls are about to run."""

    def approvals(self, spec: Spec, step: int, emit: Sink) -> tuple[list[Content], bool]:
        """Before any call of the reply runs: the calls still waiting for a person's decision (asking for
        those not asked yet, and counting those past their deadline as denied), and whether the run was
        asked to stop meanwhile."""

    def approval(self, call: Content) -> Approval | None:
        """The approval ``call`` needed, with its decision; ``None`` when it needed none."""

    def pending(self, calls: Sequence[Content]) -> list[PendingApproval]: ...

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        """The result a resumed call gets without running, or ``None`` to run it."""

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        """Immediately before a tool runs: ``False`` when the run was asked to stop."""

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None: ...

    def store_steers(self, steers: Sequence[str]) -> list[str]:
        """Store ``steers`` (given to this run, in no stored transcript) as the session's waiting steers, so
        the next run takes them; return those it could not store."""
        ...

    def stored_as(self, transcript: Sequence[Message]) -> bool | None:
        """After a save that went unanswered: is ``transcript`` what the session holds? ``None``: unknown
        (no session, or the read failed)."""
        ...

    def finish(self, transcript: list[Message], result: Result) -> None:
        """The run returns ``result``: save what the last request's reply (and anything since) added."""


class _NotKept:
    saves = False
    stopped = False

    @property
    def epoch(self) -> int | None:
        return None

    def store_steers(self, steers: Sequence[str]) -> list[str]:
        return list(steers)  # no session to keep them in

    def stored_as(self, transcript: Sequence[Message]) -> bool | None:
        return None

    def __enter__(self) -> _NotKept:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        pass

    def publishing(self, emit: Sink) -> Sink:
        return emit

    def resume(self, transcript: list[Message]) -> None:
        pass

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        return _NOTHING

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        pass

    def approvals(self, spec: Spec, step: int, emit: Sink) -> tuple[list[Content], bool]:
        return _NO_APPROVALS

    def approval(self, call: Content) -> Approval | None:
        return None

    def pending(self, calls: Sequence[Content]) -> list[PendingApproval]:
        return []

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        return None

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        return True

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None:
        pass

    def finish(self, transcript: list[Message], result: Result) -> None:
        pass


NOT_KEPT = _NotKept()


class Kept(_NotKept):
    """A plain Session: saves == requests + 1. Nothing fences it: two runs of one session both write."""

    saves = True

    def __init__(self, session: Session) -> None:
        self.session = session

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        steers = self.session.take_steers()
        transcript.extend(Message.user(t) for t in steers)
        self.session.save(transcript)
        return steers, False

    def finish(self, transcript: list[Message], result: Result) -> None:
        self.session.save(transcript)

    def store_steers(self, steers: Sequence[str]) -> list[str]:
        return _store_steers(self.session.steer, str(getattr(self.session, "id", "?")), steers)

    def stored_as(self, transcript: Sequence[Message]) -> bool | None:
        return _stored_as(self.session.messages, transcript)


class Leased:
    """A session over a RunStore. Per step: one fenced save before the request (which takes the steers and
    reports a cancel); before each tool call a cancel check, which for a non-idempotent tool is the journal
    write recording that it started (and carrying the results so far), and for an idempotent one a read of
    the lease, unless the store pushes cancels or knows none can have come (``_cancelled``); after a
    non-idempotent tool that is not the reply's last call, a journal write of its result. Every other result
    rides with the next write."""

    saves = True

    def __init__(self, session: RunSession, spec: Spec, *, continuing: bool = False, start: int = 0,
                 lease: Lease | None = None) -> None:
        self.store = session.store
        self.session = session.id
        self.start = start
        """The index in the stored transcript of the run's first message (a ``Tail``'s): its saves append
        after the stored messages it was not given (``TailStore``), and its journal's index counts them."""
        self.continuing = continuing
        """The run goes on with a turn already begun (``Runner.turn`` delivered again): a cancel handed with
        the lease is of that turn, whatever input waits."""
        self.new_input = lease is not None and not continuing
        """Handed a lease its caller took, and not going on with a turn: its caller took a queued message into
        the transcript under that lease (``busy``), or steers wait; either is new input, stored already."""
        self.stopped = False
        self.lease = lease if lease is not None else Lease(self.store, self.session, spec.lease_ttl,
                                                           spec.lease_wait, spec.name)
        self.replace = spec.replace_transcript
        self.written = -1
        """The length of the transcript as this run last wrote it; -1 before its first write (the CAS)."""
        self.journal: Journal | None = None
        self.journal_text: str | None = None
        """The journal's text as stored, when this run read it (a resume): a change to its approvals is
        a compare-and-swap against it, since people may be deciding meanwhile."""
        self.closing = False
        """Handed a cancel with new input: the cancelled turn's reply, resumed, is closed unrun (``replay``),
        and the turn closed by the save before the first request. Until that save lands, the cancel is the
        run's to hand on if it fails (``_hand_on_cancel``)."""
        self.fresh: bool | None = None
        """The cancel flag a journal write just returned, with no tool run since: the next call's check."""
        self.unwritten = False
        """A non-idempotent tool's result is in ``journal`` but in no write yet (the reply's last call: the
        next save carries it). A run that fails before that save journals it on its way out (``__exit__``)."""
        self.held = True
        """Events wait for the first write (``_append_events``) unless the run fails otherwise (``__exit__``)."""
        self.publish = spec.publish_events
        self.seq_floor = 0
        """The number the log gave this run's last append of events alone: where a read-back starts."""
        self.events_kept = spec.events_kept
        self.publisher: Publisher | None = None
        self.pushes = isinstance(self.store, CancelWatcher)
        """Checked once per run: the store pushes cancels to this process, or watches for them (``_cancelled``)."""
        self.watch: CancelWatch | None = None
        self.since: object | None = None
        """What ``watch.listening()`` said immediately before the run's last read of its cancel flag, if that
        read found none; ``None`` otherwise (no watch, no such read yet, or the read found a cancel)."""

    @property
    def epoch(self) -> int | None:
        return self.lease.holder.epoch

    @property
    def _from(self) -> dict[str, int]:
        """The keyword of a save of a ``Tail`` (``TailStore``): none for a whole transcript, so any RunStore
        takes it."""
        return {"start": self.start} if self.start else {}

    def __enter__(self) -> Leased:
        self.lease.__enter__()
        if self.pushes:  # the watch is of this lease: taken once the lease is
            try:
                self.watch = cast(CancelWatcher, self.store).watch_cancel(self.session, self.lease.holder)
            except BaseException as exc:
                self.lease.__exit__(type(exc), exc, exc.__traceback__)
                raise
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        try:
            self._before_release(exc)
        finally:
            # Whatever the way out: a lease left unreleased keeps its heartbeat renewing it, and the session
            # stays busy for as long as this process lives (a resume in it waited out four ttls, seed 13).
            self.lease.__exit__(kind, exc, tb)

    def _before_release(self, exc: object) -> None:
        """What goes before the release: the cancel watch closed, a failing run's tool results journalled
        and its events (with ``failed``) written, while the lease is still the run's."""
        if self.watch is not None:
            self.watch.close()  # no tool starts from here on
        if isinstance(exc, BaseException) and self.unwritten and self.lease.lost is None and not isinstance(
                exc, LeaseLost):
            self._keep_results()
        if self.publisher is not None:
            self.publisher.close()
            if isinstance(exc, BaseException) and self.lease.lost is None:
                if self.written < 0 and isinstance(exc, (TranscriptConflict, AwaitingApproval)):
                    # Refused before it wrote anything (another delivery of the turn saved first, a turn
                    # waits for decisions, the session was erased): as far as the session goes this run did
                    # not happen, so it publishes nothing, not even ``failed`` (``_append_events``).
                    self.publisher.buffer.clear()
                else:
                    # Any other failure, even before the first write (an events callback raising on the
                    # first step, say), is the run's, which held the session: its events and ``failed`` go
                    # to the log, while the lease is still the run's (its writes are fenced by it).
                    self.held = False
                    self.publisher.failing(exc)
        if isinstance(exc, BaseException) and self.closing and self.lease.lost is None:
            self._hand_on_cancel(exc)

    def _hand_on_cancel(self, exc: BaseException) -> None:
        """The lease came with the cancel of the turn in progress, which this run was to close before its new
        input (``closing``, in the save before its first request), and it fails before that save landed (a
        stale transcript's ``TranscriptConflict``, say): the turn is still open and its cancel taken. So the
        cancel goes back on this run's lease, whose release hands it on, and a redelivery of that turn stops
        as it would have had this run never taken the lease, rather than go on with it (run its tools). Best
        effort, on the lease the run still holds (its heartbeat renews it to the release): the run's own
        error is the one that propagates. A worker killed in that window takes the cancel with it."""
        try:
            if not self.store.check(self.session, self.lease.holder):
                self.store.cancel(self.session)
            log.info("session %r: the run failed (%s) before it closed the cancelled turn; the cancel is handed "
                     "on", self.session, type(exc).__name__)
        except Exception as error:  # noqa: BLE001 - a lease lost meanwhile took the cancel with it
            log.warning("session %r: the cancel of the turn this run was to close could not be handed on (%s: %s)",
                        self.session, type(error).__name__, error)

    def store_steers(self, steers: Sequence[str]) -> list[str]:
        return _store_steers(lambda text: self.store.add_steer(self.session, text), self.session, steers)

    def stored_as(self, transcript: Sequence[Message]) -> bool | None:
        return _stored_as(lambda: self.store.messages(self.session)[self.start:], transcript)

    def _keep_results(self) -> None:
        """The run fails (an events callback raised on ``ToolFinished``, say) after a non-idempotent tool ran
        and before the save that would carry its result: journal the result, so a resume replays it rather
        than call its outcome unknown. Best effort: the run's own error is the one that propagates."""
        assert self.journal is not None
        try:
            self.store.put_journal(self.session, self.lease.holder, self.journal.to_json())
        except Exception as exc:  # noqa: BLE001 - a resume then says the outcome is unknown, as after a crash
            log.warning("session %r: the results of the failing run's tools could not be journalled (%s: %s)",
                        self.session, type(exc).__name__, exc)

    def publishing(self, emit: Sink) -> Sink:
        if not self.publish:
            return emit
        # Checked once, in ``keeping``: an isinstance against a Protocol costs tens of µs, not for every step.
        self.event_store = cast(EventStore, self.store)
        self.publisher = Publisher(emit, self._append_events)
        self.publisher.start()
        return self.publisher

    def _append_events(self, records: list[str]) -> None:
        if self.held and self.written < 0:  # the run's events wait for its first write (the compare-and-swap)
            assert self.publisher is not None
            self.publisher.restore(records)
            return
        try:
            self.seq_floor = self.event_store.append_events(self.session, self.lease.holder, records,
                                                            keep=self.events_kept)
        except OutcomeUnknown as exc:
            if not self._logged(records):
                raise
            log.warning("session %r: an append of %d event(s) went unanswered (%s); read back, it had landed",
                        self.session, len(records), exc)

    def _logged(self, records: list[str]) -> bool:
        """After an append of ``records`` went unanswered: are they the log's last events? (Read from the
        last number this run was given on, so at most the log's ``events_kept``; ``False`` when the read
        fails too, and the caller writes them again rather than lose them.)"""
        tail: list[StoredEvent] = []
        after = self.seq_floor
        try:
            while True:
                page = self.event_store.events(self.session, after, eventlog.MAX_READ)
                tail = [*tail, *page][-len(records):]
                if len(page) < eventlog.MAX_READ:
                    break
                after = page[-1].seq
        except AgentError:
            return False
        wanted = [eventlog.decode(0, record) for record in records]
        return [(e.kind, e.at) for e in tail] == [(w.kind, w.at) for w in wanted]

    def resume(self, transcript: list[Message]) -> None:
        """Tools may run before the first request: so the compare-and-swap comes first here, without
        writing a reply that waits for its results (the loop never stores a tool call without them)."""
        self._read_from_now(transcript)
        if self.lease.holder.cancelled:
            # The lease came with a cancel (``RunStore.acquire``) of the turn that was in progress. With new
            # input (a user's message of this run's own, or steers waiting: the next turn), that turn's calls
            # still pending are closed unrun (``closing``) and the input is answered. Without, this run
            # would only go on with the cancelled turn: it marks its own lease, so it stops before it
            # starts anything and hands the cancel on in turn. A run that continues a turn (``continuing``:
            # a redelivered ``Runner.turn``) is that turn's: it stops, and the steers wait for the next one.
            if not self.continuing and (self.new_input or self._begins_turn(transcript) or self._steers_wait()):
                self.closing = True
                log.info("session %r: the turn in progress was cancelled; closing it before the new input",
                         self.session)
            else:
                log.info("session %r: the turn this run goes on with was cancelled; stopping it", self.session)
                self.store.cancel(self.session)  # its own lease, whose release hands the cancel on again
                self.stopped = True
        text = self.store.journal(self.session)
        journal = None if text is None else Journal.from_json(text, f"session {self.session!r}")
        if self.closing and journal is not None and _started_anew(journal, transcript, self.start):
            # The cancelled turn's reply waits in the journal while the new input follows the transcript it
            # answered: the reply goes back in its place, with its calls answered unrun, before the input.
            self._put_back(journal, transcript, self._closing)
            return
        if journal is not None and journal.approvals and not self.replace and _started_anew(journal, transcript,
                                                                                              self.start):
            raise AwaitingApproval(self.session, [c for c, a in journal.approvals.items() if a.decision is None]
                                   or list(journal.approvals))
        if journal is not None and not self.replace and _started_anew(journal, transcript, self.start):
            # A run stopped among the tools of a reply the transcript does not hold (its lease lapsed), and this
            # run brings new input after the transcript that reply answered. The first save would drop the
            # journal with the reply: a finished call's result lost, and a model asked afresh free to run
            # again what ran. So the reply goes back in its place, each call closed as it stands (its result
            # kept, a started non-idempotent call's outcome unknown, the rest not run), before the input.
            self._put_back(journal, transcript, _superseded)
            log.info("session %r: a stopped run's reply (%d call(s), %d started, %d result(s) kept) is closed "
                     "before the new input", self.session, len(journal.reply.tool_calls), len(journal.started),
                     len(journal.results))
            return
        if journal is not None and journal.answers(transcript, self.start) and self._is_stored(transcript):
            self.journal = journal  # the reply waits in the journal: finish it
            self.journal_text = text
            transcript.append(journal.reply)
            return
        if not unanswered(transcript):
            return
        if journal is not None and transcript[-1] == journal.reply and journal.answers(transcript[:-1], self.start):
            try:
                waits = self._is_stored(transcript[:-1])
            except TranscriptConflict as exc:
                if exc.stored != len(transcript):
                    raise
                if self._is_stored(transcript):
                    self.journal = journal  # the reply is stored with its calls (a cut fork, a plain save): finish it
                    return
            else:
                if waits:  # the caller gave back the reply that waits in the journal: as above, write nothing
                    self.journal = journal
                    self.journal_text = text
                    return
        try:
            self._save(transcript[:-1], take_steers=False)
        except TranscriptConflict as exc:
            if exc.stored != len(transcript):
                raise
            self._save(transcript, take_steers=False)  # stored with its calls already, and no journal

    def _read_from_now(self, transcript: Sequence[Message]) -> None:
        """Before the run's first write: were the messages read from this session read from it as it is now?
        Not when it was deleted or pruned since (``messages.read_from``): then the compare-and-swap would
        see an empty transcript, a prefix of anything, and write the erased conversation back. Checked
        once the lease is held: from here on a delete fences this run out (``LeaseLost``) and prune passes
        it by, so nothing can erase the session between this read and the write that follows."""
        read = incarnations_read(transcript, self.session)
        if not read or not isinstance(self.store, LifecycleStore):
            return  # nothing was read from this session (a new conversation), or this store cannot erase it
        if self.start and isinstance(self.store, TailStore):
            # The last message, read from the end, carries the incarnation: no count of a long transcript.
            first, last = self.store.read_back(self.session, None, 1)
            if read != incarnations_read(last, self.session):
                raise TranscriptDeleted(self.session, first + len(last), self.start + len(transcript))
            return
        info = self.store.info(self.session)
        if info is None or read != {info.created}:
            raise TranscriptDeleted(self.session, 0 if info is None else info.messages, len(transcript))

    def _begins_turn(self, transcript: Sequence[Message]) -> bool:
        """Does ``transcript`` bring a user's message of its own, one the stored transcript does not hold
        where it stands (a new turn), rather than only what a resume adds (the waiting reply, its results)?
        Compared from where the two part, not from the stored one's end: a history replaced on purpose
        (``replace_transcript``, an edited question) may be no longer than the stored one. Asked only of a
        run handed a cancel."""
        stored = self.store.messages(self.session)[self.start:]
        same = 0
        while same < min(len(stored), len(transcript)) and stored[same] == transcript[same]:
            same += 1
        return any(m.role is Role.USER and m.text for m in transcript[same:])

    def _steers_wait(self) -> bool:
        """Are steers waiting (new input for the session), as a store with the lifecycle can tell without
        taking them? Asked only of a run handed a cancel."""
        return isinstance(self.store, LifecycleStore) and bool(self.store.pending_steers(self.session))

    def _put_back(self, journal: Journal, transcript: list[Message],
                  result: Callable[[Journal, Content], Content]) -> None:
        """The journal's reply back in its place in ``transcript``, followed by ``result`` of each of its calls,
        before the new input that follows the transcript it answered (``_started_anew``)."""
        at = journal.at - self.start
        transcript[at:at] = [journal.reply, Message(Role.USER, [result(journal, c) for c in journal.reply.tool_calls])]

    @staticmethod
    def _closing(journal: Journal, call: Content) -> Content:
        """The result a call of a cancelled turn's reply gets when the turn is closed: what it had, or that
        it was not run (``approvals.closing_result``)."""
        approval = journal.approvals.get(call.id)
        if call.id not in journal.results and approval is not None and approval.decision is None:
            return Content.tool_result(call.id, approvals.CANCELLED_WAITING, is_error=True)
        return approvals.closing_result(journal, call)

    def _is_stored(self, msgs: Sequence[Message]) -> bool:
        """The compare-and-swap of a run that finishes a journalled reply: ``msgs`` must be exactly what is
        stored, so nothing is written and the journal stays until the results are saved. ``False`` when it
        is not but the run replaces the history on purpose (its first save then drops the journal)."""
        try:
            self._save(msgs, take_steers=False, replace=False)
        except TranscriptConflict:
            if self.replace:
                return False
            raise
        return True

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        saved = self._save(transcript, take_steers=True)
        self.closing = False  # the cancelled turn is closed in the store (its cancel spent): the new turn goes on
        transcript.extend(Message.user(t) for t in saved.steers)
        self.journal = None  # the save holds the reply and its results: the store dropped the journal
        return saved.steers, saved.cancelled

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        at = len(transcript) - 1
        if self.journal is not None and self.journal.at == self.start + at:
            return  # resuming it
        self.journal = Journal(self.start + at, fingerprint(transcript, at), transcript[at])
        self.journal_text = None
        self.fresh = None

    def approvals(self, spec: Spec, step: int, emit: Sink) -> tuple[list[Content], bool]:
        for _ in range(approvals.ATTEMPTS):  # each look again follows a change by someone else: bounded
            outcome = self._approvals_once(spec, step, emit)
            if outcome is not None:
                return outcome
        raise StoreError(f"session {self.session!r}: the journal changed under each of {approvals.ATTEMPTS} "
                         f"looks at its approvals")

    def _approvals_once(self, spec: Spec, step: int, emit: Sink) -> tuple[list[Content], bool] | None:
        """``approvals``, or ``None`` to look again (the journal changed under a write)."""
        journal = self.journal
        assert journal is not None
        if self.closing:
            return _NO_APPROVALS  # a cancelled turn's reply: its calls are closed unrun (``replay``)
        needing = [c for c in journal.reply.tool_calls if c.id in journal.approvals or _asks(spec, c, journal)]
        if not needing:
            return _NO_APPROVALS
        new = [c for c in needing if c.id not in journal.approvals]
        if new:
            now = time.time()
            for call in new:
                tool = spec.tool(call.name)
                seconds = None if tool is None else spec.deadline_seconds(tool)
                journal.approvals[call.id] = Approval(now, approvals.deadline_of(seconds, now))
            if not self._store_approvals():
                return None  # decided meanwhile: look again
            if self.fresh:
                return [], True
            for call in new:
                emit.approval_requested(step, call)
        elif any(approvals.expired(journal.approvals[c.id], time.time()) for c in needing):
            self._expire()
            return None
        waiting = [c for c in needing if self.journal.approvals[c.id].decision is None]  # type: ignore[union-attr]
        if waiting:
            if self.fresh is None and self._check():
                # A cancel reached this run (session.cancel() found it holding the lease, so did not close
                # the turn itself): close it here, deciding the undecided calls "cancel" as close_waiting
                # does, by compare-and-swap, so a concurrent person's decision is kept or refused.
                assert isinstance(self.store, ApprovalStore)
                approvals._decide_rest(self.store, self.session)
                self._reload()
                return [], True
            return waiting, False
        for call in needing:
            decision = self.journal.approvals[call.id].decision  # type: ignore[union-attr]
            assert decision is not None
            emit.approval_decided(step, call, decision.approved, decision.reason, decision.by)
        return _NO_APPROVALS

    def _store_approvals(self) -> bool:
        """Write the journal naming the calls that wait. ``False`` when a resumed journal changed under
        it (then it is read again). Sets ``fresh`` to the cancel flag the write returned."""
        assert self.journal is not None
        text = self.journal.to_json()
        if self.journal_text is None:
            self.fresh = self._put_journal(text, unless_cancelled=True)
            self.journal_text = None if self.fresh else text
            return True
        assert isinstance(self.store, ApprovalStore)
        if self.store.swap_journal(self.session, self.journal_text, text):
            self.journal_text = text
            return True
        self._reload()
        return False

    def _expire(self) -> None:
        """Count the calls undecided past their deadline as denied, by compare-and-swap (a person's
        decision stored first stands)."""
        assert isinstance(self.store, ApprovalStore) and self.journal is not None
        for _ in range(approvals.ATTEMPTS):
            now = time.time()
            for approval in self.journal.approvals.values():
                if approvals.expired(approval, now):
                    approval.decision = Decision(False, "the approval deadline passed", now, "deadline")
            text = self.journal.to_json()
            if self.journal_text is not None and self.store.swap_journal(self.session, self.journal_text, text):
                self.journal_text = text
                return
            self._reload()
        raise StoreError(f"session {self.session!r}: the journal kept changing while its expired "
                                   f"approvals were denied")

    def _reload(self) -> None:
        assert self.journal is not None
        text = self.store.journal(self.session)
        journal = None if text is None else Journal.from_json(text, f"session {self.session!r}")
        if journal is None or (journal.at, journal.digest) != (self.journal.at, self.journal.digest):
            raise StoreError(f"session {self.session!r}: the journal of the reply being run vanished "
                                       f"while this run held the session")
        self.journal, self.journal_text = journal, text

    def approval(self, call: Content) -> Approval | None:
        assert self.journal is not None
        return self.journal.approvals.get(call.id)

    def pending(self, calls: Sequence[Content]) -> list[PendingApproval]:
        if not calls:
            return []
        assert self.journal is not None
        out = []
        for call in calls:
            approval = self.journal.approvals[call.id]
            out.append(PendingApproval(call.id, call.name, call.arguments, when(approval.asked),
                                       None if approval.deadline is None else when(approval.deadline)))
        return out

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        assert self.journal is not None
        if self.closing:  # the resumed reply of a cancelled turn: nothing of it runs
            return self._closing(self.journal, call)
        done = self.journal.results.get(call.id)
        if done is not None:
            return done
        if call.id in self.journal.started and tool is not None and not tool.idempotent:
            return Content.tool_result(call.id, UNKNOWN_OUTCOME, is_error=True)
        return None

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        assert self.journal is not None
        if tool is not None and not tool.idempotent:
            self.journal.started.append(call.id)
            # Not listening: what the watch would say before this write is never asked (the tool's own
            # journal write, ``ran``, or the save after the reply's last call, is the next read), and on
            # SQLite asking costs a statement (``stores.sqlite.Watch``).
            cancelled = self._put_journal(self.journal.to_json(), unless_cancelled=True, listen=False)
            if cancelled:  # nothing was written: the call never starts, and the journal never says it did
                self.journal.started.pop()
        elif self.fresh is not None:
            cancelled = self.fresh
        else:
            cancelled = self._cancelled()
        self.fresh = None
        return not cancelled

    def _cancelled(self) -> bool:
        """The check before an idempotent tool. Where the store pushes cancels, what it pushed, when that
        answers: a cancel of this lease was heard, or none can have been committed since the run's last
        read of the flag without being heard by the time of asking (``CancelWatcher``, docs/runs/leases.md).
        Otherwise (a plain RunStore, or the store not listening since before that read) a read of the
        lease."""
        if self.watch is not None:
            pushed = self.watch.cancelled(self.since)
            if pushed is not None:
                return pushed
        return self._check()

    # The run's reads of its cancel flag: each notes what the watch said just before it, for ``_cancelled``.

    def _listening(self) -> object | None:
        return None if self.watch is None else self.watch.listening()

    def _check(self) -> bool:
        since = self._listening()
        cancelled = self.store.check(self.session, self.lease.holder)
        self.since = None if cancelled else since
        return cancelled

    def _put_journal(self, text: str, *, unless_cancelled: bool = False, listen: bool = True) -> bool:
        since = self._listening() if listen else None
        try:
            cancelled = self.store.put_journal(self.session, self.lease.holder, text,
                                               unless_cancelled=unless_cancelled)
        except OutcomeUnknown as exc:
            cancelled = self._journalled(text, exc, unless_cancelled)
        self.since = None if cancelled else since
        return cancelled

    def _journalled(self, text: str, exc: OutcomeUnknown, unless_cancelled: bool) -> bool:
        """A journal write that went unanswered: read the journal back, then the lease (as ``_landed`` does
        for a save), and answer as the write would have. Landed: the run goes on, so a call it marked
        started runs now (once: nobody else can have run it) and the calls it asked approval for are
        announced (``approval_requested``), where failing would leave a resume to call the one's outcome
        unknown and never announce the others. Not landed and the run cancelled, for a write that would
        not land once it was: not written, cancelled. Otherwise, or when a read fails too, ``exc``."""
        def read() -> tuple[bool, bool]:
            return self.store.journal(self.session) == text, self.store.check(self.session, self.lease.holder)

        landed, cancelled = self._read_back("a journal write", exc, read)
        if landed:
            log.warning("session %r: a journal write went unanswered (%s); read back, it had landed: the run "
                        "goes on", self.session, exc)
            return cancelled and not unless_cancelled  # it was written, so it was not refused for a cancel
        if unless_cancelled and cancelled:
            return True
        raise exc

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None:
        assert self.journal is not None
        self.journal.results[result.tool_call_id] = result
        if tool is None or tool.idempotent:
            return
        if call.id != self.journal.reply.tool_calls[-1].id:
            # Other calls run before the next save: journal this result, so a crash among them replays it
            # rather than call its outcome unknown. After the reply's last call the save comes at once and
            # carries it (or, should the run fail first, ``__exit__`` journals it).
            self.fresh = self._put_journal(self.journal.to_json())
        else:
            self.unwritten = True

    def finish(self, transcript: list[Message], result: Result) -> None:
        if result.stop_reason == "cancelled":
            # A cancel is of the turn however it reached the run (``Run.cancel()`` sets only this process's
            # flag): the lease is marked, and its release keeps the mark for whichever run goes on with the
            # turn (``approvals.cancel``). One round trip, only for a run that was cancelled.
            self.store.cancel(self.session)
        if self.publisher is None:
            if len(transcript) != self.written:
                self._save(transcript, take_steers=False)
        else:
            with self.publisher.lock:  # the watcher must not write ``finished`` before the save it rides in
                finished = self.publisher.finishing(result)
                try:
                    if len(transcript) != self.written:
                        self._save(transcript, take_steers=False)
                    else:
                        self.publisher.flush()
                except BaseException:
                    self.publisher.buffer.remove(finished)  # the run fails instead: ``failed`` is its last event
                    raise
        self._end_turn(transcript, result)

    def _end_turn(self, transcript: Sequence[Message], result: Result) -> None:
        """The run returns, so its turn has ended however it ended: a turn it leaves open in the transcript
        (stopped at ``max_steps`` after tool results, or waiting for decisions) is no stranded run, and no
        sweep may run it again (with a fresh budget). Its mark is cleared under this run's own lease, only
        while nothing came since (a steer, a queued message, a decision, which are new input: the mark
        stays for the sweep). A cancelled turn is kept from the sweep by its cancel, handed on. One round
        trip, only for a run that ends without an answer."""
        if result.stop_reason not in ("max_steps", "awaiting_approval") or not isinstance(self.store,
                                                                                          LifecycleStore):
            return
        if not turn_open(transcript) and result.stop_reason == "max_steps":
            return
        journal = self.journal_text if result.stop_reason == "awaiting_approval" else None
        self.store.mark_finished(self.session, self.lease.holder, journal)

    def _save(self, msgs: Sequence[Message], take_steers: bool, replace: bool | None = None) -> Saved:
        """``replace``: by default, the spec's, for the run's first write only. The events buffered so far
        ride in it, pointing at the messages it writes (``Publisher.render``)."""
        if replace is None:
            replace = self.replace and self.written < 0
        since = self._listening()
        if self.publisher is None:
            try:
                saved = self.store.save_fenced(self.session, self.lease.holder, msgs, take_steers=take_steers,
                                               replace=replace, **self._from)
            except OutcomeUnknown as exc:
                saved = self._landed(msgs, exc)
        else:
            with self.publisher.lock:  # no event is written by the watcher between these and after them
                records = self.publisher.take()
                try:
                    try:
                        saved = self.event_store.save_fenced_events(
                            self.session, self.lease.holder, msgs, take_steers=take_steers, replace=replace,
                            events=self.publisher.render(records, msgs, self.start), keep=self.events_kept,
                            **self._from)
                    except OutcomeUnknown as exc:
                        saved = self._landed(msgs, exc)  # landed: its events are in the log, with its messages
                except BaseException:
                    self.publisher.restore(records)  # not written: the next write (or ``failed``'s) takes them
                    raise
        self.since = None if saved.cancelled else since
        self.written = len(msgs) + len(saved.steers)
        self.unwritten = False
        return saved


    def _landed(self, msgs: Sequence[Message], exc: OutcomeUnknown) -> Saved:
        """A save that went unanswered: read the session back, then the lease. If it landed (the session
        holds ``msgs``, and after them the steers it took) and the lease is still this run's, the run goes on
        as if the answer had come: nothing is written twice (its events, its steers), and the cancel flag is
        the one the check reads. The lease is read after the transcript: while it is still ours, nobody else
        wrote the session in between, so what follows ``msgs`` is the steers this save took (a resume on
        another worker that took the session meanwhile is ``LeaseLost`` here, and a delete makes the read
        find nothing: not landed). If it did not land, or a read fails too, ``exc`` fails the run."""
        def read() -> tuple[list[Message], bool, bool]:
            stored = self.store.messages(self.session)[self.start:]
            landed = _holds(stored, msgs)
            return stored, landed, self.store.check(self.session, self.lease.holder) if landed else False

        stored, landed, cancelled = self._read_back("a save", exc, read)
        if not landed:
            raise exc
        steers = [m.text for m in stored[len(msgs):]]
        log.warning("session %r: a save went unanswered (%s); read back, it had landed (%d steer(s) taken): "
                    "the run goes on", self.session, exc, len(steers))
        return Saved(steers, cancelled)

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


def _holds(stored: Sequence[Message], msgs: Sequence[Message]) -> bool:
    """Does ``stored`` begin with ``msgs`` (as far as a save that may have landed can tell: its length and its
    last message; before the save the session held fewer)?"""
    return bool(msgs) and len(stored) >= len(msgs) and stored[len(msgs) - 1] == msgs[-1]


def _superseded(journal: Journal, call: Content) -> Content:
    """What a call of a stopped run's reply gets when new input comes first: as a closed turn's call
    (``approvals.closing_result``: its result, "outcome unknown" if it started and is not idempotent), else
    that it was not run again."""
    return approvals.closing_result(journal, call, NOT_RUN_SUPERSEDED)


def _started_anew(journal: Journal, transcript: Sequence[Message], start: int) -> bool:
    """Does ``transcript`` (the stored one from index ``start`` on) go on from the one the journal's reply
    answered with other messages than the reply: a new turn, which would drop the reply waiting for
    decisions?"""
    at = journal.at - start
    return 0 <= at < len(transcript) and transcript[at] != journal.reply and journal.answers(transcript[:at], start)


def _asks(spec: Spec, call: Content, journal: Journal) -> bool:
    """Does ``call`` need a decision it was not asked for yet? Not once it has started or has a result."""
    if call.id in journal.results or call.id in journal.started:
        return False
    tool = spec.tool(call.name)
    return tool is not None and tool.asks_approval(call)


def keeping(spec: Spec, *, continuing: bool = False, start: int = 0, lease: Lease | None = None) -> Keeping:
    """How the run of ``spec`` keeps its transcript. ``continuing``: the run goes on with a turn already begun
    (``Runner.turn`` delivered again), never begins one (see ``Leased.resume``). ``start``: the run was given
    the stored transcript from that index on (a ``Tail``), which only a ``TailStore`` can save. ``lease``:
    taken already, by a turn that waited for the session (``busy``); the run holds it from here and
    releases it."""
    session = spec.session
    if start and session is not None and not (is_run_session(session) and isinstance(session.store, TailStore)):
        raise ArgumentError(
            f"the run was given the stored transcript from message {start} on (a Tail), which only a session over "
            f"a store implementing agent_sessions.contract.TailStore can save: give it the whole transcript"
        )
    if start and spec.replace_transcript:
        raise ArgumentError("Spec.replace_transcript replaces the whole stored transcript: give the run all of it, "
                            "not a Tail")
    if spec.publish_events and not (
        session is not None and is_run_session(session) and isinstance(session.store, EventStore)
    ):
        raise ArgumentError(
            "Spec.publish_events writes the run's events to the session's store: give the spec a session over a "
            "store implementing agent_sessions.EventStore"
        )
    if spec.asks_approval and not (
        session is not None and is_run_session(session) and isinstance(session.store, ApprovalStore)
    ):
        raise ArgumentError(
            "a tool of this spec needs approval, and decisions are kept in the session's store: give the spec a "
            "session over a store implementing agent_sessions.ApprovalStore (all of the library's "
            "stores but a plain Store do)"
        )
    if session is None:
        return NOT_KEPT
    if is_run_session(session):
        return Leased(session, spec, continuing=continuing, start=start, lease=lease)
    return Kept(session)


def _store_steers(add: Callable[[str], object], session: str, steers: Sequence[str]) -> list[str]:
    """Add each of ``steers``, in order, until one fails; return the rest (that one included)."""
    for i, text in enumerate(steers):
        try:
            add(text)
        except AgentError as exc:
            log.warning("session %r: %d steer(s) given to the failed run could not be kept as waiting steers "
                        "(%s); they are handed back on its exception", session, len(steers) - i, exc)
            return list(steers[i:])
    if steers:
        log.info("session %r: %d steer(s) given to the failed run kept as waiting steers", session, len(steers))
    return []


def _stored_as(read: Callable[[], list[Message]], transcript: Sequence[Message]) -> bool | None:
    try:
        stored = read()
    except AgentError as exc:
        log.warning("could not read the session back after a save that went unanswered: %s", exc)
        return None
    return _holds(stored, transcript)
