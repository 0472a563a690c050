"""``agent_sessions.contrib.celery`` without Django, in this process: ``configure`` refuses what it cannot
use; the turn task answers its message (eager, as ``task_always_eager`` runs it); a message whose task
could not be sent at all (the broker is down) was stored first, and the sweep task answers it. The real
workers, with Django, are tests/test_django_celery.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from kombu.exceptions import OperationalError

import agent_sessions as agent
from agent_sessions.contrib import celery as agent_celery
from stores import memory


class Quoting:
    """The model: answers quoting the last user message."""

    def complete(self, system: str, messages: Any, tools: Any) -> agent.Message:
        return agent.Message.assistant(f"answer to: {messages[-1].text}")


def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint]:
    return agent.Spec(name="support", lease_ttl=5.0), Quoting()


@contextmanager
def current(app: Celery) -> Iterator[Celery]:
    """``app`` as Celery's current app (the one the shared tasks bind to), then the one before it again."""
    from celery import current_app

    before = current_app._get_current_object()
    app.set_current()
    try:
        yield app
    finally:
        before.set_current()


@pytest.fixture
def store() -> Iterator[memory.Store]:
    made = memory.Store()
    agent_celery.configure(store=lambda: made, resolve=resolve)
    try:
        yield made
    finally:
        agent_celery._configured = None


def test_configure_refuses_what_it_cannot_use(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(agent.ArgumentError, match="resolve"):
        agent_celery.configure(store=memory.Store(), resolve="myapp.agent:resolve")  # type: ignore[arg-type]
    with pytest.raises(agent.ArgumentError, match="sweep_seconds"):
        agent_celery.configure(store=memory.Store(), resolve=resolve, sweep_seconds=-1)
    # A process without Django: one that ran tests/test_django_app.py first has the Django app's store set up.
    monkeypatch.setitem(sys.modules, "django.apps", None)
    with pytest.raises(agent.ArgumentError, match="has no store"):
        agent_celery.setup()


def test_the_turn_task_answers_and_says_how(store: memory.Store) -> None:
    app = Celery("eager", set_as_current=False)
    app.conf.task_always_eager = True
    with current(app):  # its tasks run in this process
        done = agent_celery.turn.delay("s-1", "what is a lease?", "msg-1").get()
        again = agent_celery.turn.delay("s-1", "what is a lease?", "msg-1").get()  # delivered twice: answered once
    assert done == {"session": "s-1", "key": "msg-1", "answered": True, "stop_reason": "answered",
                    "text": "answer to: what is a lease?", "steps": 1, "pending": [], "position": 0}
    assert again["text"] == done["text"] and again["steps"] == 0
    assert [m.key for m in store.messages("s-1")] == ["msg-1", ""]
    with pytest.raises(agent.ArgumentError):  # a bad message is refused before anything is stored or sent
        agent_celery.turn.delay("s-1", "", "msg-2")


def test_a_message_whose_task_could_not_be_sent_is_stored_and_the_sweep_answers_it(store: memory.Store) -> None:
    app = Celery("down", broker="redis://127.0.0.1:1/0", set_as_current=False)  # nothing listens there
    app.conf.broker_connection_retry = False
    app.conf.broker_connection_max_retries = 0
    app.conf.broker_transport_options = {"max_retries": 0}
    with current(app), pytest.raises(OperationalError):  # the broker cannot be reached
        agent_celery.turn.delay("s-2", "is order 7 refundable?", "msg-7")
    assert store.queued("s-2") == ["msg-7"]  # stored before the send was tried
    assert agent.open("s-2", store).answer("msg-7") is None
    counts = agent_celery.sweep.apply(kwargs={"grace": 0}).get()
    assert counts == {"recovered": 1}
    assert agent.open("s-2", store).answer("msg-7") == agent.Message.assistant("answer to: is order 7 refundable?")
