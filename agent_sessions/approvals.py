"""Tool calls a person must approve: asked for by a run, decided from any process, executed at most once
(docs/runs/approvals.md).

A reply calling a tool that needs approval stops its run before any of its calls runs: the reply waits in
the tool journal, with an ``Approval`` per call that needs one. A decision is a compare-and-swap of the
journal's text (``swap_journal``), so of concurrent decisions on one call exactly one is stored. Deadlines
are absolute times on the clock of the process that asked: meant for hours and days, where skew is noise.
"""

from __future__ import annotations

import logging
import math
import time

from . import validate
from .contract import ApprovalStore, RunStore
from .errors import AlreadyDecided, ArgumentError, LeaseLost, SessionBusy, StoreError, UnknownApproval
from .journal import UNKNOWN_OUTCOME, Approval, Journal
from .lease import Lease
from .messages import Content, ContentType, Message, Role
from .values import Decision, PendingApproval, when

log = logging.getLogger(__name__)

ATTEMPTS = 50
"""Compare-and-swaps a decision tries: each failure means the journal changed meanwhile (another
decision), and the next read sees why."""

DENIED = "not run: a person denied this call"
EXPIRED = "not run: no decision was made on this call before its approval deadline"
CANCELLED_WAITING = "not run: the turn was cancelled while this call waited for approval"
CANCELLED_APPROVED = "not run: the turn was cancelled before this call ran"


def result_text(decision: Decision) -> str:
    """The result a call denied by ``decision`` gets: what the model reads."""
    if decision.by == "deadline":
        return EXPIRED
    if decision.by == "cancel":
        return CANCELLED_WAITING
    return f"{DENIED}: {decision.reason}" if decision.reason else DENIED


def expired(approval: Approval, now: float) -> bool:
    return approval.decision is None and approval.deadline is not None and now >= approval.deadline


def pending(store: ApprovalStore, session: str) -> list[PendingApproval]:
    """The session's calls waiting for a decision, in the order the model made them."""
    journal = _journal(store, session)
    if journal is None:
        return []
    now = time.time()
    out = []
    for call in journal.reply.tool_calls:
        approval = journal.approvals.get(call.id)
        if approval is not None and approval.decision is None and not expired(approval, now):
            out.append(waiting(call, approval))
    return out


def waiting(call: Content, approval: Approval) -> PendingApproval:
    return PendingApproval(call.id, call.name, call.arguments, when(approval.asked),
                           None if approval.deadline is None else when(approval.deadline))


def decide(store: ApprovalStore, session: str, call_id: str, approved: bool, reason: str) -> Decision:
    """Record a person's decision on ``call_id``, exactly once (see the module docstring)."""
    validate.session_id(session)
    if not isinstance(call_id, str) or not call_id:
        raise ArgumentError(f"the call id must be a non-empty str, got {call_id!r}")
    if not isinstance(reason, str):
        raise ArgumentError(f"the reason must be a str, got {type(reason).__name__}")
    for _ in range(ATTEMPTS):
        text = store.journal(session)
        journal = Journal.of(text, session)
        approval = None if journal is None else journal.approvals.get(call_id)
        if text is None or journal is None or approval is None:
            closed = _closed(store, session, call_id)
            if closed is not None:
                raise _already(session, call_id, closed)
            raise UnknownApproval(f"session {session!r}: no call {call_id!r} waits for a decision (a wrong id, or "
                                  f"its turn was closed)")
        if approval.decision is not None:
            raise _already(session, call_id, approval.decision)
        now = time.time()
        if expired(approval, now):
            decision = Decision(False, "the approval deadline passed", now, "deadline")
        else:
            decision = Decision(approved, reason, now, "person")
        approval.decision = decision
        if store.swap_journal(session, text, journal.to_json()):
            if decision.by == "deadline":
                raise _already(session, call_id, decision)
            log.info("session %r: call %r %s", session, call_id, "approved" if approved else "denied")
            return decision
    raise StoreError(f"session {session!r}: the decision on call {call_id!r} could not be stored: the journal "
                     f"changed under each of {ATTEMPTS} attempts")


def cancel(store: RunStore, session: str) -> bool:
    """What ``StoreSession.cancel`` does: the cancel is stored where every run that could go on with the turn
    looks before it starts anything. The lease is marked (``RunStore.cancel``), and the mark outlives its run:
    it is handed to whichever run takes the session next, which stops if it goes on with the same turn
    (``persistence.Leased.resume``). A turn waiting for decisions has its undecided calls decided "cancel",
    by compare-and-swap, and with no run holding the session it is closed now (``close_waiting``).

    ``True`` when a run held the session or a turn waited: no call of that turn starts afterwards."""
    running = store.cancel(session)
    if _decide_rest(store, session) is None:
        return running
    if running:
        return True  # the holder finds the mark and the decisions; so does whoever resumes after it
    return close_waiting(store, session)


def close_waiting(store: ApprovalStore, session: str) -> bool:
    """Cancel a turn waiting for decisions: every call without a result gets an error result saying it was
    not run (a decision it had is kept in the record as made; the undecided ones are decided "cancel"),
    and the reply is saved with them, closing the turn. ``False`` when no turn waits. Takes the session's
    lease for the write, so it cannot race a run; a run holding it now is cancelled instead."""
    if _journal(store, session) is None:
        return False
    lease = Lease(store, session, ttl=30.0, wait=0.0)
    try:
        lease.__enter__()
    except SessionBusy:
        return store.cancel(session)  # a run took the session meanwhile: cancel that run
    lost: LeaseLost | None = None
    try:
        journal = _decide_rest(store, session)
        if journal is None:
            return False
        transcript = store.messages(session)
        if not journal.answers(transcript):
            return False  # a stale journal, not a waiting turn: the next save drops it
        results = [closing_result(journal, call) for call in journal.reply.tool_calls]
        try:
            store.save_fenced(session, lease.holder, [*transcript, journal.reply, Message(Role.USER, results)],
                              take_steers=False)
        except LeaseLost as exc:
            # A forced delete (or a prune) took the session meanwhile, journal and all: nothing of the turn
            # is left to start. Or a run took the lease over (this stalled past its ttl): it is marked, and
            # stops before its next call.
            lost = exc
            log.info("session %r: the turn waiting for approval was gone before it could be closed (%s)",
                     session, exc)
            return store.cancel(session) or store.journal(session) is None
        store.cancel(session)  # marks this lease, which hands the cancel on: a redelivered turn stays closed
        log.info("session %r: the turn waiting for approval was cancelled and closed", session)
        return True
    finally:
        lease.__exit__(None if lost is None else LeaseLost, lost, None)


def _decide_rest(store: ApprovalStore, session: str) -> Journal | None:
    """Decide every undecided call "cancel", by compare-and-swap, so a concurrent person's decision is
    either stored before (and kept) or refused after; the journal as it then stands."""
    for _ in range(ATTEMPTS):
        text = store.journal(session)
        if text is None:
            return None
        journal = Journal.from_json(text, f"session {session!r}")
        waiting = [a for a in journal.approvals.values() if a.decision is None]
        if not journal.approvals:
            return None  # a crashed run's journal, not a turn waiting for decisions
        if not waiting:
            return journal
        now = time.time()
        for approval in waiting:
            approval.decision = Decision(False, "the turn was cancelled", now, "cancel")
        if store.swap_journal(session, text, journal.to_json()):
            return journal
    raise StoreError(f"session {session!r}: the journal changed under each of {ATTEMPTS} attempts to cancel")


def closing_result(journal: Journal, call: Content, unrun: str = CANCELLED_APPROVED) -> Content:
    """What a call of a closed turn's reply gets: its result, its denial, "outcome unknown" for a started
    non-idempotent call, else ``unrun``: by default, that the turn was cancelled before it ran."""
    done = journal.results.get(call.id)
    if done is not None:
        return done
    approval = journal.approvals.get(call.id)
    if approval is not None and approval.decision is not None and not approval.decision.approved:
        return Content.tool_result(call.id, result_text(approval.decision), is_error=True)
    if call.id in journal.started:
        return Content.tool_result(call.id, UNKNOWN_OUTCOME, is_error=True)
    return Content.tool_result(call.id, unrun, is_error=True)


def _already(session: str, call_id: str, decision: Decision) -> AlreadyDecided:
    how = {"deadline": "denied: its approval deadline passed", "cancel": "denied: its turn was cancelled"}.get(
        decision.by, ("approved" if decision.approved else "denied") + " by a person"
        + (f" ({decision.reason})" if decision.reason else ""))
    at = f", at {when(decision.at).isoformat()}" if decision.at == decision.at else ""  # NaN: not known
    return AlreadyDecided(f"session {session!r}: call {call_id!r} was already decided: {how}{at}", decision)


def _closed(store: RunStore, session: str, call_id: str) -> Decision | None:
    """The decision a call's stored result shows, once its turn was closed: a decision coming after a denial
    is one too late, not one on an unknown call. ``None`` when no such result says one (a call that ran may
    or may not have waited for a decision: that is no longer kept). ``at`` is NaN: not kept either."""
    for message in reversed(store.messages(session)):
        for c in message.content:
            if c.type is ContentType.TOOL_RESULT and c.tool_call_id == call_id:
                if c.text == EXPIRED:
                    return Decision(False, "the approval deadline passed", math.nan, "deadline")
                if c.text in (CANCELLED_WAITING, CANCELLED_APPROVED):
                    return Decision(False, "the turn was cancelled", math.nan, "cancel")
                if c.is_error and c.text.startswith(DENIED):
                    return Decision(False, c.text[len(DENIED) + 2:], math.nan, "person")
                return None  # it ran: whether it waited for a decision is no longer kept
    return None


def _journal(store: RunStore, session: str) -> Journal | None:
    validate.session_id(session)
    return Journal.of(store.journal(session), session)

