"""What the fault tests share: a database of their own per module and server, with the store's tables made
fresh (named from the module's ``DATABASE``), reached directly; each test reaches it through a proxy too
(``proxy``, which a module may define for itself), a store each way (``via_and_direct``), and a scripted
model server over real HTTP (``model``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, make_url

import agent_sessions as agent
from tests import servers
from tests.model_server import ModelServer

from .proxy import FaultProxy


@pytest.fixture(scope="module", params=["postgres", "mysql"])
def database(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Engine]]:
    """(server name, URL, an engine reaching it directly)."""
    name = request.param
    base = servers.POSTGRES_URL if name == "postgres" else servers.MYSQL_URL
    url = servers.database_url(base, servers.database_name(request.module.DATABASE))
    direct = create_engine(url)
    servers.fresh_schema(direct)
    yield name, url, direct
    direct.dispose()


@pytest.fixture
def proxy(database: tuple[str, str, Engine]) -> Iterator[FaultProxy]:
    """A fault proxy in front of the test's database server."""
    with FaultProxy(database[0], int(make_url(database[1]).port or 0)) as p:
        yield p


@pytest.fixture
def via_and_direct(database: tuple[str, str, Engine], proxy: FaultProxy) -> Iterator[tuple[agent.RunStore,
                                                                                           agent.RunStore]]:
    """A store reaching the database through the proxy, and one reaching it directly."""
    url = make_url(database[1]).set(port=proxy.port).render_as_string(hide_password=False)
    make = servers.postgres_store if database[0] == "postgres" else servers.mysql_store
    via, direct = make(url), make(database[1])
    warm = f"warm-{uuid.uuid4().hex}"  # what a store does once (read its limits) is done before a rule is armed
    via.add_steer(warm, "warm")
    assert direct.take_steers(warm) == ["warm"]
    proxy.statements.clear()
    yield via, direct
    for store in (via, direct):
        getattr(store, "close", store.engine.dispose)()


@pytest.fixture
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    yield server
    server.close()
