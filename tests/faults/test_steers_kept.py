"""Issue #25, item 2: a run that fails keeps what it was given. Steers given with ``Run.steer`` that no
stored transcript holds become the session's waiting steers, which the documented resume takes once; what
cannot be stored there, or may be stored already, comes back on the exception as ``unapplied_steers``.
Through the fault proxy on PostgreSQL and MariaDB, with the model over real HTTP."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine, make_url

import agent_sessions as agent
from tests import servers
from tests.model_server import ModelServer, Reply, Request, openai

from .proxy import FaultProxy, Rule, every_attempt, pg_write

WAIT = 10.0


@agent.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


@agent.tool
def slow_lookup(key: str) -> str:
    """Look a key up, slowly: its events are written while it runs (the publisher's watcher)."""
    time.sleep(0.4)
    return f"value of {key}"


DATABASE = "faultsteers"
"""This module's database (conftest.py's ``database`` fixture)."""


OPENED: list[agent.RunStore] = []


def _store(database: tuple[str, str, Engine], port: int | None = None) -> agent.RunStore:
    url = database[1] if port is None else make_url(database[1]).set(port=port).render_as_string(hide_password=False)
    store = servers.postgres_store(url) if database[0] == "postgres" else servers.mysql_store(url)
    OPENED.append(store)
    return store


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    """Each test's stores closed after it (PostgreSQL's listener would go on reconnecting to its proxy)."""
    yield
    while OPENED:
        store = OPENED.pop()
        getattr(store, "close", store.engine.dispose)()  # type: ignore[attr-defined]


def _endpoint(model: ModelServer) -> agent.endpoints.OpenAIChat:
    return agent.endpoints.OpenAIChat(model.url + "/v1", "test-model", max_retries=0)


def _held(entered: threading.Event, release: threading.Event, reply: Reply) -> object:
    """A scripted reply that first lets the test act while its request is in flight."""

    def step(_: Request) -> Reply:
        entered.set()
        release.wait(WAIT)
        return reply

    return step


def _failed_run(
    spec: agent.Spec, model: ModelServer, steer: str, first: Reply, arm: object = None
) -> BaseException:
    """Start a run whose first request is held while ``steer`` is given to it; ``first`` answers it."""
    entered, release = threading.Event(), threading.Event()
    model.push(_held(entered, release, first))
    run = agent.Runner().start(spec, [agent.Message.user("go")], _endpoint(model))
    assert entered.wait(WAIT)
    run.steer(steer)
    if callable(arm):
        arm()
    release.set()
    with pytest.raises(agent.AgentError) as raised:
        run.wait(WAIT * 3)
    return raised.value


def _steered_run(
    spec: agent.Spec, model: ModelServer, steer: str, tool: str, arm: Callable[[], object]
) -> agent.Result:
    """A run whose first request (answered by a call of ``tool``) is held while ``steer`` is given to it
    and ``arm`` is called; the model then answers "done"."""
    entered, release = threading.Event(), threading.Event()
    model.push(_held(entered, release, openai(calls=[("c1", tool, '{"key": "a"}')])), openai("done"))
    run = agent.Runner().start(spec, [agent.Message.user("go")], _endpoint(model))
    assert entered.wait(WAIT)
    run.steer(steer)
    arm()
    release.set()
    return run.wait(WAIT * 3)


def _resume(database: tuple[str, str, Engine], sid: str, model: ModelServer) -> list[agent.Message]:
    """The documented resume, on a worker that reaches the database directly: a run from the stored
    transcript. Returns the messages of its one request."""
    model.push(openai("done"))
    store = _store(database)
    try:
        session = agent.open(sid, store)
        result = agent.Runner().run(agent.Spec(session=session, tools=[lookup]), session.messages(), _endpoint(model))
        assert result.stop_reason == "answered"
        assert store.messages(sid) == result.messages
        return result.messages
    finally:
        store.engine.dispose()  # type: ignore[attr-defined]


def _count(messages: list[agent.Message], text: str) -> int:
    return sum(m.text == text for m in messages)


def test_a_steer_given_during_a_request_that_fails_is_kept_for_the_resume(
    database: tuple[str, str, Engine], proxy: FaultProxy, model: ModelServer
) -> None:
    sid = f"s503-{uuid.uuid4().hex[:12]}"
    store = _store(database, proxy.port)
    spec = agent.Spec(session=agent.open(sid, store), tools=[lookup])
    failed = _failed_run(spec, model, "and look at b", Reply({"error": {"message": "overloaded"}}, status=503))
    assert isinstance(failed, agent.EndpointError) and failed.status == 503
    assert not getattr(failed, "unapplied_steers", [])  # kept in the store: nothing to hand back
    assert _store(database).pending_steers(sid) == ["and look at b"]  # type: ignore[attr-defined]
    resumed = _resume(database, sid, model)
    assert _count(resumed, "and look at b") == 1
    assert model.requests[-1].json["messages"][-1]["content"] == "and look at b"


def test_a_steer_whose_save_was_cut_is_kept_for_the_resume(
    database: tuple[str, str, Engine], proxy: FaultProxy, model: ModelServer
) -> None:
    """The steer is taken into the step-2 transcript; that save is cut before the database sees it. On
    PostgreSQL the save is one statement in autocommit, so the cut leaves its outcome unknown: the run
    reads the session back, finds it did not land, writes it again and goes on, the steer stored once."""
    sid = f"scut-{uuid.uuid4().hex[:12]}"
    store = _store(database, proxy.port)
    spec = agent.Spec(session=agent.open(sid, store), tools=[lookup])
    cut = Rule("cut_before", pg_write("splice"))
    result = _steered_run(spec, model, "and look at c", "lookup", lambda: proxy.arm(cut))
    assert cut.fired and result.stop_reason == "answered"
    assert _store(database).messages(sid) == result.messages and _count(result.messages, "and look at c") == 1


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_save_that_went_unanswered_but_landed_goes_on_and_doubles_nothing(
    database: tuple[str, str, Engine], proxy: FaultProxy, model: ModelServer, nth: int
) -> None:
    """Items 2 and 3: the run reads the session back, finds its save there, and goes on as if the answer
    had come: the steer it carried is stored once, its events are in the log once, and the run finishes."""
    sid = f"sack-{uuid.uuid4().hex[:12]}"
    store = _store(database, proxy.port)
    session = agent.open(sid, store)
    spec = agent.Spec(session=session, tools=[slow_lookup], publish_events=True)
    # The nth write that carries events: a step's save (its messages and events in one statement on
    # PostgreSQL), or events written alone (a flush before a request, a slow tool's).
    rule = Rule("lose_ack", pg_write("events"), nth=nth)
    result = _steered_run(spec, model, "and look at d", "slow_lookup", lambda: proxy.arm(rule))
    assert result.stop_reason == "answered" and result.text == "done"
    if not rule.fired:
        pytest.skip(f"fewer than {nth} writes carried events")
    direct = _store(database)
    assert direct.messages(sid) == result.messages and _count(result.messages, "and look at d") == 1
    assert direct.pending_steers(sid) == []  # type: ignore[attr-defined]
    kinds = [(e.kind, e.data.get("step"), e.data.get("text"), e.data.get("call_id")) for e in
             agent.open(sid, direct).events(limit=1000)]
    assert len(kinds) == len(set(kinds)), kinds  # nothing written twice
    assert [k for k, *_ in kinds].count("finished") == 1 and "failed" not in [k for k, *_ in kinds]


def test_events_of_a_save_cut_before_it_landed_are_written_once_with_failed(
    database: tuple[str, str, Engine], proxy: FaultProxy, model: ModelServer
) -> None:
    sid = f"sevc-{uuid.uuid4().hex[:12]}"
    store = _store(database, proxy.port)
    spec = agent.Spec(session=agent.open(sid, store), tools=[lookup], publish_events=True)
    rules: list[Rule] = []
    pattern = pg_write("splice")

    def arm() -> None:
        # One statement a write on both servers, which, cut, may have landed: the library reads it back,
        # finds it did not, and writes it once more, which is cut too, so the run fails.
        rules.extend(every_attempt(proxy, "cut_before", pattern, 2))

    failed = _failed_run(spec, model, "and look at f", openai(calls=[("c1", "lookup", '{"key": "a"}')]), arm=arm)
    assert rules[0].fired and isinstance(failed, agent.StoreError), [(r.pattern, bool(r.fired)) for r in rules]
    proxy.disarm()
    events = agent.open(sid, _store(database)).events(limit=1000)
    kinds = [(e.kind, e.data.get("step"), e.data.get("text"), e.data.get("call_id")) for e in events]
    assert len(kinds) == len(set(kinds)), kinds
    assert [e.kind for e in events][-1] == "failed" and "finished" not in [e.kind for e in events]


def test_without_a_session_the_steers_come_back_on_the_exception(model: ModelServer) -> None:
    failed = _failed_run(agent.Spec(tools=[lookup]), model, "and look at e",
                         Reply({"error": {"message": "overloaded"}}, status=503))
    assert isinstance(failed, agent.EndpointError)
    assert failed.unapplied_steers == ["and look at e"]  # type: ignore[attr-defined]
