"""The SQL stores' round trips, counted by the fault proxy (each unit it sees is one): every write is one
statement (PostgreSQL: a call of the function ``agent_sessions_write``; MySQL: a CALL of the procedure of that
name) and every read one (MySQL: a CALL of ``agent_sessions_read``, and the pool's connection goes back to it
without a ROLLBACK: the CALL left no transaction open), so a run's start is two (the acquire, the save of its
new input), its usual step one (the save, whose answer carries the cancel flag; on PostgreSQL a cancel is
pushed besides), two with a non-idempotent tool (the journal's write, then the save), and the events ride in
the save."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, make_url

import agent_sessions as agent
from stores import mysql
from tests import servers

from .counting import CountingModel, charge, look
from .proxy import FaultProxy

DATABASE = "faulttrips"
"""This module's database."""


@pytest.fixture(scope="module", params=["postgres", "mysql"])
def database(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Engine]]:
    """Each SQL server in turn (the proxy fixture stands in front of it)."""
    base = servers.POSTGRES_URL if request.param == "postgres" else servers.MYSQL_URL
    url = servers.database_url(base, servers.database_name(DATABASE))
    direct = create_engine(url)
    servers.fresh_schema(direct)
    yield request.param, url, direct
    direct.dispose()


@pytest.fixture
def via(database: tuple[str, str, Engine], proxy: FaultProxy) -> Iterator[Any]:
    url = make_url(database[1]).set(port=proxy.port).render_as_string(hide_password=False)
    store = servers.postgres_store(url) if database[0] == "postgres" else servers.mysql_store(url)
    yield store
    store.close()
    store.engine.dispose()


@pytest.fixture
def mysql_via(database: tuple[str, str, Engine], via: Any) -> mysql.Store:
    if database[0] != "mysql":
        pytest.skip("MySQL's pool reset, which PostgreSQL's driver does not send for an idle connection")
    assert isinstance(via, mysql.Store)
    return via


def _run(store: agent.Store, proxy: FaultProxy, tool: agent.Tool, publish: bool) -> list[int]:
    sid = f"rt-{uuid.uuid4().hex[:12]}"
    model = CountingModel(tool.name, proxy, 20)
    spec = agent.Spec(session=agent.open(sid, store), tools=[tool], max_steps=21, publish_events=publish)
    proxy.statements.clear()
    agent.Runner().run(spec, [agent.Message.user("go")], model)
    return model.seen


@pytest.mark.parametrize(("tool", "publish", "step"), [(look, False, 1), (charge, False, 2), (look, True, 1)])
def test_a_runs_start_is_two_round_trips_and_its_usual_step_one(
    via: agent.Store, proxy: FaultProxy, tool: agent.Tool, publish: bool, step: int
) -> None:
    """A first run opens the store's connections (PostgreSQL: also the one that listens for cancels;
    MySQL: reads the server's packet limit); the second is counted."""
    _run(via, proxy, tool, publish)
    seen = _run(via, proxy, tool, publish)
    steps = [b - a for a, b in itertools.pairwise(seen)]
    assert seen[0] == 2, proxy.statements[:seen[0]]
    assert steps == [step] * len(steps), (steps, proxy.statements)


def test_a_traced_engine_sees_each_call_and_pays_the_pools_rollback(
    mysql_via: mysql.Store, proxy: FaultProxy
) -> None:
    """While something listens for the engine's cursor events the store's calls go through SQLAlchemy's
    Connection, so the listener sees them, and the pool's ROLLBACK is sent at each check-in."""
    heard: list[str] = []

    def hear(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        heard.append(statement)

    mysql_via.save("warm", [agent.Message.user("q")])
    event.listen(mysql_via.engine, "before_cursor_execute", hear)
    try:
        proxy.statements.clear()
        mysql_via.save("traced", [agent.Message.user("q")])
    finally:
        event.remove(mysql_via.engine, "before_cursor_execute", hear)
    assert [s.split("(")[0] for s in heard] == ["CALL agent_sessions_write"], heard
    assert len(proxy.statements) == 2 and proxy.statements[1].upper().startswith("ROLLBACK"), proxy.statements


def test_a_read_is_one_round_trip_and_a_write_another(
    mysql_via: mysql.Store, proxy: FaultProxy
) -> None:
    """A read is one CALL, a write one CALL, and neither is followed by the pool's ROLLBACK."""
    msgs = [agent.Message.user("q"), agent.Message.assistant("a")]
    mysql_via.save("one-trip", msgs[:1])
    proxy.statements.clear()
    assert mysql_via.messages("one-trip") == msgs[:1]
    mysql_via.add_steer("one-trip", "s")
    assert [s.split("(")[0] for s in proxy.statements] == ["CALL agent_sessions_read", "CALL agent_sessions_write"]
