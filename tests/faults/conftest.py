"""What the fault tests share: a database of their own per module and server, with the store's tables made
fresh (named from the module's ``DATABASE``), reached directly; each test reaches it through a proxy too
(``proxy``, which a module may define for itself), and a scripted model server over real HTTP (``model``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, make_url

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
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    yield server
    server.close()
