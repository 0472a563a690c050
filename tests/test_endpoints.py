"""Both endpoints against a real local HTTP server speaking each provider's wire format."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import events as ev
from agent_sessions.endpoints import AnthropicMessages, OpenAIChat
from tests.model_server import ModelServer, Reply, Request, anthropic, openai, openai_raw

ODD = '{"z":1,"a":[1, 2],"z":3}'


@agent.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key


def test_openai_request_shape_and_reply(model: ModelServer) -> None:
    model.push(openai(calls=[("c1", "lookup", '{"key":"a"}')]))
    ep = OpenAIChat(model.url + "/v1", "m", api_key="sk-test", extra={"temperature": 0})
    reply = ep.complete("be brief", [agent.Message.user("hi")], [lookup])
    request = model.requests[0]
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    body = request.json
    assert body["model"] == "m" and body["temperature"] == 0 and body["tool_choice"] == "auto"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert body["tools"][0]["function"]["name"] == "lookup"
    assert reply == agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "lookup", '{"key":"a"}')])


def test_openai_tool_call_arguments_pass_through_byte_for_byte(model: ModelServer) -> None:
    hand_written = ('{"choices":[{"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c1",'
                    '"type":"function","function":{"name":"lookup","arguments":' + json.dumps(ODD) + '}}]}}]}')
    model.push(openai_raw(hand_written), openai("done"))
    result = agent.Runner().run(agent.Spec(tools=[lookup]), [agent.Message.user("go")],
                                OpenAIChat(model.url + "/v1", "m"))
    assert result.messages[1].tool_calls[0].arguments == ODD
    sent = model.requests[1].json["messages"][1]
    assert sent["tool_calls"][0]["function"]["arguments"] == ODD
    assert sent["content"] == ""  # never null beside tool calls: llama.cpp's server answers 500 to null


def test_openai_error_status_carries_the_providers_message(model: ModelServer) -> None:
    model.push(Reply({"error": {"message": "Invalid API key", "type": "invalid_request_error"}}, 401))
    with pytest.raises(agent.EndpointError) as info:
        OpenAIChat(model.url + "/v1", "m").complete("", [agent.Message.user("x")], [])
    assert info.value.status == 401 and info.value.message == "Invalid API key"
    assert len(model.requests) == 1  # a 401 is not retried


def test_retries_429_and_5xx_honouring_retry_after(model: ModelServer) -> None:
    model.push(Reply({"error": {"message": "slow down"}}, 429, {"retry-after": "0.2"}),
               Reply({"error": {"message": "overloaded"}}, 503), openai("finally"))
    started = time.monotonic()
    reply = OpenAIChat(model.url + "/v1", "m", backoff=0.01).complete("", [agent.Message.user("x")], [])
    assert reply.text == "finally" and len(model.requests) == 3
    assert time.monotonic() - started >= 0.2


def test_retries_are_bounded(model: ModelServer) -> None:
    model.push(*[Reply({"error": {"message": "down"}}, 502)] * 5)
    with pytest.raises(agent.EndpointError, match="502: down"):
        OpenAIChat(model.url + "/v1", "m", max_retries=2, backoff=0.001).complete("", [], [])
    assert len(model.requests) == 3


def test_connection_refused_is_an_endpoint_error() -> None:
    with pytest.raises(agent.EndpointError, match="cannot reach"):
        OpenAIChat("http://127.0.0.1:9/v1", "m", max_retries=1, backoff=0.001).complete("", [], [])


def test_a_hung_endpoint_fails_within_the_timeout(model: ModelServer) -> None:
    model.push(lambda req: (time.sleep(1.0), openai("late"))[1])
    started = time.monotonic()
    with pytest.raises(agent.EndpointError, match="failed"):
        OpenAIChat(model.url + "/v1", "m", timeout=0.2).complete("", [], [])
    assert time.monotonic() - started < 0.9
    assert len(model.requests) == 1  # a read timeout is not retried


@pytest.mark.parametrize("body", [
    "not json at all", "[]", '{"choices": []}', '{"choices": [{"message": {"content": 3}}]}',
    '{"choices": [{"message": {"content": null, "tool_calls": [{"function": {}}]}}]}',
    '{"choices": [{"mess',
    '{"choices": [{"message": {"content": null, "tool_calls": [{"id": "c", "function": {"name": ""}}]}}]}',
])
def test_malformed_openai_replies_are_endpoint_errors(model: ModelServer, body: str) -> None:
    model.push(openai_raw(body))
    with pytest.raises(agent.EndpointError, match="malformed|not a JSON object"):
        OpenAIChat(model.url + "/v1", "m").complete("", [], [])


def test_anthropic_request_shape_merges_roles_and_keeps_arguments(model: ModelServer) -> None:
    model.push(anthropic(calls=[("tu1", "lookup", {"key": "a"})]), anthropic("done"))
    ep = AnthropicMessages(model.url, "claude-test", api_key="k", max_tokens=100)
    history = [
        agent.Message.user("go"),
        agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("t0", "lookup", ODD)]),
        agent.Message(agent.Role.USER, [agent.Content.tool_result("t0", "bad", is_error=True)]),
        agent.Message.user("steer: try again"),
    ]
    result = agent.Runner().run(agent.Spec(tools=[lookup], system="sys"), history, ep)
    first = model.requests[0]
    assert first.path == "/v1/messages"
    assert first.headers["x-api-key"] == "k" and first.headers["anthropic-version"] == "2023-06-01"
    assert b'"input": ' + ODD.encode() in first.raw  # spliced in verbatim, duplicate key and all
    body = first.json
    assert body["system"] == "sys" and body["max_tokens"] == 100
    assert body["tools"][0]["input_schema"]["properties"] == {"key": {"type": "string"}}
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "t0", "content": "bad", "is_error": True},
        {"type": "text", "text": "steer: try again"},
    ]
    call = result.messages[4].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("tu1", "lookup", '{"key":"a"}')
    second = model.requests[1].json["messages"]
    assert second[-1]["content"] == [{"type": "tool_result", "tool_use_id": "tu1", "content": "a"}]
    assert result.text == "done"


def test_anthropic_error_status(model: ModelServer) -> None:
    model.push(Reply({"type": "error", "error": {"type": "invalid_request_error",
                      "message": "This model does not support assistant message prefill."}}, 400))
    with pytest.raises(agent.EndpointError) as info:
        AnthropicMessages(model.url, "m").complete("", [agent.Message.assistant("pre")], [])
    assert info.value.status == 400 and "prefill" in info.value.message


@pytest.mark.parametrize("body", ['{"content": "text"}', '{"content": [{"type": "image"}]}',
                                  '{"content": [{"type": "tool_use", "name": "x"}]}',
                                  '{"content": [{"type": "tool_use", "id": "", "name": "x"}]}'])
def test_malformed_anthropic_replies(model: ModelServer, body: str) -> None:
    model.push(openai_raw(body))
    with pytest.raises(agent.EndpointError, match="malformed"):
        AnthropicMessages(model.url, "m").complete("", [], [])


def test_one_connection_is_reused(model: ModelServer) -> None:
    model.push(openai("x"), openai("y"), openai("z"))
    ep = OpenAIChat(model.url + "/v1", "m")
    for _ in range(3):
        ep.complete("", [agent.Message.user("x")], [])
    assert len({r.client_port for r in model.requests}) == 1


# The old encoder wrote these into the body and then replaced them with the arguments text.
FORMER_PLACEHOLDERS = [f"\x00agent-sessions-raw-input-{i}\x00" for i in range(3)]


def test_anthropic_text_equal_to_a_former_placeholder_goes_out_verbatim(model: ModelServer) -> None:
    model.push(anthropic("ok"))
    history = [
        agent.Message.user(FORMER_PLACEHOLDERS[0]),
        agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("t0", "lookup", '{"key":"a"}'),
                                             agent.Content.tool_call("t1", "lookup", '{"key":"b"}')]),
        agent.Message(agent.Role.USER, [agent.Content.tool_result("t0", FORMER_PLACEHOLDERS[1]),
                                        agent.Content.tool_result("t1", FORMER_PLACEHOLDERS[2])]),
    ]
    AnthropicMessages(model.url, "m").complete("", history, [lookup])
    sent = model.requests[0].json["messages"]
    assert sent[0]["content"] == [{"type": "text", "text": FORMER_PLACEHOLDERS[0]}]
    assert [block["input"] for block in sent[1]["content"]] == [{"key": "a"}, {"key": "b"}]
    assert [block["content"] for block in sent[2]["content"]] == FORMER_PLACEHOLDERS[1:]


any_text = st.text(st.characters(exclude_categories=()) | st.sampled_from(["\x00", "\ud800", "\U0001f600", '"', "\\"]),
                   max_size=20) | st.sampled_from(FORMER_PLACEHOLDERS)


@st.composite
def raw_arguments(draw: st.DrawFn) -> str:
    """What a model may write as arguments: a JSON object in any spacing, or something that is not one."""
    value = draw(st.dictionaries(any_text, st.none() | st.integers() | any_text | st.lists(st.booleans()),
                                 max_size=3))
    indent = draw(st.sampled_from([None, 0, 2]))
    text = json.dumps(value, indent=indent, ensure_ascii=draw(st.booleans()))
    return draw(st.sampled_from([text, f" {text}\n", text[: len(text) // 2], "[1, 2]", "", draw(any_text),
                                 '{"n": NaN}', '{"n": [-Infinity]}']))


contents = st.one_of(
    st.builds(agent.Content.from_text, any_text),
    st.builds(agent.Content.tool_call, st.text(min_size=1, max_size=8), st.just("lookup"), raw_arguments()),
    st.builds(agent.Content.tool_result, st.text(min_size=1, max_size=8), any_text, st.booleans()),
)
transcripts = st.lists(st.builds(agent.Message, st.sampled_from(list(agent.Role)), st.lists(contents, max_size=3)),
                       max_size=6)


def strict_json(text: str | bytes) -> Any:
    """json.loads without Python's NaN and Infinity, which are not JSON and which a provider rejects."""

    def reject(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=reject)


def expected_anthropic_body(system: str, msgs: list[agent.Message]) -> dict[str, Any]:
    """The request the Anthropic encoder must write, built the plain way: a tool call's ``input`` is its
    arguments parsed when they are a JSON object, else ``{}``; neighbours of one role are merged."""

    def block(c: agent.Content) -> dict[str, Any]:
        if c.type is agent.ContentType.TEXT:
            return {"type": "text", "text": c.text}
        if c.type is agent.ContentType.TOOL_CALL:
            try:
                arguments = strict_json(c.arguments)
            except ValueError:
                arguments = None
            return {"type": "tool_use", "id": c.id, "name": c.name,
                    "input": arguments if isinstance(arguments, dict) else {}}
        out = {"type": "tool_result", "tool_use_id": c.tool_call_id, "content": c.text}
        return {**out, "is_error": True} if c.is_error else out

    wire: list[dict[str, Any]] = []
    for m in msgs:
        if wire and wire[-1]["role"] == m.role.value:
            wire[-1]["content"].extend(block(c) for c in m.content)
        else:
            wire.append({"role": m.role.value, "content": [block(c) for c in m.content]})
    body: dict[str, Any] = {"model": "m", "max_tokens": 7, "messages": wire, "temperature": 0}
    if system:
        body["system"] = system
    body["tools"] = [{"name": "lookup", "description": "Look a key up.",
                      "input_schema": {"type": "object", "properties": {"key": {"type": "string"}},
                                       "required": ["key"]}}]
    return body


@settings(max_examples=300, deadline=None)
@given(any_text, transcripts)
def test_anthropic_body_is_the_transcript_with_arguments_as_input(system: str, msgs: list[agent.Message]) -> None:
    ep = AnthropicMessages("http://127.0.0.1:9", "m", max_tokens=7, extra={"temperature": 0})
    body = ep.body(system, msgs, [lookup])
    assert strict_json(body.encode("utf-8")) == expected_anthropic_body(system, msgs)


def test_anthropic_arguments_that_only_python_parses_go_out_as_an_empty_input(model: ModelServer) -> None:
    # 1e999 is a JSON number; Python reads it as inf and the stored arguments say Infinity, which is not.
    model.push(openai_raw('{"content": [{"type": "tool_use", "id": "tu1", "name": "lookup", '
                          '"input": {"key": "a", "n": 1e999}}]}'), anthropic("done"))
    result = agent.Runner().run(agent.Spec(tools=[lookup]), [agent.Message.user("go")],
                                AnthropicMessages(model.url, "m"))
    assert result.messages[1].tool_calls[0].arguments == '{"key":"a","n":Infinity}'
    sent = strict_json(model.requests[1].raw)["messages"]
    assert sent[1]["content"][0]["input"] == {}
    assert result.text == "done"


def test_anthropic_arguments_with_a_lone_surrogate_are_sent(model: ModelServer) -> None:
    # JSON may escape half a surrogate pair; read, it is a str that UTF-8 cannot encode as it stands.
    model.push(openai_raw('{"content": [{"type": "tool_use", "id": "tu1", "name": "lookup", '
                          '"input": {"key": "a\\ud800"}}]}'), anthropic("done"))
    result = agent.Runner().run(agent.Spec(tools=[lookup]), [agent.Message.user("go")],
                                AnthropicMessages(model.url, "m"))
    assert result.messages[1].tool_calls[0].arguments == '{"key":"a\ud800"}'
    sent = model.requests[1].json["messages"]
    assert sent[1]["content"][0]["input"] == {"key": "a\ud800"}
    assert sent[2]["content"][0]["content"] == "a\ud800"
    assert result.text == "done"


def test_sixteen_threads_share_one_endpoint(model: ModelServer) -> None:
    def echo(request: Request) -> Reply:
        time.sleep(0.002)
        return openai("echo " + request.json["messages"][-1]["content"])

    model.push(*[echo] * 16 * 5)
    ep = OpenAIChat(model.url + "/v1", "m", max_retries=0)
    start = threading.Barrier(16)
    answers: dict[int, list[str]] = {}

    def work(i: int) -> None:
        start.wait(timeout=10)
        answers[i] = [ep.complete("", [agent.Message.user(f"{i}.{k}")], []).text for k in range(5)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert answers == {i: [f"echo {i}.{k}" for k in range(5)] for i in range(16)}
    ports: dict[str, set[int]] = {}
    for r in model.requests:
        ports.setdefault(r.json["messages"][-1]["content"].split(".")[0], set()).add(r.client_port)
    assert all(len(p) == 1 for p in ports.values())  # a session per thread: each keeps its connection
    assert len(set().union(*ports.values())) == 16  # and shares it with no other thread


MAKERS: dict[str, tuple[Callable[..., Any], Reply, str]] = {
    "openai": (lambda url, **kw: OpenAIChat(url + "/v1", "m", api_key="sk", **kw), openai("ok"), "authorization"),
    "anthropic": (lambda url, **kw: AnthropicMessages(url, "m", api_key="sk", **kw), anthropic("ok"), "x-api-key"),
}


@pytest.mark.parametrize("kind", MAKERS)
def test_a_callers_session_and_headers_are_used(model: ModelServer, kind: str) -> None:
    make, ok, key_header = MAKERS[kind]
    session = requests.Session()
    session.headers["x-gateway"] = "from the session"
    elsewhere = session.get_adapter("http://example.com/")
    model.push(Reply({"error": {"message": "busy"}}, 503), ok)
    ep = make(model.url, session=session, headers={"x-trace": "t-1", key_header: "the gateway's"}, backoff=0.001)
    assert ep.complete("", [agent.Message.user("x")], []).text == "ok"
    assert len(model.requests) == 2  # the endpoint's retries hold on the caller's session too
    for r in model.requests:
        assert r.headers["x-gateway"] == "from the session" and r.headers["x-trace"] == "t-1"
        assert r.headers[key_header] == "the gateway's"  # headers= wins over the endpoint's own
    ep.close()
    assert session.get_adapter("http://example.com/") is elsewhere  # ours is mounted for base_url only


def test_a_session_or_headers_of_the_wrong_type_are_argument_errors() -> None:
    with pytest.raises(agent.ArgumentError, match="session"):
        OpenAIChat("http://127.0.0.1:9/v1", "m", session=object())  # type: ignore[arg-type]
    with pytest.raises(agent.ArgumentError, match="headers"):
        AnthropicMessages("http://127.0.0.1:9", "m", headers={"x-n": 1})  # type: ignore[dict-item]


def endpoint_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("agent_sessions.endpoints") and r.levelno == logging.WARNING]


@pytest.mark.parametrize(("retry_after", "wait"), [
    ("0.02", "0.02"), ("3600", "0.05"), ("Wed, 21 Oct 2015 07:28:00 GMT", "0.00"),
])
def test_a_retry_is_logged_with_its_cause_attempt_and_wait(
    model: ModelServer, caplog: pytest.LogCaptureFixture, retry_after: str, wait: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="agent_sessions")
    model.push(Reply({"error": {"message": "slow down"}}, 429, {"retry-after": retry_after}),
               Reply({"error": {"message": "overloaded"}}, 529), openai("ok"))
    OpenAIChat(model.url + "/v1", "m", backoff=0.001, max_backoff=0.05).complete("", [agent.Message.user("x")], [])
    first, second = endpoint_warnings(caplog)
    assert "/v1/chat/completions" in first and "status 429" in first and "attempt 1 of 3" in first
    assert f"retrying in {wait} s (Retry-After: {retry_after})" in first  # honoured, capped at max_backoff
    assert "status 529" in second and "attempt 2 of 3" in second and "Retry-After" not in second


def test_a_connection_retry_is_logged_with_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agent_sessions")
    with pytest.raises(agent.EndpointError, match="cannot reach"):
        OpenAIChat("http://127.0.0.1:9/v1", "m", max_retries=1, backoff=0.001).complete("", [], [])
    (warning,) = endpoint_warnings(caplog)
    assert "attempt 1 of 2" in warning and "NewConnectionError" in warning and "retrying in" in warning


@pytest.mark.parametrize("retry_after", ["nan", "soon", "-3", "inf", "1e999", ""])
def test_a_retry_after_that_makes_no_sense_means_the_usual_backoff(
    model: ModelServer, caplog: pytest.LogCaptureFixture, retry_after: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="agent_sessions")
    model.push(Reply({"error": {"message": "slow down"}}, 429, {"retry-after": retry_after}), openai("ok"))
    ep = OpenAIChat(model.url + "/v1", "m", backoff=0.001, max_backoff=0.05)
    assert ep.complete("", [agent.Message.user("x")], []).text == "ok"
    (warning,) = endpoint_warnings(caplog)
    assert "retrying in 0.00 s" in warning


def test_usage_is_reported_per_request_and_summed_per_run(model: ModelServer) -> None:
    """Both wire formats: each ModelResponse event carries its request's usage, the Result their sums,
    by the provider's own field names (nested objects and non-integers are left out)."""
    cases = [
        (OpenAIChat(model.url + "/v1", "m", max_retries=0), openai,
         {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"x": 1}},
         {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26}),
        (AnthropicMessages(model.url, "m", api_key="sk", max_retries=0), anthropic,
         {"input_tokens": 10, "output_tokens": 3, "service_tier": "standard"},
         {"input_tokens": 20, "output_tokens": 6}),
    ]
    for endpoint, reply, usage, total in cases:
        calls = [("c1", "lookup", '{"key":"a"}' if reply is openai else {"key": "a"})]
        model.push(reply(calls=calls, usage=usage), reply("done", usage=usage))
        seen: list[ev.Event] = []
        result = agent.Runner().run(agent.Spec(tools=[lookup]), [agent.Message.user("go")], endpoint, seen.append)
        assert result.usage == total
        responses = [e for e in seen if isinstance(e, ev.ModelResponse)]
        assert [dict(e.usage or {}) for e in responses] == [{k: v for k, v in usage.items() if type(v) is int}] * 2
    model.push(openai("no usage"))
    assert agent.Runner().run(agent.Spec(), [agent.Message.user("go")], cases[0][0]).usage == {}
