"""The work every row of the benchmark does, and how its samples are summarised.

One step of a ReAct run appends an assistant message with a tool call (~200 bytes of JSON arguments)
and a ~1 KB tool result: the workload of ../shared/design/peers-bench.md, so the figures compare.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import agent_sessions as agent

SIZES = (10, 100, 1000)
RESULT_TEXT = ("line of code\n" * 80)[:1024]


def arguments(i: int) -> str:
    return json.dumps({"path": f"src/module_{i}.py", "pattern": "lease.*expir", "context": 3, "note": "x" * 120})


def step_messages(i: int) -> list[agent.Message]:
    return [
        agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call(f"call_{i}", "grep", arguments(i))]),
        agent.Message(agent.Role.USER, [agent.Content.tool_result(f"call_{i}", RESULT_TEXT)]),
    ]


def transcript(n: int) -> list[agent.Message]:
    """``n`` messages: a question, then whole steps (the last one cut if ``n`` is even)."""
    msgs = [agent.Message.user("review the lease code")]
    while len(msgs) < n:
        msgs.extend(step_messages(len(msgs)))
    return msgs[:n]


def clock(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, round(len(ordered) * 0.99))],
        "samples": len(ordered),
    }
