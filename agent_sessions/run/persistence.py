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
from collections.abc import Callable, Sequence
from typing import Literal

from .. import approvals
from ..contract import RunSession, Session, is_run_session
from ..errors import AgentError, ArgumentError, AwaitingApproval, LeaseLost, TranscriptConflict
from ..events import Sink
from ..journal import NOT_RUN_SUPERSEDED, Journal
from ..lease import Lease
from ..messages import Content, Message, Role, turn_open, unanswered
from ..result import Result
from ..spec import Spec
from .calls import NO_CALLS, Calls, NoCalls, closing
from .publisher import Publisher
from .writes import Writes, holds

log = logging.getLogger(__name__)


class Keeping:
    """How a run keeps its transcript; this base keeps nothing (``NOT_KEPT``)."""

    saves = False
    """Whether ``before_request`` and ``finish`` write anything (for the Saved events)."""
    stopped = False
    """Set by ``resume``: the turn this run goes on with was cancelled before it, so it starts nothing (not
    even the save before its first request, which would take the steers waiting for the next turn)."""
    calls: NoCalls = NO_CALLS
    """How the reply's tool calls run: journalled (``Calls``), for a leased run."""

    @property
    def epoch(self) -> int | None:
        """The epoch of the lease the run holds (for its log lines); ``None`` when it holds none."""
        return None

    def __enter__(self) -> Keeping:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        pass

    def publishing(self, emit: Sink) -> Sink:
        """The sink the loop reports to: ``emit``, or with ``Spec.publish_events`` a ``Publisher`` around it
        whose events go to the session's log."""
        return emit

    def resume(self, transcript: list[Message]) -> None:
        """Before the loop starts: put back a reply whose tools a dead run was running."""

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        """Take the steers waiting, append them to ``transcript`` and save it; return those steers and
        whether somebody asked the run to stop."""
        return (), False

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        """The last message of ``transcript`` is a reply whose tool calls are about to run."""

    def store_steers(self, steers: Sequence[str]) -> list[str]:
        """Store ``steers`` (given to this run, in no stored transcript) as the session's waiting steers, so
        the next run takes them; return those it could not store."""
        return list(steers)  # no session to keep them in

    def stored_as(self, transcript: Sequence[Message]) -> bool | None:
        """After a save that went unanswered: is ``transcript`` what the session holds? ``None``: unknown
        (no session, or the read failed)."""
        return None

    def finish(self, transcript: list[Message], result: Result) -> None:
        """The run returns ``result``: save what the last request's reply (and anything since) added."""


NOT_KEPT = Keeping()


class Kept(Keeping):
    """A plain Session: saves == requests + 1. Nothing fences it: two runs of one session both write."""

    saves = True

    def __init__(self, session: Session) -> None:
        self.session = session

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        steers = self.session.take_steers()
        transcript.extend(Message.user(t, steer=True) for t in steers)
        self.session.save(transcript)
        return steers, False

    def finish(self, transcript: list[Message], result: Result) -> None:
        self.session.save(transcript)

    def store_steers(self, steers: Sequence[str]) -> list[str]:
        session = str(getattr(self.session, "id", "?"))
        for i, text in enumerate(steers):
            try:
                self.session.steer(text)
            except AgentError as exc:
                return _kept(session, steers, list(steers[i:]), exc)
        return _kept(session, steers, [])

    def stored_as(self, transcript: Sequence[Message]) -> bool | None:
        return _stored_as(self.session.messages, transcript)


class Leased(Keeping):
    """A session over a RunStore. Per step: one fenced save before the request (which takes the steers and
    reports a cancel); before each tool call a cancel check (for a non-idempotent tool, the journal write
    saying it started; for the first call of a reply, the save before its request); every other result
    rides with the next write. The writes are ``Writes``'; the reply being run is ``Calls``'."""

    saves = True

    def __init__(self, session: RunSession, spec: Spec, *, continuing: bool = False, start: int = 0,
                 lease: Lease | None = None, turn: str | None = None) -> None:
        self.store = session.store
        self.session = session.id
        self.start = start
        """The index in the stored transcript of the run's first message (a ``Tail``'s)."""
        self.continuing = continuing
        """The run goes on with a turn already begun (``Runner.turn`` delivered again): a cancel handed with
        the lease is of that turn, whatever input waits."""
        self.new_input = lease is not None and not continuing
        """Handed a lease its caller took, and not going on with a turn: its caller took a queued message into
        the transcript under that lease (``busy``), or steers wait; either is new input, stored already."""
        self.turn = turn
        """The key of the turn this run runs (``Runner.turn``), recorded with its lease: a cancel handed to it
        that was of this very turn stops it, even when the turn's message was never stored."""
        self.lease = lease if lease is not None else Lease(self.store, self.session, spec.lease_ttl,
                                                           spec.lease_wait, spec.name, turn)
        self.replace = spec.replace_transcript
        self.writes = Writes(self.store, self.session, self.lease, start, spec.replace_transcript,
                             spec.events_kept)
        self.calls: Calls = Calls(self.writes)
        self.publish = spec.publish_events
        self.checked = False
        """The save before this step's request read the cancel flag and found none (``Calls.begin``)."""

    @property
    def epoch(self) -> int | None:
        return self.lease.holder.epoch

    def __enter__(self) -> Leased:
        self.lease.__enter__()
        try:
            self.writes.start_watching()  # the watch is of this lease: taken once the lease is
        except BaseException as exc:
            self.lease.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        try:
            self._before_release(exc)
        finally:
            # Whatever the way out: a lease left unreleased keeps its heartbeat renewing it, and the session
            # stays busy for as long as this process lives.
            self.lease.__exit__(kind, exc, tb)

    def _before_release(self, exc: object) -> None:
        """What goes before the release: the cancel watch closed, a failing run's tool results journalled
        and its events (with ``failed``) written, while the lease is still the run's."""
        self.writes.stop_watching()  # no tool starts from here on
        failing = isinstance(exc, BaseException)
        if failing and self.lease.lost is None and not isinstance(exc, LeaseLost):
            self.calls.keep_results()
        publisher = self.writes.publisher
        if publisher is not None:
            publisher.close()
            if isinstance(exc, BaseException) and self.lease.lost is None:
                if self.writes.written < 0 and isinstance(exc, (TranscriptConflict, AwaitingApproval)):
                    # Refused before it wrote anything: as far as the session goes this run did not happen,
                    # so it publishes nothing, not even ``failed``.
                    publisher.buffer.clear()
                else:
                    # Any other failure, even before the first write, is the run's: its events and ``failed``
                    # go to the log, while the lease is still the run's.
                    self.writes.held = False
                    publisher.failing(exc)

    def store_steers(self, steers: Sequence[str]) -> list[str]:
        try:
            left = self.store.give_back(self.session, self.lease.holder, steers)
        except AgentError as exc:
            return _kept(self.session, steers, list(steers), exc)
        return _kept(self.session, steers, left)

    def stored_as(self, transcript: Sequence[Message]) -> bool | None:
        return _stored_as(lambda: self.store.messages(self.session)[self.start:], transcript)

    def publishing(self, emit: Sink) -> Sink:
        if not self.publish:
            return emit
        publisher = self.writes.publisher = Publisher(emit, self.writes.append_events)
        publisher.start()
        return publisher

    # -- before the loop ---------------------------------------------------------------------------------------

    def resume(self, transcript: list[Message]) -> None:
        """Before the loop: what the run does with the turn it finds (``_handed``, ``_journalled``). Tools may
        run before the first request, so the compare-and-swap comes first, without writing a reply that waits
        for its results (the loop never stores a tool call without them)."""
        handed = self._handed(transcript)
        if handed == "stop":
            log.info("session %r: the turn this run goes on with was cancelled; stopping it", self.session)
            self.store.cancel(self.session)  # its own lease, whose release hands the cancel on again
            self.stopped = True
        elif handed == "close":
            log.info("session %r: the turn in progress was cancelled; closing it before the new input",
                     self.session)
            self.calls.closing = True
        text = self.store.journal_as_taken(self.session, self.lease.holder)
        journal = Journal.of(text, self.session)
        if journal is not None and self._journalled(journal, text, transcript):
            return
        if not unanswered(transcript):
            return
        if journal is not None and transcript[-1] == journal.reply and journal.answers(transcript[:-1], self.start):
            try:
                waits = self.writes.is_stored(transcript[:-1])
            except TranscriptConflict as exc:
                if exc.stored != len(transcript):
                    raise
                if self.writes.is_stored(transcript):
                    self.calls.resumed(journal, None)  # stored with its calls (a cut fork, a plain save): finish it
                    return
            else:
                if waits:  # the caller gave back the reply that waits in the journal: write nothing
                    self.calls.resumed(journal, text)
                    return
        try:
            self.writes.save(transcript[:-1], take_steers=False)
        except TranscriptConflict as exc:
            if exc.stored != len(transcript):
                raise
            self.writes.save(transcript, take_steers=False)  # stored with its calls already, and no journal

    def _handed(self, transcript: Sequence[Message]) -> Literal["close", "stop"] | None:
        """What a cancel handed with the lease (``RunStore.acquire``) makes of this run. With new input (a user's
        message of its own, or steers waiting) the cancelled turn is closed, its pending calls answered unrun
        ("close"). A run going on with the cancelled turn (``continuing``, the very turn whose cancel it was, or a
        resume bringing nothing new) stops before it starts anything ("stop")."""
        holder = self.lease.holder
        if not holder.cancelled:
            return None
        own = self.turn is not None and holder.turn == self.turn
        if not self.continuing and not own and (self.new_input or self._begins_turn(transcript)
                                                 or self.store.pending_steers(self.session)):
            return "close"
        return "stop"

    def _journalled(self, journal: Journal, text: str | None, transcript: list[Message]) -> bool:
        """What becomes of the reply waiting in the journal, before the run starts (``True``: settled here): put
        back closed where new input follows what it answered, refused where that would drop decisions or calls
        that ran, or finished by this run."""
        anew = _started_anew(journal, transcript, self.start)
        if self.calls.closing and anew:
            # The cancelled turn's reply waits in the journal while the new input follows the transcript it
            # answered: the reply goes back in its place, with its calls answered unrun, before the input.
            self._put_back(journal, transcript, closing)
            return True
        ran = bool(journal.started or journal.results)
        if anew and (ran or not self.replace):
            # A run stopped among the tools of a reply the transcript does not hold (its lease lapsed), and this
            # run brings new input after the transcript that reply answered. The first save would drop the
            # journal with the reply: a finished call's result lost, and a model asked afresh free to run again
            # what ran. So the reply goes back in its place, each call closed as it stands, before the input
            # (a history replaced on purpose too, where it still holds what the reply answered).
            if not self.replace and journal.approvals:
                raise AwaitingApproval(self.session, [c for c, a in journal.approvals.items()
                                                      if a.decision is None] or list(journal.approvals))
            self._put_back(journal, transcript, _superseded)
            if not self.replace:
                log.info("session %r: a stopped run's reply (%d call(s), %d started, %d result(s) kept) is closed "
                         "before the new input", self.session, len(journal.reply.tool_calls), len(journal.started),
                         len(journal.results))
            return True
        if journal.answers(transcript, self.start) and self.writes.is_stored(transcript):
            self.calls.resumed(journal, text)  # the reply waits in the journal: finish it
            transcript.append(journal.reply)
            return True
        if self.replace and ran:  # rather than forget a call that ran, nothing is written
            raise ArgumentError(
                f"session {self.session!r}: its last run stopped among the tools of a reply ({len(journal.started)} "
                f"call(s) started, {len(journal.results)} result(s) kept), which Spec(replace_transcript=True) "
                f"with this history would drop, outcome and all; nothing was written. Resume the session first "
                f"(Runner().run(spec, session.messages())), then replace its history")
        return False

    def _begins_turn(self, transcript: Sequence[Message]) -> bool:
        """Does ``transcript`` bring a user's message the stored transcript does not hold where it stands (a new
        turn), rather than only what a resume adds? Compared from where the two part: a history replaced on
        purpose may be no longer than the stored one. Asked only of a run handed a cancel."""
        stored = self.store.messages(self.session)[self.start:]
        same = 0
        while same < min(len(stored), len(transcript)) and stored[same] == transcript[same]:
            same += 1
        return any(m.role is Role.USER and m.text for m in transcript[same:])

    def _put_back(self, journal: Journal, transcript: list[Message],
                  result: Callable[[Journal, Content], Content]) -> None:
        """The journal's reply back in its place in ``transcript``, followed by ``result`` of each of its calls,
        before the new input that follows the transcript it answered (``_started_anew``)."""
        at = journal.at - self.start
        transcript[at:at] = [journal.reply, Message(Role.USER, [result(journal, c) for c in journal.reply.tool_calls])]

    # -- the steps -------------------------------------------------------------------------------------------

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        saved = self.writes.save(transcript, take_steers=True, closes=self.calls.closing)
        self.calls.closing = False  # the cancelled turn is closed in the store (its cancel spent): the new turn goes on
        keys = saved.keys if saved.keys is not None else [""] * len(saved.steers)
        transcript.extend(Message.user(t, key=k, steer=not (saved.began and i == 0))
                          for i, (t, k) in enumerate(zip(saved.steers, keys, strict=True)))
        self.calls.saved()
        # Where nothing pushes cancels, this save is the check before the reply's first call (a cancel that
        # comes while the model answers stops the run at its next write, or before the reply's next call).
        self.checked = not saved.cancelled and self.writes.watch is None
        return saved.steers, saved.cancelled

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        self.calls.begin(transcript, self.checked)
        self.checked = False

    # -- the end ---------------------------------------------------------------------------------------------

    def finish(self, transcript: list[Message], result: Result) -> None:
        if result.stop_reason == "cancelled":
            # A cancel is of the turn however it reached the run (``Run.cancel()`` sets only this process's
            # flag): the lease is marked, and its release hands the mark on (``approvals.cancel``).
            self.store.cancel(self.session)
        publisher = self.writes.publisher
        if publisher is None:
            if len(transcript) != self.writes.written:
                self._save_end(transcript)
        else:
            with publisher.lock:  # the watcher must not write ``finished`` before the save it rides in
                finished = publisher.finishing(result)
                try:
                    if len(transcript) != self.writes.written:
                        self._save_end(transcript)
                    else:
                        publisher.flush()
                except BaseException:
                    publisher.buffer.remove(finished)  # the run fails instead: ``failed`` is its last event
                    raise
        self._end_turn(transcript, result)

    def _save_end(self, transcript: Sequence[Message]) -> None:
        self.writes.save(transcript, take_steers=False)
        self.calls.unwritten = False

    def _end_turn(self, transcript: Sequence[Message], result: Result) -> None:
        """The run returns, so its turn has ended: one it leaves open (at ``max_steps`` after tool results, or
        waiting for decisions) is no stranded run for a sweep to run again. Its mark is cleared under this run's
        lease, only while no new input came since (then the mark stays for the sweep)."""
        if result.stop_reason not in ("max_steps", "awaiting_approval") or (
                result.stop_reason == "max_steps" and not turn_open(transcript)):
            return
        journal = self.calls.text if result.stop_reason == "awaiting_approval" else None
        self.store.mark_finished(self.session, self.lease.holder, journal)


def _superseded(journal: Journal, call: Content) -> Content:
    """What a call of a stopped run's reply gets when new input comes first: as a closed turn's call, else
    that it was not run again."""
    return approvals.closing_result(journal, call, NOT_RUN_SUPERSEDED)


def _started_anew(journal: Journal, transcript: Sequence[Message], start: int) -> bool:
    """Does ``transcript`` (the stored one from index ``start`` on) go on from the one the journal's reply
    answered with other messages than the reply: a new turn, which would drop the reply waiting for
    decisions?"""
    at = journal.at - start
    return 0 <= at < len(transcript) and transcript[at] != journal.reply and journal.answers(transcript[:at], start)


def keeping(spec: Spec, *, continuing: bool = False, start: int = 0, lease: Lease | None = None,
            turn: str | None = None) -> Keeping:
    """How the run of ``spec`` keeps its transcript. ``continuing``: the run goes on with a turn already begun.
    ``start``: the run was given the stored transcript from that index on (a ``Tail``). ``lease``: taken
    already, by a turn that waited for the session (``busy``); the run releases it. ``turn``: the key of the
    turn the run runs, if it runs one (``turns.running``)."""
    session = spec.session
    leased = session is not None and is_run_session(session)  # every capability below is a RunStore's
    if start and session is not None and not leased:
        raise ArgumentError(f"the run was given the stored transcript from message {start} on (a Tail), which only a "
                            f"session over a store implementing agent_sessions.contract.TailStore can save: give it "
                            f"the whole transcript")
    if start and spec.replace_transcript:
        raise ArgumentError("Spec.replace_transcript replaces the whole stored transcript: give the run all of it, "
                            "not a Tail")
    if spec.publish_events and not leased:
        raise ArgumentError("Spec.publish_events writes the run's events to the session's store: give the spec a "
                            "session over a store implementing agent_sessions.EventStore")
    if spec.asks_approval and not leased:
        raise ArgumentError("a tool of this spec needs approval, and decisions are kept in the session's store: give "
                            "the spec a session over a store implementing agent_sessions.ApprovalStore (all of the "
                            "library's stores but a plain Store do)")
    if session is None:
        return NOT_KEPT
    if is_run_session(session):
        return Leased(session, spec, continuing=continuing, start=start, lease=lease, turn=turn)
    return Kept(session)


def _kept(session: str, steers: Sequence[str], left: list[str], error: AgentError | None = None) -> list[str]:
    """Say what became of the ``steers`` given to a failed run (``left``: those not kept); return ``left``."""
    if error is not None:
        log.warning("session %r: %d steer(s) given to the failed run could not be kept as waiting steers "
                    "(%s); they are handed back on its exception", session, len(left), error)
    elif left:
        log.warning("session %r: %d steer(s) given to the failed run were not kept (its lease is gone: the "
                    "session was deleted or taken over); they are handed back on its exception", session, len(left))
    elif steers:
        log.info("session %r: %d steer(s) given to the failed run kept as waiting steers", session, len(steers))
    return left


def _stored_as(read: Callable[[], list[Message]], transcript: Sequence[Message]) -> bool | None:
    try:
        stored = read()
    except AgentError as exc:
        log.warning("could not read the session back after a save that went unanswered: %s", exc)
        return None
    return holds(stored, transcript)
