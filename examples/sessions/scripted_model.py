"""A model server for the example: ``agent_sessions.testing.model_server`` (the library's scripted
OpenAI-compatible server) with the example's own script. It is not a language model: it reads what the
tools returned, so its answers quote real lines.

    python scripted_model.py [--port N]     prints "listening on http://127.0.0.1:N/v1"
"""

from __future__ import annotations

import json
import re
from typing import Any

from agent_sessions.testing.model_server import Reply, Request, completion, serve

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


def respond(request: Request) -> Reply:
    body = request.json
    return completion(reply(body["messages"]), bool(body.get("stream")))


if __name__ == "__main__":
    serve(respond, description=__doc__)
