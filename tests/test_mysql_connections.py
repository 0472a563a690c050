"""The MySQL store when the server has dropped the pool's idle connections (KILL, ``wait_timeout``), refuses
new ones (the account's connection limit), or the pool has none to give: a leased run's next step, the
first to need a connection of its own, completes or fails with a ``StoreError`` the store raised from the
driver's error, never with the driver's (or the pool's) own; and the step after it completes. Written
against the store's public behaviour: how the store holds its connections is its own business."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text

import agent_sessions as agent
from stores import mysql
from tests import servers

WAIT = 10.0
"""Seconds a test waits for the server to drop a connection it was told to (KILL, ``wait_timeout``)."""


@pytest.fixture(scope="module")
def url() -> str:
    return servers.fresh_database(servers.MYSQL_URL, "myconn")


@pytest.fixture
def admin(url: str) -> Iterator[Engine]:
    engine = create_engine(url, pool_size=1)
    yield engine
    engine.dispose()


@contextmanager
def _store(url: str, **options: Any) -> Iterator[mysql.Store]:
    """A store on an engine of its own (``options``), closed and disposed of at the end."""
    engine = create_engine(url, **options)
    store = mysql.Store(engine)
    try:
        yield store
    finally:
        store.close()
        engine.dispose()


def _run(store: mysql.Store) -> tuple[str, agent.Holder, list[agent.Message]]:
    """A leased session whose transcript the store knows: its next save is a run's usual step."""
    sid = f"conn-{uuid.uuid4().hex[:12]}"
    held = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
    msgs = [agent.Message.user("q")]
    store.save_fenced(sid, held, msgs, take_steers=True)
    return sid, held, msgs


def _step(store: mysql.Store, sid: str, held: agent.Holder, msgs: list[agent.Message]) -> BaseException | None:
    """The run's next step: ``None`` once it is saved, or the ``StoreError`` it failed with (the step is then
    not in ``msgs``); any other exception fails the test."""
    msgs.append(agent.Message.user(f"step {len(msgs)}"))
    try:
        store.save_fenced(sid, held, msgs, take_steers=True)
    except agent.StoreError as exc:
        msgs.pop()
        assert exc.__cause__ is not None, "raised from the driver's error"
        return exc
    return None


def _goes_on(store: mysql.Store, sid: str, held: agent.Holder, msgs: list[agent.Message]) -> None:
    """The run's next steps are saved, and the session holds every step saved."""
    assert _step(store, sid, held, msgs) is None
    assert _step(store, sid, held, msgs) is None
    assert mysql.Store(store.engine).messages(sid) == msgs


def _idle(admin: Engine) -> list[int]:
    """The server's ids of the idle connections to the test database, but the admin's own."""
    with admin.connect() as conn:
        me = conn.execute(text("SELECT CONNECTION_ID()")).scalar_one()
        return [int(row[0]) for row in conn.execute(text(
            "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = DATABASE() AND COMMAND = 'Sleep' AND ID <> :me"
        ), {"me": me})]


def _gone(admin: Engine, ids: list[int]) -> None:
    deadline = time.monotonic() + WAIT
    while set(ids) & set(_idle(admin)):
        assert time.monotonic() < deadline, f"the server did not drop connections {ids} within {WAIT} s"
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["kill", "wait_timeout"])
def test_a_step_after_the_server_dropped_the_idle_connections(url: str, admin: Engine, how: str) -> None:
    with _store(url, pool_size=3) as store:  # no pool_pre_ping: the pool hands out what it has
        sid, held, msgs = _run(store)
        if how == "wait_timeout":  # the store's connection times out one second after its last use
            with store.engine.connect() as conn:
                conn.exec_driver_sql("SET SESSION wait_timeout = 1")
        dropped = _idle(admin)
        assert dropped, "the store's connection is idle in the pool"
        if how == "kill":
            with admin.connect() as conn:
                for thread in dropped:
                    conn.exec_driver_sql(f"KILL CONNECTION {thread}")
        _gone(admin, dropped)
        _step(store, sid, held, msgs)  # saved, or a StoreError
        _goes_on(store, sid, held, msgs)


@pytest.fixture
def limited(url: str, admin: Engine) -> Iterator[str]:
    """The test database's URL for an account of its own that may hold two connections at once."""
    user = f"{servers.PREFIX}_lim"
    account = f"'{user}'@'127.0.0.1'"
    password = uuid.uuid4().hex
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP USER IF EXISTS {account}")
        conn.exec_driver_sql(f"CREATE USER {account} IDENTIFIED BY '{password}' WITH MAX_USER_CONNECTIONS 2")
        conn.exec_driver_sql(f"GRANT ALL ON `{make_url(url).database}`.* TO {account}")
    try:
        yield make_url(url).set(username=user, password=password, host="127.0.0.1").render_as_string(
            hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP USER IF EXISTS {account}")


def test_a_step_at_the_connection_limit_is_a_store_error(limited: str) -> None:
    with _store(limited, pool_size=3) as store:
        sid, held, msgs = _run(store)
        holding = [store.engine.connect() for _ in range(2)]  # the account's two: the store's idle one, a new one
        try:
            error = _step(store, sid, held, msgs)
            assert error is not None and "1226" in str(error), error  # the server refused a third
        finally:
            for conn in holding:
                conn.close()
        _goes_on(store, sid, held, msgs)


def test_a_step_when_the_pool_has_no_connection_to_give_is_a_store_error(url: str) -> None:
    with _store(url, pool_size=2, max_overflow=0, pool_timeout=0.2) as store:
        sid, held, msgs = _run(store)
        holding = [store.engine.connect() for _ in range(2)]  # the whole pool, in the caller's hands
        try:
            error = _step(store, sid, held, msgs)
            assert error is not None, "no connection to save with"
        finally:
            for conn in holding:
                conn.close()
        _goes_on(store, sid, held, msgs)
