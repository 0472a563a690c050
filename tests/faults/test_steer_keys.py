"""Issue #25, item 5, through the fault proxy on PostgreSQL and MariaDB: a steer whose commit went
unanswered raises ``OutcomeUnknown``, and it is stored. Sent again as it was, it would be stored twice (the
first test shows it); sent again with its key, it is stored once, and the next model request (real HTTP to
the scripted model server) carries it once."""

from __future__ import annotations

import uuid

import pytest

import agent_sessions as agent
from tests.model_server import ModelServer, openai

from .proxy import FaultProxy, Rule, pg_write

DATABASE = "faultsteerkeys"
"""This module's database (conftest.py's ``database`` fixture; ``proxy`` and ``model`` are conftest.py's too)."""



@pytest.fixture
def stores(via_and_direct: tuple[agent.RunStore, agent.RunStore]) -> tuple[agent.RunStore, agent.RunStore]:
    """A store reaching the database through the proxy, and one reaching it directly (conftest.py's)."""
    return via_and_direct


def _rule(proxy: FaultProxy) -> Rule:
    """The COMMIT of a steer's transaction (the statement before it: the steer's INSERT, or for a keyed one the
    session's mark of an open turn that follows it): answered by the database, the answer dropped, the
    connection cut. On PostgreSQL the steer is one statement in autocommit: that statement."""
    return proxy.arm(Rule("lose_ack", pg_write("add_steer")))


def test_an_unkeyed_steer_sent_again_after_a_lost_answer_is_stored_twice(
    stores: tuple[agent.RunStore, agent.RunStore], proxy: FaultProxy
) -> None:
    """Why a steer needs a key: the answer was lost, the steer is stored, and the sender cannot tell."""
    via, direct = stores
    sid = f"plain-{uuid.uuid4().hex[:12]}"
    rule = _rule(proxy)
    with pytest.raises(agent.OutcomeUnknown, match="may have happened"):
        agent.open(sid, via).steer("check the expiry")
    assert rule.fired
    assert agent.open(sid, via).steer("check the expiry") is True
    assert direct.take_steers(sid) == ["check the expiry", "check the expiry"]


def test_a_keyed_steer_sent_again_after_a_lost_answer_is_delivered_once(
    stores: tuple[agent.RunStore, agent.RunStore], proxy: FaultProxy, model: ModelServer
) -> None:
    via, direct = stores
    sid = f"keyed-{uuid.uuid4().hex[:12]}"
    session = agent.open(sid, via)
    rule = _rule(proxy)
    with pytest.raises(agent.OutcomeUnknown, match="may have happened"):
        session.steer("check the expiry", key="req-1")
    assert rule.fired
    assert session.steer("check the expiry", key="req-1") is False  # it had landed: not stored again
    assert session.steer("check the expiry", key="req-1") is False
    assert direct.pending_steers(sid) == ["check the expiry"]  # type: ignore[attr-defined]
    model.push(openai("the expiry is checked"))
    result = agent.Runner().run(agent.Spec(session=agent.open(sid, direct)), [agent.Message.user("review")],
                                agent.endpoints.OpenAIChat(model.url + "/v1", "test-model", max_retries=0))
    assert result.stop_reason == "answered"
    sent = [m["content"] for m in model.requests[-1].json["messages"]]
    assert sent == ["review", "check the expiry"]  # the request carried it once
    assert direct.take_steers(sid) == []
    assert session.steer("check the expiry", key="req-1") is False  # delivered: the key is still remembered


@pytest.mark.parametrize("fault", ["cut_before", "cut_inside"])
def test_a_keyed_steer_cut_before_the_database_had_it_is_stored_by_the_retry(
    stores: tuple[agent.RunStore, agent.RunStore], proxy: FaultProxy, fault: str
) -> None:
    """A plain ``StoreError``: nothing happened, the key included, so the retry stores the steer. On
    PostgreSQL, where the steer is one statement in autocommit, a cut once it was sent leaves its outcome
    unknown (``OutcomeUnknown``), and the retry with its key stores it all the same."""
    via, direct = stores
    sid = f"cut-{uuid.uuid4().hex[:12]}"
    session = agent.open(sid, via)
    rule = proxy.arm(Rule(fault, pg_write("add_steer")))  # one statement: a cut once it was sent may have run it
    with pytest.raises(agent.OutcomeUnknown):
        session.steer("look at b", key="req-2")
    assert rule.fired
    assert direct.pending_steers(sid) == []  # type: ignore[attr-defined]
    assert session.steer("look at b", key="req-2") is True
    assert direct.take_steers(sid) == ["look at b"]
