"""What the round-trip tests run through the fault proxy: a model that notes how many units (requests or
statements) the proxy has seen at each of its own requests, and the two tools of a usual step."""

from __future__ import annotations

from typing import Any

import agent_sessions as agent

from .proxy import FaultProxy


class CountingModel:
    """Calls ``tool`` at once, ``steps`` times, then answers; ``seen``: the proxy's count at each request."""

    def __init__(self, tool: str, proxy: FaultProxy, steps: int) -> None:
        self.tool, self.proxy, self.steps = tool, proxy, steps
        self.seen: list[int] = []

    def complete(self, system: str, messages: Any, tools: Any) -> agent.Message:
        self.seen.append(len(self.proxy.statements))
        if len(self.seen) > self.steps:
            return agent.Message.assistant("done")
        call = agent.Content.tool_call(f"c{len(self.seen)}", self.tool, '{"q": "x"}')
        return agent.Message(agent.Role.ASSISTANT, [call])


@agent.tool
def look(q: str) -> str:
    """Look something up."""
    return "found " + q * 200


@agent.tool(idempotent=False)
def charge(q: str) -> str:
    """Charge once."""
    return "charged " + q * 200
