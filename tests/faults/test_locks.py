"""Issue #25, item 1: a worker that goes silent inside a transaction holding the session's row lock (here:
frozen by the fault proxy just before the COMMIT of its lease acquisition, no FIN, no RST) wedges nobody.
Another worker's acquisition and cancel wait at most ``lock_wait`` and say why (``SessionLocked``); on
MySQL the session is free again once the connection goes. The PostgreSQL store holds no transaction open
across a round trip (each write is one statement), so there the silent worker is another client's
transaction that locked the session's row: the store's writes wait at most ``lock_wait`` for it, and go
through once it ends."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

import agent_sessions as agent
from agent_sessions.lease import Lease
from stores import mysql, postgres

from .proxy import FaultProxy

LOCK_WAIT = 1.0
IDLE = 3.0


DATABASE = "faultlocks"
"""This module's database (conftest.py's ``database`` fixture)."""


def _store(database: tuple[str, str, Engine], port: int | None = None) -> agent.RunStore:
    url = make_url(database[1])
    engine = create_engine(url if port is None else url.set(port=port), pool_size=2)
    if database[0] == "postgres":
        return postgres.Store(engine, lock_wait=LOCK_WAIT, transaction_timeout=IDLE)
    return mysql.Store(engine, lock_wait=LOCK_WAIT, transaction_timeout=IDLE)


def _close(store: agent.RunStore) -> None:
    getattr(store, "close", store.engine.dispose)()  # type: ignore[attr-defined]


def _locker(database: tuple[str, str, Engine], proxy: FaultProxy, sid: str) -> threading.Thread:
    """Another client's transaction, through ``proxy``, that locks the session's row and goes silent."""
    engine = create_engine(make_url(database[1]).set(port=proxy.port), poolclass=NullPool)
    locked = threading.Event()

    def lock() -> None:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1 FROM agent_sessions WHERE session_id = :s FOR UPDATE"), {"s": sid})
                locked.set()
                proxy.closing.wait(30)  # silent, idle in its transaction, until the proxy goes
        except Exception:  # noqa: BLE001 - its connection is cut: what the test does to it
            pass
        finally:
            engine.dispose()

    worker = threading.Thread(target=lock, daemon=True)
    worker.start()
    assert locked.wait(10)
    return worker


@pytest.fixture
def frozen(database: tuple[str, str, Engine]) -> Iterator[tuple[str, FaultProxy, threading.Thread]]:
    """A session whose row a worker has locked: another client's transaction (the stores' own writes are one
    call each, their transactions inside it)."""
    sid = f"lock-{uuid.uuid4().hex[:12]}"
    proxy = FaultProxy(database[0], int(make_url(database[1]).port or 0)).start()
    silent = _store(database, proxy.port)
    silent.save(sid, [agent.Message.user("hi")])
    worker = _locker(database, proxy, sid)  # the stores' own writes hold no transaction across a round trip
    try:
        yield sid, proxy, worker
    finally:
        proxy.close()
        worker.join(10)
        assert not worker.is_alive()
        _close(silent)


def test_another_acquisition_waits_at_most_lock_wait_and_says_why(
    database: tuple[str, str, Engine], frozen: tuple[str, FaultProxy, threading.Thread]
) -> None:
    sid = frozen[0]
    other = _store(database)
    try:
        started = time.monotonic()
        with pytest.raises(agent.SessionLocked, match="lock_wait"):
            with Lease(other, sid, ttl=30, wait=0.5):
                pass
        assert time.monotonic() - started < LOCK_WAIT + 0.5 + 2.5
    finally:
        _close(other)


def test_a_cancel_beside_the_silent_worker_is_bounded(
    database: tuple[str, str, Engine], frozen: tuple[str, FaultProxy, threading.Thread]
) -> None:
    sid = frozen[0]
    other = _store(database)
    try:
        started = time.monotonic()
        with pytest.raises(agent.SessionLocked):  # its cancel gives up at lock_wait
            other.cancel(sid)
        assert time.monotonic() - started < LOCK_WAIT + 2.5
    finally:
        _close(other)


def test_the_session_is_free_again_once_the_silent_transaction_is_ended(
    database: tuple[str, str, Engine], frozen: tuple[str, FaultProxy, threading.Thread]
) -> None:
    sid, proxy, _ = frozen
    other = _store(database)
    try:
        proxy.cut_all()  # the silent transaction's connection goes, and the server ends it
        started = time.monotonic()
        with Lease(other, sid, ttl=30, wait=IDLE + 5) as lease:
            assert lease.holder.token != "s" * 32
        assert time.monotonic() - started < IDLE + 5
    finally:
        _close(other)
