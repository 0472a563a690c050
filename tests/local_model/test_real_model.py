"""Against a real model (scripts/local-model-test serves one; skipped without it): a session's turn,
steered before it starts, and a tool-result follow-up, through both endpoints. A 135M model says odd
things, so the checks are about the wire and the store, not the wisdom."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import agent_sessions as agent
from stores import sqlite

URL = os.environ.get("AGENT_SESSIONS_LOCAL_MODEL", "")
pytestmark = pytest.mark.skipif(not URL, reason="no local model: run scripts/local-model-test")

ENDPOINTS = {
    "openai": lambda: agent.endpoints.OpenAIChat(URL + "/v1", "smollm2", timeout=120, extra={"temperature": 0,
                                                                                          "max_tokens": 48}),
    "anthropic": lambda: agent.endpoints.AnthropicMessages(URL, "smollm2", max_tokens=48, timeout=120),
}


@pytest.mark.parametrize("name", ENDPOINTS)
def test_a_steered_turn_is_answered_and_stored(name: str, tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "real.db")
    session = agent.open("real-1", store)
    session.steer("Answer in one short sentence.")
    result = agent.Runner().run(agent.Spec(session=session, max_steps=2),
                                [agent.Message.user("What is a lease in distributed systems?")], ENDPOINTS[name]())
    assert result.stop_reason == "answered" and result.text.strip()
    assert store.messages("real-1") == result.messages
    assert [m.text for m in result.messages[:2]] == ["What is a lease in distributed systems?",
                                                      "Answer in one short sentence."]


@pytest.mark.parametrize("name", ENDPOINTS)
def test_a_tool_result_follow_up_is_accepted(name: str) -> None:
    # An assistant tool call beside its result: OpenAI-compatible servers refuse "content": null here.
    msgs = [
        agent.Message.user("What does lease.go return on expiry?"),
        agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("call_1", "read_file", '{"path": "lease.go"}')]),
        agent.Message(agent.Role.USER, [agent.Content.tool_result("call_1", "return ErrLeaseExpired")]),
    ]

    @agent.tool
    def read_file(path: str) -> str:
        """Read a file."""
        return "return ErrLeaseExpired"

    result = agent.Runner().run(agent.Spec(tools=[read_file], max_steps=2), msgs, ENDPOINTS[name]())
    assert result.messages[3].role is agent.Role.ASSISTANT
    assert agent.orphaned_tool_calls(result.messages) == []
