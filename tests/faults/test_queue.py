"""Issue 26 through the fault proxy on PostgreSQL and MariaDB: a queued turn whose write went unanswered
(``OutcomeUnknown``) is sent again with its key, as a task is retried, and its message is answered once.

- the commit of ``enqueue`` is lost: the message is queued; sent again it is not queued twice;
- the commit of ``take_queued`` is lost: the message is in the transcript, with the turn's lease left to
  expire; the turn sent again finds its key there and answers it, one model request in all."""

from __future__ import annotations

import uuid

import pytest

import agent_sessions as agent
from tests.model_server import ModelServer, openai

from .proxy import FaultProxy, Rule, pg_write

DATABASE = "faultqueue"
"""This module's database (conftest.py's ``database`` fixture; ``proxy`` and ``model`` are conftest.py's too)."""
TTL = 1.0


@pytest.fixture
def stores(via_and_direct: tuple[agent.RunStore, agent.RunStore]) -> tuple[agent.RunStore, agent.RunStore]:
    """A store reaching the database through the proxy, and one reaching it directly (conftest.py's)."""
    return via_and_direct


def _turn(store: agent.RunStore, sid: str, model: ModelServer) -> agent.Result:
    spec = agent.Spec(session=agent.open(sid, store), lease_ttl=TTL, lease_wait=TTL * 5)
    endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "test-model", max_retries=0)
    return agent.Runner().turn(spec, "is order 1183 refundable?", "msg-1183", endpoint)


@pytest.mark.parametrize("lost", ["enqueue", "take_queued"])
def test_a_queued_turn_whose_write_went_unanswered_is_answered_once_when_sent_again(
    stores: tuple[agent.RunStore, agent.RunStore], proxy: FaultProxy, model: ModelServer, lost: str
) -> None:
    via, direct = stores
    sid = f"queue-{lost}-{uuid.uuid4().hex[:12]}"
    rule = proxy.arm(Rule("lose_ack", pg_write("push" if lost == "enqueue" else "pop")))  # one statement
    with pytest.raises(agent.OutcomeUnknown, match="may have happened"):
        _turn(via, sid, model)
    assert rule.fired and model.requests == []
    model.push(openai("yes, within the window"))
    result = _turn(direct, sid, model)  # the task retried, on a worker that reaches the database
    assert (result.stop_reason, result.text) == ("answered", "yes, within the window")
    assert len(model.requests) == 1
    assert [(m.key, m.text) for m in direct.messages(sid)] == [
        ("msg-1183", "is order 1183 refundable?"), ("", "yes, within the window")]
    assert direct.queued(sid) == []  # type: ignore[attr-defined]
    again = _turn(direct, sid, model)
    assert (again.text, again.steps, len(model.requests)) == ("yes, within the window", 0, 1)
