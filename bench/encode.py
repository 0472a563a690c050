"""What writing one request body costs, for a long run: the Anthropic body is written from encoded pieces
(tool-use ``input`` spliced in as the model's own arguments text), the OpenAI one by json.dumps. Both
encoders, one transcript of the benchmark's steps; the OpenAI figure is the yardstick."""

from __future__ import annotations

import json
import statistics
from typing import Any

import agent_sessions as agent
from agent_sessions.endpoints import AnthropicMessages, OpenAIChat

from .workload import clock, transcript

TOOL_CALLS = 700
REPEAT = 21


@agent.tool
def grep(path: str, pattern: str, context: int = 0, note: str = "") -> str:
    """Search a file (never called: only its schema goes into the body)."""
    return ""


def encode_times(tool_calls: int = TOOL_CALLS, repeat: int = REPEAT) -> dict[str, Any]:
    """Median milliseconds to write the body of a request carrying ``tool_calls`` steps, per encoder.
    No request is sent: the endpoints point at a closed port and are never asked to complete."""
    msgs = transcript(2 * tool_calls + 1)
    anthropic = AnthropicMessages("http://127.0.0.1:9", "m")
    openai = OpenAIChat("http://127.0.0.1:9/v1", "m")
    bodies = {
        "anthropic": lambda: anthropic.body("You are a code reviewer.", msgs, [grep]),
        "openai": lambda: json.dumps(openai.body("You are a code reviewer.", msgs, [grep])),
    }
    out: dict[str, Any] = {"tool_calls": tool_calls, "repeat": repeat,
                           "bytes": {name: len(body()) for name, body in bodies.items()}}
    for name, body in bodies.items():
        out[f"{name}_ms"] = statistics.median(clock(body) for _ in range(repeat))
    out["ratio"] = out["anthropic_ms"] / out["openai_ms"]
    return out


def line(report: dict[str, Any]) -> str:
    return (f"Request body encode, {report['tool_calls']} tool calls: anthropic {report['anthropic_ms']:.1f} ms, "
            f"openai {report['openai_ms']:.1f} ms ({report['ratio']:.2f} x)")


if __name__ == "__main__":
    print(line(encode_times()))
