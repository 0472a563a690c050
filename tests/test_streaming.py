"""Token streaming from both endpoints, against recorded server-sent-event streams (``tests/streams``)
served over real HTTP by the local model server, each next to the non-streamed reply of the same content.

What the recordings hold: OpenAI chat.completion.chunk streams (text with a usage chunk; two parallel
tool calls, the first one's arguments split over 29 deltas with odd spacing, a duplicate key, escapes
and non-ASCII), and Anthropic message streams (text; a thinking block, text, a tool_use whose
``partial_json`` is split mid-string and mid-escape, and a tool_use without input, with pings)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import events as ev
from agent_sessions.endpoints import AnthropicMessages, OpenAIChat
from agent_sessions.endpoints.anthropic import parse_response as parse_anthropic
from agent_sessions.endpoints.openai import parse_response as parse_openai
from stores import memory
from tests.model_server import ModelServer, Reply, Request, anthropic, openai, openai_raw, sse

STREAMS = Path(__file__).parent / "streams"
RECORDINGS = ["openai_text", "openai_tool_calls", "anthropic_text", "anthropic_tool_use"]


@agent.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key


def recorded(name: str) -> str:
    return (STREAMS / f"{name}.sse").read_text(encoding="utf-8")


def unstreamed(name: str) -> agent.Message:
    """The reply the same content gives without streaming, read by the non-streaming parser."""
    data = json.loads((STREAMS / f"{name}.json").read_text(encoding="utf-8"))
    return parse_openai(data) if name.startswith("openai") else parse_anthropic(data)


def same_reply(streamed: agent.Message, unstreamed: agent.Message) -> bool:
    """The same Message, except that a streamed Anthropic tool call keeps the model's own argument text
    where the unstreamed reply only has ``input`` as an object (written compact): equal as JSON values."""
    if streamed == unstreamed:
        return True
    def calls_as_values(m: agent.Message) -> list[Any]:
        return [json.loads(c.arguments) if c.type is agent.ContentType.TOOL_CALL else c for c in m.content]
    bare = [dataclasses.replace(c, arguments="") for c in streamed.content]
    other = [dataclasses.replace(c, arguments="") for c in unstreamed.content]
    return bare == other and calls_as_values(streamed) == calls_as_values(unstreamed)


def endpoint(model: ModelServer, name: str, **kw: Any) -> OpenAIChat | AnthropicMessages:
    if name.startswith("openai"):
        return OpenAIChat(model.url + "/v1", "m", api_key="sk", stream=True, **kw)
    return AnthropicMessages(model.url, "m", api_key="sk", stream=True, **kw)


def text_deltas(name: str) -> list[str]:
    """The text pieces of a recording, in order, as its provider's format puts them."""
    out = []
    for line in recorded(name).splitlines():
        if not line.startswith("data: {"):
            continue
        data = json.loads(line[6:])
        if name.startswith("openai"):
            for choice in data["choices"]:
                if choice["delta"].get("content"):
                    out.append(choice["delta"]["content"])
        elif data.get("delta", {}).get("type") == "text_delta":
            out.append(data["delta"]["text"])
    return out


@pytest.mark.parametrize("size", [0, 1, 7, 4096], ids=["by-event", "1-byte", "7-byte", "4k"])
@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
@pytest.mark.parametrize("name", RECORDINGS)
def test_a_streamed_reply_is_the_unstreamed_one(model: ModelServer, name: str, crlf: bool, size: int) -> None:
    """Whatever the chunking (1 byte: every CRLF and every UTF-8 character split between two reads), the
    Message is the non-streaming one, usage included, and on_text saw every text delta, in order."""
    model.push(sse(recorded(name), size=size, crlf=crlf))
    pieces: list[str] = []
    reply = endpoint(model, name).complete("", [agent.Message.user("go")], [lookup], on_text=pieces.append)
    expected = unstreamed(name)
    assert same_reply(reply, expected)
    assert reply.usage == expected.usage and reply.usage
    assert pieces == text_deltas(name)
    assert "".join(pieces) == reply.text


def test_openai_tool_call_arguments_are_the_deltas_joined_byte_for_byte(model: ModelServer) -> None:
    model.push(sse(recorded("openai_tool_calls"), size=5))
    reply = endpoint(model, "openai_tool_calls").complete("", [agent.Message.user("go")], [lookup])
    first, second = reply.tool_calls
    assert first.arguments == '{"z":1,  "a" : [1, 2],"z":3 ,\n "note": "caf\\u00e9 ☕ 😀 \\"quoted\\" \\\\ back"}'
    assert (first.id, first.name) == ("call_8Dq0fT3nYwZ1mRkL2xVbA9cE", "lookup")
    assert (second.id, second.arguments) == ("call_Xp4sJ7uHq2WvN6tB1yKeR0gM", '{"key": "b"}')
    assert reply.text == ""


def test_anthropic_tool_use_arguments_are_the_deltas_joined_byte_for_byte(model: ModelServer) -> None:
    model.push(sse(recorded("anthropic_tool_use"), size=3))
    reply = endpoint(model, "anthropic_tool_use").complete("", [agent.Message.user("go")], [lookup])
    call, bare = reply.tool_calls
    assert call.arguments == '{"key": "aé 😀\\"x", "n": [1, 2.5e3]}'  # the model's text, 2.5e3 and spaces kept
    assert json.loads(call.arguments) == json.loads(unstreamed("anthropic_tool_use").tool_calls[0].arguments)
    assert bare.arguments == "{}"  # a tool without input: one empty partial_json
    assert reply.text == "I'll look that up — both keys."  # the thinking block is not kept


@pytest.mark.parametrize("name", RECORDINGS)
def test_the_request_asks_for_a_stream(model: ModelServer, name: str) -> None:
    model.push(sse(recorded(name)))
    endpoint(model, name).complete("sys", [agent.Message.user("go")], [lookup])
    request = model.requests[0]
    body = request.json
    assert body["stream"] is True and request.headers["accept"] == "text/event-stream"
    if name.startswith("openai"):
        assert body["stream_options"] == {"include_usage": True}
    else:
        assert "stream_options" not in body
    assert body["messages"][-1]["role"] == "user"


def test_extra_wins_over_the_stream_options(model: ModelServer) -> None:
    model.push(sse(recorded("openai_text")))
    OpenAIChat(model.url + "/v1", "m", stream=True, extra={"stream_options": {"include_usage": False}}).complete(
        "", [agent.Message.user("go")], [])
    assert model.requests[0].json["stream_options"] == {"include_usage": False}


def test_text_is_handed_on_as_it_arrives(model: ModelServer) -> None:
    """The server holds back the rest of the stream until the client has seen the first text: a client
    that read the whole body before parsing it would wait here forever (the test fails on the timeout)."""
    first_seen = threading.Event()
    text = recorded("anthropic_text")
    split = text.index("event: content_block_delta", text.index('"text_delta"'))  # after the first text delta
    model.push(Reply(None, pieces=[text[:split].encode(), lambda: first_seen.wait(5), text[split:].encode()]))
    seen: list[str] = []

    def on_text(piece: str) -> None:
        seen.append(piece)
        first_seen.set()

    started = time.monotonic()
    reply = endpoint(model, "anthropic_text").complete("", [agent.Message.user("go")], [], on_text=on_text)
    assert time.monotonic() - started < 4
    assert "".join(seen) == reply.text and seen[0] == "The"


def cut_points(name: str) -> list[int]:
    """Where to cut a recording: inside its first event, just after an event, mid-way through a text or
    an argument delta (mid-character too), and just before its end marker."""
    data = recorded(name).encode()
    end = data.rindex(b"data: [DONE]" if name.startswith("openai") else b"event: message_stop")
    return [10, data.index(b"\n\n") + 2, len(data) // 3, len(data) // 2 + 1, end - 1, end]


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_stream_cut_midway_is_an_endpoint_error(model: ModelServer, name: str) -> None:
    for cut in cut_points(name):
        model.push(sse(recorded(name), cut_at=cut, size=64))
        with pytest.raises(agent.EndpointError, match="broke off|before its end") as info:
            endpoint(model, name, max_retries=2, backoff=0.001).complete("", [agent.Message.user("go")], [])
        assert info.value.status == 200
    assert len(model.requests) == len(cut_points(name))  # once the body has begun, nothing is retried


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_stream_that_ends_cleanly_without_its_end_marker_is_an_endpoint_error(model: ModelServer, name: str) -> None:
    text = recorded(name)
    marker = "data: [DONE]" if name.startswith("openai") else "event: message_stop"
    model.push(sse(text[: text.rindex(marker)]))  # the chunked body is complete: only the end marker is missing
    with pytest.raises(agent.EndpointError, match="before its end"):
        endpoint(model, name).complete("", [agent.Message.user("go")], [])


def test_an_anthropic_error_event_is_an_endpoint_error(model: ModelServer) -> None:
    text = recorded("anthropic_text")
    cut = text.index("event: content_block_delta", text.index('"text_delta"') + 1)
    error = ('event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
             '"message": "Overloaded"}}\n\n')
    model.push(sse(text[:cut] + error + text[cut:]))
    seen: list[str] = []
    with pytest.raises(agent.EndpointError, match=r"Overloaded \(overloaded_error\)") as info:
        endpoint(model, "anthropic_text").complete("", [agent.Message.user("go")], [], on_text=seen.append)
    assert seen == ["The"]  # what came before the error had been handed on
    assert "overloaded_error" in info.value.body


def test_an_openai_error_chunk_is_an_endpoint_error(model: ModelServer) -> None:
    text = recorded("openai_text")
    cut = text.index("data: ", 2000)
    error = ('data: {"error": {"message": "The server had an error while processing your request.", '
             '"type": "server_error"}}\n\n')
    model.push(sse(text[:cut] + error))
    with pytest.raises(agent.EndpointError, match="server had an error.*server_error"):
        endpoint(model, "openai_text").complete("", [agent.Message.user("go")], [])


@pytest.mark.parametrize("name", RECORDINGS)
@pytest.mark.parametrize("bad", ['data: {"choices": [{"delta": {"content": "x"\n\n', "data: not json\n\n",
                                 "data: [1, 2]\n\n"])
def test_data_that_is_not_a_json_object_is_an_endpoint_error(model: ModelServer, name: str, bad: str) -> None:
    text = recorded(name)
    cut = text.index("\n\n", len(text) // 2) + 2
    model.push(sse(text[:cut] + bad + text[cut:]))
    with pytest.raises(agent.EndpointError, match="malformed stream"):
        endpoint(model, name).complete("", [agent.Message.user("go")], [])


@pytest.mark.parametrize(("name", "old", "new"), [
    ("anthropic_tool_use", '"id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6"', '"id":""'),
    ("anthropic_tool_use", '"name":"now"', '"name":""'),
    ("openai_tool_calls", '"name":"lookup"', '"name":""'),
])
def test_a_tool_call_without_an_id_or_name_is_an_endpoint_error(model: ModelServer, name: str, old: str,
                                                                 new: str) -> None:
    model.push(sse(recorded(name).replace(old, new)))
    with pytest.raises(agent.EndpointError, match="without id or name|has no function name"):
        endpoint(model, name).complete("", [agent.Message.user("go")], [])


def test_anthropic_arguments_that_are_not_json_are_kept_as_the_model_wrote_them(model: ModelServer) -> None:
    """As for every model's arguments: the transcript says what the model said, and the tool is given the
    error of parsing them (tests/test_tools.py), not the run."""
    text = recorded("anthropic_tool_use").replace('"partial_json":"]}"', '"partial_json":"]"')
    model.push(sse(text))
    reply = endpoint(model, "anthropic_tool_use").complete("", [agent.Message.user("go")], [])
    assert reply.tool_calls[0].arguments == '{"key": "aé 😀\\"x", "n": [1, 2.5e3]'  # no closing brace


@pytest.mark.parametrize("name", ["openai_text", "anthropic_text"])
def test_a_status_before_the_stream_is_retried_and_an_error_status_carries_the_providers_text(
    model: ModelServer, name: str,
) -> None:
    model.push(Reply({"error": {"message": "overloaded"}}, 529), sse(recorded(name)),
               Reply({"error": {"type": "invalid_request_error", "message": "max_tokens: too large"}}, 400))
    ep = endpoint(model, name, backoff=0.001)
    assert ep.complete("", [agent.Message.user("go")], []) == unstreamed(name)
    assert len(model.requests) == 2
    with pytest.raises(agent.EndpointError) as info:
        ep.complete("", [agent.Message.user("go")], [])
    assert info.value.status == 400 and info.value.message == "max_tokens: too large"


@pytest.mark.parametrize("name", ["openai_tool_calls", "anthropic_tool_use"])
def test_a_server_that_ignores_stream_answers_json_and_that_is_read(model: ModelServer, name: str) -> None:
    model.push(openai_raw((STREAMS / f"{name}.json").read_text(encoding="utf-8")))
    pieces: list[str] = []
    reply = endpoint(model, name).complete("", [agent.Message.user("go")], [], on_text=pieces.append)
    assert reply == unstreamed(name) and reply.usage == unstreamed(name).usage
    assert pieces == ([reply.text] if reply.text else [])  # in one piece: the pieces still join to the text


def test_a_stream_that_trickles_forever_fails_within_the_timeout(model: ModelServer) -> None:
    stop = threading.Event()
    pings: list[bytes | Callable[[], object]] = [b'event: message_start\ndata: {"type": "message_start", '
                                                 b'"message": {"usage": {}}}\n\n']
    for _ in range(200):
        pings += [lambda: stop.wait(0.05), b'event: ping\ndata: {"type": "ping"}\n\n']
    model.push(Reply(None, pieces=pings))
    started = time.monotonic()
    try:
        with pytest.raises(agent.EndpointError, match="did not finish its stream within the timeout of 0.4 s"):
            endpoint(model, "anthropic_text", timeout=0.4).complete("", [agent.Message.user("go")], [])
        assert time.monotonic() - started < 0.8
    finally:
        stop.set()


@pytest.mark.parametrize("name", ["openai_text", "anthropic_text"])
def test_one_connection_serves_stream_after_stream(model: ModelServer, name: str) -> None:
    model.push(*[sse(recorded(name))] * 3)
    ep = endpoint(model, name)
    for _ in range(3):
        ep.complete("", [agent.Message.user("go")], [])
    assert len({r.client_port for r in model.requests}) == 1


HELD = 10.0
"""Seconds the server holds a body open after its end event: far less than the client's timeout, so a
client that reads to the end of the body returns only after the server ended it."""


@pytest.mark.parametrize("name", ["openai_text", "anthropic_text"])
def test_a_reply_complete_at_its_end_event_is_returned_while_the_body_is_still_open(model: ModelServer,
                                                                                    name: str) -> None:
    """``[DONE]`` / ``message_stop`` ends the reply: the call returns then, not when the server (a proxy
    that keeps the connection open, say) gets round to ending the body, nor at the timeout."""
    released, ended = threading.Event(), threading.Event()
    held = sse(recorded(name))
    assert held.pieces is not None
    held.pieces += [lambda: released.wait(HELD), ended.set]  # then the chunked body's end
    model.push(held, sse(recorded(name)))
    ep = endpoint(model, name, timeout=6 * HELD)
    try:
        got = ep.complete("", [agent.Message.user("go")], [])
        assert not ended.is_set(), "the call returned only once the server had ended the body"
    finally:
        released.set()
    assert same_reply(got, unstreamed(name))
    assert same_reply(ep.complete("", [agent.Message.user("again")], []), unstreamed(name))  # a new connection


# Through the loop.


def final_openai_stream(text: str) -> str:
    """A short OpenAI stream answering ``text``, a word per delta."""
    words = text.split(" ")
    chunks = [{"choices": [{"index": 0, "delta": {"content": w if i == 0 else " " + w}}]} for i, w in enumerate(words)]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 9}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


@pytest.mark.parametrize("first", ["openai_tool_calls", "anthropic_tool_use"])
def test_a_run_reports_text_deltas_whose_join_is_the_answer(model: ModelServer, first: str) -> None:
    """Step 1 streams text and tool calls, step 2 the answer: each step's TextDelta events come between
    its ModelRequest and ModelResponse, and join to that response's text; the last step's, to the result."""

    @agent.tool
    def now() -> str:
        """The time."""
        return "noon"

    if first.startswith("openai"):
        second = final_openai_stream("The lease is compared with the replica's clock.")
    else:
        second = recorded("anthropic_text")
    model.push(sse(recorded(first), size=11), sse(second, size=11))
    seen: list[ev.Event] = []
    result = agent.Runner().run(agent.Spec(tools=[lookup, now]), [agent.Message.user("go")],
                                endpoint(model, first), seen.append)
    assert result.stop_reason == "answered" and result.steps == 2
    for step in (1, 2):
        kinds = [type(e) for e in seen if getattr(e, "step", None) == step]
        request, response = kinds.index(ev.ModelRequest), kinds.index(ev.ModelResponse)
        assert all(request < i < response for i, k in enumerate(kinds) if k is ev.TextDelta)
        (message,) = [e.message for e in seen if isinstance(e, ev.ModelResponse) and e.step == step]
        assert "".join(e.text for e in seen if isinstance(e, ev.TextDelta) and e.step == step) == message.text
    assert "".join(e.text for e in seen if isinstance(e, ev.TextDelta) and e.step == 2) == result.text
    assert len([e for e in seen if isinstance(e, ev.TextDelta) and e.step == 2]) > 3
    assert same_reply(result.messages[1], unstreamed(first))
    assert result.usage  # summed over both streamed requests


def test_a_run_without_events_streams_and_calls_no_text_callback(model: ModelServer) -> None:
    model.push(sse(recorded("openai_text")))
    calls: list[dict[str, Any]] = []
    ep = endpoint(model, "openai_text")
    complete = ep.complete

    def watched(*args: Any, **kw: Any) -> agent.Message:
        calls.append(kw)
        return complete(*args, **kw)

    ep.complete = watched  # type: ignore[method-assign]
    result = agent.Runner().run(agent.Spec(), [agent.Message.user("go")], ep)
    assert result.text == unstreamed("openai_text").text
    assert calls == [{}]  # no on_text: nobody listens
    assert model.requests[0].json["stream"] is True


def test_an_endpoint_without_on_text_still_serves_a_run_with_events(model: ModelServer) -> None:
    """A third-party Endpoint with the three-argument complete: the loop passes no on_text to it."""

    class Plain:
        def complete(self, system: str, messages: Any, tools: Any) -> agent.Message:
            return agent.Message.assistant("plain")

    seen: list[ev.Event] = []
    result = agent.Runner().run(agent.Spec(), [agent.Message.user("go")], Plain(), seen.append)
    assert result.text == "plain" and not [e for e in seen if isinstance(e, ev.TextDelta)]


@pytest.mark.parametrize("name", ["openai_tool_calls", "anthropic_tool_use"])
def test_a_cut_stream_leaves_no_half_reply_in_a_leased_session(model: ModelServer, name: str) -> None:
    """Step 1 completes (a tool call, its result, saved); step 2's stream is cut after text had been handed
    on: the run raises EndpointError, and the stored transcript is what was saved before that request."""

    @agent.tool
    def now() -> str:
        """The time."""
        return "noon"

    answer = recorded("anthropic_text") if name.startswith("anthropic") else recorded("openai_text")
    model.push(sse(recorded(name)), sse(answer, size=50, cut_at=len(answer) // 2))
    store = memory.Store()
    session = agent.open("s", store)
    assert agent.contract.is_run_session(session)
    seen: list[ev.Event] = []
    with pytest.raises(agent.EndpointError, match="broke off"):
        agent.Runner().run(agent.Spec(tools=[lookup, now], session=session), [agent.Message.user("go")],
                           endpoint(model, name), seen.append)
    assert [e for e in seen if isinstance(e, ev.TextDelta) and e.step == 2]  # some text had been shown
    stored = store.messages("s")
    assert len(stored) == 3 and same_reply(stored[1], unstreamed(name))
    assert stored[2].role is agent.Role.USER and stored[2].content[0].type is agent.ContentType.TOOL_RESULT
    holder = store.holder("s")
    assert holder is None or holder.token is None  # the lease was let go


def test_a_streamed_and_an_unstreamed_run_store_the_same_transcript(model: ModelServer) -> None:
    for stream in (False, True):
        store = memory.Store()
        if stream:
            model.push(sse(recorded("openai_tool_calls")), sse(final_openai_stream("done now")))
        else:
            model.push(openai_raw((STREAMS / "openai_tool_calls.json").read_text(encoding="utf-8")),
                       openai("done now", usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 9}))
        agent.Runner().run(agent.Spec(tools=[lookup], session=agent.open("s", store)), [agent.Message.user("go")],
                           OpenAIChat(model.url + "/v1", "m", stream=stream))
        if not stream:
            plain = store.messages("s")
    assert store.messages("s") == plain
    assert [m.to_json() for m in store.messages("s")] == [m.to_json() for m in plain]
    # The arguments went back to the model as they came, streamed or not.
    sent = [r.json["messages"][1]["tool_calls"][0]["function"]["arguments"] for r in model.requests[1::2]]
    assert sent[0] == sent[1] == json.loads((STREAMS / "openai_tool_calls.json").read_text())[
        "choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]


def test_anthropic_streamed_run_round_trips(model: ModelServer) -> None:
    """The streamed tool call goes back as tool_use input, and its result follows."""

    @agent.tool
    def now() -> str:
        """The time."""
        return "noon"

    model.push(sse(recorded("anthropic_tool_use")), sse(recorded("anthropic_text")))
    result = agent.Runner().run(agent.Spec(tools=[lookup, now]), [agent.Message.user("go")],
                                endpoint(model, "anthropic_tool_use"))
    assert result.text == unstreamed("anthropic_text").text
    sent = model.requests[1].json["messages"]
    assert [b["type"] for b in sent[1]["content"]] == ["text", "tool_use", "tool_use"]
    assert sent[1]["content"][1]["input"] == {"key": 'aé 😀"x', "n": [1, 2500.0]}
    results = sent[2]["content"]
    assert "unexpected keyword argument 'n'" in results[0]["content"] and results[0]["is_error"] is True
    assert results[1]["content"] == "noon"


def test_a_request_callable_reply_may_stream(model: ModelServer) -> None:
    """The server's script may build a stream from the request (used by nothing else here; a sanity check
    of the test server itself: a Reply with pieces answers like a provider's stream)."""

    def echo(request: Request) -> Reply:
        return sse(final_openai_stream("echo " + request.json["messages"][-1]["content"]))

    model.push(echo)
    assert endpoint(model, "openai_text").complete("", [agent.Message.user("hi")], []).text == "echo hi"
    model.push(anthropic("plain"))  # and a plain reply still answers after a streamed one
    assert AnthropicMessages(model.url, "m").complete("", [agent.Message.user("go")], []).text == "plain"


values = st.recursive(
    st.none() | st.booleans() | st.integers(-1, 3) | st.text(max_size=6)
    | st.sampled_from(["tool_use", "text", "text_delta", "input_json_delta", "thinking", "", '{"a": 1}', "{"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "delta", "content", "tool_calls", "index", "id", "function", "name", "arguments",
                         "usage", "type", "message", "content_block", "text", "partial_json", "input", "error"]),
        inner, max_size=4),
    max_leaves=10,
)
ANTHROPIC_TYPES = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                   "message_delta", "ping", "error", "something_new"]


@st.composite
def event_bodies(draw: st.DrawFn, kind: str) -> list[Any]:
    bodies = draw(st.lists(values, max_size=6))
    if kind == "anthropic":  # mostly typed events, so that the block logic is reached
        bodies = [{**b, "type": draw(st.sampled_from(ANTHROPIC_TYPES))} if isinstance(b, dict) else b for b in bodies]
    return bodies


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_any_events_in_a_stream_give_a_message_or_an_endpoint_error(model: ModelServer, kind: str) -> None:
    ep = endpoint(model, kind + "_text", max_retries=0)
    end = "data: [DONE]\n\n" if kind == "openai" else 'event: message_stop\ndata: {"type": "message_stop"}\n\n'

    @settings(max_examples=200, deadline=None)
    @given(event_bodies(kind))
    def check(bodies: list[Any]) -> None:
        model.push(sse("".join(f"data: {json.dumps(b)}\n\n" for b in bodies) + end))
        try:
            reply = ep.complete("", [agent.Message.user("go")], [], on_text=lambda text: None)
        except agent.EndpointError:
            return
        assert isinstance(reply, agent.Message) and reply.role is agent.Role.ASSISTANT

    check()
