"""Schema 1 is the only schema (nothing was released before it): a database of another one is refused with a
typed error, ``SchemaMismatch``, before anything is read or written, and never taken for an empty database.
The DDL of an earlier development schema (4) is kept in tests/upgrade/ as that version exported it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DBAPIError

import agent_sessions as agent
from stores import mysql, postgres, sqlite
from stores._sql import SCHEMA_VERSION, SchemaMismatch
from stores._sql.tables import TABLES
from tests import servers

OLD = Path(__file__).parent / "upgrade"


def _statements(path: Path) -> list[str]:
    return [s.strip() for s in path.read_text().split(";\n") if s.strip()]


def test_schema_1_is_the_only_schema_and_a_typed_store_error() -> None:
    assert SCHEMA_VERSION == 1 and issubclass(SchemaMismatch, agent.StoreError)
    assert sqlite.SchemaMismatch is mysql.SchemaMismatch is postgres.SchemaMismatch is SchemaMismatch


def test_a_sqlite_file_of_an_earlier_schema_is_refused_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        for statement in _statements(OLD / "schema4.sqlite.sql"):
            conn.exec_driver_sql(statement)
        conn.exec_driver_sql("INSERT INTO agent_sessions (session_id, version) VALUES ('kept', 'v1')")
    engine.dispose()
    with pytest.raises(SchemaMismatch, match="earlier version"):
        sqlite.open(path)
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:  # nothing was changed
        assert conn.exec_driver_sql("SELECT session_id FROM agent_sessions").scalars().all() == ["kept"]
        assert conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE name = 'agent_store'").first() is None
    engine.dispose()


def test_a_sqlite_file_of_another_schema_version_is_refused_at_its_first_operation(tmp_path: Path) -> None:
    path = tmp_path / "next.db"
    sqlite.open(path).close()
    store = sqlite.open(path)
    store.save("s", [agent.Message.user("kept")])
    store.close()
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE agent_store SET schema_version = 2")
    later = sqlite.open(path)
    with pytest.raises(SchemaMismatch, match="schema 2"):
        later.messages("s")
    later.close()


@pytest.fixture(params=["postgres", "mysql"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    base = servers.POSTGRES_URL if request.param == "postgres" else servers.MYSQL_URL
    made = create_engine(servers.database_url(base, servers.database_name("schema")))
    servers.fresh_schema(made)
    yield made
    made.dispose()


def test_a_server_database_of_another_schema_version_is_refused_and_left_alone(engine: Engine) -> None:
    make = postgres.Store if engine.dialect.name == "postgresql" else mysql.Store
    make(engine).save("s", [agent.Message.user("kept")])  # its first operation writes agent_store: schema 1
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT schema_version FROM agent_store").scalar_one() == 1
        conn.exec_driver_sql("UPDATE agent_store SET schema_version = 7")
    with pytest.raises(SchemaMismatch, match="schema 7"):
        make(engine).save("s", [agent.Message.user("lost")])
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE agent_store SET schema_version = 1")
    assert make(engine).messages("s") == [agent.Message.user("kept")]


def test_the_tables_are_those_of_schema_1() -> None:
    assert [t.name for t in TABLES] == ["agent_store", "agent_sessions", "agent_messages", "agent_steers",
                                        "agent_queue", "agent_keys", "agent_events", "agent_metadata"]


def test_a_postgres_database_of_an_earlier_schema_is_refused_by_schema_and_the_store() -> None:
    """An earlier development schema's tables are another layout: ``postgres.SCHEMA`` refuses to run over them
    (``CREATE TABLE IF NOT EXISTS`` would leave them, and no write could use them), and a store on such a
    database raises ``SchemaMismatch`` at its first operation; nothing is changed."""
    engine = create_engine(servers.database_url(servers.POSTGRES_URL, servers.database_name("earlier")))
    try:
        with engine.begin() as conn:
            for table in ("agent_session_tags", "agent_steer_keys", *(t.name for t in TABLES)):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table} CASCADE")
            for statement in _statements(OLD / "schema4.postgres.sql"):
                conn.exec_driver_sql(statement)
            conn.exec_driver_sql("INSERT INTO agent_sessions (session_id, version) VALUES ('kept', 'v1')")
        with pytest.raises(DBAPIError, match="holds the tables of an earlier version"), engine.begin() as conn:
            conn.exec_driver_sql(postgres.SCHEMA)
        with pytest.raises(SchemaMismatch, match="earlier version"):
            postgres.Store(engine).save("s", [agent.Message.user("lost")])
        with pytest.raises(SchemaMismatch, match="earlier version"):
            postgres.Store(engine).messages("kept")
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT session_id FROM agent_sessions").scalars().all() == ["kept"]
            assert conn.exec_driver_sql("SELECT to_regclass('agent_store')").scalar() is None
    finally:
        engine.dispose()
