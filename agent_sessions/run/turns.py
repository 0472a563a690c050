"""A turn that is safe to repeat (``Runner.turn``: a task queue delivers at least once): its message is
stored with its key, so a repeat finds it and goes on with the turn where a dead worker left it, or says how
it ended, with no request (docs/lifecycle.md, "A turn that is safe to repeat"). Two deliveries at once
cannot both append: a leased run's first write is a compare-and-swap, so the later one gets
``TranscriptConflict``, reads again and finds the key. That is why a turn needs a session over a RunStore.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol

from ..contract import RunSession, is_run_session
from ..endpoints import Endpoint
from ..errors import ArgumentError, TranscriptConflict, TranscriptDeleted
from ..events import Compacted, Event, Events, Failed, SteerApplied, StepStarted
from ..journal import Journal
from ..lease import Lease
from ..messages import Message, Role
from ..result import Result, StopReason
from ..spec import Spec


class Run(Protocol):
    """How a turn runs its messages (``Runner._turn_run``): told whether it goes on with its turn (a cancel
    handed with the lease stops a run going on with it), and handed the lease it runs under (taken by the
    caller, released by the run), or ``None`` to take its own."""

    def __call__(self, spec: Spec, msgs: list[Message], endpoint: Endpoint, events: Events | None,
                 continuing: bool, lease: Lease | None = None) -> Result: ...

log = logging.getLogger(__name__)

ATTEMPTS = 5
"""Reads of the transcript a turn makes at most: each conflict means another delivery saved meanwhile."""


def run_session(spec: Spec, key: object) -> RunSession:
    """The session a turn runs in, once its arguments are checked: ``Spec.session`` over a RunStore."""
    session = spec.session
    if session is None or not is_run_session(session):
        raise ArgumentError("Runner.turn needs Spec.session over a RunStore: only a leased, fenced run can tell a "
                            "repeated delivery from a new turn")
    if not isinstance(key, str) or not key:
        raise ArgumentError(f"Runner.turn(key=) must be a non-empty str, got {key!r}")
    return session


def turn(run: Run, spec: Spec, text: str, key: str, endpoint: Endpoint, events: Events | None) -> Result:
    session = run_session(spec, key)
    message = Message.user(text, key=key)
    conflict: TranscriptConflict | None = None
    for _ in range(ATTEMPTS):
        stored = session.messages()
        at = keyed(stored, key)
        continuing = at is not None
        if at is None:
            todo = [*stored, message]
        else:
            planned = plan(session, spec, stored, message, at)
            if isinstance(planned, Result):
                return planned
            spec, todo = planned
        attempt = _Attempt(events)
        try:
            return run(spec, todo, endpoint, None if events is None else attempt, continuing)
        except TranscriptDeleted:
            attempt.report()
            raise  # the conversation was erased after our read: answering it would bring it back
        except TranscriptConflict as exc:  # another delivery (or run) saved after our read: read again
            log.info("session %r: turn %r: %s", session.id, key, exc)
            conflict = exc
            last = attempt
        except BaseException:
            attempt.report()
            raise
    assert conflict is not None
    last.report()
    raise conflict


def plan(session: RunSession, spec: Spec, stored: list[Message], message: Message, at: int
         ) -> Result | tuple[Spec, list[Message]]:
    """What a turn whose message is stored at ``at`` does: the Result to return as it is, or the spec (with
    what is left of the turn's budget) and the transcript to go on with."""
    key = message.key
    if stored[at] != message:
        raise ArgumentError(f"session {session.id!r}: the turn key {key!r} is already used by message {at}, whose text "
                            f"differs from this one; a key names one message")
    answer = answered(stored, at, spec.max_steps)
    if answer is not None:
        log.info("session %r: turn %r was answered already; returning its answer", session.id, key)
        return ended(stored, "answered", answer.text)
    later = _later_turn(stored, at)
    if later is not None and replies(stored[:later], at) >= spec.max_steps:
        # It stopped at its budget before the later turn came: that is how it ended.
        log.info("session %r: turn %r stopped at max_steps before a later turn came", session.id, key)
        return ended(stored, "max_steps")
    if later is not None:
        # Another turn's message followed this one's before it was answered: that turn takes both up,
        # with its own budget and outcome.
        log.info("session %r: turn %r was taken up by the later turn %r before it was answered", session.id,
                 key, stored[later].key)
        return ended(stored, "superseded")
    waiting = _reply_waiting(session, stored)
    # A keyed steer that joined a turn in progress is that turn's: its budget was spent from where that turn
    # began, not from the steer (counted from the steer, a repeat would go on with a turn that had ended).
    budget = spec.max_steps
    made = replies(stored, at if begins(stored, at, budget) else turn_start(stored[:at + 1], budget)) + waiting
    if made >= spec.max_steps and not waiting:
        log.info("session %r: turn %r stopped at max_steps (%d requests) already", session.id, key, made)
        return ended(stored, "max_steps")
    log.info("session %r: turn %r is unfinished; continuing it", session.id, key)
    # What is left of the turn's budget: a turn makes max_steps requests in all, however often it is
    # delivered. A turn that was cancelled stops at once: its lease hands the cancel on.
    return replace(spec, max_steps=max(0, spec.max_steps - made)), stored  # 0: only finish the waiting reply


def ended(stored: list[Message], reason: StopReason, text: str = "") -> Result:
    """The Result of a turn that ended before this delivery: as it stands, no request made."""
    return Result(messages=stored, text=text, steps=0, stop_reason=reason, unapplied_steers=[])


class Held:
    """Events held back from a turn's listener (``held``) until they are known to be its turn's: ``report``
    hands them on, and everything after."""

    def __init__(self, events: Events | None) -> None:
        self.events = events
        self.held: list[Event] | None = []
        """What came before it was known; ``None`` once it is."""

    def report(self) -> None:
        held, self.held = self.held or [], None
        if self.events is not None:
            for event in held:
                self.events(event)


class _Attempt(Held):
    """The events of one attempt of a turn. An attempt refused at its first write (another delivery saved)
    is absorbed by the turn, which reads again: its listener must never hear of it. So what comes before that
    write, and a ``Failed``, are held back until the write is past or the turn gives up (``report``)."""

    def __call__(self, event: Event) -> None:
        if self.events is None:
            return
        if self.held is not None:
            if isinstance(event, (StepStarted, Compacted, SteerApplied, Failed)):
                self.held.append(event)
                return
            held, self.held = self.held, None
            for early in held:
                self.events(early)
        elif isinstance(event, Failed):
            self.held = [event]  # after the first write a failure is the turn's own: ``report`` says it
            return
        self.events(event)


def keyed(msgs: Sequence[Message], key: str) -> int | None:
    """The index of the message keyed ``key``, searched from the end (a turn is usually the latest)."""
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].key == key:
            return i
    return None


def _reply_waiting(session: RunSession, stored: Sequence[Message]) -> int:
    """1 when a reply of the turn waits in the journal to follow ``stored``: a request the transcript does not
    hold yet."""
    journal = Journal.of(session.store.journal(session.id), session.id)
    return int(journal is not None and journal.answers(stored))


def _later_turn(msgs: Sequence[Message], at: int) -> int | None:
    """The index of the first message after ``at`` that begins another turn (a user message with text that came
    as no steer: a steer joins the turn it lands in), or ``None``."""
    for i in range(at + 1, len(msgs)):
        if msgs[i].role is Role.USER and msgs[i].text and not msgs[i].steer:  # no tool result, no record
            return i
    return None


def begins(msgs: Sequence[Message], i: int, budget: int | None = None) -> bool:
    """Does user message ``i`` begin a turn: it came as no steer, or as a steer after the turn before it had
    ended with an answer (or with nothing before it), or, given the turn's ``budget`` (its ``max_steps``),
    after that turn had made its ``budget`` requests (a run in it stops there, so a later run took the steer:
    the ``"steer"`` caller's, the sweep's), so no run was in a turn for it to join?"""
    if not msgs[i].steer:
        return True
    return dict(_beginnings(msgs[:i + 1], budget))[i]  # a steer is a user message: it has its entry


def _beginnings(msgs: Sequence[Message], budget: int | None) -> Iterator[tuple[int, bool]]:
    """Each user message's index and whether it begins a turn (``begins``), in one pass: worked out again for
    each steer, they would cost time exponential in the steers of one long turn."""
    before: Message | None = None  # the last message that came as no steer
    made = 0  # the replies since the last user message with text that began a turn
    for i, message in enumerate(msgs):
        if message.role is Role.USER:
            starts = (not message.steer or before is None
                      or (before.role is Role.ASSISTANT and not before.tool_calls)
                      or (budget is not None and made >= budget))
            yield i, starts
            if starts and message.text:
                made = 0
        elif message.role is Role.ASSISTANT:
            made += 1
        if not message.steer:
            before = message


def running(msgs: Sequence[Message], continuing: bool) -> str | None:
    """The key of the turn a run of ``msgs`` runs: a new turn's (its keyed message ends them), or, going on
    with one, the last keyed user message's; ``None`` for a plain run."""
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].role is Role.USER and msgs[i].key:
            return msgs[i].key if continuing or i == len(msgs) - 1 else None
        if not continuing:
            return None
    return None


def turn_start(msgs: Sequence[Message], budget: int | None = None) -> int:
    """Where the transcript's last turn begins: its last user message with text that begins one (a plain run's
    message, or steers that came when no turn was in progress: ``begins``, given the turns' ``budget``); -1
    when it has none."""
    return max((i for i, starts in _beginnings(msgs, budget) if starts and msgs[i].text), default=-1)


def replies(msgs: Sequence[Message], at: int) -> int:
    """The model's replies to the turn starting at ``at``: the requests it has made."""
    return sum(1 for m in msgs[at + 1:] if m.role is Role.ASSISTANT)


def answered(msgs: Sequence[Message], at: int, budget: int | None = None) -> Message | None:
    """The reply that answered the turn starting at ``at``: the first later reply with no tool calls, among
    the first ``budget`` replies (its ``max_steps``: a reply past them answered something after the turn
    had stopped, a later run's). ``None`` while the turn is unfinished (a worker died in it, or it stopped
    before an answer)."""
    made = 0
    for message in msgs[at + 1:]:
        if message.role is Role.ASSISTANT:
            made += 1
            if budget is not None and made > budget:
                return None
            if not message.tool_calls:
                return message
    return None
