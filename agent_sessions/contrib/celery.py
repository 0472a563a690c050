"""agent-sessions on Celery (docs/integrations.md, docs/django.md): the crash-safe turn task, the sweep,
and each worker's watch for a turn nobody answers, so that every message handed to ``turn`` is answered
and every approved call runs, with nothing to schedule by hand.

    turn.delay(session_id, text, message_id)     # stored before it is sent; the task answers it

In a Django project with the app installed, the app gives the store and ``AGENT_SESSIONS["RESOLVE"]``;
elsewhere call ``configure(store=..., resolve=...)``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from celery import Task, shared_task  # type: ignore[import-untyped]
from celery.signals import worker_ready, worker_shutdown  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.stranded import Resolve

log = logging.getLogger(__name__)

SWEEP_SECONDS = 5.0
"""How often each worker looks for a turn nobody answers (``configure(sweep_seconds=)``; in Django
``AGENT_SESSIONS["SWEEP_SECONDS"]``; 0: the worker does not look)."""
GRACE = 5.0
"""A turn open for less than this is left to the caller that may be about to run it (``agent.recover``'s
``grace``): the task sent for it usually takes it first."""
LIMIT = 100
"""Sessions one sweep task finishes at most (the next watch sends another while more are stranded)."""
SWEEP = "agent_sessions.sweep"
TURN = "agent_sessions.turn"
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "agent-sessions-sweep": {"task": SWEEP, "schedule": SWEEP_SECONDS, "options": {"expires": 2 * SWEEP_SECONDS}},
}
"""The sweep as a beat entry: ``app.conf.beat_schedule = {**BEAT_SCHEDULE}`` (Django:
``CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE}``), for a deployment that runs beat."""


@dataclass(frozen=True)
class Setup:
    store: Callable[[], agent.Store]
    resolve: Callable[[], Resolve | None]
    sweep_seconds: Callable[[], float]


_configured: Setup | None = None


def configure(store: agent.Store | Callable[[], agent.Store], resolve: Resolve, *,
              sweep_seconds: float = SWEEP_SECONDS) -> None:
    """For a project without the Django app, where the Celery app is made: the store (or a function making
    it, called once per process) and ``agent.recover``'s ``resolve``, choosing each session's spec and
    endpoint (``info.spec``: the ``Spec.name`` its last run recorded, or the one ``turn`` was given)."""
    if not callable(resolve):
        raise agent.ArgumentError(f"configure(resolve=) must be callable, got {resolve!r}")
    if isinstance(sweep_seconds, bool) or not isinstance(sweep_seconds, (int, float)) or sweep_seconds < 0:
        raise agent.ArgumentError(f"configure(sweep_seconds=) must be a number of seconds >= 0, got {sweep_seconds!r}")
    global _configured
    made: list[agent.Store] = [store] if isinstance(store, agent.Store) else []
    lock = threading.Lock()

    def get() -> agent.Store:
        with lock:
            if not made:
                built = store()  # type: ignore[operator]
                if not isinstance(built, agent.Store):
                    raise agent.ArgumentError(f"configure(store=) made {type(built).__name__}, not a Store")
                made.append(built)
            return made[0]

    _configured = Setup(get, lambda: resolve, lambda: float(sweep_seconds))


def setup() -> Setup:
    """What ``configure`` gave, else the Django app's (``AGENT_SESSIONS``)."""
    if _configured is not None:
        return _configured
    try:
        from django.apps import apps  # type: ignore[import-untyped]
        from django.conf import settings  # type: ignore[import-untyped]
    except ImportError:
        apps = settings = None
    if settings is not None and settings.configured and apps.is_installed("agent_sessions.contrib.django"):
        from . import django as app

        return Setup(app.store, app.resolve, lambda: float(app.options()["SWEEP_SECONDS"]))
    raise agent.ArgumentError("agent_sessions.contrib.celery has no store: install the Django app "
                              "agent_sessions.contrib.django, or call configure(store=..., resolve=...)")


# -- the turn task ---------------------------------------------------------------------------------------------


def _message(args: Any, kwargs: Any) -> tuple[str, str, str]:
    given = dict(zip(("session_id", "text", "key"), args or (), strict=False)) | dict(kwargs or {})
    try:
        return given["session_id"], given["text"], given["key"]
    except KeyError as exc:
        raise agent.ArgumentError(f"turn takes (session_id, text, key, spec=None); {exc.args[0]} is missing") from None


class TurnTask(Task):  # type: ignore[misc]
    """The turn task's class: its message is stored in the session's queue before the task is sent."""

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        session_id, text, key = _message(args, kwargs)
        store = setup().store()
        if isinstance(store, agent.QueueStore):
            agent.open(session_id, store).enqueue(text, key)  # in the store before it is in the broker
        return super().apply_async(args, kwargs, *rest, **options)


@shared_task(name=TURN, base=TurnTask, acks_late=True, reject_on_worker_lost=True)  # type: ignore[untyped-decorator]
def turn(session_id: str, text: str, key: str, spec: str | None = None) -> dict[str, Any]:
    """Answer the message ``text`` of ``session_id`` (``key``: the client's id for it), safe to deliver
    again: ``Runner.turn`` keyed by ``key``. ``spec``: the spec name ``resolve`` is given for a session no
    run has recorded one for yet. ``stop_reason`` "queued": the wait for the session ran out (the message
    is stored, and answered by whoever holds the session next)."""
    made = setup()
    store = made.store()
    resolve = made.resolve()
    if resolve is None:
        raise agent.ArgumentError("the turn task has no resolve: set AGENT_SESSIONS['RESOLVE'] (Django) or "
                                  "configure(resolve=...)")
    chosen = resolve(_info(store, session_id, spec))
    if chosen is None:
        raise agent.ArgumentError(f"resolve gave no spec for session {session_id!r} (spec {spec!r})")
    run_spec, endpoint = chosen
    # The wait outlasts a dead run's lease, so a delivery handed back after its pool process died goes on
    # with the turn itself; a caller's message queued behind others waits that long for its answer.
    run_spec = replace(run_spec, session=agent.open(session_id, store),
                       lease_wait=max(run_spec.lease_wait, 2 * run_spec.lease_ttl))
    try:
        result = agent.Runner().turn(run_spec, text, key, endpoint)
    except agent.StillQueued as busy:
        return _outcome(session_id, key, stop_reason="queued", position=busy.position)
    except agent.AwaitingApproval:  # queued behind a turn that waits for decisions: answered once it goes on
        return _outcome(session_id, key, stop_reason="queued", position=1)
    return _outcome(session_id, key, result.stop_reason, result.text, result.steps,
                    [p.call_id for p in result.pending_approvals])


def _info(store: agent.Store, session_id: str, spec: str | None) -> agent.SessionInfo:
    """What ``resolve`` is given for a turn: the session's info (made up for a new one), with ``spec``."""
    info = store.info(session_id) if isinstance(store, agent.LifecycleStore) else None
    if info is None:
        now = datetime.now(UTC)
        return agent.SessionInfo(session_id, now, now, 0, {}, spec)
    return info if spec is None else replace(info, spec=spec)


def _outcome(session: str, key: str, stop_reason: str, text: str = "", steps: int = 0,
             pending: list[str] | None = None, position: int = 0) -> dict[str, Any]:
    return {"session": session, "key": key, "answered": stop_reason == "answered", "stop_reason": stop_reason,
            "text": text, "steps": steps, "pending": pending or [], "position": position}


# -- the sweep -------------------------------------------------------------------------------------------------


@shared_task(name=SWEEP, ignore_result=True)  # type: ignore[untyped-decorator]
def sweep(limit: int = LIMIT, grace: float = GRACE) -> dict[str, int]:
    """Finish the turns nobody answers (``agent.recover``), each once whoever else sweeps; how many came to
    each outcome. Cheap when none is stranded: one indexed query."""
    made = setup()
    resolve = made.resolve()
    store = made.store()
    if resolve is None or not isinstance(store, agent.LifecycleStore):
        log.warning("agent_sessions.sweep: nothing to sweep with (%s)", "no resolve" if resolve is None else
                    f"{type(store).__name__} is not a LifecycleStore")
        return {}
    counts: dict[str, int] = {}
    for done in agent.recover(store, resolve, limit=limit, grace=grace):
        counts[done.outcome] = counts.get(done.outcome, 0) + 1
        if done.outcome not in ("busy", "skipped"):
            log.info("agent_sessions.sweep: session %r %s%s", done.session, done.outcome,
                     "" if done.result is None else f" ({done.result.stop_reason})")
    return counts


class Watch(threading.Thread):
    """A worker's watch (a daemon thread of its main process, which runs no turn itself): every ``seconds``,
    one indexed query for the stranded sessions, and the ``sweep`` task sent when one is the application's
    (it expires unrun after two periods, so sweeps never pile up behind busy pool processes)."""

    def __init__(self, app: Any, store: Callable[[], agent.Store], resolve: Resolve, seconds: float) -> None:
        super().__init__(name="agent-sessions-watch", daemon=True)
        self.app, self.store, self.resolve, self.seconds = app, store, resolve, seconds
        self.stop = threading.Event()

    def run(self) -> None:
        log.info("agent-sessions: this worker looks for turns nobody answers every %g s", self.seconds)
        while not self.stop.wait(self.seconds):
            try:
                if self.stranded():
                    self.app.send_task(SWEEP, expires=2 * self.seconds)
            except Exception as exc:  # noqa: BLE001 - a database blip must not end the watch
                log.warning("agent-sessions: looking for stranded turns failed (%s: %s); looking again in %g s",
                            type(exc).__name__, exc, self.seconds)

    def stranded(self) -> bool:
        """Is a session stranded that the sweep would finish? One the application's ``resolve`` leaves alone
        (``None``) would have a sweep sent for it at every look, for nothing."""
        store = self.store()
        if not isinstance(store, agent.LifecycleStore):
            return False
        for info in store.list_sessions(limit=LIMIT, stranded=True, grace=GRACE):
            try:
                if self.resolve(info) is not None:
                    return True
            except Exception:  # noqa: BLE001 - the sweep runs it and reports what it raises
                return True
        return False


_watch: Watch | None = None


@worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
def _start_watch(sender: Any = None, **kwargs: Any) -> None:
    global _watch
    try:
        made = setup()
        seconds = made.sweep_seconds()
        resolve = made.resolve()
    except Exception as exc:  # noqa: BLE001 - a worker of tasks of another kind starts whatever is amiss here
        log.warning("agent-sessions: this worker does not look for turns nobody answers: %s", exc)
        return
    if seconds <= 0:
        log.info("agent-sessions: this worker does not look for turns nobody answers (SWEEP_SECONDS is 0)")
        return
    if resolve is None:
        log.warning("agent-sessions: this worker does not look for turns nobody answers: no resolve "
                    "(AGENT_SESSIONS['RESOLVE'], or configure(resolve=...))")
        return
    _watch = Watch(sender.app, made.store, resolve, seconds)
    _watch.start()


@worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _stop_watch(**kwargs: Any) -> None:
    if _watch is not None:
        _watch.stop.set()


__all__ = ["BEAT_SCHEDULE", "GRACE", "LIMIT", "SWEEP", "SWEEP_SECONDS", "TURN", "Setup", "TurnTask", "Watch",
           "configure", "setup", "sweep", "turn"]
