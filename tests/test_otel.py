"""agent_sessions.otel: real runs (Runner over HTTP against tests.model_server) traced into the SDK's
in-memory exporter; the spans' names, nesting, attributes and statuses, on runs that answer and runs that
fail."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import agent_sessions as agent
from agent_sessions import events as ev
from agent_sessions.lease import claimant
from agent_sessions.otel import Tracing
from stores import memory
from tests.model_server import ModelServer, Reply, anthropic, openai


@agent.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


@agent.tool
def explode(reason: str) -> str:
    """Fail on purpose."""
    raise RuntimeError(reason)


class Abort(BaseException):
    """What no tool wrapper catches: it escapes the tool and the run."""


@agent.tool
def abort() -> str:
    """Escape the run."""
    raise Abort("pulled the plug")


class Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        [span] = self.named(name)
        return span


@pytest.fixture
def traced() -> Iterator[Traced]:
    t = Traced()
    yield t
    t.provider.shutdown()


def endpoint(model: ModelServer) -> agent.endpoints.OpenAIChat:
    return agent.endpoints.OpenAIChat(model.url + "/v1", "test-model", max_retries=0)


def parent_of(span: ReadableSpan, spans: list[ReadableSpan]) -> ReadableSpan | None:
    if span.parent is None:
        return None
    [parent] = [s for s in spans if s.context is not None and s.context.span_id == span.parent.span_id]
    return parent


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_a_run_is_one_trace_of_steps_requests_and_tool_calls(model: ModelServer, traced: Traced) -> None:
    session = agent.open("s1", memory.Store())
    session.steer("mind the clock")
    model.push(
        openai(calls=[("c1", "lookup", '{"key": "a"}'), ("c2", "explode", '{"reason": "boom"}')],
               usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}),
        openai("done", usage={"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}),
    )
    spec = agent.Spec(session=session, tools=[lookup, explode])
    seen: list[ev.Event] = []
    tracing = Tracing.for_run(spec, endpoint(model), tracer_provider=traced.provider, also=seen.append)
    result = agent.Runner().run(spec, [agent.Message.user("go")], endpoint(model), events=tracing)
    assert result.text == "done" and isinstance(seen[-1], ev.Finished)  # `also` was told every event
    assert not trace.get_current_span().get_span_context().is_valid  # the caller's context is as it was

    spans = traced.spans()
    assert sorted(s.name for s in spans) == sorted([
        "invoke_agent", "step", "step", "chat test-model", "chat test-model", "execute_tool lookup",
        "execute_tool explode"])
    assert len({s.context.trace_id for s in spans if s.context is not None}) == 1

    run = traced.one("invoke_agent")
    assert run.parent is None and run.kind is SpanKind.INTERNAL
    step1, step2 = sorted(traced.named("step"), key=lambda s: attrs(s)["agent_sessions.step"])
    chat1, chat2 = sorted(traced.named("chat test-model"), key=lambda s: attrs(s)["agent_sessions.step"])
    for step in (step1, step2):
        assert parent_of(step, spans) is run
    assert parent_of(chat1, spans) is step1 and parent_of(chat2, spans) is step2
    for tool in ("execute_tool lookup", "execute_tool explode"):
        assert parent_of(traced.one(tool), spans) is step1

    # The session's id on every span; the conventions' attributes on each kind.
    assert {attrs(s).get("gen_ai.conversation.id") for s in spans} == {"s1"}
    assert attrs(run).items() >= {"gen_ai.operation.name": "invoke_agent", "gen_ai.provider.name": "openai",
                               "gen_ai.request.model": "test-model", "gen_ai.usage.input_tokens": 30,
                               "gen_ai.usage.output_tokens": 12, "agent_sessions.steps": 2,
                               "agent_sessions.stop_reason": "answered"}.items()
    assert chat1.kind is SpanKind.CLIENT
    assert attrs(chat1).items() >= {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                                    "gen_ai.request.model": "test-model", "gen_ai.usage.input_tokens": 10,
                                    "gen_ai.usage.output_tokens": 5, "agent_sessions.messages": 2}.items()
    assert attrs(chat2)["gen_ai.usage.input_tokens"] == 20 and attrs(chat2)["gen_ai.usage.output_tokens"] == 7
    looked = traced.one("execute_tool lookup")
    assert attrs(looked).items() >= {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                                     "gen_ai.tool.call.id": "c1", "gen_ai.tool.type": "function"}.items()
    assert looked.status.status_code is StatusCode.UNSET

    # A tool's error result marks its own span only: the model reads it and the run goes on.
    exploded = traced.one("execute_tool explode")
    assert exploded.status.status_code is StatusCode.ERROR and exploded.status.description == "RuntimeError: boom"
    assert attrs(exploded)["error.type"] == "tool_error"
    assert [e.name for e in exploded.events] == ["exception"]
    assert all(s.status.status_code is StatusCode.UNSET for s in spans if s is not exploded)

    # The steer and the saves are events of the step they happened in.
    assert [e.name for e in step1.events] == ["agent_sessions.steer", "agent_sessions.saved"]
    assert dict(step1.events[0].attributes or {})["agent_sessions.steer.source"] == "session"

    # Every span ends within its parent.
    for span in spans:
        parent = parent_of(span, spans)
        if parent is not None:
            assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time  # type: ignore[operator]


def test_a_run_whose_endpoint_fails_ends_every_open_span_with_the_error(model: ModelServer, traced: Traced) -> None:
    model.push(openai(calls=[("c1", "lookup", '{"key": "a"}')]), Reply({"error": {"message": "overloaded"}}, 503))
    spec = agent.Spec(session=agent.open("s2", memory.Store()), tools=[lookup])
    with pytest.raises(agent.EndpointError, match="overloaded"):
        agent.Runner().run(spec, [agent.Message.user("go")], endpoint(model),
                           events=Tracing.for_run(spec, endpoint(model), tracer_provider=traced.provider))
    assert not trace.get_current_span().get_span_context().is_valid

    spans = traced.spans()  # only ended spans are exported: all six ended
    assert sorted(s.name for s in spans) == sorted([
        "invoke_agent", "step", "step", "chat test-model", "chat test-model", "execute_tool lookup"])
    step2 = max(traced.named("step"), key=lambda s: attrs(s)["agent_sessions.step"])
    chat2 = max(traced.named("chat test-model"), key=lambda s: attrs(s)["agent_sessions.step"])
    failed = [traced.one("invoke_agent"), step2, chat2]
    for span in failed:  # the error escaped each of them
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "EndpointError: 503: overloaded"
        assert attrs(span)["error.type"] == "agent_sessions.errors.EndpointError"
        [exception] = span.events[-1:]
        assert exception.name == "exception"
        assert dict(exception.attributes or {})["exception.type"] == "agent_sessions.errors.EndpointError"
        assert attrs(span)["gen_ai.conversation.id"] == "s2"
    assert attrs(chat2)["http.response.status_code"] == 503
    rest = [s for s in spans if all(s is not f for f in failed)]
    assert [s.status.status_code for s in rest] == [StatusCode.UNSET] * 3


def test_an_exception_escaping_a_tool_ends_the_tool_step_and_run_spans(model: ModelServer, traced: Traced) -> None:
    model.push(openai(calls=[("c1", "abort", "{}")]))
    spec = agent.Spec(tools=[abort])
    with pytest.raises(Abort):
        agent.Runner().run(spec, [agent.Message.user("go")], endpoint(model),
                           events=Tracing(model="test-model", tracer_provider=traced.provider))
    spans = traced.spans()
    assert len(spans) == 4
    errored = {s.name for s in spans if s.status.status_code is StatusCode.ERROR}
    assert errored == {"invoke_agent", "step", "execute_tool abort"}
    assert attrs(traced.one("execute_tool abort"))["error.type"] == "tests.test_otel.Abort"
    # No session: no conversation id, anywhere; no provider given: _OTHER.
    assert not [s for s in spans if "gen_ai.conversation.id" in attrs(s)]
    assert attrs(traced.one("invoke_agent"))["gen_ai.provider.name"] == "_OTHER"


def test_a_run_that_fails_before_its_first_step_is_one_errored_span(traced: Traced) -> None:
    store = memory.Store()
    store.acquire("busy", claimant(), 30.0)  # another run holds the lease
    spec = agent.Spec(session=agent.open("busy", store))
    with pytest.raises(agent.SessionBusy):
        agent.Runner().run(spec, [agent.Message.user("go")], agent.endpoints.OpenAIChat("http://127.0.0.1:9/v1", "m"),
                           events=Tracing(session_id="busy", tracer_provider=traced.provider))
    [run] = traced.spans()
    assert run.name == "invoke_agent" and run.status.status_code is StatusCode.ERROR
    assert attrs(run)["error.type"] == "agent_sessions.errors.SessionBusy"
    assert attrs(run)["gen_ai.conversation.id"] == "busy"


def test_anthropic_usage_counts_cached_input_and_names_the_provider(model: ModelServer, traced: Traced) -> None:
    model.push(anthropic("hi", usage={"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": 100,
                                      "cache_creation_input_tokens": 20}))
    claude = agent.endpoints.AnthropicMessages(model.url, "claude-test", max_retries=0)
    spec = agent.Spec()
    agent.Runner().run(spec, [agent.Message.user("go")], claude,
                       events=Tracing.for_run(spec, claude, agent_name="reviewer", tracer_provider=traced.provider))
    chat = traced.one("chat claude-test")
    assert attrs(chat).items() >= {"gen_ai.provider.name": "anthropic", "gen_ai.usage.input_tokens": 130,
                                   "gen_ai.usage.output_tokens": 3, "gen_ai.usage.cache_read.input_tokens": 100,
                                   "gen_ai.usage.cache_creation.input_tokens": 20}.items()
    run = traced.one("invoke_agent reviewer")
    assert attrs(run)["gen_ai.agent.name"] == "reviewer" and attrs(run)["gen_ai.usage.input_tokens"] == 130


def test_a_started_run_is_a_child_of_the_span_current_where_its_tracing_was_made(
    model: ModelServer, traced: Traced
) -> None:
    model.push(openai("done"))
    tracer = traced.provider.get_tracer("the application")
    with tracer.start_as_current_span("POST /review") as request:
        tracing = Tracing(session_id="s3", model="test-model", tracer_provider=traced.provider)
        run = agent.Runner().start(agent.Spec(), [agent.Message.user("go")], endpoint(model), events=tracing)
    run.wait(10)
    spans = traced.spans()
    invoke = traced.one("invoke_agent")
    assert parent_of(invoke, spans) is traced.one("POST /review")
    assert invoke.context is not None and invoke.context.trace_id == request.get_span_context().trace_id


def test_a_tool_s_own_spans_are_children_of_its_execute_tool_span(model: ModelServer, traced: Traced) -> None:
    tracer = traced.provider.get_tracer("the application")

    @agent.tool
    def query(sql: str) -> str:
        """Run a query."""
        with tracer.start_as_current_span("SELECT"):
            return "1 row"

    model.push(openai(calls=[("c1", "query", '{"sql": "select 1"}')]), openai("done"))
    agent.Runner().run(agent.Spec(tools=[query]), [agent.Message.user("go")], endpoint(model),
                       events=Tracing(tracer_provider=traced.provider))
    assert parent_of(traced.one("SELECT"), traced.spans()) is traced.one("execute_tool query")


def test_a_tracing_that_breaks_is_logged_and_the_run_goes_on(
    model: ModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(trace.NoOpTracer):
        def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
            raise RuntimeError("exporter bug")

    class BrokenProvider(trace.NoOpTracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
            return Broken()

    caplog.set_level(logging.ERROR, logger="agent_sessions.otel")
    model.push(openai("done"))
    result = agent.Runner().run(agent.Spec(), [agent.Message.user("go")], endpoint(model),
                                events=Tracing(tracer_provider=BrokenProvider()))
    assert result.text == "done"
    logged = [r for r in caplog.records if r.name == "agent_sessions.otel"]
    assert len(logged) == 1 and logged[0].exc_info is not None and "exporter bug" in str(logged[0].exc_info[1])


def test_one_tracing_traces_runs_one_after_another_and_ignores_a_second_thread(
    model: ModelServer, traced: Traced, caplog: pytest.LogCaptureFixture
) -> None:
    tracing = Tracing(tracer_provider=traced.provider)
    model.push(openai("one"), openai("two"))
    for _ in range(2):
        agent.Runner().run(agent.Spec(), [agent.Message.user("go")], endpoint(model), events=tracing)
    runs = traced.named("invoke_agent")
    assert len(runs) == 2 and runs[0].context is not None and runs[1].context is not None
    assert runs[0].context.trace_id != runs[1].context.trace_id

    # A run open on this thread; another thread's events are not woven into it.
    caplog.set_level(logging.WARNING, logger="agent_sessions.otel")
    tracing(ev.StepStarted(1))
    other = threading.Thread(target=tracing, args=(ev.StepStarted(1),))
    other.start()
    other.join(10)
    tracing(ev.Finished(agent.Result([], "", 1, "answered", [])))
    assert [s.name for s in traced.spans()[6:]] == ["step", "invoke_agent"]  # after two runs of 3 spans
    assert [r for r in caplog.records if "two runs at once" in r.message]
