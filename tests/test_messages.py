"""The stored JSON form of a message: the text every store keeps."""

from __future__ import annotations

import json

from hypothesis import given

import agent_sessions as agent
from storetest import strategies


@given(strategies.messages)
def test_to_json_is_json_dumps_of_to_dict(message: agent.Message) -> None:
    """to_json writes the text itself (it is on every step's path); it must be exactly what json.dumps
    gives, so transcripts stored before and after read the same."""
    expected = json.dumps(message.to_dict(), separators=(",", ":"))
    assert agent.Message(message.role, message.content).to_json() == expected
    assert expected.isascii()


@given(strategies.messages)
def test_to_json_round_trips(message: agent.Message) -> None:
    assert agent.Message.from_json(message.to_json()) == message
