"""A provider that misbehaves on the wire: bodies cut short, lying Content-Length, HTML where JSON
belongs, any JSON at all in place of a reply, a server that never answers or trickles its answer.
Every one is an EndpointError, within the configured timeout; never another exception, never a hang."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions.endpoints import AnthropicMessages, OpenAIChat
from tests.model_server import ModelServer, Reply

from . import figures

TIMEOUT = 0.4
FAULTS: dict[str, int] = {}


class RawServer:
    """Answers each connection with ``behave(socket)``: whatever bytes, pauses or silences a test wants."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.behave = behave
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.open.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            self.behave(conn)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for conn in self.open:
            conn.close()


def head(status: str = "200 OK", content_type: str = "application/json", length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def reply_with(body: bytes, **kw: Any) -> Callable[[socket.socket], None]:
    def behave(conn: socket.socket) -> None:
        conn.sendall(head(length=len(body), **kw) + body)
        conn.close()

    return behave


def cut_short(conn: socket.socket) -> None:
    conn.sendall(head(length=1000) + b'{"choices": [{"message": {"role": "assist')
    conn.close()


def silent(conn: socket.socket) -> None:
    time.sleep(30)


def trickle(conn: socket.socket) -> None:
    conn.sendall(head(length=100_000))
    for _ in range(600):
        conn.sendall(b" ")
        time.sleep(0.05)


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn.close()


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


EVENT = b'data: {"choices": [{"delta": {"content": "half"}}]}\n\n'
START = b'event: message_start\ndata: {"type": "message_start", "message": {"usage": {}}}\n\n'


def stream_cut_short(conn: socket.socket) -> None:
    conn.sendall(head(content_type="text/event-stream") + START + EVENT)  # no length: the close ends it
    conn.close()


def stream_chunk_cut_short(conn: socket.socket) -> None:
    conn.sendall(head(content_type="text/event-stream")[:-2] + b"Transfer-Encoding: chunked\r\n\r\n"
                 + chunked(START) + b"400\r\n" + EVENT)
    conn.close()


def stream_trickles_pings(conn: socket.socket) -> None:
    conn.sendall(head(content_type="text/event-stream") + START)
    for _ in range(600):
        conn.sendall(b": ping\n\n")
        time.sleep(0.05)


def stream_reset(conn: socket.socket) -> None:
    conn.sendall(head(content_type="text/event-stream") + START + EVENT)
    time.sleep(0.05)
    reset(conn)


CASES = {
    "event stream cut short": stream_cut_short,
    "event stream cut inside a chunk": stream_chunk_cut_short,
    "event stream that pings forever": stream_trickles_pings,
    "event stream reset mid-way": stream_reset,
    "truncated JSON body": reply_with(b'{"choices": [{"message": {"role": "assistant", "content": "hal'),
    "body shorter than Content-Length": cut_short,
    "HTML with status 200": reply_with(b"<html><body>Welcome to nginx!</body></html>", content_type="text/html"),
    "HTML 502 from a proxy": reply_with(b"<html><h1>502 Bad Gateway</h1></html>", status="502 Bad Gateway",
                                        content_type="text/html"),
    "JSON of the wrong shape": reply_with(b'{"choices": [{"message": null}], "content": 7}'),
    "not UTF-8": reply_with(b'{"choices": "\xff\xfe"}'),
    "connection reset": reset,
    "never answers": silent,
    "trickles forever": trickle,
}

ENDPOINTS: dict[str, Callable[[str], Any]] = {
    "openai": lambda url: OpenAIChat(url + "/v1", "m", timeout=TIMEOUT, max_retries=0),
    "anthropic": lambda url: AnthropicMessages(url, "m", timeout=TIMEOUT, max_retries=0),
    "openai streaming": lambda url: OpenAIChat(url + "/v1", "m", timeout=TIMEOUT, max_retries=0, stream=True),
    "anthropic streaming": lambda url: AnthropicMessages(url, "m", timeout=TIMEOUT, max_retries=0, stream=True),
}


@pytest.fixture(scope="module", autouse=True)
def _record() -> Iterator[None]:
    yield
    figures.record("endpoint faults", "both endpoints", **FAULTS)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("case", CASES)
def test_a_misbehaving_provider_is_an_endpoint_error_within_the_timeout(case: str, endpoint: str) -> None:
    server = RawServer(CASES[case])
    try:
        started = time.monotonic()
        with pytest.raises(agent.EndpointError) as failure:
            ENDPOINTS[endpoint](server.url).complete("", [agent.Message.user("hi")], [])
        elapsed = time.monotonic() - started
    finally:
        server.close()
    # The whole answer is bounded by the timeout; a read under way when it passes may take one more.
    assert elapsed < 2 * TIMEOUT + 0.2, f"{case}: {elapsed:.2f} s"
    assert str(failure.value)
    FAULTS[case] = FAULTS.get(case, 0) + 1


json_bodies = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "message", "content", "tool_calls", "role", "function", "arguments", "name",
                         "id", "type", "text", "input", "stop_reason", "error"]) | st.text(max_size=5),
        inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_any_json_in_place_of_a_reply_is_a_message_or_an_endpoint_error(endpoint: str) -> None:
    model = ModelServer()
    client = ENDPOINTS[endpoint](model.url)
    outcomes = {"message": 0, "EndpointError": 0}

    @settings(max_examples=150, deadline=None)
    @given(json_bodies)
    def check(body: Any) -> None:
        model.push(Reply(json.dumps(body), raw=True))
        try:
            reply = client.complete("", [agent.Message.user("hi")], [])
        except agent.EndpointError:
            outcomes["EndpointError"] += 1
        else:
            assert isinstance(reply, agent.Message) and reply.role is agent.Role.ASSISTANT
            outcomes["message"] += 1

    try:
        check()
    finally:
        model.close()
    FAULTS[f"random JSON bodies ({endpoint})"] = sum(outcomes.values())


OK_BODIES = {"openai": b'{"choices": [{"message": {"content": "ok"}}]}',
             "anthropic": b'{"content": [{"type": "text", "text": "ok"}]}',
             "openai streaming": b'{"choices": [{"message": {"content": "ok"}}]}'}  # a server that ignores stream
RETRYING: dict[str, Callable[[str], Any]] = {
    "openai": lambda url: OpenAIChat(url + "/v1", "m", timeout=TIMEOUT, max_retries=1, backoff=0.01),
    "anthropic": lambda url: AnthropicMessages(url, "m", timeout=TIMEOUT, max_retries=1, backoff=0.01),
    "openai streaming": lambda url: OpenAIChat(url + "/v1", "m", timeout=TIMEOUT, max_retries=1, backoff=0.01,
                                               stream=True),
}


@pytest.mark.parametrize("endpoint", RETRYING)
def test_a_connection_the_server_broke_is_retried(endpoint: str) -> None:
    answers = iter([reset, reply_with(OK_BODIES[endpoint])])
    server = RawServer(lambda conn: next(answers)(conn))
    try:
        assert RETRYING[endpoint](server.url).complete("", [agent.Message.user("hi")], []).text == "ok"
    finally:
        server.close()


def trickled_503(conn: socket.socket) -> None:
    conn.sendall(head("503 Service Unavailable", length=100_000))
    for _ in range(600):
        conn.sendall(b" ")
        time.sleep(0.05)


@pytest.mark.parametrize("endpoint", RETRYING)
def test_a_retried_status_whose_body_trickles_is_not_read_to_its_end(endpoint: str) -> None:
    server = RawServer(trickled_503)
    try:
        started = time.monotonic()
        with pytest.raises(agent.EndpointError) as failure:
            RETRYING[endpoint](server.url).complete("", [agent.Message.user("hi")], [])
        elapsed = time.monotonic() - started
    finally:
        server.close()
    assert failure.value.status == 503
    assert elapsed < 2 * TIMEOUT + 0.2, f"{elapsed:.2f} s"  # the retried one was closed, not drained
    FAULTS["503 whose body trickles, retried"] = FAULTS.get("503 whose body trickles, retried", 0) + 1
