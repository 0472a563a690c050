"""Issue #25, through the fault proxy on PostgreSQL and MariaDB: a journal write whose answer was lost is
read back, as a save is. When it landed the run goes on as if the answer had come: the non-idempotent call
it marked started runs (once), where failing would leave the resume to report its outcome unknown; and the
calls it asked approval for are announced (``approval_requested``), which a resume, finding them already
in the journal, would never do."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, make_url

import agent_sessions as agent
from agent_sessions.journal import UNKNOWN_OUTCOME
from tests import servers
from tests.model_server import ModelServer, openai

from .proxy import FaultProxy, Rule, pg_write

DATABASE = "faultjournal"
"""This module's database (conftest.py's ``database`` fixture)."""

PAID: list[str] = []


@agent.tool(idempotent=False)
def pay(bill: str) -> str:
    """Pay a bill (not idempotent: at most once per call)."""
    PAID.append(bill)
    return f"paid {bill}"


@agent.tool(idempotent=False, needs_approval=True)
def transfer(amount: int) -> str:
    """Transfer money, once a person approves."""
    return f"transferred {amount}"


def _store(database: tuple[str, str, Engine], port: int | None = None) -> agent.EventStore:
    url = database[1] if port is None else make_url(database[1]).set(port=port).render_as_string(hide_password=False)
    return servers.postgres_store(url) if database[0] == "postgres" else servers.mysql_store(url)


@pytest.fixture
def stores(database: tuple[str, str, Engine], proxy: FaultProxy) -> Iterator[tuple[agent.EventStore, agent.EventStore]]:
    """(through the proxy, warmed up so a rule meets only the run's statements; direct)."""
    via, direct = _store(database, proxy.port), _store(database)
    warm = f"warm-{uuid.uuid4().hex}"
    via.save(warm, [agent.Message.user("warm")])
    via.messages(warm)
    proxy.statements.clear()
    yield via, direct
    for store in (via, direct):
        getattr(store, "close", store.engine.dispose)()  # type: ignore[attr-defined]


def _lose_the_journal_ack(proxy: FaultProxy) -> Rule:
    """The journal write: one statement, a call of the write function or procedure."""
    return proxy.arm(Rule("lose_ack", pg_write("journal", r'\["')))  # a journal written, not dropped


def test_a_started_mark_whose_answer_was_lost_is_read_back_and_the_call_runs_once(
    stores: tuple[agent.EventStore, agent.EventStore], proxy: FaultProxy, model: ModelServer
) -> None:
    via, direct = stores
    sid = f"jstart-{uuid.uuid4().hex[:12]}"
    bill = f"bill-{sid}"
    model.push(openai(calls=[("c1", "pay", json.dumps({"bill": bill}))]), openai("paid it"))
    rule = _lose_the_journal_ack(proxy)
    spec = agent.Spec(session=agent.open(sid, via), tools=[pay])
    endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
    result = agent.Runner().run(spec, [agent.Message.user("pay my bill")], endpoint)
    assert rule.fired, proxy.statements
    assert result.stop_reason == "answered"
    assert PAID.count(bill) == 1
    results = [c for m in direct.messages(sid) for c in m.content if c.tool_call_id == "c1"]
    assert [c.text for c in results] == [f"paid {bill}"]
    assert UNKNOWN_OUTCOME not in results[0].text


def test_an_approval_request_whose_answer_was_lost_is_still_announced(
    stores: tuple[agent.EventStore, agent.EventStore], proxy: FaultProxy, model: ModelServer
) -> None:
    via, direct = stores
    sid = f"jappr-{uuid.uuid4().hex[:12]}"
    model.push(openai(calls=[("t1", "transfer", json.dumps({"amount": 5}))]))
    rule = _lose_the_journal_ack(proxy)
    spec = agent.Spec(session=agent.open(sid, via), tools=[transfer], publish_events=True)
    endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
    try:
        stop = agent.Runner().run(spec, [agent.Message.user("send 5")], endpoint).stop_reason
    except agent.AwaitingApproval:
        stop = "awaiting_approval"
    assert rule.fired, proxy.statements
    assert stop == "awaiting_approval"
    session = agent.open(sid, direct)
    assert [p.call_id for p in session.pending_approvals()] == ["t1"]
    kinds = [e.kind for e in session.events(limit=100)]
    assert kinds.count("approval_requested") == 1, kinds
    assert kinds[-1] == "finished", kinds
