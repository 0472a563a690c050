"""What the fault tests share: a database of their own per module and server, with the store's tables made
fresh (named from the module's ``DATABASE``), reached directly; each test reaches it through a proxy too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine

from tests import servers


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
