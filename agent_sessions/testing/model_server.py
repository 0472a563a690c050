"""A scripted model server over real HTTP on 127.0.0.1, answering from a script rather than a language
model; standard library only. ``python -m agent_sessions.testing.model_server [--port 8080]`` answers
OpenAI's ``/v1/chat/completions`` as ``scripted`` does; in code, ``ModelServer(respond)`` serves any
``respond(request) -> Reply``, recording every request body byte for byte.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

PORT = 8080  # the quick start's


@dataclass
class Reply:
    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    raw: bool = False
    """``body`` is sent as given (a str), not JSON-encoded."""
    pieces: list[bytes | Callable[[], object]] | None = None
    """A chunked body, each piece one chunk as it comes; a callable is called between two pieces (a wait),
    and the body is nothing else."""
    cut: bool = False
    """With ``pieces``: the connection is closed after them, without the chunked body's end."""


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    raw: bytes
    client_port: int = 0

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


Script = Reply | Callable[[Request], Reply]


class ModelServer:
    """A threading HTTP server on 127.0.0.1 (``port`` 0: a free one) answering each POST with
    ``respond(request)``, on a daemon thread until ``close``."""

    def __init__(self, respond: Callable[[Request], Reply], port: int = 0) -> None:
        self.requests: list[Request] = []
        self.respond = respond
        self._lock = threading.Lock()
        self.httpd = _Server(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True,
                                        name="model-server")
        self._thread.start()

    def take(self, request: Request) -> Script:
        """What answers ``request``; called holding the lock under which the request was recorded, so a
        subclass handing out replies in turn hands the n-th to the n-th request. The default: ``respond``."""
        return self.respond

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ModelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # the default listen backlog, 5, resets some of a burst of 16 connections

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that reset its kept-alive connection (after an error status it did not read to the
        end, say) is a client gone, logged at DEBUG; anything else is printed, as socketserver does."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            log.debug("model server: %s reset the connection", client_address)
            return
        super().handle_error(request, client_address)


def _handler(server: ModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            request = Request(self.path, {k.lower(): v for k, v in self.headers.items()},
                              self.rfile.read(length), self.client_address[1])
            with server._lock:
                server.requests.append(request)
                step = server.take(request)
            reply = step(request) if callable(step) else step
            self.send_response(reply.status)
            if reply.pieces is None:
                payload = (reply.body if reply.raw else json.dumps(reply.body)).encode()
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
            else:
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("transfer-encoding", "chunked")
            for k, v in reply.headers.items():
                self.send_header(k, v)
            self.end_headers()
            if reply.pieces is None:
                self.wfile.write(payload)
                return
            try:
                for piece in reply.pieces:
                    if callable(piece):
                        piece()
                    elif piece:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                if reply.cut:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                else:
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client gave up (a timeout under test)
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("model server: " + format, *args)

    return Handler


# -- replies ---------------------------------------------------------------------------------------------------


def openai(text: str | None = None, calls: Sequence[tuple[str, str, str]] = (),
           usage: dict[str, Any] | None = None) -> Reply:
    """A chat completion: ``text``, and ``calls`` as (id, tool name, arguments as JSON text)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ]
    body: dict[str, Any] = {"id": "chatcmpl-scripted", "object": "chat.completion",
                            "choices": [{"index": 0, "message": message,
                                         "finish_reason": "tool_calls" if calls else "stop"}]}
    if usage is not None:
        body["usage"] = usage
    return Reply(body)


def openai_raw(text: str) -> Reply:
    """A reply whose body is written by hand, so tool-call argument bytes are exactly the caller's."""
    return Reply(text, raw=True)


def anthropic(text: str | None = None, calls: Sequence[tuple[str, str, Any]] = (),
              usage: dict[str, Any] | None = None) -> Reply:
    """An Anthropic message: ``text``, and ``calls`` as (id, tool name, input object)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    blocks += [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls]
    body: dict[str, Any] = {"id": "msg_scripted", "type": "message", "role": "assistant", "content": blocks,
                            "stop_reason": "tool_use" if calls else "end_turn"}
    if usage is not None:
        body["usage"] = usage
    return Reply(body)


def sse(text: str | bytes, *, size: int = 0, crlf: bool = False, cut_at: int | None = None) -> Reply:
    """A streamed reply: ``text`` (server-sent events, LF line ends; CRLF with ``crlf``) sent in chunks of
    ``size`` bytes (0: one chunk per event), and with ``cut_at`` only its first ``cut_at`` bytes, after
    which the connection is closed mid-body."""
    data = text.encode() if isinstance(text, str) else text
    if crlf:
        data = data.replace(b"\n", b"\r\n")
    if cut_at is not None:
        data = data[:cut_at]
    if size:
        pieces: list[bytes | Callable[[], object]] = [data[i : i + size] for i in range(0, len(data), size)]
    else:
        end = b"\r\n\r\n" if crlf else b"\n\n"
        events = [p + end for p in data.split(end) if p]
        if not data.endswith(end) and events:  # the last piece was not a whole event: send it as it is
            events[-1] = events[-1][: -len(end)]
        pieces = list(events)
    return Reply(None, pieces=pieces, cut=cut_at is not None)


def completion(message: dict[str, Any], stream: bool = False) -> Reply:
    """``message`` (an OpenAI assistant message: ``content``, maybe ``tool_calls``) as a chat completion,
    or with ``stream`` as the chunks a streaming request gets."""
    calls = message.get("tool_calls") or []
    if not stream:
        return openai(message.get("content"), [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                               for c in calls])
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if calls:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
    chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls else "stop"}]}]
    return sse("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")


# -- a model's context -------------------------------------------------------------------------------------------


def context_length_exceeded(tokens: int, limit: int) -> Reply:
    return Reply({"error": {
        "message": f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                   f"{tokens} tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}, status=400)


def prompt_too_long(tokens: int, limit: int) -> Reply:
    return Reply({"type": "error", "error": {"type": "invalid_request_error",
                                             "message": f"prompt is too long: {tokens} tokens > {limit} maximum"}},
                 status=400)


def request_tokens(body: dict[str, Any]) -> int:
    """What the scripted server counts for a request: a token per 4 bytes (rounded up) of its messages and
    its system prompt as JSON (OpenAI's system prompt is one of its messages; Anthropic's is ``system``)."""
    size = len(json.dumps(body.get("messages")).encode()) + len(json.dumps(body.get("system", "")).encode())
    return -(-size // 4)


def windowed(respond: Callable[[Request], Reply], tokens: int,
             count: Callable[[dict[str, Any]], int] = request_tokens) -> Callable[[Request], Reply]:
    """``respond`` behind a model's context of ``tokens``: a request that ``count`` makes longer gets the
    provider's context-length error (``/messages``: Anthropic's, else OpenAI's); a JSON reply that reports
    no usage gets the count as its prompt's, as a provider reports what it counted."""
    def answer(request: Request) -> Reply:
        anthropic_wire = request.path.rstrip("/").endswith("/messages")
        try:
            body = request.json
        except ValueError:
            return respond(request)
        counted = count(body) if isinstance(body, dict) else 0
        if counted > tokens:
            return (prompt_too_long if anthropic_wire else context_length_exceeded)(counted, tokens)
        reply = respond(request)
        if isinstance(reply.body, dict) and reply.status == 200 and "usage" not in reply.body:
            reply.body["usage"] = {"input_tokens" if anthropic_wire else "prompt_tokens": counted}
        return reply
    return answer


# -- the script ------------------------------------------------------------------------------------------------


def scripted(request: Request) -> Reply:
    """The default script: OpenAI's chat completions only; anything else is a 404."""
    if not request.path.rstrip("/").endswith("/chat/completions"):
        return Reply({"error": {"message": f"the scripted model server answers POST /v1/chat/completions, "
                                           f"not {request.path}"}}, status=404)
    try:
        body = request.json
        messages: list[dict[str, Any]] = body["messages"]
    except (ValueError, KeyError, TypeError):
        return Reply({"error": {"message": "the body must be a JSON object with messages"}}, status=400)
    return completion(answer(messages, body.get("tools") or []), bool(body.get("stream")))


def answer(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    last = messages[-1] if messages else {"role": "user", "content": ""}
    if last.get("role") == "tool":
        results = [m for m in _since_assistant(messages) if m.get("role") == "tool"]
        first = next((line for line in str(results[0].get("content") or "").splitlines() if line.strip()), "")
        return {"role": "assistant", "content": f"(scripted) {len(results)} tool result"
                f"{'' if len(results) == 1 else 's'} read; the first begins: {first[:120]!r}"}
    said = _text(last.get("content"))
    if tools:
        asked = [_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"]
        function = tools[0].get("function", {})
        made = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{made + 1}", "type": "function",
             "function": {"name": function.get("name", "tool"),
                          "arguments": json.dumps(_arguments(function.get("parameters") or {}, asked))}}]}
    return {"role": "assistant", "content": f"(scripted) you said: {said[:200]}"}


def _since_assistant(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return list(messages[i + 1:])
    return list(messages)


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _arguments(schema: dict[str, Any], asked: Sequence[str]) -> dict[str, Any]:
    """Arguments for a tool of JSON schema ``schema``, from what the user said (``asked``, newest first). A
    parameter named in the newest message takes the word after its name ("refund order 1182": ``order`` is
    "1182"). Otherwise a string is the newest word that looks like a file name (``lease.go``), else the
    newest message; a number the last number of the newest message ("80 euros"), else 1; a boolean false."""
    words = [w.strip(".,;:!?\"'`()") for text in asked for w in text.split()]
    word = next((w for w in words if "." in w), asked[0] if asked else "")
    newest = [w.strip(".,;:!?\"'`()") for w in (asked[0].split() if asked else [])]
    numbers = [int(w) for w in newest if w.isdigit()]
    made: dict[str, Any] = {}
    for name, prop in (schema.get("properties") or {}).items():
        kind = str(prop.get("type") if isinstance(prop, dict) else None)
        after = next((newest[i + 1] for i in range(len(newest) - 1) if newest[i].lower() == name.lower()), None)
        if kind in ("integer", "number"):
            made[name] = int(after) if after is not None and after.isdigit() else (numbers[-1] if numbers else 1)
        elif kind in ("boolean", "array", "object"):
            made[name] = {"boolean": False, "array": [], "object": {}}[kind]
        else:
            made[name] = after if after is not None else word
    return made


def serve(respond: Callable[[Request], Reply] = scripted, argv: Sequence[str] | None = None,
          description: str = "A scripted OpenAI-compatible model server on 127.0.0.1.") -> None:
    """Serve ``respond`` on ``--port`` (default ``PORT``; 0: a free one) until interrupted, after printing
    ``listening on URL/v1`` (flushed: a parent reads the URL from it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, default=PORT, help=f"the port (default {PORT}; 0: any free one)")
    port = parser.parse_args(argv).port
    try:
        server = ModelServer(respond, port)
    except OSError as exc:
        raise SystemExit(f"cannot listen on 127.0.0.1:{port}: {exc} (--port N picks another)") from exc
    print(f"listening on {server.url}/v1", flush=True)
    try:
        server._thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    serve()
