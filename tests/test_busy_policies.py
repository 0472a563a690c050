"""``Runner.turn(..., if_busy=...)`` in one process, on the memory store: what each policy does with a
message while a run holds the session, what a wait that runs out raises and says, and what it logs. The
same policies with real processes on every store are tests/test_busy.py."""

from __future__ import annotations

import logging
import pathlib
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions.run import turns
from agent_sessions.run.react import CANCELLED
from stores import memory
from storetest.mixin import stand_in
from storetest.scripted import Answer, ToolsThenAnswer
from tests.four_method_store import FourMethodStore
from tests.test_lease import holding


class Echo:
    """Answers the last message: a turn's answer says which message it answered, whoever's endpoint made it."""

    def complete(self, system: str, messages: Sequence[agent.Message], tools: object) -> agent.Message:
        return agent.Message.assistant(f"answer to {messages[-1].text}")


def _held(store: agent.RunStore, sid: str) -> tuple[agent.Run, threading.Event]:
    """A run holding ``sid`` inside a tool until the returned event is set."""
    hold, entered, go = holding()
    run = agent.Runner().start(agent.Spec(session=agent.open(sid, store), tools=[hold]), [agent.Message.user("a")],
                               ToolsThenAnswer(["hold"]))
    assert entered.wait(10)
    return run, go


def test_a_queued_message_that_waits_too_long_is_stored_and_answered_later(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="agent_sessions")
    store = memory.Store()
    run, go = _held(store, "chat")
    held = store.holder("chat")
    assert held is not None
    try:
        with pytest.raises(agent.StillQueued) as waited:
            agent.Runner().turn(agent.Spec(session=agent.open("chat", store), lease_wait=0.2), "b", "msg-2",
                                Answer("never asked"))
        error = waited.value
        assert isinstance(error, agent.SessionBusy) and (error.key, error.position) == ("msg-2", 1)
        assert error.holder == held and f"is held by {held.describe()}" in str(error)
        assert "Spec.lease_wait=0.2" in str(error) and "is stored" in str(error) and "will be answered" in str(error)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is agent.StillQueued and (again.key, again.position, again.holder) == ("msg-2", 1, held)
        assert store.queued("chat") == ["msg-2"]
    finally:
        go.set()
    assert run.wait(10).stop_reason == "answered"
    model = Answer("the answer to b")
    result = agent.Runner().turn(agent.Spec(session=agent.open("chat", store)), "b", "msg-2", model)
    assert (result.text, model.requests) == ("the answer to b", 1)
    assert [m.key for m in store.messages("chat")][-2:] == ["msg-2", ""] and store.queued("chat") == []
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"is held by {held.describe()}; waiting up to 0.2 s for it (lease_wait)" in line
               for line in lines), lines
    assert any("turn 'msg-2' still queued (position 1) after waiting 0.2 s" in line for line in lines), lines
    assert any("turn 'msg-2' answered (answered)" in line for line in lines), lines


def test_an_uncontended_turn_logs_no_wait_and_a_message_behind_others_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """Contention is logged where there is some: a turn on an idle session passes through the queue without an
    INFO line about queueing or waiting; one queued behind another message says how many are ahead."""
    caplog.set_level(logging.INFO, logger="agent_sessions")
    store = memory.Store()
    result = agent.Runner().turn(agent.Spec(session=agent.open("idle", store), lease_wait=90), "a", "msg-1",
                                 Answer("the answer to a"))
    assert result.text == "the answer to a"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [line for line in said if "queued" in line or "waiting" in line], said
    caplog.clear()
    store.acquire("busy", agent.Holder("worker-2", 4242, "a-token", 0.0), 30)  # another run holds it
    store.enqueue("busy", "msg-1", "first")
    with pytest.raises(agent.StillQueued):
        agent.Runner().turn(agent.Spec(session=agent.open("busy", store), lease_wait=0), "second", "msg-2",
                            Answer("never asked"))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert any("turn 'msg-2' queued at position 2, behind 1 message(s)" in line for line in said), said


def test_queued_messages_are_answered_in_order_each_by_its_own_turn_whoever_waits() -> None:
    """Three callers queue while the session is held; the one whose message is last may get the lease first:
    it answers the others' messages first, each in a turn of its own, and returns its own answer."""
    store = memory.Store()
    run, go = _held(store, "chat")
    results: dict[str, agent.Result] = {}
    spec = agent.Spec(session=agent.open("chat", store), lease_wait=10)

    def send(key: str) -> None:  # whoever holds the lease answers with its own endpoint: one that quotes
        results[key] = agent.Runner().turn(spec, f"text {key}", key, Echo())

    threads = []
    for key in ("k1", "k2", "k3"):
        threads.append(threading.Thread(target=send, args=(key,)))
        threads[-1].start()
        while key not in store.queued("chat"):
            threading.Event().wait(0.005)
    go.set()
    for t in threads:
        t.join(10)
    run.wait(10)
    assert {k: r.text for k, r in results.items()} == {k: f"answer to text {k}" for k in ("k1", "k2", "k3")}
    tail = store.messages("chat")[-6:]
    assert [(m.key, m.text) for m in tail[::2]] == [("k1", "text k1"), ("k2", "text k2"), ("k3", "text k3")]
    assert [m.text for m in tail[1::2]] == ["answer to text k1", "answer to text k2", "answer to text k3"]


def test_reject_raises_at_once_and_writes_nothing() -> None:
    store = memory.Store()
    run, go = _held(store, "chat")
    before = store.messages("chat")
    try:
        with pytest.raises(agent.SessionBusy) as busy:
            agent.Runner().turn(agent.Spec(session=agent.open("chat", store), lease_wait=30), "b", "k",
                                Answer("never"), if_busy="reject")
        assert not isinstance(busy.value, agent.StillQueued)
        assert store.messages("chat") == before and store.queued("chat") == [] and store.pending_steers("chat") == []
    finally:
        go.set()
    run.wait(10)
    store.enqueue("chat", "waiting", "queued while the lease is free")  # a queue makes the session busy too
    with pytest.raises(agent.SessionBusy, match="messages queued"):
        agent.Runner().turn(agent.Spec(session=agent.open("chat", store)), "c", "k2", Answer("never"),
                            if_busy="reject")


def test_interrupt_cancels_the_running_run_and_answers_on_what_it_left() -> None:
    store = memory.Store()
    run, go = _held(store, "chat")
    answered: list[agent.Result] = []
    spec = agent.Spec(session=agent.open("chat", store), lease_wait=10)
    interrupting = threading.Thread(target=lambda: answered.append(agent.Runner().turn(
        spec, "stop, do this instead", "k", Answer("done instead"), if_busy="interrupt")))
    interrupting.start()
    while not store.check("chat", store.holder("chat") or agent.Holder("", 0, "", 0.0)):
        threading.Event().wait(0.005)  # the cancel is on the running run's lease
    go.set()
    interrupting.join(10)
    assert run.wait(10).stop_reason == "cancelled"
    assert answered and answered[0].text == "done instead"
    assert store.messages("chat")[-2:] == [agent.Message.user("stop, do this instead", key="k"),
                                           agent.Message.assistant("done instead")]


def test_a_steer_lands_in_the_running_run_and_the_caller_gets_the_answer_that_covers_it() -> None:
    store = memory.Store()
    run, go = _held(store, "chat")
    got: list[agent.Result] = []
    spec = agent.Spec(session=agent.open("chat", store), lease_wait=10)
    steering = threading.Thread(target=lambda: got.append(agent.Runner().turn(
        spec, "also check the date", "k", Answer("unused"), if_busy="steer")))
    steering.start()
    while not store.pending_steers("chat"):
        threading.Event().wait(0.005)
    go.set()  # the held run's next request takes the steer, and its answer covers it
    steering.join(10)
    result = run.wait(10)
    assert got and got[0].stop_reason == "answered" and got[0].text == result.text
    assert "also check the date" in [m.text for m in store.messages("chat")]


def test_a_steer_left_after_the_last_request_is_answered_by_its_caller() -> None:
    """The held run makes no request after the steer came (its answer is in flight): the lease comes free
    with the steer waiting, and the caller runs the session itself."""
    store = memory.Store()
    started, go = threading.Event(), threading.Event()

    class Slow(Answer):
        def complete(self, *args: object) -> agent.Message:  # type: ignore[override]
            started.set()
            go.wait(10)
            return super().complete(*args)  # type: ignore[arg-type]

    run = agent.Runner().start(agent.Spec(session=agent.open("chat", store)), [agent.Message.user("a")], Slow("first"))
    assert started.wait(10)
    got: list[agent.Result] = []
    model = Answer("covers the steer")
    steering = threading.Thread(target=lambda: got.append(agent.Runner().turn(
        agent.Spec(session=agent.open("chat", store), lease_wait=10), "one more thing", "k", model,
        if_busy="steer")))
    steering.start()
    while not store.pending_steers("chat"):
        threading.Event().wait(0.005)
    go.set()
    steering.join(10)
    assert run.wait(10).text == "first"
    assert got and got[0].text == "covers the steer" and model.requests == 1
    assert [m.text for m in store.messages("chat")] == ["a", "first", "one more thing", "covers the steer"]


def test_an_idle_session_answers_every_policy_at_once() -> None:
    """Nobody holds the session: each policy's message is answered by its own caller, and a repeat returns
    that answer. A steer is still stored as one, and lands in the transcript with its key (how a repeat finds
    it, and never another message of the same text)."""
    store = memory.Store()
    spec = agent.Spec(session=agent.open("chat", store))
    for i, policy in enumerate(("queue", "steer", "reject", "interrupt")):
        result = agent.Runner().turn(spec, f"q{i}", f"k{i}", Answer(f"a{i}"), if_busy=policy)  # type: ignore[arg-type]
        assert (result.text, result.steps) == (f"a{i}", 1)
        again = agent.Runner().turn(spec, f"q{i}", f"k{i}", Answer("never"), if_busy=policy)  # type: ignore[arg-type]
        assert (again.text, again.steps) == (f"a{i}", 0)
    assert [(m.key, m.text) for m in store.messages("chat")] == [
        ("k0", "q0"), ("", "a0"), ("k1", "q1"), ("", "a1"), ("k2", "q2"), ("", "a2"), ("k3", "q3"), ("", "a3")]
    with pytest.raises(agent.ArgumentError, match="if_busy"):
        agent.Runner().turn(spec, "q", "k9", Answer("never"), if_busy="later")  # type: ignore[arg-type]


def test_a_queued_message_waits_for_a_turn_that_waits_for_approval() -> None:
    """Taking the next message would drop the waiting reply and its decisions, as a new turn would: the turn
    raises AwaitingApproval and the message stays queued, to be answered once the turn goes on."""
    from tests.test_review_approvals import Model, _waiting

    store = memory.Store()
    spec, _ = _waiting(store, "chat")
    journal = store.journal("chat")
    with pytest.raises(agent.AwaitingApproval):
        agent.Runner().turn(spec, "and one more thing", "k", Model())
    assert store.journal("chat") == journal and store.queued("chat") == ["k"]


def test_a_steer_that_waits_too_long_is_stored_and_its_answer_returned_when_sent_again() -> None:
    store = memory.Store()
    run, go = _held(store, "chat")
    spec = agent.Spec(session=agent.open("chat", store), lease_wait=0.2)
    try:
        with pytest.raises(agent.StillQueued) as waited:
            agent.Runner().turn(spec, "check the date too", "k", Answer("never"), if_busy="steer")
        assert (waited.value.key, waited.value.position) == ("k", 0) and "is stored" in str(waited.value)
        assert "held by" in str(waited.value) and store.pending_steers("chat") == ["check the date too"]
    finally:
        go.set()
    answer = run.wait(10)  # its next request took the steer
    again = agent.Runner().turn(spec, "check the date too", "k", Answer("never"), if_busy="steer")
    assert (again.text, again.steps) == (answer.text, 0)
    assert [m.text for m in store.messages("chat")].count("check the date too") == 1


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_an_interrupt_delivered_again_while_its_message_waits_cancels_nothing_more(
    backend: str, tmp_path: pathlib.Path
) -> None:
    """A task queue delivers an interrupt twice: the first cancelled the run in progress and queued its
    message behind one queued before it. The second, while another holder answers that earlier message,
    finds its own message queued: it must not cancel that holder's turn (somebody else's message), and says
    the message is still queued."""
    from stores import sqlite

    store = memory.Store() if backend == "memory" else sqlite.open(str(tmp_path / "chat.db"))
    run, go = _held(store, "chat")
    quick = agent.Spec(session=agent.open("chat", store), lease_wait=0.0)
    try:
        with pytest.raises(agent.StillQueued):
            agent.Runner().turn(quick, "earlier", "q", Answer("never"))
        with pytest.raises(agent.StillQueued):
            agent.Runner().turn(quick, "stop, do this instead", "k", Answer("never"), if_busy="interrupt")
    finally:
        go.set()
    assert run.wait(10).stop_reason == "cancelled" and store.queued("chat") == ["q", "k"]
    hold, entered, release = holding()
    answering: list[agent.Result] = []
    spec = agent.Spec(session=agent.open("chat", store), tools=[hold], lease_wait=10)
    worker = threading.Thread(target=lambda: answering.append(agent.Runner().turn(
        spec, "earlier", "q", ToolsThenAnswer(["hold"], rounds=2))))  # the transcript made one call already
    worker.start()
    try:
        assert entered.wait(10)  # the holder answers "q", inside its tool; "k" waits behind it
        holder = store.holder("chat")
        assert holder is not None and store.queued("chat") == ["k"]
        with pytest.raises(agent.StillQueued) as waited:
            agent.Runner().turn(quick, "stop, do this instead", "k", Answer("never"), if_busy="interrupt")
        assert waited.value.key == "k" and store.queued("chat") == ["k"]
        assert not store.check("chat", holder), "the redelivered interrupt cancelled the turn answering 'q'"
    finally:
        release.set()
        worker.join(10)
    assert answering and answering[0].stop_reason == "answered"
    result = agent.Runner().turn(agent.Spec(session=agent.open("chat", store)), "stop, do this instead", "k",
                                 Answer("done instead"), if_busy="interrupt")
    assert result.text == "done instead" and store.queued("chat") == []


class _Died(BaseException):
    """A worker dying inside a tool: nothing of the run's code handles it (as a kill, its lease then lapses)."""


def _no_orphans_sent(request: list[dict[str, object]]) -> bool:
    """Does a chat completions request hold a result for every tool call it sends? (A provider refuses one that
    does not: a 400.)"""
    results = {m.get("tool_call_id") for m in request if m.get("role") == "tool"}
    calls = [c["id"] for m in request for c in m.get("tool_calls") or []]  # type: ignore[attr-defined]
    return all(c in results for c in calls)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_a_queued_message_waits_for_the_unfinished_turn_of_a_holder_that_died(
    backend: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker answering "pay order 7" dies inside its second tool: ``charge`` (not idempotent) finished, its
    result waits in the journal; ``ship`` (not idempotent) started, its outcome unknown. A second message,
    queued meanwhile, gets the lease. Its caller goes on with the unfinished turn first, as a resume would
    (the journal replayed: neither tool runs again, the model is told ship's outcome is unknown), and only
    then takes its own message from the queue. (Taking it first dropped the journal: the model was asked
    both messages afresh, with no sign anything had run, and charged and shipped a second time.)"""
    from agent_sessions.journal import UNKNOWN_OUTCOME
    from agent_sessions.testing.model_server import ModelServer, Reply, Request, openai
    from stores import sqlite
    from storetest.mixin import no_orphans as assert_no_orphans

    caplog.set_level(logging.INFO, logger="agent_sessions")

    def respond(request: Request) -> Reply:
        messages = request.json["messages"]
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        since = messages[last + 1:]
        if since and since[-1]["role"] == "tool":
            return openai("done: " + " | ".join(m["content"] for m in since if m["role"] == "tool"))
        new = [m["content"] for m in since if m["role"] == "user"]
        if "pay order 7" in new:  # asked to pay, with nothing in the transcript saying it was done: it pays
            n = len(messages)
            return openai(None, [(f"charge-{n}", "charge", '{"n": 7}'), (f"ship-{n}", "ship", '{"n": 7}')])
        return openai("answer to: " + " | ".join(new))

    ran: list[str] = []
    entered, go = threading.Event(), threading.Event()

    @agent.tool(idempotent=False)
    def charge(n: int) -> str:
        """Charge the card for the order."""
        ran.append("charge")
        return "charged"

    @agent.tool(idempotent=False)
    def ship(n: int) -> str:
        """Ship the order."""
        ran.append("ship")
        if ran.count("ship") == 1:  # the first worker dies in here, once the second message is queued
            entered.set()
            go.wait(10)
            raise _Died
        return "shipped"

    store = memory.Store() if backend == "memory" else sqlite.open(str(tmp_path / "chat.db"))
    spec = agent.Spec(session=agent.open("chat", store), tools=[charge, ship], lease_wait=10)
    outcomes: dict[str, object] = {}
    with ModelServer(respond) as model:
        def send(text: str, key: str) -> None:
            endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
            try:
                outcomes[key] = agent.Runner().turn(spec, text, key, endpoint)
            except _Died as died:
                outcomes[key] = died

        first = threading.Thread(target=send, args=("pay order 7", "k1"))
        first.start()
        assert entered.wait(10)
        second = threading.Thread(target=send, args=("and my invoice?", "k2"))
        second.start()
        while "k2" not in store.queued("chat"):
            threading.Event().wait(0.005)
        go.set()  # the first worker dies; the second caller gets the lease
        first.join(20)
        second.join(20)
        requests = [r.json["messages"] for r in model.requests]
        again = agent.Runner().turn(spec, "pay order 7", "k1",
                                    agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0))
    assert isinstance(outcomes["k1"], _Died)
    assert ran == ["charge", "ship"], f"a tool that was not idempotent ran again: {ran}"
    result = outcomes["k2"]
    assert isinstance(result, agent.Result) and result.text == "answer to: and my invoice?", result
    stored = store.messages("chat")
    assert_no_orphans(stored)
    answer = f"done: charged | Error: {UNKNOWN_OUTCOME}"  # what the model read (an error result, over HTTP)
    assert all(_no_orphans_sent(r) for r in requests), requests
    assert [(m.role.value, m.key, m.text) for m in stored] == [
        ("user", "k1", "pay order 7"), ("assistant", "", ""), ("user", "", ""),
        ("assistant", "", answer),
        ("user", "k2", "and my invoice?"), ("assistant", "", "answer to: and my invoice?")]
    results = {c.tool_call_id.split("-")[0]: c for c in stored[2].content}
    assert results["charge"].text == "charged" and not results["charge"].is_error  # the result kept
    assert results["ship"].is_error and results["ship"].text == UNKNOWN_OUTCOME  # not run again
    assert len(requests) == 3  # the first turn's reply, its answer, the second's: none asked twice
    assert (again.stop_reason, again.text, again.steps) == ("answered", answer, 0)
    assert store.queued("chat") == [] and store.journal("chat") is None
    lines = [r.getMessage() for r in caplog.records]
    assert any("goes on with the unfinished turn" in line for line in lines), lines


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_a_queued_message_waits_for_tool_calls_the_transcript_holds_without_results(
    backend: str, tmp_path: pathlib.Path
) -> None:
    """The stored transcript ends with a reply's tool calls and no results (saved so by hand, or a fork cut
    there). The queue's head is taken only once the turn has gone on and answered them: appended after them,
    it would leave the calls unanswered for good, and every later request would send them so (a 400)."""
    from stores import sqlite
    from storetest.mixin import no_orphans as assert_no_orphans

    looked: list[int] = []

    @agent.tool
    def lookup(n: int) -> str:
        """Look the order up."""
        looked.append(n)
        return f"order {n} found"

    store = memory.Store() if backend == "memory" else sqlite.open(str(tmp_path / "chat.db"))
    store.save("chat", [agent.Message.user("find order 7", key="k0"),
                        agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "lookup", '{"n": 7}')])])
    spec = agent.Spec(session=agent.open("chat", store), tools=[lookup])
    result = agent.Runner().turn(spec, "and order 8?", "k1", Echo())
    assert result.text == "answer to and order 8?" and looked == [7]
    stored = store.messages("chat")
    assert_no_orphans(stored)
    assert [(m.role.value, m.key) for m in stored] == [("user", "k0"), ("assistant", ""), ("user", ""),
                                                        ("assistant", ""), ("user", "k1"), ("assistant", "")]
    assert stored[2].content[0].text == "order 7 found" and not stored[3].tool_calls  # k0's turn answered
    assert stored[-2:] == [agent.Message.user("and order 8?", key="k1"), agent.Message.assistant(result.text)]


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@pytest.mark.parametrize("how", ["run", "turn"])
def test_new_input_after_a_stopped_run_closes_its_reply_and_runs_nothing_again(
    backend: str, how: str, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker answering "pay order 7" stops inside its reply's second tool (``charge`` finished, its result
    in the journal; ``ship`` started; ``notify`` never did) and its lease lapses. New input comes before any
    resume or sweep: ``Runner.run`` with a new message after the transcript, or ``Runner.turn`` of another
    key. The reply goes back in its place, each call closed as it stood (charged; ship's outcome unknown;
    notify not run), and the model answers the new message with that in view. (Before, the first save
    dropped the journal: the model, asked both messages afresh with no sign anything had run, charged and
    shipped a second time.)"""
    from agent_sessions.journal import NOT_RUN_SUPERSEDED, UNKNOWN_OUTCOME
    from agent_sessions.testing.model_server import ModelServer, Reply, Request, openai
    from stores import sqlite
    from storetest.mixin import no_orphans as assert_no_orphans

    caplog.set_level(logging.INFO, logger="agent_sessions")

    def respond(request: Request) -> Reply:
        messages = request.json["messages"]
        if any(m["role"] == "tool" and m["content"] == "charged" for m in messages):
            return openai("answer to: " + messages[-1]["content"])  # it sees the charge was made
        if any(m["role"] == "user" and m["content"] == "pay order 7" for m in messages):
            n = len(messages)  # asked to pay, nothing saying it was done: it pays (again)
            return openai(None, [(f"charge-{n}", "charge", "{}"), (f"ship-{n}", "ship", "{}"),
                                 (f"notify-{n}", "notify", "{}")])
        return openai("answer to: " + messages[-1]["content"])

    ran: list[str] = []

    @agent.tool(idempotent=False)
    def charge() -> str:
        """Charge the card for the order."""
        ran.append("charge")
        return "charged"

    @agent.tool(idempotent=False)
    def ship() -> str:
        """Ship the order."""
        ran.append("ship")
        if ran.count("ship") == 1:
            raise _Died  # the worker stops in here: its lease lapses
        return "shipped"

    @agent.tool(idempotent=False)
    def notify() -> str:
        """Tell the customer."""
        ran.append("notify")
        return "notified"

    store = memory.Store() if backend == "memory" else sqlite.open(str(tmp_path / "chat.db"))
    spec = agent.Spec(session=agent.open("chat", store), tools=[charge, ship, notify], lease_ttl=1.0, lease_wait=10)
    with ModelServer(respond) as model:
        endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
        with pytest.raises(_Died):
            agent.Runner().turn(spec, "pay order 7", "k1", endpoint)
        assert store.journal("chat") is not None
        if how == "run":
            result = agent.Runner().run(spec, [*store.messages("chat"), agent.Message.user("and my invoice?")],
                                        endpoint)
        else:
            result = agent.Runner().turn(spec, "and my invoice?", "k2", endpoint, if_busy="reject")
        requests = [r.json["messages"] for r in model.requests]
    assert ran == ["charge", "ship"], f"a tool that is not idempotent ran again: {ran}"
    assert result.text == "answer to: and my invoice?", result
    stored = store.messages("chat")
    assert_no_orphans(stored)
    assert [(m.role.value, m.text) for m in stored] == [
        ("user", "pay order 7"), ("assistant", ""), ("user", ""), ("user", "and my invoice?"),
        ("assistant", "answer to: and my invoice?")]
    results = {c.tool_call_id.split("-")[0]: c for c in stored[2].content}
    assert results["charge"].text == "charged" and not results["charge"].is_error
    assert results["ship"].is_error and results["ship"].text == UNKNOWN_OUTCOME
    assert results["notify"].is_error and results["notify"].text == NOT_RUN_SUPERSEDED
    assert len(requests) == 2 and all(_no_orphans_sent(r) for r in requests), requests
    assert store.journal("chat") is None
    assert any("closed before the new input" in r.getMessage() for r in caplog.records)


KILLED_IN_SHIP = """
import sys, time
import agent_sessions as agent
from stores import sqlite
from storetest.scripted import ToolsThenAnswer

path, ledger = sys.argv[1], sys.argv[2]


@agent.tool(idempotent=False)
def charge(n: int) -> str:
    \"\"\"Charge.\"\"\"
    with open(ledger, "a") as f:
        f.write("charge\\n")
    return "charged"


@agent.tool(idempotent=False)
def ship(n: int) -> str:
    \"\"\"Ship.\"\"\"
    with open(ledger, "a") as f:
        f.write("ship\\n")
    print("in ship", flush=True)
    time.sleep(60)  # killed in here
    return "shipped"


spec = agent.Spec(session=agent.open("s", sqlite.open(path)), tools=[charge, ship], lease_ttl=1.0)
agent.Runner().run(spec, [agent.Message.user("pay order 7")], ToolsThenAnswer(["charge", "ship"]))
"""


def test_new_input_after_a_worker_killed_in_a_tool_runs_nothing_of_its_reply_again(tmp_path: pathlib.Path) -> None:
    """The same across processes: a worker is SIGKILLed inside ``ship`` (``charge`` finished before it), and
    another process, once the lease lapsed, runs a new message on the session: each tool ran once, and the
    stored transcript holds the killed reply with charge's result and ship's outcome unknown."""
    import os
    import signal
    import subprocess
    import sys

    from agent_sessions.journal import UNKNOWN_OUTCOME
    from stores import sqlite
    from storetest.mixin import no_orphans as assert_no_orphans
    from storetest.scripted import ToolsThenAnswer

    root = pathlib.Path(__file__).resolve().parent.parent
    path, ledger = tmp_path / "s.db", tmp_path / "ledger"
    ledger.touch()
    child = subprocess.Popen([sys.executable, "-c", KILLED_IN_SHIP, str(path), str(ledger)], stdout=subprocess.PIPE,
                             text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "in ship"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)

    @agent.tool(idempotent=False)
    def charge(n: int) -> str:
        """Charge."""
        with open(ledger, "a") as f:
            f.write("charge\n")
        return "charged"

    @agent.tool(idempotent=False)
    def ship(n: int) -> str:
        """Ship."""
        with open(ledger, "a") as f:
            f.write("ship\n")
        return "shipped"

    store = sqlite.open(path)
    spec = agent.Spec(session=agent.open("s", store), tools=[charge, ship], lease_ttl=1.0, lease_wait=15)
    result = agent.Runner().run(spec, [*store.messages("s"), agent.Message.user("and my invoice?")],
                                ToolsThenAnswer(["charge", "ship"]))
    assert ledger.read_text().split() == ["charge", "ship"], "a tool that is not idempotent ran again"
    stored = store.messages("s")
    assert_no_orphans(stored)
    assert [m.text for m in stored if m.role is agent.Role.USER and m.text] == ["pay order 7", "and my invoice?"]
    assert [c.text for c in stored[2].content] == ["charged", UNKNOWN_OUTCOME]
    assert result.stop_reason == "answered" and stored[-1] == result.messages[-1]
    store.close()


def test_enqueue_hands_a_message_over_and_answer_reads_its_answer_whoever_made_it() -> None:
    """``Session.enqueue`` stores a message for a turn of its own without running anything; ``answer(key)`` is
    ``None`` while it waits, the reply that answered it once a turn did (found at the transcript's end, or
    further back), and waits up to ``timeout`` for another thread's turn to answer it."""
    store = memory.Store()
    session = agent.open("handed", store)
    assert session.enqueue("what is a lease?", "msg-1") == 1
    assert session.enqueue("what is a lease?", "msg-1") == 1  # sent again: stored once
    assert session.queued() == ["msg-1"] and session.answer("msg-1") is None and session.answer("nope") is None
    spec = agent.Spec(session=session, name="support")
    done = agent.recover(store, lambda info: (spec, Answer("a lease is a claim")), grace=0)
    assert [r.outcome for r in done] == ["recovered"]
    assert session.answer("msg-1") == agent.Message.assistant("a lease is a claim") and session.queued() == []
    for i in range(40):  # the answered message is now far from the transcript's end
        agent.Runner().turn(spec, f"more {i}", f"more-{i}", Answer(f"answer {i}"))
    assert session.answer("msg-1") == agent.Message.assistant("a lease is a claim")
    session.enqueue("and the renewal?", "msg-2")
    started = time.monotonic()
    later = threading.Timer(0.3, lambda: agent.recover(store, lambda info: (spec, Answer("it renews")), grace=0))
    later.start()
    try:
        assert session.answer("msg-2", timeout=30) == agent.Message.assistant("it renews")
    finally:
        later.join(30)
    assert 0.2 < time.monotonic() - started < 30
    assert session.answer("msg-3", timeout=0.1) is None  # a bounded wait for what never comes
    for bad in ({"key": ""}, {"key": "k", "timeout": -1}, {"key": "k", "timeout": float("inf")}):
        with pytest.raises(agent.ArgumentError):
            session.answer(**bad)  # type: ignore[arg-type]
    with pytest.raises(agent.ArgumentError):
        session.enqueue("", "msg-4")
    with pytest.raises(agent.Unsupported):
        agent.open("s", FourMethodStore()).enqueue("hi", "k")


@agent.tool(idempotent=False, needs_approval=True)
def refund(order: int) -> str:
    """Refund an order (a person approves it first)."""
    return "refunded"


@pytest.mark.parametrize("lease_wait", [0.0, 0.3])
def test_a_steer_beside_a_turn_waiting_for_a_decision_says_so_and_runs_nothing(lease_wait: float) -> None:
    """The session's turn waits for a decision; nobody holds it. A turn with ``if_busy="steer"`` stores its
    steer, finds the lease free, and must not run the session over and over until its wait runs out (each run
    stopping at the waiting decision, each a write and a ``Finished``), nor say that its message will be
    answered by the next run: it raises ``AwaitingApproval``, as ``"queue"`` does, and the steer waits."""
    store = memory.Store()
    spec = agent.Spec(session=agent.open("chat", store), tools=[refund], lease_wait=lease_wait)
    first = agent.Runner().run(spec, [agent.Message.user("refund order 7")], ToolsThenAnswer(["refund"]))
    assert first.stop_reason == "awaiting_approval"
    stored = store.messages("chat")
    heard: list[object] = []
    with pytest.raises(agent.AwaitingApproval):
        agent.Runner().turn(spec, "and order 8", "k-8", Answer("never"), heard.append, if_busy="steer")
    assert heard == [] and store.messages("chat") == stored
    assert store.pending_steers("chat") == ["and order 8"]


def test_a_steer_whose_own_run_stops_at_max_steps_returns_that_result() -> None:
    """Nobody holds the session: the ``"steer"`` caller runs it itself, and that run, which took the steer,
    stops at its ``max_steps``. That is how the caller's turn ended: it returns that Result, as ``"queue"``
    does. Waiting on (and raising ``StillQueued``, "will be answered by the session's next run") promised an
    answer that nothing gives: the run that returned left the session no longer open, and a run going on
    with that turn would pass its budget."""
    store = memory.Store()
    spec = agent.Spec(session=agent.open("chat", store), tools=[refund], max_steps=1)
    result = agent.Runner().turn(spec, "refund order 7", "k-7", ToolsThenAnswer(["lookup"], rounds=5),
                                 if_busy="steer")
    assert (result.stop_reason, result.steps) == ("max_steps", 1)
    assert not agent.open("chat", store).info().open_since  # type: ignore[union-attr]


class Charging:
    """Calls the non-idempotent ``charge`` on every request; ``during`` runs inside the first request."""

    def __init__(self, during: object = None) -> None:
        self.requests = 0
        self.during = during

    def complete(self, system: str, messages: Sequence[agent.Message], tools: object) -> agent.Message:
        self.requests += 1
        if self.requests == 1 and callable(self.during):
            self.during()
        return agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call(f"c{self.requests}", "charge", "{}")])


@agent.tool(idempotent=False)
def charge() -> str:
    """Charge the card (not idempotent)."""
    return "charged"


def test_a_keyed_steer_that_joined_a_turn_stopped_at_max_steps_is_not_gone_on_with_when_sent_again() -> None:
    """A keyed steer (``if_busy="steer"``) joins a turn after its first request; the turn stops at its
    ``max_steps``. The steer's turn is the one it joined: sent again, it says ``max_steps`` and asks nothing
    (counted from the steer, its budget looked unspent, and the repeat went on with a turn that had ended)."""
    store = memory.Store()
    session = agent.open("chat", store)
    spec = agent.Spec(session=session, tools=[charge], max_steps=2)
    model = Charging(lambda: session.steer("and the other card", key="k-2"))
    assert agent.Runner().turn(spec, "charge me", "k-1", model).stop_reason == "max_steps"
    assert model.requests == 2 and [m.key for m in store.messages("chat") if m.steer] == ["k-2"]
    again = agent.Runner().turn(spec, "and the other card", "k-2", model, if_busy="steer")
    assert (again.stop_reason, again.steps, model.requests) == ("max_steps", 0, 2)


def test_a_queued_turn_finishes_a_plain_runs_waiting_reply_within_that_runs_budget() -> None:
    """A plain run (``max_steps=1``) made its one request, whose call waits for approval. Approved, the turn
    goes on when the next message's turn takes the session: it finishes the waiting reply (the refund runs)
    and asks the model nothing more for that turn, whose one request is made; then it answers its own."""
    store = memory.Store()
    spec = agent.Spec(session=agent.open("chat", store), tools=[refund], max_steps=1)
    asked: list[str] = []

    class Model:
        def complete(self, system: str, messages: Sequence[agent.Message], tools: object) -> agent.Message:
            said = [m.text for m in messages if m.role is agent.Role.USER and m.text]
            asked.append(said[-1])
            if said[-1] == "refund order 7":
                return agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("r1", "refund", '{"order": 7}')])
            return agent.Message.assistant("done")

    first = agent.Runner().run(spec, [agent.Message.user("refund order 7")], Model())
    assert first.stop_reason == "awaiting_approval"
    agent.open("chat", store).approve("r1")
    result = agent.Runner().turn(spec, "thanks", "k-2", Model())
    assert result.text == "done" and asked == ["refund order 7", "thanks"]


@pytest.mark.parametrize("lease_wait", [0.0, 5.0])
def test_a_steer_whose_own_run_is_cancelled_before_it_took_the_steer_runs_the_steer_once(lease_wait: float) -> None:
    """Nobody holds the session, and its turn's reply waits in the journal with its refund approved. The
    ``"steer"`` caller runs the session itself: its run goes on with that reply first, and a ``cancel()``
    lands inside the reply's first call, so the run stops before any request, the steer still waiting. That
    was the cancelled turn's run, not the caller's: the caller runs its steer at once, its wait spent or not
    (it raised ``StillQueued`` with ``lease_wait=0``, promising an answer no run was coming to give), and its
    listener hears one turn (it heard the cancelled run's ``Finished`` and then, running again, another)."""
    store = memory.Store()
    hold, entered, go = holding()
    session = agent.open("chat", store)
    spec = agent.Spec(session=session, tools=[hold, refund], lease_wait=lease_wait)
    first = agent.Runner().run(spec, [agent.Message.user("refund order 7")], ToolsThenAnswer(["hold", "refund"]))
    assert first.stop_reason == "awaiting_approval"
    session.approve(first.pending_approvals[0].call_id)
    heard: list[agent.events.Event] = []
    got: list[agent.Result] = []
    failed: list[BaseException] = []

    def steer() -> None:
        try:
            got.append(agent.Runner().turn(spec, "and order 8", "k-8", Answer("both done"), heard.append,
                                           if_busy="steer"))
        except BaseException as exc:  # noqa: BLE001 - asserted below, on the test's thread
            failed.append(exc)

    steering = threading.Thread(target=steer)
    steering.start()
    try:
        assert entered.wait(10)  # the caller's run, inside the waiting reply's first call
        assert session.cancel()
    finally:
        go.set()
        steering.join(10)
    assert not steering.is_alive() and failed == [] and [r.text for r in got] == ["both done"]
    ends = [e for e in heard if isinstance(e, (agent.events.Finished, agent.events.Failed))]
    assert ends == [heard[-1]] and isinstance(ends[0], agent.events.Finished)
    assert ends[0].result.stop_reason == "answered"
    stored = store.messages("chat")
    refunded = [c for m in stored for c in m.content if c.type is agent.ContentType.TOOL_RESULT
                and c.tool_call_id == first.pending_approvals[0].call_id]
    assert [c.text for c in refunded] == [CANCELLED]  # the cancel stopped the refund
    assert [m.text for m in stored[-2:]] == ["and order 8", "both done"] and store.pending_steers("chat") == []


class CancelledOnAcquire(memory.Store):
    """Its first lease is cancelled as soon as it is taken: the run's first save finds the cancel."""

    armed = 1

    def acquire(self, session: str, holder: agent.Holder, ttl: float) -> agent.Holder:
        got = super().acquire(session, holder, ttl)
        if got.token == holder.token and self.armed:
            self.armed -= 1
            assert self.cancel(session)
        return got


@pytest.mark.parametrize("lease_wait", [0.0, 5.0])
def test_a_steer_whose_own_run_stops_at_a_cancelled_turns_message_runs_the_steer_once(lease_wait: float) -> None:
    """A turn was cancelled after its message was stored and before any reply (its run stopped at its first
    save), and the cancel is handed on with the lease. The ``"steer"`` caller's run goes on with that
    transcript, which ends with that very turn's message: the handed cancel stops it before it takes the
    steer. The caller runs the steer once more (the cancel is spent), and its listener hears that run alone
    (it ran again and again until its wait was spent, a ``Finished`` each time, then ``StillQueued``)."""
    store = CancelledOnAcquire()
    session = agent.open("chat", store)
    spec = agent.Spec(session=session, lease_wait=lease_wait)
    model = Answer("never")
    cancelled = agent.Runner().turn(spec, "refund order 7", "k-7", model)
    assert (cancelled.stop_reason, model.requests) == ("cancelled", 0)
    assert store.messages("chat")[-1].key == "k-7" and store.armed == 0
    heard: list[agent.events.Event] = []
    result = agent.Runner().turn(spec, "and order 8", "k-8", Answer("both done"), heard.append, if_busy="steer")
    assert (result.text, result.stop_reason) == ("both done", "answered")
    ends = [e for e in heard if isinstance(e, (agent.events.Finished, agent.events.Failed))]
    assert ends == [heard[-1]] and isinstance(ends[0], agent.events.Finished)
    assert [m.text for m in store.messages("chat")][-2:] == ["and order 8", "both done"]


@agent.tool
def lookup(n: int) -> str:
    """Look an order up."""
    return "found"


def test_where_turns_begin_in_a_long_turn_of_steers_is_read_in_one_pass() -> None:
    """A turn of 300 tool steps with a steer after each. Whether a steer began a turn depends on where the
    turn before it began and the replies made since; worked out again for each earlier steer (as it once was),
    the answer took time exponential in the steers (18 steers: a second; 300: never). Within a budget of
    1,000 every steer joined the turn; with 2, every second steer came after the turn had made its two
    requests, and began one."""
    msgs = [agent.Message.user("go", key="go")]
    for i in range(300):
        msgs += [agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call(f"c{i}", "look", "{}")]),
                 agent.Message(agent.Role.USER, [agent.Content.tool_result(f"c{i}", "ok")]),
                 agent.Message.user(f"and {i}", key=f"s{i}", steer=True)]
    last = len(msgs) - 1
    assert turns.turn_start(msgs, 1000) == 0 and not turns.begins(msgs, last, 1000)
    assert turns.turn_start(msgs) == 0 and not turns.begins(msgs, last)
    assert turns.turn_start(msgs, 2) == last and turns.begins(msgs, last, 2) and not turns.begins(msgs, last - 3, 2)


class RefundsOrderEight:
    """Asks for a refund of order 8 when the last user message asks for it, else answers."""

    def __init__(self) -> None:
        self.requests = 0

    def complete(self, system: str, messages: Sequence[agent.Message], tools: object) -> agent.Message:
        self.requests += 1
        if messages[-1].text == "and refund order 8":
            return agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("r-8", "refund", '{"order": 8}')])
        return agent.Message.assistant("refunded order 8")


def _steer_answered_in_a_turn_of_its_own(then: str, spec: agent.Spec, store: memory.Store,
                                        session: agent.StoreSession) -> None:
    """A ``"steer"`` caller's refund of order 8, nobody holding the session: its own run asks the model once and
    waits for the refund's approval; approved, its repeat (or the sweep) answers within the steer's own budget
    (a second request)."""
    model = RefundsOrderEight()
    first = agent.Runner().turn(spec, "and refund order 8", "k-8", model, if_busy="steer")
    assert first.stop_reason == "awaiting_approval" and model.requests == 1
    session.approve("r-8")
    if then == "repeat":
        result = agent.Runner().turn(spec, "and refund order 8", "k-8", model, if_busy="steer")
    else:
        done = agent.recover(store, lambda info: (spec, model), grace=0, session="chat")
        assert [r.outcome for r in done] == ["recovered"] and done[0].result is not None
        result = done[0].result
    assert (result.stop_reason, result.text, model.requests) == ("answered", "refunded order 8", 2)


def _cancelled_in_its_second_lookup(session: agent.StoreSession) -> agent.Spec:
    """A plain run of ``session`` cancelled by the user during its second tool (two requests made of its
    ``max_steps`` of 3, tool results last, its cancel handed on with the lease); the spec it ran, which has the
    refund tool too."""
    looked: list[int] = []

    @agent.tool(name="lookup")
    def cancelled_meanwhile(n: int) -> str:
        """Look an order up (the user cancels during the second)."""
        looked.append(n)
        if len(looked) == 2:
            assert session.cancel()
        return "found"

    spec = agent.Spec(session=session, tools=[cancelled_meanwhile, refund], max_steps=3)
    plain = agent.Runner().run(spec, [agent.Message.user("look order 7 up")], ToolsThenAnswer(["lookup"], rounds=5))
    assert plain.stop_reason == "cancelled"
    return spec


@pytest.mark.parametrize("then", ["repeat", "sweep"])
def test_a_steer_its_caller_ran_after_a_cancelled_turn_begins_a_turn_of_its_own(then: str) -> None:
    """A plain run is cancelled in its second tool (two requests made of its ``max_steps`` of 3; tool results
    last, its cancel handed on with the lease). A ``"steer"`` caller runs the session itself: its run takes the
    steer, which begins a turn (stored as that turn's message, no steer: the cancelled turn had ended), asks
    the model, and waits for the refund's approval. Approved, its repeat (or the sweep) answers within the
    steer's own budget. Counted in the cancelled turn, it had one request left: the refund ran and the turn
    stopped at ``max_steps``, unanswered."""
    store = memory.Store()
    session = agent.open("chat", store)
    spec = _cancelled_in_its_second_lookup(session)
    _steer_answered_in_a_turn_of_its_own(then, spec, store, session)
    steer = store.messages("chat")[5]
    assert (steer.text, steer.key, steer.steer) == ("and refund order 8", "k-8", False)


class CancelsBeforeTheSteersAreRead:
    """A memory backend that, when a save first asks for the waiting steers (its write was refused: steers
    wait), lets the user cancel first: between the read that decides whether the steer begins a turn and the
    write that takes it."""

    def __init__(self, backend: Any, session: agent.StoreSession) -> None:
        self.backend, self.session, self.cancelled = backend, session, False

    def read(self, sid: str, want: Any) -> Any:
        if want.steers and not self.cancelled:
            self.cancelled = self.session.cancel()
        return self.backend.read(sid, want)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def test_a_cancel_landing_before_the_steers_are_read_stops_the_turn_the_steer_began() -> None:
    """After a cancelled turn, a ``"steer"`` caller's run is cancelled itself between its refused first save
    and its read of the waiting steers. What that read decided (no turn in progress: the steer begins one)
    still holds, since the cancel moves neither the open mark nor the handed cancel; the write takes the steer
    as that turn's message and answers that it was cancelled: the run stops before any request, and the
    caller hears that its own turn was cancelled."""
    store = memory.Store()
    session = agent.open("chat", store)
    spec = _cancelled_in_its_second_lookup(session)
    model = RefundsOrderEight()
    racing = CancelsBeforeTheSteersAreRead(store.backend, session)
    with stand_in(store, racing):
        first = agent.Runner().turn(spec, "and refund order 8", "k-8", model, if_busy="steer")
    assert racing.cancelled and (first.stop_reason, model.requests) == ("cancelled", 0)
    steer = store.messages("chat")[5]
    assert (steer.text, steer.key, steer.steer) == ("and refund order 8", "k-8", False)


@pytest.mark.parametrize("then", ["repeat", "sweep"])
def test_a_steer_its_caller_ran_after_a_turn_stopped_at_max_steps_begins_a_turn_of_its_own(then: str) -> None:
    """A plain run stopped at its ``max_steps`` (tool results last). Nobody holds the session: a ``"steer"``
    caller runs it itself, and its run takes the steer and asks the model with a budget of its own; the reply
    calls ``refund``, which waits for approval. The steer follows tool results in the transcript, as one that
    joined a turn in progress does, but no run was in that turn (it had made its ``max_steps`` requests): the
    steer began a turn. Approved, its repeat (or the sweep) goes on with that turn within its budget and
    answers. Counted in the turn that had ended, it had no budget left: the refund ran and the turn stopped at
    ``max_steps``, the steer unanswered (and a repeat while it ran said ``max_steps``)."""
    store = memory.Store()
    session = agent.open("chat", store)
    spec = agent.Spec(session=session, tools=[lookup, refund], max_steps=2)
    plain = agent.Runner().run(spec, [agent.Message.user("look order 7 up")], ToolsThenAnswer(["lookup"], rounds=5))
    assert plain.stop_reason == "max_steps"
    _steer_answered_in_a_turn_of_its_own(then, spec, store, session)
    assert [m.text for m in store.messages("chat")][-1] == "refunded order 8"
