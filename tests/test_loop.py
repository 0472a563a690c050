"""The ReAct loop's semantics, over a real HTTP endpoint (OpenAIChat against tests.model_server)."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Sequence

import pytest

import agent_sessions as agent
from agent_sessions import events as ev
from agent_sessions.run import publisher
from stores import memory
from tests.four_method_store import FourMethodStore
from tests.model_server import ModelServer, Reply, Request, openai, sse


@agent.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


@agent.tool
def explode(reason: str) -> str:
    """Fail on purpose."""
    raise RuntimeError(reason)


def endpoint(model: ModelServer) -> agent.endpoints.OpenAIChat:
    return agent.endpoints.OpenAIChat(model.url + "/v1", "test-model", max_retries=0)


class CountingStore(memory.Store):
    """A memory store that counts calls, to check how often the loop saves and takes."""

    def __init__(self) -> None:
        super().__init__()
        self.saves: list[int] = []
        self.takes = 0

    def save(self, session: str, msgs: Sequence[agent.Message]) -> None:
        self.saves.append(len(msgs))
        super().save(session, msgs)

    def take_steers(self, session: str) -> list[str]:
        self.takes += 1
        return super().take_steers(session)

    def save_fenced(
        self, session: str, holder: agent.Holder, msgs: Sequence[agent.Message], *, take_steers: bool,
        replace: bool = False, closes: bool = False,
    ) -> agent.Saved:
        self.takes += take_steers
        saved = super().save_fenced(session, holder, msgs, take_steers=take_steers, replace=replace, closes=closes)
        self.saves.append(len(msgs) + len(saved.steers))
        return saved


def wire_texts(request: Request) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content") or "") for m in request.json["messages"]]


def test_a_steer_waiting_in_the_store_is_taken_before_the_first_request(model: ModelServer) -> None:
    store = CountingStore()
    session = agent.open("s1", store)
    session.steer("check the lease expiry, not the token")
    model.push(openai("done"))
    result = agent.Runner().run(agent.Spec(session=session), [agent.Message.user("review")], endpoint(model))
    assert wire_texts(model.requests[0])[-1] == ("user", "check the lease expiry, not the token")
    assert result.messages[1] == agent.Message.user("check the lease expiry, not the token")
    assert store.take_steers("s1") == []


def test_steers_land_where_the_run_had_got_to_and_stay_there(model: ModelServer) -> None:
    store = CountingStore()
    session = agent.open("s1", store)
    model.push(
        openai(calls=[("c1", "lookup", '{"key": "a"}')]),
        lambda req: (session.steer("now look at b"), openai(calls=[("c2", "lookup", '{"key":"b"}')]))[1],
        openai("answer"),
    )
    result = agent.Runner().run(
        agent.Spec(session=session, tools=[lookup]), [agent.Message.user("go")], endpoint(model)
    )
    assert result.stop_reason == "answered" and result.text == "answer" and result.steps == 3
    # The steer left during request 2 is collected before request 3, after the tool result of step 2 ...
    third = model.requests[2].json["messages"]
    assert [m["role"] for m in third] == ["user", "assistant", "tool", "assistant", "tool", "user"]
    assert third[-1]["content"] == "now look at b"
    # ... and it stays at index 5 in the stored transcript, the answer after it.
    stored = store.messages("s1")
    assert stored[5] == agent.Message.user("now look at b")
    assert stored[6].text == "answer" and len(stored) == 7


def test_saves_are_one_more_than_requests(model: ModelServer) -> None:
    store = CountingStore()
    model.push(openai(calls=[("c1", "lookup", "{}")]), openai(calls=[("c2", "lookup", '{"key":"x"}')]),
               openai("fin"))
    result = agent.Runner().run(
        agent.Spec(session=agent.open("s", store), tools=[lookup]), [agent.Message.user("go")], endpoint(model)
    )
    assert len(model.requests) == result.steps == 3
    assert len(store.saves) == len(model.requests) + 1
    assert store.takes == len(model.requests)
    assert store.saves[-1] == len(result.messages)  # the final answer is stored
    assert store.messages("s")[-1].text == "fin"


def test_tool_results_follow_calls_and_errors_reach_the_model(model: ModelServer) -> None:
    model.push(
        openai(calls=[("c1", "lookup", '{"key":"k"}'), ("c2", "explode", '{"reason":"boom"}'),
                      ("c3", "missing", "{}"), ("c4", "lookup", "{not json")]),
        openai("ok"),
    )
    result = agent.Runner().run(agent.Spec(tools=[lookup, explode]), [agent.Message.user("go")],
                                endpoint(model))
    results = result.messages[2].content
    assert [c.tool_call_id for c in results] == ["c1", "c2", "c3", "c4"]
    assert results[0] == agent.Content.tool_result("c1", "value of k")
    assert results[1].is_error and results[1].text == "RuntimeError: boom"
    assert results[2].is_error and "no tool named 'missing'" in results[2].text
    assert results[3].is_error and "not valid JSON" in results[3].text
    tool_msgs = [m for m in model.requests[1].json["messages"] if m["role"] == "tool"]
    assert tool_msgs[1]["content"] == "Error: RuntimeError: boom"


def test_max_steps_bounds_the_requests(model: ModelServer) -> None:
    model.push(*[openai(calls=[(f"c{i}", "lookup", "{}")]) for i in range(5)])
    store = CountingStore()
    result = agent.Runner().run(agent.Spec(max_steps=2, tools=[lookup], session=agent.open("s", store)),
                                [agent.Message.user("go")], endpoint(model))
    assert result.stop_reason == "max_steps" and result.steps == 2 and result.text == ""
    assert len(model.requests) == 2 and len(store.saves) == 3
    assert len(store.messages("s")) == 5  # user, (call, result) x 2


def test_without_a_session_nothing_changes(model: ModelServer) -> None:
    script = [openai(calls=[("c1", "lookup", '{"key":"a"}')]), openai("the end")]
    model.push(*script)
    plain = agent.Runner().run(agent.Spec(tools=[lookup], system="sys"), [agent.Message.user("go")],
                               endpoint(model))
    plain_bodies = [r.raw for r in model.requests]
    model.requests.clear()
    model.push(*script)
    stored = agent.Runner().run(agent.Spec(tools=[lookup], system="sys", session=agent.open("s", CountingStore())),
                                [agent.Message.user("go")], endpoint(model))
    assert [r.raw for r in model.requests] == plain_bodies
    assert plain == stored


def test_without_a_session_no_session_or_store_code_runs(model: ModelServer) -> None:
    """No call: not one frame of agent_sessions/session.py, of the contract or of any store executes during the
    run."""
    model.push(openai(calls=[("c1", "lookup", "{}")]), openai("x"))
    spec = agent.Spec(tools=[lookup])
    ran: set[str] = set()

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call":
            ran.add(frame.f_code.co_filename)  # type: ignore[attr-defined]

    runner, msgs, ep = agent.Runner(), [agent.Message.user("go")], endpoint(model)
    sys.setprofile(profile)
    try:
        runner.run(spec, msgs, ep)
    finally:
        sys.setprofile(None)
    assert not [f for f in ran if f.endswith(("agent_sessions/session.py", "agent_sessions/contract.py"))
                or "/stores/" in f]
    assert not [f for f in ran if f.endswith(("agent_sessions/eventlog.py", "agent_sessions/run/publisher.py"))]
    assert any(f.endswith("run/react.py") for f in ran)  # the profile did see the loop


def test_without_publish_events_no_event_log_code_runs(model: ModelServer) -> None:
    """A session, events listened to, but publish_events off: not one frame of the event log's code (eventlog.py,
    run/publisher.py) executes."""
    model.push(openai(calls=[("c1", "lookup", "{}")]), openai("x"))
    spec = agent.Spec(tools=[lookup], session=agent.open("s", memory.Store()))
    ran: set[str] = set()

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call":
            ran.add(frame.f_code.co_filename)  # type: ignore[attr-defined]

    runner, msgs, ep, seen = agent.Runner(), [agent.Message.user("go")], endpoint(model), []
    sys.setprofile(profile)
    try:
        runner.run(spec, msgs, ep, seen.append)
    finally:
        sys.setprofile(None)
    assert not [f for f in ran if f.endswith(("agent_sessions/eventlog.py", "agent_sessions/run/publisher.py"))]
    assert any(f.endswith("stores/memory/__init__.py") for f in ran)  # the profile did see the store


class CountingEventStore(memory.Store):
    """Counts the event log's writes: appends on their own, and saves the events rode in."""

    def __init__(self) -> None:
        super().__init__()
        self.appends: list[int] = []
        self.rides: list[int] = []

    def append_events(self, session: str, holder: agent.Holder, events: Sequence[str], *, keep: int) -> int:
        self.appends.append(len(events))
        return super().append_events(session, holder, events, keep=keep)

    def save_fenced_events(self, session: str, holder: agent.Holder, msgs: Sequence[agent.Message], *,
                           take_steers: bool, replace: bool = False, events: Sequence[str], keep: int,
                           closes: bool = False) -> agent.Saved:
        self.rides.append(len(events))
        return super().save_fenced_events(session, holder, msgs, take_steers=take_steers, replace=replace,
                                          events=events, keep=keep, closes=closes)


def test_published_events_ride_in_the_saves_and_a_step_with_quick_tools_costs_no_write(model: ModelServer) -> None:
    model.push(openai(calls=[("c1", "lookup", "{}"), ("c2", "lookup", "{}")]), openai("done"))
    store = CountingEventStore()
    session = agent.open("s", store)
    agent.Runner().run(agent.Spec(tools=[lookup], session=session, publish_events=True), [agent.Message.user("go")],
                       endpoint(model))
    # step 1's save: step_started; step 2's save: the reply with its calls, the tools and step_started (a
    # quick tool's events wait for it: no write of their own); the final save: the answer and finished.
    assert store.appends == [] and store.rides == [1, 6, 2]
    assert [e.kind for e in session.events()] == [
        "step_started", "model_response", "tool_called", "tool_finished", "tool_called", "tool_finished",
        "step_started", "model_response", "finished"]


def test_streamed_text_is_published_in_batches_never_a_write_per_token(model: ModelServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    words = ["abcd"] * 12
    chunks = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in words]
    model.push(sse("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"))
    monkeypatch.setattr(publisher, "TEXT_CHARS", 16)  # a batch of four pieces
    store = CountingEventStore()
    session = agent.open("s", store)
    seen: list[ev.Event] = []
    streaming = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0, stream=True)
    result = agent.Runner().run(agent.Spec(session=session, publish_events=True), [agent.Message.user("go")],
                                streaming, seen.append)
    texts = [e for e in session.events() if e.kind == "text"]
    assert [e.data["text"] for e in texts] == ["abcd" * 4] * 3 and "".join(words) == result.text
    assert len(store.appends) == 3 and sum(isinstance(e, ev.TextDelta) for e in seen) == 12
    assert all(e.data["step"] == 1 for e in texts)


def test_resume_from_a_transcript_ending_in_a_tool_result(model: ModelServer) -> None:
    store = memory.Store()
    model.push(openai(calls=[("c1", "lookup", '{"key":"a"}')]), Reply({"error": {"message": "worker died"}}, 500))
    with pytest.raises(agent.EndpointError):
        agent.Runner().run(agent.Spec(tools=[lookup], session=agent.open("s", store)),
                           [agent.Message.user("go")], endpoint(model))
    transcript = store.messages("s")
    assert transcript[-1].content[0].type is agent.ContentType.TOOL_RESULT
    model.push(openai("resumed answer"))
    result = agent.Runner().run(agent.Spec(tools=[lookup]), transcript, endpoint(model))
    assert result.text == "resumed answer"
    assert [m["role"] for m in model.requests[-1].json["messages"]] == ["user", "assistant", "tool"]


def test_resuming_a_finished_conversation_without_a_new_message_gets_the_providers_400(
    model: ModelServer,
) -> None:
    transcript = [agent.Message.user("q"), agent.Message.assistant("a")]
    model.push(Reply({"error": {"message": "This model does not support assistant message prefill. "
                                           "The conversation must end with a user message."}}, 400))
    with pytest.raises(agent.EndpointError) as info:
        agent.Runner().run(agent.Spec(), transcript, endpoint(model))
    assert info.value.status == 400 and "prefill" in info.value.message
    model.push(openai("which line: 42"))
    result = agent.Runner().run(agent.Spec(), [*transcript, agent.Message.user("and which line?")],
                                endpoint(model))
    assert result.text == "which line: 42"


def test_run_steer_from_another_thread_lands_in_the_very_next_request(model: ModelServer) -> None:
    in_flight, steered = threading.Event(), threading.Event()

    def first(req: Request) -> Reply:
        in_flight.set()
        assert steered.wait(5)
        return openai(calls=[("c1", "lookup", '{"key":"a"}')])

    model.push(first, openai("done"))
    run = agent.Runner().start(agent.Spec(tools=[lookup]), [agent.Message.user("go")], endpoint(model))
    assert in_flight.wait(5)
    threading.Thread(target=lambda: (run.steer("use key b"), steered.set())).start()
    result = run.wait(timeout=10)
    second = model.requests[1].json["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool", "user"]
    assert second[3]["content"] == "use key b"
    assert result.messages[3] == agent.Message.user("use key b")
    assert result.unapplied_steers == []


def test_steers_after_the_last_request_are_unapplied(model: ModelServer) -> None:
    box: list[agent.Run] = []
    in_flight = threading.Event()
    model.push(lambda req: (in_flight.wait(5), box[0].steer("too late"), openai("done"))[2])
    run = agent.Runner().start(agent.Spec(), [agent.Message.user("go")], endpoint(model))
    box.append(run)
    in_flight.set()
    result = run.wait(10)
    assert result.unapplied_steers == ["too late"]
    with pytest.raises(agent.RunFinished):
        run.steer("after the end")


def test_cancel_stops_before_the_next_request(model: ModelServer) -> None:
    box: list[agent.Run] = []
    go = threading.Event()
    model.push(lambda req: (go.wait(5), box[0].cancel(), openai(calls=[("c1", "lookup", "{}")]))[2])
    store = CountingStore()
    run = agent.Runner().start(agent.Spec(tools=[lookup], session=agent.open("s", store)),
                               [agent.Message.user("go")], endpoint(model))
    box.append(run)
    go.set()
    result = run.wait(10)
    assert result.stop_reason == "cancelled" and result.steps == 1 and len(model.requests) == 1
    assert store.messages("s") == result.messages and len(result.messages) == 3


def test_wait_re_raises_the_runs_error_and_times_out(model: ModelServer) -> None:
    release = threading.Event()
    model.push(lambda req: (release.wait(5), Reply({"error": {"message": "nope"}}, 401))[1])
    run = agent.Runner().start(agent.Spec(), [agent.Message.user("go")], endpoint(model))
    with pytest.raises(TimeoutError):
        run.wait(timeout=0.05)
    release.set()
    with pytest.raises(agent.EndpointError, match="401: nope"):
        run.wait(timeout=10)


def test_events_tell_the_story_in_order(model: ModelServer) -> None:
    seen: list[ev.Event] = []
    session = agent.open("s", memory.Store())
    session.steer("hint")
    model.push(openai(calls=[("c1", "lookup", "{}")]), openai("done"))
    agent.Runner().run(agent.Spec(tools=[lookup], session=session), [agent.Message.user("go")],
                       endpoint(model), seen.append)
    kinds = [type(e).__name__ for e in seen]
    assert kinds == ["StepStarted", "SteerApplied", "Saved", "ModelRequest", "ModelResponse", "ToolCalled",
                     "ToolFinished", "StepStarted", "Saved", "ModelRequest", "ModelResponse", "Saved",
                     "Finished"]
    applied = seen[1]
    assert isinstance(applied, ev.SteerApplied) and applied.index == 1 and applied.source == "session"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: agent.Spec(max_steps=-1), "max_steps must be an int >= 0"),
        (lambda: agent.Spec(max_steps=True), "max_steps must be an int >= 0"),
        (lambda: agent.open("", memory.Store()), "must not be empty"),
        (lambda: agent.open(7, memory.Store()), "must be a str"),  # type: ignore[arg-type]
        (lambda: agent.open("s", object()), "needs a Store"),  # type: ignore[arg-type]
        (lambda: agent.open("s", memory.Store()).steer(3), "steer text must be a str"),  # type: ignore[arg-type]
        (lambda: agent.Spec(tools=[lookup, lookup]), "two tools named 'lookup'"),
        (lambda: agent.Spec(session="s"), "Spec.session must be a Session"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_raise_at_once_saying_what(build: object, message: str) -> None:
    with pytest.raises(agent.ArgumentError, match=message):
        build()  # type: ignore[operator]


def test_bad_runner_arguments(model: ModelServer) -> None:
    with pytest.raises(agent.ArgumentError, match=r"msgs\[1\] must be a Message"):
        agent.Runner().start(agent.Spec(), [agent.Message.user("a"), "b"], endpoint(model))  # type: ignore[list-item]
    run = agent.Runner().start(agent.Spec(), [], endpoint(model))
    with pytest.raises(agent.ArgumentError, match="Run.steer text must be a str"):
        run.steer(None)  # type: ignore[arg-type]
    with pytest.raises(agent.EndpointError):
        run.wait(10)  # the script is empty: the server says 599



def test_a_store_without_the_run_protocol_still_runs_and_says_what_it_lacks(model: ModelServer) -> None:
    store = FourMethodStore()
    assert isinstance(store, agent.Store) and not isinstance(store, agent.RunStore)
    session = agent.open("core-only", store)
    model.push(openai(calls=[("c1", "lookup", '{"key": "k"}')]), openai("done"))
    result = agent.Runner().run(agent.Spec(session=session, tools=[lookup]), [agent.Message.user("go")],
                                endpoint(model))
    assert result.text == "done" and store.messages("core-only") == result.messages
    for call in (lambda: session.fork("other"), session.holder, session.cancel):
        with pytest.raises(agent.Unsupported, match="agent_sessions.RunStore"):
            call()


def test_a_transcript_ending_in_unanswered_tool_calls_gets_their_results_before_the_next_request(
    model: ModelServer,
) -> None:
    msgs = [agent.Message.user("go"),
            agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "lookup", '{"key": "k"}')])]
    model.push(openai("done"))
    result = agent.Runner().run(agent.Spec(tools=[lookup]), msgs, endpoint(model))
    sent = model.requests[0].json["messages"]
    assert sent[-1] == {"role": "tool", "tool_call_id": "c1", "content": "value of k"}
    assert result.text == "done" and agent.orphaned_tool_calls(result.messages) == []


def test_a_tool_is_idempotent_unless_declared_otherwise() -> None:
    @agent.tool(idempotent=False)
    def charge(amount: int) -> str:
        """Charge once."""
        return "ok"

    assert lookup.idempotent is True and charge.idempotent is False
    with pytest.raises(agent.ArgumentError, match="idempotent must be a bool"):
        agent.Tool("t", "", {"type": "object"}, lambda: None, idempotent="no")  # type: ignore[arg-type]


def test_a_started_run_tells_its_done_callbacks_and_logs_a_failure_nobody_waits_for(
    model: ModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="agent_sessions.run.runner")
    model.push(Reply({"error": {"message": "overloaded"}}, 503))
    told: list[agent.Run] = []
    watched = agent.Runner().start(agent.Spec(session=agent.open("s", memory.Store())),
                                   [agent.Message.user("go")], endpoint(model))
    watched.add_done_callback(told.append)
    with pytest.raises(agent.EndpointError):
        watched.wait(10)
    assert told == [watched] and isinstance(watched.error, agent.EndpointError)
    late: list[agent.Run] = []
    watched.add_done_callback(late.append)  # after the end: called at once
    assert late == [watched]
    assert not [r for r in caplog.records if "nothing waits" in r.message]

    model.push(Reply({"error": {"message": "overloaded"}}, 503))
    dropped = agent.Runner().start(agent.Spec(session=agent.open("t", memory.Store())),
                                   [agent.Message.user("go")], endpoint(model))
    dropped._thread.join(10)  # type: ignore[union-attr]  # a view that answered 202 and let go of it
    failures = [r for r in caplog.records if "nothing waits for it" in r.message]
    assert len(failures) == 1 and "the run of session 't'" in failures[0].getMessage()
    assert failures[0].exc_info is not None and "overloaded" in str(failures[0].exc_info[1])

    def broken(run: agent.Run) -> None:
        raise RuntimeError("a bug in the callback")

    model.push(openai("fine"))
    ok = agent.Runner().start(agent.Spec(), [agent.Message.user("go")], endpoint(model))
    ok.add_done_callback(broken)
    assert ok.wait(10).text == "fine" and ok.error is None
    ok._thread.join(10)  # type: ignore[union-attr]
    assert [r for r in caplog.records if "done callback" in r.message]


def test_a_failing_run_reports_failed_last_and_raises_its_own_error(
    model: ModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[ev.Event] = []
    model.push(openai(calls=[("c1", "lookup", "{}")]), Reply({"error": {"message": "overloaded"}}, 503))
    with pytest.raises(agent.EndpointError, match="overloaded") as raised:
        agent.Runner().run(agent.Spec(tools=[lookup], session=agent.open("s", memory.Store())),
                           [agent.Message.user("go")], endpoint(model), seen.append)
    assert [type(e).__name__ for e in seen] == ["StepStarted", "Saved", "ModelRequest", "ModelResponse",
                                                "ToolCalled", "ToolFinished", "StepStarted", "Saved",
                                                "ModelRequest", "Failed"]
    assert isinstance(seen[-1], ev.Failed) and seen[-1].error is raised.value
    assert not any(isinstance(e, ev.Finished) for e in seen)

    # A callback that raises on Failed is logged; the run's error is still the one raised.
    def broken(event: ev.Event) -> None:
        if isinstance(event, ev.Failed):
            raise RuntimeError("a bug in the listener")

    caplog.set_level(logging.ERROR, logger="agent_sessions.events")
    model.push(Reply({"error": {"message": "still overloaded"}}, 503))
    with pytest.raises(agent.EndpointError, match="still overloaded"):
        agent.Runner().run(agent.Spec(), [agent.Message.user("go")], endpoint(model), broken)
    assert [r for r in caplog.records if "raised on Failed" in r.message]


def test_an_error_raised_by_the_events_callback_fails_the_run_with_failed(model: ModelServer) -> None:
    seen: list[ev.Event] = []

    def listener(event: ev.Event) -> None:
        seen.append(event)
        if isinstance(event, ev.ToolCalled):
            raise KeyError("the listener's bug")

    model.push(openai(calls=[("c1", "lookup", "{}")]))
    with pytest.raises(KeyError):
        agent.Runner().run(agent.Spec(tools=[lookup]), [agent.Message.user("go")], endpoint(model), listener)
    assert isinstance(seen[-1], ev.Failed) and isinstance(seen[-1].error, KeyError)


def test_without_events_a_failing_run_raises_and_builds_no_event(model: ModelServer) -> None:
    assert ev.sink(None) is ev.SILENT
    ev.SILENT.failed(RuntimeError("nobody listens"))  # costs a call, builds nothing
    model.push(Reply({"error": {"message": "nope"}}, 401))
    with pytest.raises(agent.EndpointError, match="401: nope"):
        agent.Runner().run(agent.Spec(), [agent.Message.user("go")], endpoint(model))


def test_a_slow_tools_call_is_published_while_it_runs(model: ModelServer) -> None:
    """The watcher writes what has waited FLUSH_SECONDS: a follower sees the call before the tool returns."""
    seen_during: list[list[str]] = []
    store = CountingEventStore()

    @agent.tool
    def slow_lookup() -> str:
        """Takes its time."""
        time.sleep(publisher.FLUSH_SECONDS * 4)
        seen_during.append([e.kind for e in store.events("s", 0, 100)])
        return "found"

    model.push(openai(calls=[("c1", "slow_lookup", "{}")]), openai("done"))
    agent.Runner().run(agent.Spec(tools=[slow_lookup], session=agent.open("s", store), publish_events=True),
                       [agent.Message.user("go")], endpoint(model))
    assert seen_during and seen_during[0][-2:] == ["model_response", "tool_called"]
    assert store.appends, "the watcher wrote the waiting events on their own"
    kinds = [e.kind for e in store.events("s", 0, 100)]
    assert kinds.count("tool_called") == 1 and kinds[-1] == "finished"


def _refunds(ran: list[str]) -> agent.Tool:
    def refund(order: str) -> str:
        """Refund 60 on an order: not idempotent."""
        ran.append(order)
        return f"refunded 60 on {order}"

    return agent.tool(idempotent=False)(refund)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_two_calls_with_one_id_without_a_session_each_run_and_go_back_with_their_own_ids(
    model: ModelServer, provider: str
) -> None:
    """The loop gives the second call a made-up id as the reply arrives: the reply it keeps, and so the next
    request, carries that id with the call and with its result (both providers require the two to match)."""
    from tests.model_server import anthropic

    ran: list[str] = []
    if provider == "openai":
        model.push(openai(calls=[("c1", "refund", '{"order": "A"}'), ("c1", "refund", '{"order": "B"}')]),
                   openai("done"))
        ep: agent.endpoints.Endpoint = endpoint(model)
    else:
        model.push(anthropic(calls=[("c1", "refund", {"order": "A"}), ("c1", "refund", {"order": "B"})]),
                   anthropic("done"))
        ep = agent.endpoints.AnthropicMessages(model.url, "test-model", max_retries=0)
    result = agent.Runner().run(agent.Spec(tools=[_refunds(ran)]), [agent.Message.user("refund A and B")], ep)
    assert result.text == "done" and ran == ["A", "B"]
    calls = result.messages[1].tool_calls
    assert calls[0].id == "c1" and calls[1].id not in ("", "c1")
    assert [(r.tool_call_id, r.text) for r in result.messages[2].content] == [
        (calls[0].id, "refunded 60 on A"), (calls[1].id, "refunded 60 on B")]
    sent = model.requests[1].json["messages"]
    if provider == "openai":
        assert [c["id"] for c in sent[1]["tool_calls"]] == [calls[0].id, calls[1].id]
        assert [(m["tool_call_id"], m["content"]) for m in sent[2:]] == [
            (calls[0].id, "refunded 60 on A"), (calls[1].id, "refunded 60 on B")]
    else:
        assert [b["id"] for b in sent[1]["content"] if b["type"] == "tool_use"] == [calls[0].id, calls[1].id]
        assert [(b["tool_use_id"], b["content"]) for b in sent[2]["content"]] == [
            (calls[0].id, "refunded 60 on A"), (calls[1].id, "refunded 60 on B")]


def test_distinct_call_ids_keeps_a_reply_whose_ids_are_distinct_and_renames_only_repeats() -> None:
    distinct = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("a", "t", "{}"),
                                                    agent.Content.tool_call("b", "t", "{}")], usage={"n": 1})
    assert agent.messages.distinct_call_ids(distinct) is distinct
    thrice = agent.Message(agent.Role.ASSISTANT, [agent.Content.from_text("x"),
                                                  *[agent.Content.tool_call("a", "t", str(i)) for i in range(3)]],
                           usage={"n": 1})
    fixed = agent.messages.distinct_call_ids(thrice)
    ids = [c.id for c in fixed.tool_calls]
    assert ids[0] == "a" and len(set(ids)) == 3 and ids[1].startswith("call_1_") and ids[2].startswith("call_2_")
    assert [c.arguments for c in fixed.tool_calls] == ["0", "1", "2"] and fixed.text == "x"
    assert fixed.usage == {"n": 1}


def test_a_transcript_handed_in_with_two_calls_of_one_id_is_refused_naming_them(model: ModelServer) -> None:
    msgs = [agent.Message.user("refund"),
            agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "refund", '{"order": "A"}'),
                                                 agent.Content.tool_call("c1", "refund", '{"order": "B"}')])]
    spec = agent.Spec(tools=[_refunds([])])
    for start in (agent.Runner().run, agent.Runner().start):
        with pytest.raises(agent.MessageError, match=r"msgs\[1\] makes two tool calls with id 'c1'"):
            start(spec, msgs, endpoint(model))
    assert model.requests == []
