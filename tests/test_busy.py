"""A message that arrives while the session is busy (issue 26), with real processes on every store that
reaches across them: one run holds the session (its model request waits), and 8 spawned processes send 5
messages each to it with ``Runner.turn(..., if_busy=policy)``. Every message is answered exactly once
("queue": each by a turn of its own, in the order the store accepted them), none is left waiting, no model
request is made that has no new user message to answer, and "reject" writes nothing.

The senders are spawned once for the module (tests/busy_children.py) and serve every store and policy, so
the tests pay for 8 interpreter starts, not 128. The model answers each request after ``DELAY`` seconds,
quoting the user messages it answers."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymongo
import pytest
from sqlalchemy import create_engine

import agent_sessions as agent
from agent_sessions.run.turns import answered
from agent_sessions.testing.model_server import ModelServer, Reply, Request, openai
from stores import mongodb, mysql, postgres, sqlite
from tests import busy_children, servers

SENDERS, MESSAGES = 8, 5
DELAY = 0.02
"""Seconds the model takes per request: short, so a store's four tests take seconds."""
TIMEOUT = 120.0
HOLD = "hold the session"


class Model(ModelServer):
    """Answers "answer to: <the user messages since the last reply>"; the request of the run holding the
    session waits until ``release``."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.holding = threading.Event()
        super().__init__(self.answer)

    def answer(self, request: Request) -> Reply:
        new = _since_reply(request.json["messages"])
        if new == [HOLD]:
            self.holding.set()
            self.held.wait(TIMEOUT)
        time.sleep(DELAY)
        return openai("answer to: " + " | ".join(new))

    def asked(self) -> list[list[dict[str, Any]]]:
        with self._lock:
            return [r.json["messages"] for r in self.requests]


def _since_reply(messages: list[dict[str, Any]]) -> list[str]:
    new: list[str] = []
    for m in messages:
        if m["role"] == "assistant":
            new = []
        elif m["role"] == "user" and isinstance(m.get("content"), str):
            new.append(m["content"])
    return new


@dataclass
class Target:
    kind: str
    address: str
    store: Any

@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    with Model() as served:
        yield served


@pytest.fixture(scope="module")
def senders(model: Model) -> Iterator[tuple[list[Any], Any]]:
    ctx = multiprocessing.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(SENDERS)]
    procs = [ctx.Process(target=busy_children.serve, args=(model.url, inbox, outbox), daemon=True)
             for inbox in inboxes]
    for p in procs:
        p.start()
    try:
        for _ in range(SENDERS):
            assert outbox.get(timeout=TIMEOUT)[0] == "ready"
        yield inboxes, outbox
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module", params=["sqlite", "postgres", "mysql", "mongodb"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    kind = request.param
    if kind == "sqlite":
        path = str(tmp_path_factory.mktemp("busy") / "busy.db")
        store: Any = sqlite.open(Path(path))
        yield Target(kind, path, store)
        store.close()
    elif kind == "mongodb":
        database = servers.database_name("busy")
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(servers.MONGO_URL)
        client.drop_database(database)
        yield Target(kind, f"{servers.MONGO_URL}#{database}", mongodb.Store(client[database]))
        client.close()
    else:
        base = servers.POSTGRES_URL if kind == "postgres" else servers.MYSQL_URL
        url = servers.database_url(base, servers.database_name("busy"))
        engine = create_engine(url)
        servers.fresh_schema(engine)
        yield Target(kind, url, (postgres if kind == "postgres" else mysql).Store(engine))
        engine.dispose()


@dataclass
class Sent:
    sid: str
    outcomes: dict[str, tuple[str, str]]
    """Per key: the turn's stop_reason (or the error's name) and its text (or message)."""
    pushed: dict[str, int]
    """Per key the senders queued: the queue item's id, which orders them as the store accepted them."""
    transcript: list[agent.Message]
    asked: list[list[dict[str, Any]]]
    """The model requests made after the one of the run that held the session."""


def _send(policy: str, target: Target, model: Model, senders: tuple[list[Any], Any]) -> Sent:
    """Hold the session with a run whose model request waits; have every sender send its messages with
    ``policy``; let the held request go once the policy's first messages are in (all of them, for
    "reject"); collect what each turn returned."""
    inboxes, outbox = senders
    store = target.store
    sid = f"busy-{policy}-{uuid.uuid4().hex[:12]}"
    model.held.clear()
    model.holding.clear()
    endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
    holding = agent.Runner().start(agent.Spec(session=agent.open(sid, store), lease_ttl=10),
                                   [agent.Message.user(HOLD)], endpoint)
    outcomes: dict[str, tuple[str, str]] = {}
    pushed: dict[str, int] = {}
    try:
        assert model.holding.wait(TIMEOUT) and store.holder(sid) is not None
        first = len(model.requests)
        for i, inbox in enumerate(inboxes):
            inbox.put((target.kind, target.address, sid, policy, i, MESSAGES, 60.0))
        if policy != "reject":
            _until(lambda: _first_messages_in(policy, store, sid))
            model.held.set()
        for _ in range(SENDERS):
            kind, detail = outbox.get(timeout=TIMEOUT)
            assert kind == "done", detail
            outcomes.update({key: (reason, said) for key, reason, said, _ in detail})
            pushed.update({key: at for key, _, _, at in detail if at >= 0})
    finally:
        model.held.set()
        holding.wait(TIMEOUT)
    _until(lambda: store.holder(sid) is None)
    return Sent(sid, outcomes, pushed, store.messages(sid), model.asked()[first:])


def _first_messages_in(policy: str, store: Any, sid: str) -> bool:
    """The senders' first messages are stored as the policy stores them (a cancel, for "interrupt": the held
    request goes after a moment)."""
    if policy == "queue":
        return len(store.queued(sid)) == SENDERS
    if policy == "steer":
        return len(store.pending_steers(sid)) == SENDERS
    time.sleep(0.2)
    return True


def _until(condition: Any) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def _at(sent: Sent, key: str) -> int:
    """Where the transcript holds the message sent under ``key``: by its text, since a steer taken into a run
    carries no key."""
    return next(i for i, m in enumerate(sent.transcript) if m.role is agent.Role.USER and m.text == f"message {key}")


def _keys() -> list[str]:
    return [f"s{i}-m{j}" for i in range(SENDERS) for j in range(MESSAGES)]


def _each_once_and_answered(sent: Sent, store: Any, sid_of: str) -> list[str]:
    """Every message is in the transcript exactly once, an answer follows it, nothing is left waiting, and
    every model request had a user message to answer. Returns the keys in transcript order."""
    keys = [m.text.removeprefix("message ") for m in sent.transcript
            if m.role is agent.Role.USER and m.text.startswith("message ")]
    assert sorted(keys) == sorted(_keys()), "a message is missing or stored twice"
    for key in keys:
        assert answered(sent.transcript, _at(sent, key)) is not None, f"{key} has no answer"
    assert sent.transcript[-1].role is agent.Role.ASSISTANT
    assert store.queued(sid_of) == [] and store.pending_steers(sid_of) == [], "a message was left waiting"
    for messages in sent.asked:
        assert messages[-1]["role"] == "user", "a model request had nothing new to answer"
    return keys


@pytest.mark.parametrize("policy", ["queue", "steer", "reject", "interrupt"])
def test_eight_processes_send_five_messages_each_to_a_busy_session(
    policy: str, target: Target, model: Model, senders: tuple[list[Any], Any]
) -> None:
    store = target.store
    sent = _send(policy, target, model, senders)
    sid = sent.sid
    assert set(sent.outcomes) == set(_keys())
    if policy == "reject":
        assert {reason for reason, _ in sent.outcomes.values()} == {"SessionBusy"}
        assert [m.text for m in sent.transcript] == [HOLD, f"answer to: {HOLD}"], "a rejected message was written"
        assert sent.asked == [] and store.queued(sid) == [] and store.pending_steers(sid) == []
        assert sent.pushed == {}
        return
    keys = _each_once_and_answered(sent, store, sid)
    for key, (reason, said) in sent.outcomes.items():
        reply = answered(sent.transcript, _at(sent, key))
        assert reply is not None
        if policy == "interrupt" and reason in ("cancelled", "superseded"):
            # its run was cancelled by a later message's turn, or found that turn's message after its own
            # (docs/lifecycle.md): that turn answered it with its own
            continue
        assert reason == "answered" and said == reply.text, (key, reason, said)
        assert f"message {key}" in said, (key, said)
    if policy == "queue":
        # Each message a turn of its own, in the order the store accepted them, one request each.
        assert keys == sorted(sent.pushed, key=sent.pushed.__getitem__), "not answered in the order accepted"
        assert [m.key for m in sent.transcript if m.key] == keys
        assert [m.role for m in sent.transcript[2:]] == [agent.Role.USER, agent.Role.ASSISTANT] * len(keys)
        assert all(said == f"answer to: message {key}" for key, (_, said) in sent.outcomes.items())
        assert len(sent.asked) == len(keys)
    else:
        assert len(sent.asked) <= len(keys)

