"""What ``Runner.turn`` does with a message that arrives while its session is busy (a live run holds its
lease, or messages wait in its queue): ``if_busy`` is ``"queue"`` (stored at once, answered in the order
accepted, each by a turn of its own), ``"steer"`` (a keyed steer for the running run), ``"reject"``
(``SessionBusy``, nothing written) or ``"interrupt"`` (the running run cancelled, then queued).
docs/runs/busy.md says what each does, and what each wait (bounded by ``Spec.lease_wait``) waits for.

Whatever the policy, a message whose key the transcript holds already is a repeat: ``turns.turn`` returns
its answer, or goes on with its unfinished turn.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, get_args

from ..contract import QueueStore, RunSession
from ..endpoints import Endpoint
from ..errors import ArgumentError, AwaitingApproval, SessionBusy, StillQueued, TranscriptDeleted
from ..events import Event, Events, ModelRequest
from ..journal import Journal
from ..lease import Lease
from ..messages import Message, Role, turn_open, unanswered
from ..result import Result
from ..spec import Spec
from ..values import Holder
from . import turns

Busy = Literal["queue", "steer", "reject", "interrupt"]
"""What ``Runner.turn`` does when the session is busy (this module)."""
POLICIES: tuple[str, ...] = get_args(Busy)

log = logging.getLogger(__name__)

POLL_MAX = 0.25
"""Seconds at most between two looks of a caller waiting for its steer's answer."""


def turn(run: turns.Run, spec: Spec, text: str, key: str, endpoint: Endpoint, events: Events | None,
         if_busy: str) -> Result:
    session = turns.run_session(spec, key)
    if if_busy not in POLICIES:
        raise ArgumentError(f"Runner.turn(if_busy=) must be one of {', '.join(map(repr, POLICIES))}, got {if_busy!r}")
    store = session.store
    if if_busy == "queue":
        return _queued(run, spec, session, text, key, endpoint, events)
    if turns.keyed(session.messages(), key) is not None:
        # A repeat (a task delivered again): what a turn always did, whatever the policy.
        return turns.turn(run, spec, text, key, endpoint, events)
    if if_busy == "reject":
        if store.queued(session.id):
            raise SessionBusy(f"session {session.id!r} has messages queued, and Runner.turn(if_busy='reject') "
                              f"does not wait: nothing was written", store.holder(session.id))  # type: ignore[arg-type]
        return turns.turn(run, replace(spec, lease_wait=0.0), text, key, endpoint, events)
    if if_busy == "steer":
        return _steered(run, spec, session, text, key, endpoint, events)
    if _delivered_again(session, key):
        # Its message waits in the queue or was taken from it since: the cancel was sent with the first
        # delivery. Sent again it would stop the turn now answering the queue: another caller's, or this
        # very message's.
        return _queued(run, spec, session, text, key, endpoint, events)
    held = store.holder(session.id)
    # Once per key: a delivery that died between this cancel and the enqueue below, delivered again,
    # must not stop whichever run holds the session by then (another caller's turn).
    if store.cancel(session.id, once=key):
        log.info("session %r is held by %s; turn %r cancelled that run, and waits up to %g s for the lease "
                 "(lease_wait)", session.id, "a run" if held is None else held.describe(), key, spec.lease_wait)
    # Stored after the cancel, as "queue" stores it: a wait that runs out (the cancelled run has not stopped
    # yet; lease_wait 0) leaves the message to the session's next holder or the sweep, not dropped. The
    # cancel comes first, so it cannot stop a run that has taken this very message.
    return _queued(run, spec, session, text, key, endpoint, events)


def _delivered_again(session: RunSession, key: str) -> bool:
    """Is ``key``'s message queued, or in the transcript? Read in that order: ``take_queued`` moves a message
    from the queue into the transcript in one step, so one taken between the two reads is found by the
    second (the caller's earlier look at the transcript came before the queue's)."""
    return key in session.store.queued(session.id) or turns.keyed(session.messages(), key) is not None


def _queued(run: turns.Run, spec: Spec, session: RunSession, text: str, key: str, endpoint: Endpoint,
            events: Events | None) -> Result:
    # Stored first, read after: a delete of the session between the two takes the queued message with it,
    # and the turn then finds it nowhere (``TranscriptDeleted``) rather than answer an erased conversation.
    position = session.store.enqueue(session.id, key, text)
    if turns.keyed(session.messages(), key) is not None:
        # A repeat (a task delivered again): what a turn always did. The transcript holds its message, so the
        # copy just queued (a key goes with its message into the transcript) waits for nothing.
        session.store.withdraw(session.id, key)
        return turns.turn(run, spec, text, key, endpoint, events)
    # INFO only where there is contention (a held lease is said by ``lease.Lease``'s own wait).
    if position > 1:
        log.info("session %r: turn %r queued at position %d, behind %d message(s); waiting up to %g s for the "
                 "session (lease_wait)", session.id, key, position, position - 1, spec.lease_wait)
    else:
        log.debug("session %r: turn %r queued at position %d", session.id, key, position)
    return _wait_and_answer(run, spec, session, key, endpoint, events)


def answer_queued(run: turns.Run, spec: Spec, key: str, endpoint: Endpoint, lease: Lease | None = None) -> Result:
    """Answer a session's queue from its head up to ``key``, queued already by a caller that is gone
    (``recover``); nothing is queued here. ``lease``: the session's, taken already, handed to the first turn."""
    session = turns.run_session(spec, key)
    if lease is None:
        stored = session.messages()
        at = turns.keyed(stored, key)
        if at is not None:  # taken into the transcript meanwhile: its answer, or what is left of its turn
            return turns.turn(run, spec, stored[at].text, key, endpoint, None)
    return _wait_and_answer(run, spec, session, key, endpoint, None, lease)


def go_on(run: turns.Run, spec: Spec, stored: list[Message], at: int, endpoint: Endpoint, lease: Lease,
          events: Events | None = None) -> Result:
    """Under ``lease`` (taken by the caller, released by the run): the turn whose message is ``stored[at]``
    goes on, as ``Runner.turn`` goes on with it, or its Result as it stands (answered, superseded, out of
    budget: no run, and the caller gives the lease back)."""
    planned = turns.plan(turns.run_session(spec, stored[at].key), spec, stored, stored[at], at)
    if isinstance(planned, Result):
        return planned
    budget, todo = planned
    return run(budget, todo, endpoint, events, True, lease)


def _wait_and_answer(run: turns.Run, spec: Spec, session: RunSession, key: str, endpoint: Endpoint,
                     events: Events | None, handed: Lease | None = None) -> Result:
    """Wait (``lease_wait``) for the lease (the first time, ``handed``: held already), and with it answer the
    queue from its head until ``key`` is."""
    started = time.monotonic()
    deadline = started + spec.lease_wait
    wait = spec.lease_wait
    rounds = 0
    while True:
        rounds += 1
        # Taken for this caller's turn: a cancel landing before any message is taken is of that turn (a queued
        # message taken under the lease makes the lease its turn's: ``take_queued``).
        lease = handed or Lease(session.store, session.id, spec.lease_ttl, wait, spec.name, key)
        handed = None
        try:
            lease.__enter__()
        except SessionBusy as exc:
            raise _still_queued(session, key, spec, exc) from None
        try:
            result = _answer_head(run, spec, session, lease, key, endpoint, events)
        except BaseException:
            if not lease.closed:  # the run never started: the lease is still ours to give back
                lease.__exit__(*sys.exc_info())
            raise
        if not lease.closed:
            lease.__exit__(None, None, None)
        wait = max(0.0, deadline - time.monotonic())
        if result is not None:
            # INFO when it answered others' messages first (the lease's own wait says so at INFO too).
            log.log(logging.INFO if rounds > 1 else logging.DEBUG, "session %r: turn %r answered (%s) %.1f s after "
                    "it was queued", session.id, key, result.stop_reason, time.monotonic() - started)
            return result


def _answer_head(run: turns.Run, spec: Spec, session: RunSession, lease: Lease, key: str, endpoint: Endpoint,
                 events: Events | None) -> Result | None:
    """Under the lease: this caller's own turn, once the transcript holds its message (its Result); else
    the turn of the queue's head, someone else's (``None``: the caller waits for the lease again)."""
    stored = session.messages()
    at = turns.keyed(stored, key)
    if at is not None:
        return go_on(run, spec, stored, at, endpoint, lease, events)
    waiting = queued_keys(session.store, session.id, lease.holder, stored)
    # A transcript ending with an answer leaves no reply in the journal (the save that wrote it dropped it).
    if turn_open(stored) and _unfinished_first(run, spec, session, lease, stored, endpoint,
                                               waiting[0] if waiting else None):
        return None  # the lease is given back; the queue's head is taken under the next one
    head = session.store.take_queued(session.id, lease.holder)
    if head is None:
        # Neither in the transcript nor queued: the session was deleted (its queue with it) after enqueue.
        raise TranscriptDeleted(session.id, len(stored), len(stored) + 1)
    mine = head.key == key
    log.info("session %r: took turn %r from the queue%s", session.id, head.key,
             "" if mine else f" before turn {key!r}")
    result = run(spec, [*stored, head], endpoint, events if mine else None, False, lease)
    return result if mine else None


def queued_keys(store: QueueStore, session: str, holder: Holder, stored: Sequence[Message]) -> list[str]:
    """Under the lease: the keys queued for the session. One at the head that ``stored`` holds already came
    in another way as well (a turn begun before the queue, under another policy): it is dropped, unanswered
    (the key went into the transcript with its message, so it waits for nothing)."""
    keys = store.queued(session)
    while keys and turns.keyed(stored, keys[0]) is not None:
        store.take_queued(session, holder, append=False)
        log.info("session %r: dropped queued turn %r, which the transcript holds already", session, keys[0])
        keys = store.queued(session)
    return keys


def _unfinished_first(run: turns.Run, spec: Spec, session: RunSession, lease: Lease, stored: list[Message],
                      endpoint: Endpoint, head: str | None) -> bool:
    """Under the lease, before the queue's head is taken: does the transcript's turn leave what it does not
    hold yet (its reply in the journal, or tool calls without results)? ``take_queued`` would drop the journal
    and append the head after those calls, so a model asked afresh could run a tool that ran once again. That
    turn goes on first, as a resume goes on with it, and ``True``: the caller gives the lease back and takes
    the head under the next one. A turn waiting for decisions raises ``AwaitingApproval``, taking nothing."""
    text = session.store.journal(session.id)
    journal = Journal.of(text, session.id)
    undecided = [] if journal is None else [c for c, a in journal.approvals.items() if a.decision is None]
    if undecided:
        raise AwaitingApproval(session.id, undecided)
    waits = journal is not None and journal.answers(stored)
    if not (waits or unanswered(stored)):
        return False
    at = open_turn(stored, spec.max_steps)
    if at is None:
        # A plain run's turn: what is left of its budget, counted as the sweep counts it (a turn makes
        # max_steps requests in all, however often it is taken up); 0 only finishes the waiting reply.
        made = turns.replies(stored, turns.turn_start(stored, spec.max_steps)) + int(waits)
        planned: Result | tuple[Spec, list[Message]] = (replace(spec, max_steps=max(0, spec.max_steps - made)),
                                                         stored)
    else:
        planned = turns.plan(session, spec, stored, stored[at], at)
    budget, todo = (replace(spec, max_steps=0), stored) if isinstance(planned, Result) else planned
    how = (f"its reply waits in the journal, {len(journal.started)} call(s) started, {len(journal.results)} "
           f"result(s) kept" if waits and journal is not None else "it ends with tool calls that have no results")
    log.info("session %r: goes on with the unfinished turn %s (%s%s)%s", session.id,
             "of a plain run" if at is None else repr(stored[at].key), how,
             "; it was cancelled: its calls are closed, none runs" if lease.holder.cancelled else "",
             "" if head is None else f" before taking turn {head!r} from the queue")
    run(budget, todo, endpoint, None, True, lease)
    return True


def open_turn(stored: Sequence[Message], budget: int | None = None) -> int | None:
    """The index of the last keyed user message that begins a turn (of ``Runner.turn``; a keyed steer that
    joined a turn in progress is that turn's; ``budget``: the turns' ``max_steps``, ``turns.begins``), if no
    answer follows it."""
    at = next((i for i in range(len(stored) - 1, -1, -1)
               if stored[i].key and stored[i].role is Role.USER and turns.begins(stored, i, budget)), None)
    return at if at is not None and turns.answered(stored, at) is None else None


def _still_queued(session: RunSession, key: str, spec: Spec, busy: SessionBusy) -> StillQueued:
    """``busy`` (who holds the session, until when, the lease_wait used), said of a message that is stored."""
    keys = session.store.queued(session.id)
    position = keys.index(key) + 1 if key in keys else 0
    log.info("session %r: turn %r still queued (position %d) after waiting %g s (lease_wait)", session.id, key,
             position, spec.lease_wait)
    return StillQueued(
        f"{busy} The message of turn {key!r} is stored (queued, position {position}; 0: being answered) and will "
        f"be answered by whichever turn of the session holds its lease next; Runner.turn(..., key={key!r}) "
        f"called again waits for it and returns that answer", busy.holder, key, position)


def _steered(run: turns.Run, spec: Spec, session: RunSession, text: str, key: str, endpoint: Endpoint,
             events: Events | None) -> Result:
    store = session.store
    # Stored as a steer even when nobody holds the session: its key is how a repeat finds it (a steer taken
    # into the transcript keeps its key), and with the lease free this caller runs it at once, below.
    store.add_steer_once(session.id, text, key)  # False: sent before (a repeat), stored once
    started = time.monotonic()
    deadline = started + spec.lease_wait
    log.info("session %r: turn %r left as a steer for its run; waiting up to %g s for its answer (lease_wait)",
             session.id, key, spec.lease_wait)
    pause = 0.02
    again = False
    while True:
        stored = session.messages()
        at = turns.keyed(stored, key)
        answer = None if at is None else turns.answered(stored, at, spec.max_steps)
        if answer is not None:
            log.info("session %r: steered turn %r answered after waiting %.1f s", session.id, key,
                     time.monotonic() - started)
            return turns.ended(stored, "answered", answer.text)
        if store.holder(session.id) is None:
            result = _run_steered(run, spec, session, key, endpoint, events)
            if isinstance(result, Result):
                log.info("session %r: steered turn %r answered by this caller after waiting %.1f s", session.id,
                         key, time.monotonic() - started)
                return result
            if result and not again:
                # That cancel was of the session's turn, and the steer waits, the next turn's input: run it
                # now, even with lease_wait spent (``StillQueued`` would promise an answer no run will give).
                log.info("session %r: steered turn %r: this caller's run was cancelled before it took the "
                         "steer; running the steer", session.id, key)
                again = True
                continue
        left = deadline - time.monotonic()
        if left <= 0:
            log.info("session %r: steered turn %r still waits after %g s (lease_wait)", session.id, key,
                     spec.lease_wait)
            held = store.holder(session.id)
            by = "" if held is None else f" (held by {held.describe()})"
            raise StillQueued(
                f"session {session.id!r} stayed busy{by} for Spec.lease_wait={spec.lease_wait:g} s: the message of "
                f"turn {key!r} is stored (a keyed steer) and will be answered by the session's next run; "
                f"Runner.turn(..., key={key!r}, if_busy='steer') called again returns that answer", held, key, 0)
        time.sleep(min(pause, left))
        pause = min(pause * 2, POLL_MAX)


def _run_steered(run: turns.Run, spec: Spec, session: RunSession, key: str, endpoint: Endpoint,
                 events: Events | None) -> Result | bool:
    """The lease is free while the steer waits: take it and run the session, whose first request takes the
    steers. ``False``: someone else took the lease or answered the steer meanwhile (the caller looks again).
    ``True``: this caller's run went on with the session's turn first and was cancelled before it took the
    steer."""
    store = session.store
    lease = Lease(store, session.id, spec.lease_ttl, 0.0, spec.name, key)
    try:
        lease.__enter__()
    except SessionBusy:
        return False
    try:
        # The session's turn waits for decisions: a run would stop there at once, without the steer (which
        # lands once the turn goes on), and the caller would run it again until its wait ran out.
        text = store.journal(session.id)
        journal = Journal.of(text, session.id)
        undecided = [] if journal is None else [c for c, a in journal.approvals.items() if a.decision is None]
        if undecided:
            raise AwaitingApproval(session.id, undecided)
        stored = session.messages()
        at = turns.keyed(stored, key)
        if at is not None:  # taken into the transcript: a turn like any other, answered or to go on with
            planned = turns.plan(session, spec, stored, stored[at], at)
            if isinstance(planned, Result):
                return planned if planned.stop_reason != "superseded" else False
            budget, todo = planned
            return run(budget, todo, endpoint, events, True, lease)
        if not store.pending_steers(session.id):
            raise TranscriptDeleted(session.id, len(stored), len(stored) + 1)  # the steer went with the session
        heard = _Steering(events)
        try:
            result = run(spec, stored, endpoint, None if events is None else heard, False, lease)
        except BaseException:
            heard.report()  # the run failed, and so does this turn: its listener hears how
            raise
        if turns.keyed(result.messages, key) is None:
            # The run stopped before it took the steer: it went on with the session's turn first (a reply
            # waiting in the journal), and that turn stopped. That run was not this caller's turn.
            if result.stop_reason == "awaiting_approval":
                # At the turn's waiting decisions: as above, the steer lands once that turn goes on.
                raise AwaitingApproval(session.id, [p.call_id for p in result.pending_approvals])
            return result.stop_reason == "cancelled"  # else the steer went with a delete: look again
        # The run took the steer: its turn is this caller's, however it ended. Waiting on for an answer would
        # wait for one nobody gives (the run that returned cleared the session's open mark).
        heard.report()
        return result
    finally:
        if not lease.closed:
            lease.__exit__(*sys.exc_info())


class _Steering(turns.Held):
    """The events of the ``"steer"`` caller's run: its listener's once the run has taken the steer (at its
    first model request) or returns having taken it. A run that stops before went on with the session's turn,
    not this one: its listener never hears of it."""

    def __call__(self, event: Event) -> None:
        if self.held is None:
            if self.events is not None:
                self.events(event)
            return
        self.held.append(event)
        if isinstance(event, ModelRequest):
            self.report()
