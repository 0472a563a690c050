from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, make_url

import agent_sessions as agent
import storetest
from stores import mysql
from tests import servers
from tests.sql_helpers import statements_of


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    servers.create_database(servers.MYSQL_URL)
    engine = create_engine(servers.MYSQL_URL, pool_size=8, max_overflow=12)
    servers.fresh_schema(engine)
    yield engine
    engine.dispose()


class TestMySQLStoreKeepsTheContract(storetest.StoreContract):
    @pytest.fixture(autouse=True)
    def _engine(self, engine: Engine) -> None:
        self.engine = engine

    def make_store(self) -> mysql.Store:
        return mysql.Store(self.engine)

    def process_factory(self) -> functools.partial[mysql.Store]:
        return functools.partial(servers.mysql_store, servers.MYSQL_URL)


def test_an_appending_save_writes_only_the_new_messages(engine: Engine) -> None:
    store = mysql.Store(engine)
    msgs = [agent.Message.user(f"m{i}") for i in range(100)]
    store.save("append-only", msgs)
    with statements_of(engine) as seen:
        store.save("append-only", [*msgs, agent.Message.assistant("new")])
    assert [rows for sql, rows in seen if sql.startswith("INSERT INTO agent_messages")] == [1]
    assert not [sql for sql, _ in seen if sql.startswith("DELETE")]


def test_schema_is_a_list_and_keeps_json_as_longtext() -> None:
    assert isinstance(mysql.SCHEMA, list) and all(isinstance(s, str) for s in mysql.SCHEMA)
    assert not [s for s in mysql.SCHEMA if " JSON" in s.upper()]
    assert any("body LONGTEXT" in s for s in mysql.SCHEMA)


def test_take_steers_uses_no_mariadb_only_sql(engine: Engine) -> None:
    store = mysql.Store(engine)
    store.add_steer("portable", "x")
    with statements_of(engine) as seen:
        assert store.take_steers("portable") == ["x"]
    assert not [sql for sql, _ in seen if "RETURNING" in sql.upper()]
    assert any("FOR UPDATE" in sql for sql, _ in seen)


def test_missing_tables_are_a_store_error_pointing_at_schema() -> None:
    url = make_url(servers.MYSQL_URL).set(database="agent_sessions_empty")
    servers.create_database(url.render_as_string(hide_password=False))
    empty = create_engine(url)
    try:
        with pytest.raises(agent.StoreError, match=r"table 'agent_steers' does not exist.*mysql\.SCHEMA"):
            mysql.Store(empty).take_steers("s")
        with pytest.raises(agent.StoreError, match="agent_sessions"):
            mysql.Store(empty).save("s", [agent.Message.user("x")])
    finally:
        empty.dispose()


def test_the_store_takes_an_engine_not_a_url() -> None:
    with pytest.raises(agent.ArgumentError, match="needs a SQLAlchemy Engine for MySQL or MariaDB"):
        mysql.Store(servers.MYSQL_URL)  # type: ignore[arg-type]
