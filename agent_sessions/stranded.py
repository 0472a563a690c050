"""Stranded runs, and the sweep that finishes them (docs/design/busy-and-stranded.md, section 2).

A session is stranded when its lease is free or lapsed and its last turn is open (its worker died), and it
is not cancelled. Every write keeps the session's ``open_since``, so a sweep reads only the open sessions:
one indexed query when none is. ``recover`` finishes each turn once from any number of replicas: acting on
a session takes its lease (``lease_wait=0``: the loser skips it), and the run's first write is a
compare-and-swap, so a turn finished meanwhile costs no request; a started non-idempotent call is answered
"outcome unknown" by the journal, never run twice.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from . import lifecycle
from .contract import RunStore
from .endpoints import Endpoint
from .errors import ArgumentError, AwaitingApproval, SessionBusy, TranscriptConflict
from .journal import Journal
from .lease import Lease
from .messages import turn_open
from .result import Result
from .run import busy, turns
from .run.runner import Runner
from .session import open
from .spec import Spec
from .values import SessionInfo

log = logging.getLogger(__name__)

Outcome = Literal["recovered", "finished", "waiting", "busy", "skipped", "failed"]
"""What the sweep did with one session:

- ``recovered``: this call ran the turn to its end (``Recovered.result``);
- ``finished``: nothing was left to run (another replica finished it, or the mark was stale): cleared;
- ``waiting``: the turn waits for a person (a call's approval) or was cancelled: cleared, nothing run;
- ``busy``: another live run holds the session (a replica, a redelivered task): left to it;
- ``skipped``: ``resolve`` returned ``None``;
- ``failed``: the run raised (``Recovered.error``); the session stays stranded for the next sweep."""

Resolve = Callable[[SessionInfo], "tuple[Spec, Endpoint] | None"]
"""What to finish a stranded session with: the ``Spec`` (its ``session`` is set by ``recover``) and the
model endpoint, usually chosen by ``info.spec`` (the ``Spec.name`` its last run recorded); ``None`` leaves it."""


@dataclass(frozen=True, slots=True)
class Recovered:
    """One stranded session as ``recover`` left it."""

    session: str
    outcome: Outcome
    spec: str | None = None
    """``SessionInfo.spec``: the name of the spec its last run recorded."""
    result: Result | None = None
    """The run's Result, when this call ran the turn (``recovered``)."""
    error: BaseException | None = None
    """What the run raised (``failed``)."""


def recover(store: RunStore, resolve: Resolve, limit: int = 100, grace: float = 10.0, *,
            session: str | None = None) -> list[Recovered]:
    """Finish the turns of up to ``limit`` stranded sessions, oldest first (each page shuffled, so replicas
    sweeping at once mostly take different sessions), and say what became of each. ``grace`` (seconds):
    a turn open for less is left alone, so the sweep does not race a caller about to run it. Safe to run
    from many processes at once; each turn is finished once. ``session``: that one session alone, if it is
    stranded (``SessionInfo.stranded``; ``grace`` is not asked: an operator asks for it), else ``[]``."""
    if not isinstance(store, RunStore):
        raise ArgumentError(f"recover needs a store with the lifecycle and runs (RunStore), got {type(store).__name__}")
    if not callable(resolve):
        raise ArgumentError(f"recover(resolve=) must be callable, got {resolve!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ArgumentError(f"recover(limit=) must be an int >= 1, got {limit!r}")
    if session is not None:
        info = store.info(session)
        return [] if info is None or not info.stranded else [_recover(store, info, resolve)]
    done: list[Recovered] = []
    after: str | None = None
    while len(done) < limit:
        page = store.list_sessions(limit=min(limit - len(done), lifecycle.MAX_PAGE), after=after, stranded=True,
                                   grace=grace)
        infos = list(page)
        random.shuffle(infos)
        done.extend(_recover(store, info, resolve) for info in infos)
        if page.next is None:
            break
        after = page.next
    return done


def _recover(store: RunStore, info: SessionInfo, resolve: Resolve) -> Recovered:
    try:
        chosen = resolve(info)
    except Exception as exc:  # noqa: BLE001 - the application's function failing on one session stops no sweep
        log.warning("session %r: resolve raised %s: %s; left for the next sweep", info.id, type(exc).__name__, exc)
        return Recovered(info.id, "failed", info.spec, error=exc)
    if chosen is None:
        return Recovered(info.id, "skipped", info.spec)
    spec, endpoint = chosen
    if not isinstance(spec, Spec):
        raise ArgumentError(f"recover: resolve({info.id!r}) must return (Spec, Endpoint) or None, got {chosen!r}")
    spec = replace(spec, session=open(info.id, store), lease_wait=0.0)
    try:
        run = _look(store, info.id, spec)
        if isinstance(run, str):
            return Recovered(info.id, run, info.spec)
        result = run(endpoint)
    except (SessionBusy, TranscriptConflict):  # a conflict: another replica's run wrote after this one read
        return Recovered(info.id, "busy", info.spec)
    except AwaitingApproval:
        return Recovered(info.id, "waiting", info.spec)
    except Exception as exc:  # noqa: BLE001 - one session's failure must not stop the sweep; it is reported
        log.warning("session %r: recovering its stranded turn failed (%s: %s); the next sweep tries again",
                    info.id, type(exc).__name__, exc)
        return Recovered(info.id, "failed", info.spec, error=exc)
    if turn_open(result.messages):
        _left_open(store, info.id, spec, result)
    log.info("session %r: stranded turn finished (%s, %d step(s))", info.id, result.stop_reason, result.steps)
    return Recovered(info.id, "recovered", info.spec, result)


def _look(store: RunStore, session: str, spec: Spec) -> Callable[[Endpoint], Result] | Outcome:
    """Under the session's lease (``SessionBusy`` when another run holds it): what is left to run, or, when
    nothing is, the session's mark cleared and the outcome. What is left runs under this very lease, so
    nothing (a delete, a redelivered turn, another replica) lands between the look and the run."""
    lease = Lease(store, session, spec.lease_ttl, 0.0, spec.name).__enter__()
    try:
        left = _left(store, session, spec, lease)
    except BaseException:
        lease.__exit__(*sys.exc_info())
        raise
    if isinstance(left, str):
        lease.__exit__(None, None, None)
        return left

    def run(endpoint: Endpoint) -> Result:
        try:
            return left(endpoint, lease)
        finally:
            if not lease.closed:  # the run never started (it releases the lease it is handed)
                lease.__exit__(*sys.exc_info())

    return run


Left = Callable[[Endpoint, Lease], Result]
"""What is left of a stranded session's turn: a run under the lease the sweep looked with."""


def _left(store: RunStore, session: str, spec: Spec, lease: Lease) -> Left | Outcome:
    """``_look``'s decision, under ``lease``."""
    msgs = store.messages(session)
    text = store.journal(session)
    journal = Journal.of(text, session)
    waits = journal is not None and any(a.decision is None for a in journal.approvals.values())
    # The keys queued that the transcript does not hold (one it holds came in another way as well: dropped
    # at the queue's head, as a holder answering the queue drops it, and behind it when the queue gets there).
    queued = [] if waits else [key for key in busy.queued_keys(store, session, lease.holder, msgs)
                               if turns.keyed(msgs, key) is None]
    if lease.holder.cancelled and queued:
        # The cancel stopped the turn in progress, not the messages queued behind it. The first is handed
        # this lease, which came with the cancel: the cancelled turn's reply is closed first, nothing of it run.
        return _answering(spec, queued[-1])
    if lease.holder.cancelled or waits:
        if lease.holder.cancelled:
            store.cancel(session)  # handed a cancel with the lease: hand it on, as a run would
        store.mark_finished(session, lease.holder, text)
        return "waiting"
    waiting_reply = journal is not None and journal.answers(msgs)
    steers = bool(store.pending_steers(session))
    if not (turn_open(msgs) or waiting_reply or steers or queued):
        store.mark_finished(session, lease.holder, text)
        return "finished"
    at = busy.open_turn(msgs, spec.max_steps)
    if at is None and queued and not turn_open(msgs):
        # Messages queued for the session (Runner.turn(if_busy="queue")) whose callers are gone: answered in
        # the order they were accepted, each by its own turn, up to the last one queued when this looked.
        return _answering(spec, queued[-1])
    if at is not None:
        planned = turns.plan(turns.run_session(spec, msgs[at].key), spec, msgs, msgs[at], at)
        if not isinstance(planned, Result):
            # A turn the transcript holds goes on as Runner.turn goes on with it (what is left of its
            # max_steps), and nothing is queued for it.
            budget, todo = planned
            return lambda endpoint, held: Runner()._turn_run(budget, todo, endpoint, None, True, held)
        # That turn has ended: what is open is the input after it, a turn of its own (the queue's, or a plain
        # run's message, below).
        if queued:
            return _answering(spec, queued[-1])
    if not steers:
        # A plain run's turn: what is left of its budget, counted as ``turns.plan`` counts a keyed turn's.
        # Spent, the turn has ended: what is open is the queue behind it. (Steers waiting are new input, with
        # a budget of their own.)
        made = turns.replies(msgs, turns.turn_start(msgs, spec.max_steps)) + int(waiting_reply)
        if made >= spec.max_steps and not waiting_reply:
            if queued:
                return _answering(spec, queued[-1])
            store.mark_finished(session, lease.holder, text)
            return "finished"
        spec = replace(spec, max_steps=max(0, spec.max_steps - made))  # 0: only finish the waiting reply
    return lambda endpoint, held: Runner()._turn_run(spec, msgs, endpoint, None, False, held)


def _answering(spec: Spec, last: str) -> Left:
    """The run that answers the session's queue from its head up to ``last`` (``busy.answer_queued``)."""
    return lambda endpoint, held: busy.answer_queued(Runner()._turn_run, spec, last, endpoint, held)


def _left_open(store: RunStore, session: str, spec: Spec, result: Result) -> None:
    """The run ended without an answer (its ``max_steps`` spent, cancelled, superseded): that is where the turn
    ends, so its mark is cleared, unless something came since (then the next sweep looks again)."""
    try:
        with Lease(store, session, spec.lease_ttl, 0.0, spec.name) as lease:
            if store.messages(session) == result.messages:
                store.mark_finished(session, lease.holder, store.journal(session))
    except SessionBusy:
        pass  # a new run has it: it keeps the mark
