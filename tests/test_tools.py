"""What a tool hands back, through a real run (Runner, OpenAIChat, tests.model_server)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

import agent_sessions as agent
from tests.model_server import ModelServer, openai


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque>"


RETURNS: dict[str, Any] = {
    "datetime": datetime.datetime(2026, 1, 2, 3, 4, 5),
    "set": {1, 2},
    "Opaque": Opaque(),
    "dict": {"when": datetime.date(2026, 1, 2)},  # the dict is fine, what is inside it is not
}


@pytest.mark.parametrize("kind", RETURNS)
def test_a_tool_result_json_cannot_encode_is_an_error_the_model_reads(model: ModelServer, kind: str) -> None:
    @agent.tool
    def now() -> Any:
        """What time is it?"""
        return RETURNS[kind]

    model.push(openai(calls=[("c1", "now", "{}")]), openai("it is late"))
    result = agent.Runner().run(agent.Spec(tools=[now]), [agent.Message.user("time?")],
                                agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0))
    assert result.text == "it is late"
    answer = result.messages[2].content[0]
    assert answer.is_error and answer.tool_call_id == "c1"
    assert f"returned a {kind}" in answer.text and "not JSON serializable" in answer.text
    sent = model.requests[1].json["messages"][-1]
    assert sent == {"role": "tool", "tool_call_id": "c1", "content": f"Error: {answer.text}"}


def test_a_circular_result_is_an_error_too() -> None:
    loop: list[Any] = []
    loop.append(loop)
    result = agent.Tool("t", "", {"type": "object"}, lambda: loop).invoke(agent.Content.tool_call("c1", "t", ""))
    assert result.is_error and "returned a list" in result.text and "Circular reference" in result.text


def test_strings_and_json_values_are_results_as_before() -> None:
    for value, text in [("plain", "plain"), ({"a": [1, None]}, '{"a": [1, null]}'), (3, "3"), (None, "null")]:
        tool = agent.Tool("t", "", {"type": "object"}, lambda v=value: v)
        assert tool.invoke(agent.Content.tool_call("c1", "t", "{}")) == agent.Content.tool_result("c1", text)
