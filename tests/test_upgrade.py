"""A database of an older schema, with data in it, upgrades with the exported statements, keeps every
byte, and then works: a crashed run's journal is replayed, a held lease is still held, waiting steers are
delivered, and the sessions already there are listed, described, and log their runs' events. Schema 1 is
agent-sessions 0.1's (leases in agent_runs, journals in agent_journals), which upgrades through 2 and 3 to
4; schema 2 has both on the session's row, 3 adds created, updated, metadata, the tags table and the
event log, 4 the steer keys table (a steer sent again with its key is stored once), and 5 the queue table
(messages left for a busy session: Runner.turn(if_busy="queue")).

The data is written as the old version wrote it (its rows and documents, inserted directly); the old DDL
is kept in tests/upgrade/ as that version exported it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.exc import DBAPIError

import agent_sessions as agent
from agent_sessions.journal import UNKNOWN_OUTCOME, Journal, fingerprint
from stores import mysql, postgres, sqlite
from stores._sql import SCHEMA_VERSION
from storetest.scripted import ToolsThenAnswer
from storetest.stranded import stranded_ids
from storetest.strategies import ODD_JSON
from tests import servers

OLD = Path(__file__).parent / "upgrade"

TALK = [
    agent.Message.user("look at lease.go"),
    agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "read_file", ODD_JSON)]),
    agent.Message(agent.Role.USER, [agent.Content.tool_result("c1", "package lease ü 😀")]),
    agent.Message.assistant("it renews late"),
]
CRASHED = [agent.Message.user("charge the card")]
REPLY = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("call_0_0", "charge", '{"n": 0}')])
JOURNAL = Journal(1, fingerprint(CRASHED), REPLY, started=["call_0_0"]).to_json()


@agent.tool(idempotent=False)
def charge(n: int) -> str:
    """Must not run again after the upgrade: the journal says it started."""
    raise AssertionError("the journalled call ran again")


def _rows() -> dict[str, list[dict[str, Any]]]:
    """The rows 0.1 kept for: a finished conversation with two steers waiting, a run that crashed inside a
    non-idempotent tool (its journal), and a live lease."""
    far = time.time() + 3600
    return {
        "agent_sessions": [{"session_id": "talk", "version": uuid.uuid4().hex},
                           {"session_id": "crashed", "version": uuid.uuid4().hex}],
        "agent_messages": [{"session_id": "talk", "seq": i, "body": m.to_json()} for i, m in enumerate(TALK)]
        + [{"session_id": "crashed", "seq": 0, "body": CRASHED[0].to_json()}],
        "agent_steers": [{"session_id": "talk", "text": "first ✓"}, {"session_id": "talk", "text": "second"}],
        "agent_journals": [{"session_id": "crashed", "body": JOURNAL}],
        "agent_runs": [{"session_id": "held", "host": "web-3", "pid": 4121, "token": "f" * 32, "expires": far,
                        "cancelled": False}],
    }


def _rows2() -> dict[str, list[dict[str, Any]]]:
    """The same sessions as schema 2 kept them: the journal and the lease on the session's row."""
    old = _rows()
    run = old["agent_runs"][0]
    return {
        "agent_sessions": [{"session_id": "talk", "version": uuid.uuid4().hex},
                           {"session_id": "crashed", "version": uuid.uuid4().hex, "journal": JOURNAL},
                           {"session_id": "held", "token": run["token"], "host": run["host"], "pid": run["pid"],
                            "expires": run["expires"], "epoch": 1, "cancelled": False}],
        "agent_messages": old["agent_messages"],
        "agent_steers": old["agent_steers"],
    }


def _rows_of(schema: int) -> dict[str, list[dict[str, Any]]]:
    """What a database of ``schema`` (2 or later) holds: ``_rows2``, and from schema 4 on a steer's key too (the
    steer delivered, its key kept)."""
    rows = _rows2()
    if schema >= 4:
        rows["agent_steer_keys"] = [{"session_id": "talk", "steer_key": "req-1"}]
    return rows


def _check_queue(store: Any, schema: int) -> None:
    """After the upgrade to 5: a steer key the database kept still holds, and a message queued for a
    session is taken into its transcript, under its key."""
    assert store.add_steer_once("talk", "sent again", "req-1") is (schema < 4)
    assert store.enqueue("queued", "queued-1", "one more question") == 1
    holder = store.acquire("queued", agent.Holder("upgrade", 1, uuid.uuid4().hex, 0.0), 60)
    assert store.take_queued("queued", holder) == agent.Message.user("one more question", key="queued-1")
    store.release("queued", holder)
    assert store.messages("queued") == [agent.Message.user("one more question", key="queued-1")]
    assert store.queued("queued") == [] and store.enqueue("queued", "queued-1", "one more question") == 0


def _check_lifecycle(store: agent.LifecycleStore) -> None:
    """The sessions that were there are dated by the upgrade (none counts as idle before it), listed, and
    take metadata; prune leaves them."""
    talk = store.info("talk")
    assert talk is not None and talk.messages == len(TALK) and dict(talk.metadata) == {}
    assert talk.created <= talk.updated and abs(talk.created.timestamp() - time.time()) < 600
    assert {s.id for s in store.list_sessions()} == {"talk", "crashed", "held", "new"}
    assert store.tail("talk", 2) == TALK[-2:]
    store.set_metadata("talk", {"user": "u-1"})
    assert [s.id for s in store.list_sessions(where={"user": "u-1"})] == ["talk"]
    assert store.prune(idle_for=3600) == 0
    assert store.messages("talk") == TALK


def _check_events(store: agent.EventStore, engine: Engine) -> None:
    """The event log came with the upgrade: its table is there, a session that was there before logs a
    run's events, and deleting the session takes them."""
    assert {"agent_events"} <= set(inspect(engine).get_table_names())
    assert store.events("crashed", 0, 100) == []
    session = agent.open("crashed", store)
    agent.Runner().run(agent.Spec(session=session, publish_events=True),
                       [*session.messages(), agent.Message.user("again")], ToolsThenAnswer([]))
    logged = store.events("crashed", 0, 100)
    assert [e.kind for e in logged] == ["step_started", "model_response", "finished"]
    assert [e.seq for e in logged] == list(range(logged[0].seq, logged[0].seq + 3))
    assert abs(logged[0].seq / 1e6 - time.time()) < 600  # the first number is the database's clock
    assert session.delete() is True and store.events("crashed", 0, 100) == []


def _check(store: agent.RunStore) -> None:
    assert store.messages("talk") == TALK
    assert store.messages("talk")[1].tool_calls[0].arguments == ODD_JSON  # byte for byte
    assert store.take_steers("talk") == ["first ✓", "second"]
    assert isinstance(store, agent.SteerKeyStore)  # schema 4: a keyed steer is stored once
    assert store.add_steer_once("talk", "third", "req-3") is True
    assert store.add_steer_once("talk", "third", "req-3") is False
    assert store.take_steers("talk") == ["third"]
    held = store.holder("held")
    assert held is not None and (held.host, held.pid, held.token, held.epoch) == ("web-3", 4121, "f" * 32, 1)
    assert store.messages("held") == []
    assert store.journal("crashed") == JOURNAL
    result = agent.Runner().run(agent.Spec(session=agent.open("crashed", store), tools=[charge]),
                                store.messages("crashed"), ToolsThenAnswer(["charge"]))
    assert result.stop_reason == "answered" and result.steps == 1
    assert store.messages("crashed")[2].content[0].text == UNKNOWN_OUTCOME
    taken = store.acquire("held", agent.Holder("h", 1, "a" * 32, 0.0), 30)
    assert taken.token == "f" * 32  # still held: the lease moved with its expiry
    fresh = agent.Runner().run(agent.Spec(session=agent.open("new", store)), [agent.Message.user("hi")],
                               ToolsThenAnswer([]))
    assert store.messages("new") == fresh.messages


def _insert(engine: Engine, rows: dict[str, list[dict[str, Any]]]) -> None:
    with engine.begin() as conn:
        for table, items in rows.items():
            for row in items:
                columns = ", ".join(row)
                conn.execute(text(f"INSERT INTO {table} ({columns}) VALUES ({', '.join(':' + c for c in row)})"),
                             row)


def _statements(path: Path) -> list[str]:
    return [s.strip() for s in path.read_text().split(";\n") if s.strip()]


def _columns(engine: Engine) -> dict[str, Any]:
    """Each table's columns, primary key and indexes, as the database reports them."""
    found = inspect(engine)
    return {t: ([(c["name"], str(c["type"]), c["nullable"], str(c.get("default"))) for c in found.get_columns(t)],
                found.get_pk_constraint(t)["constrained_columns"],
                sorted((i["name"], tuple(i["column_names"]), bool(i["unique"])) for i in found.get_indexes(t)))
            for t in sorted(found.get_table_names())}


@pytest.fixture(params=["mysql"])  # PostgreSQL: test_a_postgres_database_of_an_earlier_version_is_refused
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Callable[[str], Engine]]]:
    base = servers.POSTGRES_URL if request.param == "postgres" else servers.MYSQL_URL
    engines: list[Engine] = []

    def engine(database: str) -> Engine:
        made = create_engine(servers.database_url(base, database))
        with made.begin() as conn:
            for table in ("agent_journals", "agent_runs", "agent_steers", "agent_messages", "agent_sessions",
                          "agent_session_tags", "agent_events", "agent_steer_keys", "agent_queue"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        engines.append(made)
        return made

    yield request.param, engine
    for made in engines:
        made.dispose()


def _upgraded(server: tuple[str, Callable[[str], Engine]], schema: int, rows: dict[str, list[dict[str, Any]]],
              before: Callable[[Engine], None] = lambda engine: None) -> tuple[Any, Engine]:
    """A server database of ``schema`` with ``rows`` in it, upgraded by each ``MIGRATIONS`` from there to the
    current version (``before`` looks at it first); its schema must be the one ``SCHEMA`` makes. Returns the
    store's module and the database."""
    name, engine = server
    old, new = engine(servers.database_name("upgrade")), engine(servers.database_name("fresh"))
    module = postgres if name == "postgres" else mysql
    with old.begin() as conn:
        for statement in _statements(OLD / f"schema{schema}.{name}.sql"):
            conn.exec_driver_sql(statement)
    _insert(old, rows)
    before(old)
    for version in range(schema + 1, SCHEMA_VERSION + 1):
        with old.begin() as conn:  # PostgreSQL: one transaction; MySQL commits each DDL statement as it goes
            for statement in module.MIGRATIONS[version]:
                conn.exec_driver_sql(statement)
    with new.begin() as conn:
        for statement in [postgres.SCHEMA] if name == "postgres" else mysql.SCHEMA:
            conn.exec_driver_sql(statement)
    assert _columns(old) == _columns(new)  # the upgraded schema is the one SCHEMA makes
    return module, old


def test_a_server_database_of_schema_1_upgrades_with_the_exported_statements(
    server: tuple[str, Callable[[str], Engine]],
) -> None:
    module, old = _upgraded(server, 1, _rows())
    _check(module.Store(old))
    _check_lifecycle(module.Store(old))
    _check_events(module.Store(old), old)


@pytest.mark.parametrize("schema", [2, 3, 4])
def test_a_server_database_of_schema_2_3_or_4_upgrades_to_5_with_the_exported_statements(
    server: tuple[str, Callable[[str], Engine]], schema: int
) -> None:
    """Schema 3's tables take schema 2's rows as they are (created and updated from their defaults)."""

    def before(engine: Engine) -> None:
        assert "agent_queue" not in inspect(engine).get_table_names()
        if schema < 4:
            assert "agent_steer_keys" not in inspect(engine).get_table_names()

    module, old = _upgraded(server, schema, _rows_of(schema), before)
    _check(module.Store(old))
    _check_lifecycle(module.Store(old))
    _check_events(module.Store(old), old)
    _check_queue(module.Store(old), schema)


def test_a_sqlite_file_of_schema_1_is_upgraded_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = create_engine(f"sqlite:///{path}")
    with old.begin() as conn:
        for statement in _statements(OLD / "schema1.sqlite.sql"):
            conn.exec_driver_sql(statement)
    _insert(old, _rows())
    old.dispose()
    store = sqlite.open(path)
    fresh = sqlite.open(tmp_path / "new.db")
    assert _columns(store.engine) == _columns(fresh.engine)
    _check(store)
    _check_lifecycle(store)
    _check_events(store, store.engine)
    store.close()
    reopened = sqlite.open(path)  # a second open finds nothing to upgrade
    assert reopened.messages("talk") == TALK
    reopened.close()
    fresh.close()


@pytest.mark.parametrize("schema", [2, 3, 4])
def test_a_sqlite_file_of_schema_2_3_or_4_is_upgraded_to_5_when_opened(tmp_path: Path, schema: int) -> None:
    path = tmp_path / "old.db"
    old = create_engine(f"sqlite:///{path}")
    with old.begin() as conn:
        for statement in _statements(OLD / f"schema{schema}.sqlite.sql"):
            conn.exec_driver_sql(statement)
        conn.exec_driver_sql(f"PRAGMA user_version = {schema}")  # as that schema's open left it
    _insert(old, _rows_of(schema))
    old.dispose()
    store, fresh = sqlite.open(path), sqlite.open(tmp_path / "new.db")
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA user_version").scalar() == 5
    assert _columns(store.engine) == _columns(fresh.engine)
    _check(store)
    _check_lifecycle(store)
    _check_events(store, store.engine)
    _check_queue(store, schema)
    store.close()
    fresh.close()
    reopened = sqlite.open(path)  # a second open finds nothing to upgrade
    assert reopened.messages("talk") == TALK and reopened.info("talk") is not None
    reopened.close()


def _rows4() -> dict[str, list[dict[str, Any]]]:
    """Schema 4's rows: a finished conversation, a run that crashed inside a non-idempotent tool (stranded:
    its user's message has no answer, and nobody holds it), and a live lease."""
    return {table: rows for table, rows in _rows2().items() if table != "agent_steers"}


def _check_stranded(store: agent.LifecycleStore) -> None:
    """The upgrade marks every session with a transcript as open (too many, never too few): the first sweep
    finishes the crashed turn, without running its started call again, and clears the finished one; the
    held one is not listed (a live run holds it, and it has no transcript). The second sweep finds none."""
    found = set(stranded_ids(store))
    assert {"talk", "crashed"} <= found and "held" not in found

    def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint]:
        return agent.Spec(tools=[charge]), ToolsThenAnswer(["charge"])

    done = {r.session: r for r in agent.recover(store, resolve, grace=0)}
    assert done["talk"].outcome == "finished" and done["crashed"].outcome == "recovered", done
    assert store.messages("crashed")[2].content[0].text == UNKNOWN_OUTCOME
    assert store.messages("crashed")[-1].role is agent.Role.ASSISTANT
    assert store.messages("talk") == TALK
    assert not {"talk", "crashed"} & set(stranded_ids(store))


def test_a_server_database_of_schema_4_upgrades_to_5_and_the_first_sweep_finds_the_stranded_turn(
    server: tuple[str, Callable[[str], Engine]],
) -> None:
    module, old = _upgraded(server, 4, _rows4())
    _check_stranded(module.Store(old))


def test_a_sqlite_file_of_schema_4_is_upgraded_to_5_and_the_first_sweep_finds_the_stranded_turn(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    old = create_engine(f"sqlite:///{path}")
    with old.begin() as conn:
        for statement in _statements(OLD / "schema4.sqlite.sql"):
            conn.exec_driver_sql(statement)
        conn.exec_driver_sql("PRAGMA user_version = 4")
    _insert(old, _rows4())
    old.dispose()
    store, fresh = sqlite.open(path), sqlite.open(tmp_path / "new.db")
    assert _columns(store.engine) == _columns(fresh.engine)
    _check_stranded(store)
    store.close()
    fresh.close()


def test_a_postgres_database_of_an_earlier_version_is_refused_by_schema_and_the_store() -> None:
    """Schema 1 of the store redesign is another layout, with no migration from the earlier ones: ``SCHEMA``
    refuses to run over an earlier version's tables (``CREATE TABLE IF NOT EXISTS`` would leave them, and
    no write could use them), a store on such a database points at ``SCHEMA``, and the data is untouched."""
    engine = create_engine(servers.database_url(servers.POSTGRES_URL, servers.database_name("upgrade")))
    try:
        with engine.begin() as conn:
            for table in ("agent_store", "agent_keys", "agent_metadata", "agent_journals", "agent_runs",
                          "agent_steers", "agent_messages", "agent_sessions", "agent_session_tags", "agent_events",
                          "agent_steer_keys", "agent_queue"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table} CASCADE")
            for statement in _statements(OLD / "schema4.postgres.sql"):
                conn.exec_driver_sql(statement)
        _insert(engine, _rows4())
        with pytest.raises(DBAPIError, match="holds the tables of an earlier version"), engine.begin() as conn:
            conn.exec_driver_sql(postgres.SCHEMA)
        store = postgres.Store(engine)
        with pytest.raises(agent.StoreError, match=r"postgres\.SCHEMA"):
            store.messages("talk")
        with pytest.raises(agent.StoreError, match=r"postgres\.SCHEMA"):
            store.save("another", [agent.Message.user("hi")])
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM agent_messages WHERE session_id = 'talk'")).scalar() == 4
            assert "agent_store" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
