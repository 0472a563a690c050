"""Long conversations (issue 27): the provider's context-length error as a typed ContextOverflow, in both
wire formats, streamed and not; and the Window policy, which sends what fits while the store keeps every
message. Over real HTTP to the scripted server, which rejects a request longer than its window with the
provider's own error body."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine

import agent_sessions as agent
from agent_sessions.context import (
    SUMMARY_SYSTEM,
    Compaction,
    Selection,
    Window,
    bytes_over_4,
    is_record,
    prompt_tokens,
)
from agent_sessions.endpoints import AnthropicMessages, OpenAIChat
from agent_sessions.testing.model_server import ModelServer as Served
from agent_sessions.testing.model_server import request_tokens
from stores import mysql, postgres, sqlite
from tests import servers
from tests.model_server import (
    ModelServer,
    Reply,
    Request,
    anthropic,
    context_length_exceeded,
    openai,
    prompt_too_long,
    sse,
    windowed,
)

WIRES = ["openai", "anthropic"]


def endpoint(url: str, wire: str, stream: bool = False) -> OpenAIChat | AnthropicMessages:
    if wire == "openai":
        return OpenAIChat(url + "/v1", "m", stream=stream, backoff=0.01)
    return AnthropicMessages(url, "m", stream=stream, backoff=0.01)


def anthropic_sse(text: str) -> Reply:
    """An Anthropic streamed reply of ``text``, in the events the Messages API sends."""
    events = [
        ("message_start", {"type": "message_start", "message": {"id": "msg_s", "type": "message", "role": "assistant",
                                                                 "content": [], "usage": {"input_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return sse("".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events))


def openai_sse(text: str) -> Reply:
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    return sse("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")


def answering(text: Callable[[Request], str]) -> Callable[[Request], Reply]:
    """A script answering every request with ``text(request)``, in the request's wire format, streamed
    when it asks to be."""
    def respond(request: Request) -> Reply:
        said = text(request)
        streamed = bool(request.json.get("stream"))
        if request.path.rstrip("/").endswith("/messages"):
            return anthropic_sse(said) if streamed else anthropic(said)
        return openai_sse(said) if streamed else openai(said)
    return respond


@pytest.fixture
def served() -> Iterator[list[Served]]:
    made: list[Served] = []
    yield made
    for server in made:
        server.close()


def serve(made: list[Served], respond: Callable[[Request], Reply]) -> Served:
    server = Served(respond)
    made.append(server)
    return server


# -- ContextOverflow -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("wire", WIRES)
def test_a_request_past_the_window_is_a_context_overflow_with_the_providers_counts(
    served: list[Served], wire: str, stream: bool,
) -> None:
    server = serve(served, windowed(answering(lambda r: "never"), 100))
    long = agent.Message.user("x" * 2000)
    with pytest.raises(agent.ContextOverflow) as info:
        endpoint(server.url, wire, stream).complete("", [long], [])
    error = info.value
    counted = request_tokens(server.requests[0].json)
    assert isinstance(error, agent.EndpointError) and error.status == 400
    assert (error.tokens, error.limit) == (counted, 100) and counted > 100
    assert ("prompt is too long" if wire == "anthropic" else "maximum context length") in error.message
    assert len(server.requests) == 1  # a 400 is not retried: the same request cannot fit


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("wire", WIRES)
def test_a_request_within_the_window_is_answered_with_the_count_as_its_usage(
    served: list[Served], wire: str, stream: bool,
) -> None:
    server = serve(served, windowed(answering(lambda r: "fine"), 1000))
    reply = endpoint(server.url, wire, stream).complete("be brief", [agent.Message.user("hi")], [])
    assert reply.text == "fine"
    if not stream:
        assert prompt_tokens(reply.usage) == request_tokens(server.requests[0].json)


def test_an_openai_overflow_without_counts_has_none(model: ModelServer) -> None:
    model.push(Reply({"error": {"message": "Your input exceeds the context window of this model.",
                                "type": "invalid_request_error", "code": "context_length_exceeded"}}, 400))
    with pytest.raises(agent.ContextOverflow) as info:
        endpoint(model.url, "openai").complete("", [agent.Message.user("x")], [])
    assert (info.value.tokens, info.value.limit) == (None, None)


def test_an_openai_compatible_server_saying_only_the_message_is_recognised(model: ModelServer) -> None:
    """vLLM says it in the message, with no code: "you requested N tokens"."""
    model.push(Reply({"object": "error", "message": "This model's maximum context length is 4096 tokens. However, "
                      "you requested 5000 tokens (4000 in the messages, 1000 in the completion).",
                      "type": "BadRequestError", "code": 400}, 400))
    with pytest.raises(agent.ContextOverflow) as info:
        endpoint(model.url, "openai").complete("", [agent.Message.user("x")], [])
    assert (info.value.tokens, info.value.limit) == (5000, 4096)


@pytest.mark.parametrize("wire", WIRES)
def test_another_400_stays_a_plain_endpoint_error(model: ModelServer, wire: str) -> None:
    model.push(Reply({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too big"}},
                     400))
    with pytest.raises(agent.EndpointError) as info:
        endpoint(model.url, wire).complete("", [agent.Message.user("x")], [])
    assert not isinstance(info.value, agent.ContextOverflow)


def test_an_overflow_reported_inside_a_stream_is_a_context_overflow(model: ModelServer) -> None:
    error = {"type": "error", "error": {"type": "invalid_request_error",
                                        "message": "prompt is too long: 210000 tokens > 200000 maximum"}}
    model.push(sse(f"event: error\ndata: {json.dumps(error)}\n\n"))
    with pytest.raises(agent.ContextOverflow) as info:
        endpoint(model.url, "anthropic", stream=True).complete("", [agent.Message.user("x")], [])
    assert (info.value.tokens, info.value.limit) == (210000, 200000)


@pytest.mark.parametrize("wire", WIRES)
def test_without_a_policy_the_run_fails_naming_the_spec_option(model: ModelServer, wire: str) -> None:
    model.push(context_length_exceeded(9000, 8192) if wire == "openai" else prompt_too_long(210000, 200000))
    with pytest.raises(agent.ContextOverflow, match=r"Spec\(context_window=TOKENS\)") as info:
        agent.Runner().run(agent.Spec(), [agent.Message.user("hello")], endpoint(model.url, wire))
    assert info.value.tokens in (9000, 210000) and info.value.status == 400
    assert "the run sent all 1 messages" in str(info.value)


# -- Spec options ------------------------------------------------------------------------------------------------


def test_context_window_turns_on_compaction_within_most_of_it() -> None:
    policy = agent.Spec(context_window=10_000).context_policy
    assert isinstance(policy, Compaction) and policy.max_tokens == 8000 and policy.threshold == 0.8
    assert agent.Spec().context_policy is None
    mine = Window(max_tokens=500)
    assert agent.Spec(context=mine).context_policy is mine


@pytest.mark.parametrize("kw", [{"context_window": 0}, {"context_window": True}, {"context_window": 1.5},
                                {"context": "window"}, {"context": Window(10), "context_window": 10}])
def test_wrong_context_options_are_argument_errors(kw: dict[str, Any]) -> None:
    with pytest.raises(agent.ArgumentError, match="context"):
        agent.Spec(**kw)


def test_window_arguments_are_checked() -> None:
    with pytest.raises(agent.ArgumentError, match="max_tokens"):
        Window(0)
    with pytest.raises(agent.ArgumentError, match="estimate"):
        Window(10, estimate="bytes")  # type: ignore[arg-type]


# -- the Window over real HTTP ---------------------------------------------------------------------------------------


def kilobyte(n: int) -> str:
    """About 1 KB of text that says which turn it is."""
    return f"turn {n}: " + " ".join(f"word{(n * 31 + i) % 997}" for i in range(120))


def converse(spec: agent.Spec, turns: int, ep: OpenAIChat | AnthropicMessages) -> None:
    """``turns`` turns of ~1 KB user messages on ``spec.session``, each a run from the stored transcript
    (under Compaction, from what the recent read gives: the end of it, from the newest record's range on);
    each must be answered."""
    session = spec.session
    assert isinstance(session, agent.StoreSession)
    recent = isinstance(spec.context_policy, Compaction)
    for n in range(turns):
        msgs = session.messages(recent=recent)  # a Tail: appended to, it stays one (unpacked, a plain list)
        msgs.append(agent.Message.user(kilobyte(n)))
        result = agent.Runner().run(spec, msgs, ep)
        assert result.stop_reason == "answered" and result.text.startswith("answer: turn ")


@pytest.mark.parametrize(("wire", "stream"), [("openai", False), ("anthropic", False), ("openai", True),
                                               ("anthropic", True)])
def test_many_turns_on_sqlite_with_a_window_are_all_answered_within_it(
    served: list[Served], tmp_path: Path, wire: str, stream: bool,
) -> None:
    window = 6000  # about 20 of the turns' 1 KB messages
    server = serve(served, windowed(answering(lambda r: "answer: " + kilobyte(len(r.json["messages"]))), window))
    store = sqlite.open(str(tmp_path / "s.db"))
    try:
        session = agent.open("long", store)
        turns = 60
        converse(agent.Spec(session=session, system="You answer.", context=Window(int(window * 0.8))), turns,
                 endpoint(server.url, wire, stream))
        counts = [request_tokens(r.json) for r in server.requests]
        assert len(server.requests) == turns  # not one refused
        assert max(counts) <= window
        assert counts[-1] > window // 2  # the window is used, not just one message
        stored = session.messages()
        assert len(stored) == 2 * turns
        assert [m.text for m in stored[::2]] == [kilobyte(n) for n in range(turns)]
        assert all(m.role is agent.Role.ASSISTANT and m.text.startswith("answer: ") for m in stored[1::2])
        # each request sends the newest messages: the last user message is the turn's
        last = server.requests[-1].json["messages"][-1]
        assert kilobyte(turns - 1) in json.dumps(last)
    finally:
        store.close()


def no_usage(respond: Callable[[Request], Reply]) -> Callable[[Request], Reply]:
    """``respond``, its replies reporting no usage (an empty ``usage``): only an overflow teaches the window."""
    def answer(request: Request) -> Reply:
        reply = respond(request)
        reply.body["usage"] = {}
        return reply
    return answer


@pytest.mark.parametrize("reports", [True, False], ids=["usage", "no-usage"])
@pytest.mark.parametrize("wire", WIRES)
def test_a_provider_counting_more_than_the_estimate_narrows_the_window_and_is_answered(
    served: list[Served], wire: str, reports: bool,
) -> None:
    """The provider counts a token per 2 bytes, twice the estimate. When it reports its usage the window
    tightens from the first reply and no request is ever refused; when it does not, the first request
    past its window is refused, narrowed by the counts its error gives and sent once more, and from then on
    none is refused. Every turn is answered either way."""
    def count(body: dict[str, Any]) -> int:
        return 2 * request_tokens(body)
    window = 4000
    script = answering(lambda r: "ok")
    server = serve(served, windowed(script if reports else no_usage(script), window, count))
    spec = agent.Spec(context=Window(max_tokens=window))
    ep = endpoint(server.url, wire)
    msgs: list[agent.Message] = []
    for n in range(40):
        result = agent.Runner().run(spec, [*msgs, agent.Message.user(kilobyte(n))], ep)
        assert result.stop_reason == "answered"
        msgs = result.messages
    counts = [count(r.json) for r in server.requests]
    refused = [i for i, c in enumerate(counts) if c > window]
    if reports:
        assert refused == [] and len(counts) == 40
    else:
        assert len(refused) == 1 and counts[refused[0] + 1] <= window  # sent once more, narrowed
        assert len(counts) == 41
    assert max(counts[-10:]) > window // 2  # narrowed, not emptied
    assert len(msgs) == 80
    policy = spec.context_policy
    assert isinstance(policy, Window) and policy.scale > 1.5


def test_a_policy_that_can_leave_nothing_out_lets_the_overflow_end_the_run(served: list[Served]) -> None:
    server = serve(served, windowed(answering(lambda r: "never"), 50))
    with pytest.raises(agent.ContextOverflow, match="can leave nothing more out"):
        agent.Runner().run(agent.Spec(context_window=10_000), [agent.Message.user("x" * 1000)],
                           endpoint(server.url, "openai"))
    assert len(server.requests) == 1


def test_a_tool_call_and_its_result_are_sent_together_or_not_at_all(served: list[Served]) -> None:
    @agent.tool
    def fetch(key: str) -> str:
        """Fetch a value."""
        return "v" * 1500

    calls = iter(range(1000))

    def respond(request: Request) -> Reply:
        last = request.json["messages"][-1]
        if last["role"] == "tool":
            return openai("done")
        return openai(calls=[(f"c{next(calls)}", "fetch", '{"key": "k"}')])

    server = serve(served, windowed(respond, 3000))
    spec = agent.Spec(tools=[fetch], context=Window(max_tokens=2500))
    msgs: list[agent.Message] = []
    for n in range(12):
        msgs = agent.Runner().run(spec, [*msgs, agent.Message.user(kilobyte(n))], OpenAIChat(server.url + "/v1",
                                                                                              "m")).messages
    for request in server.requests:
        sent = request.json["messages"]
        assert sent[0]["role"] == "system" or sent[0]["role"] == "user"
        ids = [c["id"] for m in sent if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        answered = [m["tool_call_id"] for m in sent if m["role"] == "tool"]
        assert ids == answered or ids == [*answered, ids[-1]][: len(ids)]
        assert set(answered) <= set(ids)
    assert len(msgs) == 12 * 4


# -- the Window's choice, for any transcript -------------------------------------------------------------------------


@st.composite
def transcripts(draw: st.DrawFn) -> list[agent.Message]:
    """Valid transcripts as a run writes them: turns of a user message (and steers), then replies with
    tool calls each followed by the message of their results, then an answer."""
    text = st.text(alphabet="ab é\n", max_size=300)
    out: list[agent.Message] = []
    calls = 0
    for _ in range(draw(st.integers(1, 8))):
        out.append(agent.Message.user(draw(text)))
        for _ in range(draw(st.integers(0, 2))):
            out.append(agent.Message.user(draw(text)))  # a steer
        for _ in range(draw(st.integers(0, 3))):
            made = [agent.Content.tool_call(f"c{calls + i}", "t", "{}") for i in range(draw(st.integers(1, 3)))]
            calls += len(made)
            out.append(agent.Message(agent.Role.ASSISTANT, made))
            out.append(agent.Message(agent.Role.USER, [agent.Content.tool_result(c.id, draw(text)) for c in made]))
            if draw(st.booleans()):
                out.append(agent.Message.user(draw(text)))  # a steer after the results
        out.append(agent.Message.assistant(draw(text)))
    out.append(agent.Message.user(draw(text)))  # the request's own
    return out


def valid_start(message: agent.Message) -> bool:
    return message.role is agent.Role.USER and not any(
        c.type is agent.ContentType.TOOL_RESULT for c in message.content)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transcripts(), st.integers(1, 3000), st.text(max_size=200))
def test_the_window_sends_a_valid_suffix_within_budget(
    transcript: list[agent.Message], budget: int, system: str,
) -> None:
    policy = Window(max_tokens=budget)
    chosen = policy.select(system, transcript, [])
    assert isinstance(chosen, Selection)
    sent = list(chosen.messages)
    assert sent == transcript[chosen.start:] and sent  # a suffix, never empty
    assert valid_start(sent[0]) or not any(valid_start(m) for m in transcript)
    calls = {c.id for m in sent for c in m.tool_calls}
    results = {c.tool_call_id for m in sent for c in m.content if c.type is agent.ContentType.TOOL_RESULT}
    assert results == calls  # every call with its result, no result without its call
    cost = [bytes_over_4(m.to_json()) for m in transcript]
    fixed = bytes_over_4(system)
    newest = max(i for i, m in enumerate(transcript) if valid_start(m))
    if fixed + sum(cost[newest:]) <= budget:  # the smallest valid request fits: so does the chosen one
        assert fixed + sum(cost[chosen.start:]) <= budget
        # and it is the longest that fits: one valid start earlier would not
        earlier = [i for i in range(chosen.start) if valid_start(transcript[i])]
        if earlier:
            assert fixed + sum(cost[earlier[-1]:]) > budget
    else:
        assert chosen.start == newest  # the smallest valid request, for the provider to judge
    assert chosen.tokens == fixed + sum(cost[chosen.start:])


def test_an_estimate_of_ones_own_is_used() -> None:
    msgs = [agent.Message.user("a"), agent.Message.assistant("b"), agent.Message.user("c")]
    assert len(Window(2, estimate=lambda text: 1).select("", msgs, []).messages) == 1
    assert len(Window(3, estimate=lambda text: 1).select("", msgs, []).messages) == 3
    assert len(Window(3, estimate=lambda text: 0 if not text else 1).select("sys", msgs, []).messages) == 1


def test_reported_usage_only_tightens_the_window() -> None:
    policy = Window(1000)
    msgs = [agent.Message.user("x" * 400)]
    sent = policy.select("", msgs, [])
    policy.observe(sent, {"prompt_tokens": sent.tokens * 2})
    assert policy.scale == pytest.approx(2.0)
    policy.observe(sent, {"input_tokens": sent.tokens // 2})
    assert policy.scale == pytest.approx(2.0)
    policy.observe(sent, None)
    assert policy.scale == pytest.approx(2.0)


def test_a_narrowed_request_refused_again_ends_the_run_saying_so(model: ModelServer) -> None:
    model.push(context_length_exceeded(9000, 8192), context_length_exceeded(8500, 8192))
    history = [agent.Message.user("a" * 400), agent.Message.assistant("b" * 400), agent.Message.user("c" * 400)]
    seen: list[Any] = []
    with pytest.raises(agent.ContextOverflow, match="narrowed the request from 3 to 1 messages") as info:
        agent.Runner().run(agent.Spec(context_window=100_000), history, endpoint(model.url, "openai"), seen.append)
    assert info.value.tokens == 8500
    assert [len(r.json["messages"]) for r in model.requests] == [3, 1]
    assert [e.messages for e in seen if isinstance(e, agent.events.ModelRequest)] == [3, 1]


# -- Compaction ------------------------------------------------------------------------------------------------------

TURN = re.compile(r"turn (\d+):")
SEEN = re.compile(r"turns seen: ([\d,]*)")


def summarising(answer: Callable[[Request], str]) -> Callable[[Request], str]:
    """A script that answers a summary request (the one whose system prompt is Compaction's) with the turn
    numbers its messages mention, an earlier summary's included ("turns seen: 0,1,2"), and any other with
    ``answer``: so a test can tell that what a summary replaced is still known to the model."""
    def text(request: Request) -> str:
        body = request.json
        system = body.get("system") or body["messages"][0].get("content")
        if system != SUMMARY_SYSTEM:
            return answer(request)
        said = json.dumps(body["messages"])
        seen = {int(n) for n in TURN.findall(said)}
        for found in SEEN.findall(said):
            seen |= {int(n) for n in found.split(",") if n}
        return "turns seen: " + ",".join(map(str, sorted(seen)))
    return text


def long_answer(request: Request) -> str:
    """About 1 KB of answer, naming the number of messages it answers."""
    return "answer: " + kilobyte(len(request.json["messages"]))


def turns_known(request: Request) -> set[int]:
    """The turns a request makes known to the model: those its summary lists and those its messages say."""
    said = json.dumps(request.json["messages"])
    known = {int(n) for n in TURN.findall(said)}
    for found in SEEN.findall(said):
        known |= {int(n) for n in found.split(",") if n}
    return known


def is_summary_request(request: Request) -> bool:
    body = request.json
    return (body.get("system") or body["messages"][0].get("content")) == SUMMARY_SYSTEM


@contextmanager
def store_on(kind: str, tmp_path: Path) -> Iterator[agent.RunStore]:
    """A store of ``kind`` on a database of its own (SQLite: a file; PostgreSQL, MySQL: this test's database
    on the test servers, with fresh tables)."""
    if kind == "sqlite":
        lite = sqlite.open(str(tmp_path / "s.db"))
        try:
            yield lite
        finally:
            lite.close()
        return
    base = servers.POSTGRES_URL if kind == "postgres" else servers.MYSQL_URL
    url = servers.database_url(base, servers.database_name("context"))
    servers.create_database(url)
    engine = create_engine(url, pool_size=4)
    try:
        servers.fresh_schema(engine)
        yield (postgres.Store if kind == "postgres" else mysql.Store)(engine)
    finally:
        engine.dispose()


@pytest.mark.parametrize(("kind", "wire", "stream"), [
    ("sqlite", "openai", False), ("sqlite", "anthropic", True), ("postgres", "anthropic", False),
    ("mysql", "openai", True),
])
def test_many_turns_with_compaction_are_all_answered_and_nothing_is_lost(
    served: list[Served], tmp_path: Path, kind: str, wire: str, stream: bool,
) -> None:
    """300 turns of ~1 KB messages with context_window set: every turn is answered, no request (summary
    requests included) passes the window, the store holds every message in order with the records after
    what they cover, and the last request still makes every turn known (the summaries of summaries)."""
    window = 6000
    server = serve(served, windowed(answering(summarising(long_answer)), window))
    with store_on(kind, tmp_path) as store:
        session = agent.open(f"long-{uuid.uuid4().hex}", store)
        turns = 300
        converse(agent.Spec(session=session, system="You answer.", context_window=window),  # the model's context
                 turns, endpoint(server.url, wire, stream))
        counts = [request_tokens(r.json) for r in server.requests]
        assert max(counts) <= window  # no request refused, summary requests included
        summaries = [r for r in server.requests if is_summary_request(r)]
        assert summaries
        stored = session.messages()
        records = [m for m in stored if is_record(m)]
        said = [m for m in stored if not is_record(m)]
        assert len(records) == len(summaries) and len(said) == 2 * turns
        assert [m.text for m in said[::2]] == [kilobyte(n) for n in range(turns)]  # every message, in order
        ranges = [(r.content[0].start, r.content[0].end) for r in records]
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(ranges))
        positions = [i for i, m in enumerate(stored) if is_record(m)]
        assert all(end <= at for (_, end), at in zip(ranges, positions, strict=True))  # after what it covers
        asked = [r for r in server.requests if not is_summary_request(r)]
        assert len(asked) == turns
        after = asked[[i for i, r in enumerate(server.requests) if not is_summary_request(r)].index(
            server.requests.index(summaries[0]) + 1):]
        assert all("A summary of the conversation" in json.dumps(r.json["messages"][:2]) for r in after)
        assert turns_known(asked[-1]) == set(range(turns))  # the summary and the rest: every turn


def test_a_failed_summary_request_leaves_the_transcript_as_it_was(served: list[Served], tmp_path: Path) -> None:
    window = 3000

    def respond(request: Request) -> Reply:
        if is_summary_request(request):
            return Reply({"error": {"message": "the summariser is down", "type": "server_error"}}, status=400)
        return openai("ok")

    server = serve(served, windowed(respond, window))
    store = sqlite.open(str(tmp_path / "s.db"))
    try:
        session = agent.open("failing", store)
        spec = agent.Spec(session=session, context=Compaction(window))
        for n in range(15):
            result = agent.Runner().run(spec, [*session.messages(), agent.Message.user(kilobyte(n))],
                                        endpoint(server.url, "openai"))
            assert result.stop_reason == "answered"
        stored = session.messages()
        assert not any(is_record(m) for m in stored) and len(stored) == 30
        assert any(is_summary_request(r) for r in server.requests)
        assert max(request_tokens(r.json) for r in server.requests) <= window  # Window's choice was sent
    finally:
        store.close()


def test_a_summary_over_its_cap_is_a_failed_summary_and_the_ask_says_the_cap(
    served: list[Served], tmp_path: Path,
) -> None:
    """Each summary takes the last in, so a model that writes long ones would grow it without end: one
    whose estimate passes ``summary`` of the window counts as a failed summary request (nothing stored),
    and the request says how many words it may have."""
    window = 3000

    def respond(request: Request) -> Reply:
        if is_summary_request(request):
            return openai("turns seen: " + kilobyte(1) * 4)  # ~1,000 tokens: over a quarter of 3,000
        return openai("ok")

    server = serve(served, windowed(respond, window))
    store = sqlite.open(str(tmp_path / "s.db"))
    try:
        session = agent.open("wordy", store)
        spec = agent.Spec(session=session, context=Compaction(window, summary=0.5))
        spec_small = agent.Spec(session=session, context=Compaction(window, summary=0.25))
        for n in range(12):
            msgs = session.messages()
            msgs.append(agent.Message.user(kilobyte(n)))
            assert agent.Runner().run(spec_small, msgs, endpoint(server.url, "openai")).stop_reason == "answered"
        asked = [r for r in server.requests if is_summary_request(r)]
        assert asked and not any(is_record(m) for m in session.messages())
        assert "Keep it under 562 words." in asked[0].json["messages"][-1]["content"]  # 750 tokens, in words
        msgs = session.messages()
        msgs.append(agent.Message.user("and now?"))
        agent.Runner().run(spec, msgs, endpoint(server.url, "openai"))  # a cap of half (1,500 tokens) takes it
        assert any(is_record(m) for m in session.messages())
    finally:
        store.close()


@pytest.mark.parametrize("wire", WIRES)
def test_a_record_is_sent_as_the_summary_text(model: ModelServer, wire: str) -> None:
    record = agent.Message(agent.Role.USER, [agent.Content.compaction("they agreed on Tuesday", 0, 4)])
    model.push(openai("ok") if wire == "openai" else anthropic("ok"))
    endpoint(model.url, wire).complete("", [record, agent.Message.user("and now?")], [])
    sent = json.dumps(model.requests[0].json["messages"])
    assert "A summary of the conversation before this point:\\n\\nthey agreed on Tuesday" in sent


def test_a_record_round_trips_through_json_and_a_store(tmp_path: Path) -> None:
    record = agent.Message(agent.Role.USER, [agent.Content.compaction("summary \u00e9", 3, 10)])
    text = record.to_json()
    assert json.loads(text) == {"role": "user", "content": [{"type": "compaction", "text": "summary \u00e9",
                                                             "start": 3, "end": 10}]}
    assert agent.Message.from_json(text) == record and json.dumps(record.to_dict(), separators=(",", ":")) == text
    store = sqlite.open(str(tmp_path / "s.db"))
    try:
        store.save("s", [agent.Message.user("hi"), record])
        assert store.messages("s")[1] == record
    finally:
        store.close()


@pytest.mark.parametrize("bad", [
    {"type": "compaction", "text": "s", "start": 3, "end": 3},
    {"type": "compaction", "text": "s", "start": 0, "end": 0},
    {"type": "compaction", "text": "s", "start": -1, "end": 2},
    {"type": "compaction", "text": "s", "start": True, "end": 2},
    {"type": "text", "text": "s", "end": 2},
])
def test_a_wrong_record_is_a_message_error(bad: dict[str, Any]) -> None:
    with pytest.raises(agent.MessageError):
        agent.Message.from_dict({"role": "user", "content": [bad]})


def test_a_compaction_is_an_event_a_published_one_and_a_span_event(served: list[Served], tmp_path: Path) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agent_sessions.otel import Tracing

    window = 3000
    server = serve(served, windowed(answering(summarising(lambda r: "ok")), window))
    store = sqlite.open(str(tmp_path / "s.db"))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        session = agent.open("told", store)
        spec = agent.Spec(session=session, context_window=window, publish_events=True)
        seen: list[Any] = []
        for n in range(12):
            tracing = Tracing(session_id="told", tracer_provider=provider, also=seen.append)
            agent.Runner().run(spec, [*session.messages(), agent.Message.user(kilobyte(n))],
                               endpoint(server.url, "openai"), tracing)
        told = [e for e in seen if isinstance(e, agent.events.Compacted)]
        stored = session.messages()
        records = [(i, m.content[0]) for i, m in enumerate(stored) if is_record(m)]
        assert told and [(e.index, e.start, e.end) for e in told] == [(i, c.start, c.end) for i, c in records]
        assert all(e.tokens_after < e.tokens_before for e in told)
        published = [e.data for e in session.events(limit=1000) if e.kind == "compacted"]
        assert published == [{"step": e.step, "start": e.start, "end": e.end, "index": e.index,
                              "tokens_before": e.tokens_before, "tokens_after": e.tokens_after} for e in told]
        steps = [s for s in exporter.get_finished_spans() if s.name == "step"
                 and any(ev.name == "agent_sessions.compacted" for ev in s.events)]
        assert len(steps) == len(told)
        assert [dict(s.attributes or {})["agent_sessions.compaction.end"] for s in steps] == [e.end for e in told]
    finally:
        provider.shutdown()
        store.close()


# -- the guarantees across a compaction -------------------------------------------------------------------------------


def test_a_turn_repeated_after_its_key_was_summarised_is_answered_from_the_store(
    served: list[Served], tmp_path: Path,
) -> None:
    window = 4000
    server = serve(served, windowed(answering(summarising(long_answer)), window))
    with store_on("sqlite", tmp_path) as store:
        session = agent.open("turns", store)
        spec = agent.Spec(session=session, context_window=window)
        ep = endpoint(server.url, "openai")
        first = agent.Runner().turn(spec, kilobyte(0), "task-0", ep)
        for n in range(1, 30):
            agent.Runner().turn(spec, kilobyte(n), f"task-{n}", ep)
        records = [m.content[0] for m in session.messages() if is_record(m)]
        assert records and records[-1].end > 1  # task-0's message is inside a summarised range
        asked = len(server.requests)
        again = agent.Runner().turn(spec, kilobyte(0), "task-0", ep)  # the task redelivered
        assert again.steps == 0 and again.text == first.text and len(server.requests) == asked


def test_a_fork_cut_inside_a_summarised_range_has_the_raw_messages_and_runs(
    served: list[Served], tmp_path: Path,
) -> None:
    window = 4000
    server = serve(served, windowed(answering(summarising(long_answer)), window))
    with store_on("sqlite", tmp_path) as store:
        session = agent.open("forked", store)
        spec = agent.Spec(session=session, context_window=window)
        converse(spec, 30, endpoint(server.url, "openai"))
        stored = session.messages()
        record = next(m.content[0] for m in stored if is_record(m))
        cut = record.end - 2  # inside the first summarised range: a user message
        fork = session.fork("forked-2", at=cut)
        assert fork.messages() == stored[:cut] and not any(is_record(m) for m in fork.messages())
        result = agent.Runner().run(agent.Spec(session=fork, context_window=window),
                                    [*fork.messages(), agent.Message.user(kilobyte(99))],
                                    endpoint(server.url, "openai"))
        assert result.stop_reason == "answered"
        assert session.messages() == stored  # the source is as it was


def test_an_approval_waiting_when_the_threshold_is_passed_compacts_when_its_turn_goes_on(
    served: list[Served], tmp_path: Path,
) -> None:
    @agent.tool(needs_approval=True)
    def refund(order: str) -> str:
        """Refund an order."""
        return f"refunded {order}"

    def respond(request: Request) -> Reply:
        body = request.json
        if body["messages"][0].get("content") == SUMMARY_SYSTEM:
            return openai("turns seen: earlier")
        since = body["messages"][max((i for i, m in enumerate(body["messages"]) if m["role"] == "assistant"),
                                     default=0):]
        if any(m["role"] == "tool" for m in since):  # the results, and the steers after them
            return openai("answer: refunded")
        if "refund" in body["messages"][-1].get("content", ""):
            return openai(calls=[("c1", "refund", '{"order": "1182"}')])
        return openai("answer: noted")

    window = 4000
    server = serve(served, windowed(respond, window))
    with store_on("sqlite", tmp_path) as store:
        session = agent.open("approved", store)
        spec = agent.Spec(session=session, tools=[refund], context=Compaction(window, threshold=0.5))
        ep = endpoint(server.url, "openai")
        for n in range(4):
            agent.Runner().run(spec, [*session.messages(), agent.Message.user(kilobyte(n))], ep)
        before = session.messages()
        waiting = agent.Runner().run(spec, [*before, agent.Message.user("refund order 1182")], ep)
        assert waiting.stop_reason == "awaiting_approval"
        for n in range(4, 8):  # meanwhile more is said: steers, past the threshold
            session.steer(kilobyte(n))
        session.approve("c1")
        result = agent.Runner().run(spec, session.messages(), ep)
        assert result.stop_reason == "answered" and result.text == "answer: refunded"
        # the steers were taken by the save before that request: the next turn's check counts them
        agent.Runner().run(spec, [*session.messages(), agent.Message.user("and now?")], ep)
        stored = session.messages()
        calls = [i for i, m in enumerate(stored) if m.tool_calls]
        assert len(calls) == 1 and stored[calls[0] + 1].content[0].text == "refunded 1182"  # ran once, answered
        records = [m.content[0] for m in stored if is_record(m)]
        assert records and all(r.end != calls[0] + 1 for r in records)  # never between a call and its result
        assert all(kilobyte(n) in [m.text for m in stored] for n in range(8))
        assert max(request_tokens(r.json) for r in server.requests) <= window


class Summariser:
    """An endpoint that summarises by counting: its reply names how many messages it was given."""

    def __init__(self) -> None:
        self.asked: list[list[agent.Message]] = []

    def complete(self, system: str, messages: Sequence[agent.Message], tools: Sequence[agent.Tool]) -> agent.Message:
        self.asked.append(list(messages))
        return agent.Message.assistant(f"{len(messages)} messages")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transcripts(), st.integers(50, 3000), st.sampled_from([0.5, 0.8, 1.0]), st.integers(1, 4))
def test_compaction_records_cover_contiguous_ranges_ending_at_request_starts(
    transcript: list[agent.Message], budget: int, threshold: float, rounds: int,
) -> None:
    policy = Compaction(budget, threshold=threshold)
    summariser = Summariser()
    for _ in range(rounds):
        record = policy.compact("", transcript, [], summariser)
        if record is None:
            break
        transcript.append(record)
    records = [(i, m.content[0]) for i, m in enumerate(transcript) if is_record(m)]
    previous = 0
    for at, block in records:
        assert block.start == previous < block.end <= at  # contiguous, after what it covers
        assert valid_start(transcript[block.end]) and not is_record(transcript[block.end])
        previous = block.end
    for asked in summariser.asked:  # a summary request: a valid conversation ending with the ask
        assert asked[-1].role is agent.Role.USER and valid_start(asked[0])
        calls = {c.id for m in asked for c in m.tool_calls}
        assert calls == {c.tool_call_id for m in asked for c in m.content if c.type is agent.ContentType.TOOL_RESULT}
    chosen = policy.select("", transcript, [])
    sent = list(chosen.messages)
    if records:
        at, block = records[-1]
        assert sent[0] is transcript[at]
        rest = [m for m in transcript[block.end:] if not is_record(m)]
        assert sent[1:] == rest[len(rest) - len(sent) + 1:]  # a suffix of what follows the range
    calls = {c.id for m in sent for c in m.tool_calls}
    assert calls == {c.tool_call_id for m in sent for c in m.content if c.type is agent.ContentType.TOOL_RESULT}
