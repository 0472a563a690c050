from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, make_url

import agent_sessions as agent
import storetest
from stores import postgres
from tests import servers
from tests.sql_helpers import statements_of


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    servers.create_database(servers.POSTGRES_URL)
    engine = create_engine(servers.POSTGRES_URL, pool_size=8, max_overflow=12)
    servers.fresh_schema(engine)
    yield engine
    engine.dispose()


class TestPostgresStoreKeepsTheContract(storetest.StoreContract):
    @pytest.fixture(autouse=True)
    def _engine(self, engine: Engine) -> None:
        self.engine = engine

    def make_store(self) -> postgres.Store:
        return postgres.Store(self.engine)

    def process_factory(self) -> functools.partial[postgres.Store]:
        return functools.partial(servers.postgres_store, servers.POSTGRES_URL)


def test_an_appending_save_writes_only_the_new_messages(engine: Engine) -> None:
    store = postgres.Store(engine)
    msgs = [agent.Message.user(f"m{i}") for i in range(100)]
    store.save("append-only", msgs)
    with statements_of(engine) as seen:
        store.save("append-only", [*msgs, agent.Message.assistant("new")])
    assert [rows for sql, rows in seen if sql.startswith("INSERT INTO agent_messages")] == [1]
    assert not [sql for sql, _ in seen if sql.startswith("DELETE")]


def test_schema_is_one_string_and_keeps_json_as_text() -> None:
    assert isinstance(postgres.SCHEMA, str)
    assert "JSON" not in postgres.SCHEMA.upper()
    assert "body TEXT" in postgres.SCHEMA


def test_missing_tables_are_a_store_error_pointing_at_schema() -> None:
    url = make_url(servers.POSTGRES_URL).set(database="agent_sessions_empty")
    servers.create_database(url.render_as_string(hide_password=False))
    empty = create_engine(url)
    try:
        with pytest.raises(agent.StoreError, match=r"table 'agent_steers' does not exist.*postgres\.SCHEMA"):
            postgres.Store(empty).take_steers("s")
        with pytest.raises(agent.StoreError, match="agent_sessions"):
            postgres.Store(empty).save("s", [agent.Message.user("x")])
    finally:
        empty.dispose()


def test_the_store_takes_an_engine_not_a_url() -> None:
    with pytest.raises(agent.ArgumentError, match="needs a SQLAlchemy Engine for PostgreSQL"):
        postgres.Store(servers.POSTGRES_URL)  # type: ignore[arg-type]
