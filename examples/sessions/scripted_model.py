"""A model server for the example: OpenAI's /v1/chat/completions wire format, answering from a fixed
script (it is not a language model). It reads what the tools returned, so its answers quote real lines.

    python scripted_model.py [--port N]     prints "listening on http://127.0.0.1:N/v1"
"""

from __future__ import annotations

import argparse
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Which file a question is about, and the line in it that answers the question.
SCRIPT = {
    "lease.go": (r"return nil, ErrLeaseExpired", "renewLease returns a nil lease when the lease has expired"),
    "token.go": (r"return ErrTokenInvalid", "checkToken returns the token error"),
}


def reply(messages: list[dict[str, Any]]) -> dict[str, Any]:
    last = messages[-1]
    if last["role"] == "tool":
        call = next(m for m in reversed(messages) if m["role"] == "assistant" and m.get("tool_calls"))
        path = json.loads(call["tool_calls"][0]["function"]["arguments"])["path"]
        pattern, summary = SCRIPT[path]
        for line in last["content"].splitlines():
            if re.search(pattern, line):
                number, code = line.split(None, 1)
                return {"role": "assistant", "content": f"{summary}: {path} line {number}, `{code.strip()}`."}
        return {"role": "assistant", "content": f"I could not find it in {path}."}
    question = str(last.get("content", ""))
    path = "token.go" if "token error" in question else "lease.go"
    n = sum(1 for m in messages if m["role"] == "assistant")
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{n}", "type": "function",
         "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        message = reply(body["messages"])
        payload = json.dumps({"id": "scripted", "object": "chat.completion", "model": body.get("model"),
                              "choices": [{"index": 0, "message": message,
                                           "finish_reason": "tool_calls" if "tool_calls" in message else "stop"}]})
        data = payload.encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    port = parser.parse_args().port
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
