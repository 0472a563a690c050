"""The fault proxy itself, on real PostgreSQL and MariaDB through the drivers the stores use: it passes
everything through unchanged (prepared statements included), and each fault does what it says at the
statement it was armed for. (What the library does under these faults is tested elsewhere.)"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.exc import DBAPIError

from tests import servers

from .proxy import FaultProxy, Rule


@pytest.fixture(scope="module", params=["postgres", "mysql"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Engine]]:
    name = request.param
    base = servers.POSTGRES_URL if name == "postgres" else servers.MYSQL_URL
    url = servers.database_url(base, servers.database_name("faultproxy"))
    direct = create_engine(url)
    with direct.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS proxy_t")
        conn.exec_driver_sql("CREATE TABLE proxy_t (k VARCHAR(64) PRIMARY KEY, v INTEGER)")
    yield name, url, direct
    with direct.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS proxy_t")
    direct.dispose()


@pytest.fixture
def proxy(backend: tuple[str, str, Engine]) -> Iterator[FaultProxy]:
    name, url, direct = backend

    def terminate(backend_id: int) -> None:
        with direct.connect() as conn:
            if name == "postgres":
                conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": backend_id})
            else:
                conn.exec_driver_sql(f"KILL CONNECTION {int(backend_id)}")

    with FaultProxy(name, int(make_url(url).port or 0), terminate) as p:
        yield p


def _via(backend: tuple[str, str, Engine], proxy: FaultProxy, **options: Any) -> Engine:
    url = make_url(backend[1]).set(port=proxy.port)
    return create_engine(url, pool_pre_ping=False, **options)


def _stored(backend: tuple[str, str, Engine], key: str) -> int | None:
    with backend[2].connect() as conn:
        return conn.execute(text("SELECT v FROM proxy_t WHERE k = :k"), {"k": key}).scalar()


def _insert(engine: Engine, key: str, value: int = 1) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO proxy_t (k, v) VALUES (:k, :v)"), {"k": key, "v": value})


def test_everything_passes_through_unchanged(backend: tuple[str, str, Engine], proxy: FaultProxy) -> None:
    engine = _via(backend, proxy)
    try:
        key = uuid.uuid4().hex
        _insert(engine, key, 7)
        with engine.connect() as conn:
            for i in range(8):  # psycopg prepares a statement on the server from its fifth use on
                got = conn.execute(text("SELECT v + :i FROM proxy_t WHERE k = :k"), {"i": i, "k": key}).scalar()
                assert got == 7 + i
            rows = conn.execute(text("SELECT k FROM proxy_t")).all()
            assert (key,) in [tuple(r) for r in rows]
        assert any("INSERT INTO proxy_t" in s for s in proxy.statements)
        assert sum("SELECT v +" in s for s in proxy.statements) == 8, proxy.statements
        assert not proxy.log
    finally:
        engine.dispose()


def test_a_lost_acknowledgement_of_a_commit_leaves_it_committed(
    backend: tuple[str, str, Engine], proxy: FaultProxy
) -> None:
    engine = _via(backend, proxy)
    try:
        key = uuid.uuid4().hex
        rule = proxy.arm(Rule("lose_ack", r"^\s*COMMIT"))
        with pytest.raises(DBAPIError):
            _insert(engine, key)
        assert rule.fired and _stored(backend, key) == 1
        _insert(engine, key + "-after")  # the pool's next connection is a fresh one
        assert _stored(backend, key + "-after") == 1
    finally:
        engine.dispose()


@pytest.mark.parametrize("fault", ["cut_before", "cut_inside", "terminate"])
def test_a_statement_cut_before_or_inside_or_terminated_does_not_happen(
    backend: tuple[str, str, Engine], proxy: FaultProxy, fault: str
) -> None:
    engine = _via(backend, proxy)
    try:
        key = uuid.uuid4().hex
        rule = proxy.arm(Rule(fault, "INSERT INTO proxy_t"))
        with pytest.raises(DBAPIError):
            _insert(engine, key)
        assert rule.fired and _stored(backend, key) is None
    finally:
        engine.dispose()


def test_cut_after_delivers_the_answer_then_the_next_statement_fails(
    backend: tuple[str, str, Engine], proxy: FaultProxy
) -> None:
    engine = _via(backend, proxy)
    try:
        key = uuid.uuid4().hex
        _insert(engine, key, 3)
        proxy.arm(Rule("cut_after", "SELECT v FROM proxy_t"))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT v FROM proxy_t WHERE k = :k"), {"k": key}).scalar() == 3
            with pytest.raises(DBAPIError):
                conn.execute(text("SELECT 1")).scalar()
    finally:
        engine.dispose()


def test_the_nth_match_is_the_one(backend: tuple[str, str, Engine], proxy: FaultProxy) -> None:
    engine = _via(backend, proxy)
    try:
        keys = [uuid.uuid4().hex for _ in range(3)]
        rule = proxy.arm(Rule("cut_before", "INSERT INTO proxy_t", nth=2))
        _insert(engine, keys[0])
        with pytest.raises(DBAPIError):
            _insert(engine, keys[1])
        _insert(engine, keys[2])
        assert [_stored(backend, k) for k in keys] == [1, None, 1] and len(rule.fired) == 1
    finally:
        engine.dispose()


def test_delay_holds_the_statement(backend: tuple[str, str, Engine], proxy: FaultProxy) -> None:
    engine = _via(backend, proxy)
    try:
        proxy.arm(Rule("delay", "SELECT 42", seconds=0.4))
        started = time.monotonic()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 42")).scalar() == 42
        assert time.monotonic() - started >= 0.4
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", ["freeze", "partition"])
def test_a_frozen_or_partitioned_connection_hangs_until_released(
    backend: tuple[str, str, Engine], proxy: FaultProxy, how: str
) -> None:
    engine = _via(backend, proxy)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1")).scalar()  # connected before the fault
            if how == "freeze":
                proxy.arm(Rule("freeze", "SELECT 43"))
                release = proxy.thaw
            else:
                proxy.partition()
                release = proxy.heal
            timer = threading.Timer(0.5, release)
            timer.start()
            started = time.monotonic()
            assert conn.execute(text("SELECT 43")).scalar() == 43
            timer.join(5)
            assert time.monotonic() - started >= 0.45
    finally:
        engine.dispose()
