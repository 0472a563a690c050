"""What an operator does to a session from the console, through the library's public API. Each returns
the sentence the page shows when the action took, or raises ``Refused`` with the one it shows when it did
not (nothing was written then, and nothing is logged). Permissions are the views' to check.
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry  # type: ignore[import-untyped]
from django.contrib.contenttypes.models import ContentType  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]

import agent_sessions as agent

from .. import options
from .. import resolve as app_resolve
from ..models import Session


class Refused(Exception):
    """The action did not take: the message says why."""


def record(user: Any, session: str, message: str, flag: int = CHANGE) -> None:
    kind = ContentType.objects.get_for_model(Session, for_concrete_model=False)
    LogEntry.objects.create(user_id=user.pk, content_type_id=kind.pk, object_id=session, object_repr=session[:200],
                            action_flag=flag, change_message=message)


def steer(store: agent.Store, session: str, text: str) -> str:
    try:
        agent.open(session, store).steer(text)
    except agent.ArgumentError as exc:
        raise Refused(f"not steered: {exc}") from exc
    return f"Steered: {text}"


def cancel(store: agent.Store, session: str) -> str:
    opened = agent.open(session, store)
    if not isinstance(store, agent.RunStore):
        raise Refused("this store cannot cancel a run (it is not an agent_sessions.RunStore)")
    running = opened.holder() is not None
    waiting = not running and bool(opened.pending_approvals())
    if not opened.cancel():
        raise Refused("Nothing to cancel: no run holds the session and no turn of it waits for approval.")
    if running or not waiting:
        return "Cancelled the turn: its run stops before its next model request or tool call."
    return "Cancelled the turn waiting for approval: its calls will not run."


def decide(store: agent.Store, session: str, call_id: str, approved: bool, reason: str) -> str:
    if not isinstance(store, agent.ApprovalStore):
        raise Refused("this store keeps no approvals (it is not an agent_sessions.ApprovalStore)")
    tool = next((p.tool for p in agent.open(session, store).pending_approvals() if p.call_id == call_id), "")
    try:
        agent.approvals.decide(store, session, call_id, approved, reason)
    except (agent.AlreadyDecided, agent.UnknownApproval, agent.ArgumentError) as exc:
        raise Refused(str(exc)) from exc
    verb = "Approved" if approved else "Denied"
    return f"{verb} call {call_id}" + (f" ({tool})" if tool else "") + (f": {reason}" if reason else "")


def recover(store: agent.Store, session: str) -> str:
    """Finish the session's stranded turn now, in this process, with the project's ``RESOLVE``
    (``agent.recover``, asked for this session alone: every other stranded session is left to the sweep)."""
    try:
        resolve = app_resolve()
    except ImproperlyConfigured as exc:
        raise Refused(f"Not recovered: {exc}") from exc
    if resolve is None:
        raise Refused("Set AGENT_SESSIONS['RESOLVE'] to the project's resolve function to recover from here.")
    if not isinstance(store, agent.RunStore):
        raise Refused("this store cannot list stranded sessions (it is not an agent_sessions.LifecycleStore)")

    done = agent.recover(store, resolve, session=session)
    if not done:
        raise Refused("Not recovered: the session has no stranded turn (it was answered or cancelled meanwhile).")
    outcome = done[0]
    if outcome.outcome == "recovered" and outcome.result is not None:
        return (f"Recovered: the turn ran to its end ({outcome.result.stop_reason}, "
                f"{outcome.result.steps} step{'' if outcome.result.steps == 1 else 's'}).")
    if outcome.outcome == "finished":
        return "Recovered: nothing was left to run; the turn is marked finished."
    if outcome.outcome == "waiting":
        return "Recovered: the turn waits for a decision or was cancelled; nothing was run."
    if outcome.outcome == "busy":
        raise Refused("Not recovered: another run holds the session now.")
    if outcome.outcome == "skipped":
        raise Refused(f"Not recovered: {options()['RESOLVE']} returned None for this session.")
    raise Refused(f"Not recovered: the run failed ({type(outcome.error).__name__}: {outcome.error}); "
                  "the session stays stranded.")


def delete(store: agent.Store, session: str, force: bool) -> str:
    try:
        deleted = agent.open(session, store).delete(force=force)
    except agent.SessionBusy as exc:
        raise Refused(f"Not deleted: a live run holds the session ({exc.holder.describe()}); tick \"even while a "
                      "run holds it\" to delete it anyway (the run's next write then fails).") from exc
    except agent.Unsupported as exc:
        raise Refused(str(exc)) from exc
    if not deleted:
        raise Refused("Not deleted: there is no such session.")
    return "Deleted the session" + (" (forced, while a run held it)." if force else ".")


