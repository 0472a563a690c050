"""Issue #25, items 4 and 6, through the fault proxy on PostgreSQL and MariaDB: a write whose answer was
lost raises ``OutcomeUnknown`` (it may have happened), one cut before the database saw it raises a plain
``StoreError`` (it did not); and an acquisition whose commit lost its answer is asked again with its own
token, so the run gets the lease it took instead of finding it held by itself."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, make_url

import agent_sessions as agent
from agent_sessions.lease import Lease
from tests import servers

from .proxy import FaultProxy, Rule, pg_write

DATABASE = "faultoutcome"
"""This module's database (conftest.py's ``database`` fixture)."""


@pytest.fixture
def via(database: tuple[str, str, Engine], proxy: FaultProxy) -> Iterator[agent.Store]:
    """A store reaching the database through the proxy; and ``direct``, one that does not."""
    url = make_url(database[1]).set(port=proxy.port).render_as_string(hide_password=False)
    store = servers.postgres_store(url) if database[0] == "postgres" else servers.mysql_store(url)
    warm = f"warm-{uuid.uuid4().hex}"  # what a store does once (read its limits) is done before a rule is armed
    store.save(warm, _transcript(1))
    assert store.messages(warm) == _transcript(1)
    proxy.statements.clear()
    yield store
    store.engine.dispose()


@pytest.fixture
def direct(database: tuple[str, str, Engine]) -> Iterator[agent.Store]:
    store = servers.postgres_store(database[1]) if database[0] == "postgres" else servers.mysql_store(database[1])
    yield store
    store.engine.dispose()


def _transcript(n: int) -> list[agent.Message]:
    return [agent.Message.user(f"question {i}") if i % 2 == 0 else agent.Message.assistant(f"answer {i}")
            for i in range(n)]


def test_a_save_whose_commit_lost_its_answer_may_have_happened_and_did(
    via: agent.Store, direct: agent.Store, proxy: FaultProxy
) -> None:
    lost_save(via, direct, proxy, pg_write("splice"))


def lost_save(via: agent.Store, direct: agent.Store, proxy: FaultProxy, pattern: str) -> None:
    """A save whose write matching ``pattern`` loses its answer (test_mongo_faults.py too)."""
    sid = f"lost-{uuid.uuid4().hex}"
    msgs = _transcript(3)
    rule = proxy.arm(Rule("lose_ack", pattern))
    with pytest.raises(agent.OutcomeUnknown, match="may have happened"):
        via.save(sid, msgs)
    assert rule.fired
    assert direct.messages(sid) == msgs  # it did happen
    via.save(sid, msgs)  # and saving the same transcript again is safe: nothing is added twice
    assert direct.messages(sid) == msgs


@pytest.mark.parametrize("fault", ["cut_before", "cut_inside"])
def test_a_save_cut_before_the_database_saw_it_did_not_happen(
    via: agent.Store, direct: agent.Store, proxy: FaultProxy, fault: str
) -> None:
    """The save is one statement (a call of the write function or procedure): a connection cut once it
    was sent may have run it, and the driver cannot tell, so the outcome is unknown (as on MongoDB)."""
    sid = f"cut-{uuid.uuid4().hex}"
    rule = proxy.arm(Rule(fault, pg_write("splice")))
    with pytest.raises(agent.OutcomeUnknown):
        via.save(sid, _transcript(3))
    assert rule.fired
    assert direct.messages(sid) == []


def test_a_fenced_step_whose_answer_was_lost_may_have_happened(
    via: agent.RunStore, direct: agent.Store, proxy: FaultProxy
) -> None:
    """The usual step: one statement, whose save reads the transcript back and, finding it landed, goes
    on; nothing is stored twice."""
    lost_step(via, direct, proxy, pg_write("splice"), unknown=False)


def lost_step(
    via: agent.RunStore, direct: agent.Store, proxy: FaultProxy, pattern: str, *more: str, unknown: bool = True
) -> None:
    """A fenced append whose write matching ``pattern`` loses its answer (test_mongo_faults.py too), and so do
    the next ones matching ``more``; ``unknown``: the save raises ``OutcomeUnknown`` (else it returns)."""
    sid = f"step-{uuid.uuid4().hex}"
    msgs = _transcript(3)
    via.save(sid, msgs)
    holder = via.acquire(sid, agent.Holder("h", 1, "a" * 32, 0.0), 60)
    via.save_fenced(sid, holder, msgs, take_steers=True)  # the store now knows the transcript: the next is an append
    msgs = [*msgs, agent.Message.user("one more")]
    rules = [proxy.arm(Rule("lose_ack", p)) for p in (pattern, *more)]
    if unknown:
        with pytest.raises(agent.OutcomeUnknown):
            via.save_fenced(sid, holder, msgs, take_steers=True)
    else:
        via.save_fenced(sid, holder, msgs, take_steers=True)
    assert all(rule.fired for rule in rules) and direct.messages(sid) == msgs


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_an_acquisition_whose_commit_lost_its_answer_gets_the_lease_it_took(
    via: agent.RunStore, direct: agent.RunStore, proxy: FaultProxy, nth: int
) -> None:
    pattern = pg_write("lease", r'\{"acquire"')
    rule = lost_acquisition(via, direct, proxy, Rule("lose_ack", pattern, nth=nth))
    if not rule.fired:
        pytest.skip(f"the acquisition commits fewer than {nth} times on {proxy.protocol}")


def lost_acquisition(via: agent.RunStore, direct: agent.RunStore, proxy: FaultProxy, rule: Rule) -> Rule:
    """A lease taken while ``rule`` is armed: the run holds it, nobody else can take it (test_mongo_faults.py
    too). Returns the rule, to say whether it fired."""
    sid = f"acq-{uuid.uuid4().hex}"
    via.save(sid, _transcript(1))
    proxy.arm(rule)
    with Lease(via, sid, ttl=30, wait=0) as lease:
        held = direct.holder(sid)
        assert held is not None and held.token == lease.holder.token and held.epoch == lease.holder.epoch
        with pytest.raises(agent.SessionBusy):  # anyone else finds it held: it is this run's
            with Lease(direct, sid, ttl=30, wait=0):
                pass
    assert direct.holder(sid) is None  # released at the end, as usual
    return rule


def test_a_release_whose_answer_was_lost_does_not_fail_the_finished_turn(
    via: agent.RunStore, direct: agent.RunStore, proxy: FaultProxy
) -> None:
    """Item 7: the turn is over; the release is asked again, and the lease ends free."""
    lost_release(via, direct, proxy, pg_write("lease", r'\{"release"'))


def lost_release(via: agent.RunStore, direct: agent.RunStore, proxy: FaultProxy, pattern: str) -> None:
    """A release whose write matching ``pattern`` loses its answer (test_mongo_faults.py too)."""
    sid = f"rel-{uuid.uuid4().hex}"
    via.save(sid, _transcript(1))
    with Lease(via, sid, ttl=30, wait=0):
        rule = proxy.arm(Rule("lose_ack", pattern))
    assert rule.fired and direct.holder(sid) is None
