"""Celery tasks that run a session's turns, resuming from the store.

    celery -A examples.celery_worker.tasks worker -c 2
    celery -A examples.celery_worker.tasks beat          # the retention job (prune) hourly, the sweep every minute

``answer.delay(session_id, text, message_id)`` answers one user message, and is the crash-safe recipe:
it is safe to deliver twice. ``Runner.turn`` stores the message with its id as the turn's key, so a
redelivered task (``acks_late``: a worker that died after the turn, before its ack) finds the key and
returns the stored answer without asking the model again, and one that died mid-turn is continued, not
restarted: its run waits (``lease_wait``, longer than ``lease_ttl``) for the dead worker's lease to run out.
With a result backend (CELERY_RESULT_BACKEND, e.g. redis://127.0.0.1:6379/1) the caller reads the answer
with ``answer.delay(...).get(timeout=...)``, and a task's error arrives as itself: ``except
agent.SessionBusy as e`` catches it there, ``e.holder`` included.

``run_turn.delay(session_id)`` runs whatever waits in the session instead: a web view or a management
command leaves the user's message as a steer (``agent.open(id, store).steer(text)``). A steer left while
either task runs lands in the run, before its next model request.

The broker defaults to kombu's SQLAlchemy transport on a SQLite file (no server needed); set
CELERY_BROKER_URL for Redis (redis://127.0.0.1:6379/0) or RabbitMQ (amqp://guest@127.0.0.1//). Where
several apps share one Redis, CELERY_BROKER_KEYPREFIX puts every key of this one's under a prefix
(kombu's ``global_keyprefix``): its queues, unacked messages and bindings are then its own.

``recover_stranded`` (beat, every minute) is the safety net: a turn whose task is gone (the SQLAlchemy
transport loses a dead worker's task; a task that failed for good; a queue purged) is finished by the sweep,
``agent.recover``, once, whichever worker runs it. ``resolve`` picks the spec by the name its run recorded.

A worker killed mid-turn: with ``acks_late`` and ``reject_on_worker_lost`` a dead pool process's task
is handed back at once, and on Redis a whole worker's after the transport's ``visibility_timeout``; the
next worker process's run waits out the dead one's lease and resumes from the store: the tool journal
keeps a non-idempotent tool from running twice.

The store is made here, at import, in the worker's parent process, before the pool forks: the SQL
stores dispose of an inherited connection pool in each forked child (SQLite reopens its file), so no
connection is shared across processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery

import agent_sessions as agent
from stores import sqlite

STATE = Path(os.environ.get("CELERY_EXAMPLE_STATE", "/tmp/agent-sessions-celery"))
STATE.mkdir(parents=True, exist_ok=True)

BROKER = os.environ.get("CELERY_BROKER_URL", f"sqla+sqlite:///{STATE}/broker.db")
app = Celery("agent_sessions_example", broker=BROKER, backend=os.environ.get("CELERY_RESULT_BACKEND") or None)
app.conf.update(
    task_acks_late=True,  # acknowledged when the turn is over, not when it starts...
    task_reject_on_worker_lost=True,  # ...so a worker that dies mid-turn hands it back
    worker_prefetch_multiplier=1,
    # A task's error reaches AsyncResult.get() as itself (SessionBusy with its holder) only pickled: JSON,
    # Celery's default, rebuilds an error from its message alone, and SessionBusy needs its holder too.
    # So the result backend must be as trusted as the broker (whoever writes to it runs code in the caller).
    result_serializer="pickle",
    result_accept_content=["json", "pickle"],
    broker_connection_retry_on_startup=True,
)
transport: dict[str, Any] = {}
if BROKER.startswith("redis"):
    # A task whose whole worker died (not only a pool process: that one is handed back at once) returns to
    # the queue once it has gone unacknowledged this long. Keep it above the longest turn plus lease_wait:
    # a task running longer is handed to a second worker meanwhile (whose turn then waits, and returns the
    # stored answer). The SQLAlchemy transport has no such timeout: there, a worker's task is lost with it.
    transport["visibility_timeout"] = 3600
if os.environ.get("CELERY_BROKER_KEYPREFIX"):
    transport["global_keyprefix"] = os.environ["CELERY_BROKER_KEYPREFIX"]
    app.conf.result_backend_transport_options = {"global_keyprefix": os.environ["CELERY_BROKER_KEYPREFIX"]}
app.conf.broker_transport_options = transport

store = sqlite.open(os.environ.get("AGENT_SESSIONS_DB", str(STATE / "sessions.db")))
endpoint = agent.endpoints.OpenAIChat(os.environ.get("AGENT_MODEL_URL", "http://127.0.0.1:8080/v1"),
                                      os.environ.get("AGENT_MODEL", "local"))


@agent.tool(idempotent=False)
def file_ticket(title: str) -> str:
    """File a ticket in the tracker (not idempotent: a second call files a second ticket).

    Args:
        title: the ticket's title
    """
    with open(STATE / "tickets.log", "a") as f:
        f.write(f"{os.getpid()} {title}\n")
    if title.startswith("slow"):  # the tests kill the worker here
        import time

        time.sleep(60)
    return f"filed: {title}"


@agent.tool(idempotent=False, needs_approval=True)
def issue_refund(order: str, amount: int) -> str:
    """Refund an order. A person approves every refund first (``decide``).

    Args:
        order: the order id
        amount: the amount
    """
    with open(STATE / "refunds.log", "a") as f:
        f.write(f"{os.getpid()} {order} {amount}\n")
    return f"refunded {amount} on {order}"


TOOLS = [file_ticket, issue_refund]
LEASE_TTL = 2.0
"""Seconds a dead worker's session stays blocked before another may take it (the default is 30; short here
so that the demo and its tests take over quickly)."""
LEASE_WAIT = 30.0
"""Seconds a task's run waits for the session: longer than ``LEASE_TTL``, so a task redelivered after its
worker died outlasts the dead worker's lease instead of failing at once with SessionBusy; and long enough
for a turn already running on the session to end."""


SPEC_NAME = "support"
"""What a run records on its session (``Spec.name``): how the sweep knows which spec finishes it."""


def spec(session: agent.StoreSession) -> agent.Spec:
    return agent.Spec(session=session, tools=TOOLS, max_steps=8, lease_ttl=LEASE_TTL, lease_wait=LEASE_WAIT,
                      name=SPEC_NAME)


def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
    """The spec and endpoint to finish a stranded session with: this app's one spec, by its name (``recover``
    sets the session); a session another app's runs left is not ours."""
    if info.spec != SPEC_NAME:
        return None
    return spec(agent.open(info.id, store)), endpoint


@app.task(name="decide")
def decide(session_id: str, call_id: str, approve: bool, reason: str = "") -> dict[str, Any]:
    """A person's decision on a call the session's turn waits on (from a view, a management command),
    recorded exactly once, then the turn resumed here: it runs the call if approved, once."""
    session = agent.open(session_id, store)
    try:
        session.approve(call_id) if approve else session.deny(call_id, reason)
    except agent.AlreadyDecided as exc:
        if exc.decision.by != "person" or exc.decision.approved != approve:
            raise  # decided otherwise: by another person, its deadline, or a cancel
        # This very decision, stored by an earlier delivery of this task that died before finishing the
        # turn (acks_late hands it out again): go on and resume.
    result = agent.Runner().run(spec(session), session.messages(), endpoint)
    return {"session": session_id, "answer": result.text, "stop_reason": result.stop_reason}


@app.task(name="answer")
def answer(session_id: str, text: str, message_id: str) -> dict[str, Any]:
    """Answer one user message (``message_id``: the client's id for it, the turn's key). Delivered again,
    after its worker died anywhere in the turn, it finishes the turn or returns the stored answer."""
    result = agent.Runner().turn(spec(agent.open(session_id, store)), text, message_id, endpoint)
    with open(STATE / "workers.log", "a") as f:
        f.write(f"{os.getpid()} {session_id} answer steps={result.steps}\n")
    return {"session": session_id, "answer": result.text, "stop_reason": result.stop_reason, "steps": result.steps,
            "pending": [p.call_id for p in result.pending_approvals]}


@app.task(name="prune_sessions")
def prune_sessions(idle_days: float = 30) -> int:
    """The retention job: delete conversations idle for ``idle_days``, in bounded batches."""
    return store.prune(idle_for=idle_days * 86400)


@app.task(name="recover_stranded")
def recover_stranded(limit: int = 100, grace: float = 10.0) -> dict[str, int]:
    """The sweep: finish the turns whose worker died and whose task is gone (``agent.recover``), each once
    even when two beats overlap or several workers run it; cheap when none is stranded (one indexed query).
    Returns how many sessions came to each outcome."""
    done = agent.recover(store, resolve, limit=limit, grace=grace)
    counts: dict[str, int] = {}
    for r in done:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return counts


app.conf.beat_schedule = {
    "prune-idle-sessions": {"task": "prune_sessions", "schedule": 3600.0, "kwargs": {"idle_days": 30}},
    "recover-stranded-turns": {"task": "recover_stranded", "schedule": 60.0, "kwargs": {"limit": 100}},
}


@app.task(name="run_turn")
def run_turn(session_id: str) -> dict[str, Any]:
    session = agent.open(session_id, store)
    with open(STATE / "workers.log", "a") as f:
        f.write(f"{os.getpid()} {session_id}\n")
    result = agent.Runner().run(spec(session), session.messages(), endpoint)
    return {"session": session_id, "answer": result.text, "stop_reason": result.stop_reason, "pid": os.getpid()}
