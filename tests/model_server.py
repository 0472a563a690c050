"""A real HTTP model server for the tests: answers from a script, speaking OpenAI's or Anthropic's wire
format, and records every request body byte for byte."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    raw: bool = False  # body is sent as given (a str), not JSON-encoded
    pieces: list[bytes | Callable[[], object]] | None = None  # a chunked body, each piece one chunk as it comes;
    # a callable is called between two pieces (a wait), and the body is nothing else
    cut: bool = False  # with pieces: the connection is closed after them, without the chunked body's end


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
    """``push`` replies (or callables building one from the request); each request takes the next."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self._script: list[Script] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                request = Request(self.path, {k.lower(): v for k, v in self.headers.items()},
                                  self.rfile.read(length), self.client_address[1])
                with server._lock:
                    server.requests.append(request)
                    step = server._script.pop(0) if server._script else Reply(
                        {"error": {"message": "the test script has no reply left"}}, status=599)
                reply = step(request) if callable(step) else step
                if reply.pieces is not None:
                    self.send_pieces(reply)
                    return
                payload = (reply.body if reply.raw else json.dumps(reply.body)).encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)

            def send_pieces(self, reply: Reply) -> None:
                self.send_response(reply.status)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("transfer-encoding", "chunked")
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    for piece in reply.pieces or ():
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
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 64  # the default listen backlog, 5, resets some of a burst of 16 connections

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def push(self, *steps: Script) -> None:
        with self._lock:
            self._script.extend(steps)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def openai(text: str | None = None, calls: list[tuple[str, str, str]] = (),  # type: ignore[assignment]
           usage: dict[str, Any] | None = None) -> Reply:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ]
    body: dict[str, Any] = {"id": "chatcmpl-test", "object": "chat.completion",
                            "choices": [{"index": 0, "message": message,
                                         "finish_reason": "tool_calls" if calls else "stop"}]}
    if usage is not None:
        body["usage"] = usage
    return Reply(body)


def openai_raw(text: str) -> Reply:
    """A reply whose body is written by hand, so tool-call argument bytes are exactly the test's."""
    return Reply(text, raw=True)


def anthropic(text: str | None = None, calls: list[tuple[str, str, Any]] = (),  # type: ignore[assignment]
              usage: dict[str, Any] | None = None) -> Reply:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    blocks += [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls]
    body: dict[str, Any] = {"id": "msg_test", "type": "message", "role": "assistant", "content": blocks,
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
        pieces = [p + end for p in data.split(end) if p]
        if not data.endswith(end) and pieces:  # the last piece was not a whole event: send it as it is
            pieces[-1] = pieces[-1][: -len(end)]
    return Reply(None, pieces=pieces, cut=cut_at is not None)
