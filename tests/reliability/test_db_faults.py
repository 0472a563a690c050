"""The database goes away mid-run: its connections are killed (pg_terminate_backend, KILL), or the
server stops and comes back (a proxy in front of it, stopped and restarted). The run fails with a
StoreError saying what happened, the stored transcript is the last one saved, and the next run, once
the server is back, carries on from it. SQLite has no server to lose; its faults are the crash tests'."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text

import agent_sessions as agent
from tests import servers

from . import check, children, figures
from .backends import DATABASE, Backend, prepare
from .proxy import Proxy

STEPS = 5
BLOCKED_AT = 2
INJECTED: dict[str, dict[str, int]] = {}
SAID: dict[str, dict[str, str]] = {}
"""The StoreError each fault gave, per store: what the run reported."""


@pytest.fixture(scope="module", params=["postgres", "mysql", "mongodb"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    backend = prepare(request.param, tmp_path_factory.mktemp(request.param))
    yield backend
    figures.record("database faults", backend.name, injected=INJECTED.get(backend.name, {}),
                   errors=SAID.get(backend.name, {}))


@pytest.fixture
def proxy(server: Backend) -> Iterator[Proxy]:
    p = Proxy(_port(server.url)).start()
    yield p
    p.stop()


def _port(url: str) -> int:
    if url.startswith("mongodb://"):
        return int(url.split("://", 1)[1].split("/", 1)[0].split(":")[1])
    return int(make_url(url).port or 0)


def _via(server: Backend, proxy: Proxy) -> agent.Store:
    """The store a worker would have, reaching the server through the proxy."""
    if server.name == "mongodb":
        url = server.url.replace(f":{_port(server.url)}/", f":{proxy.port}/")
        return servers.mongo_store(url, DATABASE, serverSelectionTimeoutMS=3000, connectTimeoutMS=3000,
                                   socketTimeoutMS=5000)
    url = make_url(server.url).set(port=proxy.port).render_as_string(hide_password=False)
    return (servers.postgres_store if server.name == "postgres" else servers.mysql_store)(url)


def _count(server: Backend, kind: str) -> None:
    INJECTED.setdefault(server.name, {}).setdefault(kind, 0)
    INJECTED[server.name][kind] += 1


def _run_through_fault(server: Backend, store: agent.Store, inject: Callable[[], None],
                       restore: Callable[[], None]) -> str:
    """Run until the tool of step BLOCKED_AT, inject the fault, let the run go on into it; then check what
    is stored, restore, and resume. Returns the StoreError's text."""
    direct = server.factory()
    sid = f"fault-{uuid.uuid4().hex[:12]}"
    entered, go = threading.Event(), threading.Event()

    @agent.tool(name="work")
    def work(k: int) -> str:
        if k == BLOCKED_AT and not go.is_set():
            entered.set()
            go.wait(30)
        return f"result {k}"

    def spec(session_store: agent.Store, **more: Any) -> agent.Spec:
        return agent.Spec(session=agent.open(sid, session_store), tools=[work], max_steps=STEPS * 2,
                          lease_ttl=1.0, **more)

    run = agent.Runner().start(spec(store), [agent.Message.user(children.QUESTION)], children.Steps(STEPS))
    try:
        assert entered.wait(30)
        before = direct.messages(sid)
        inject()
        go.set()
        with pytest.raises(agent.StoreError) as failure:
            run.wait(60)
    finally:
        # Whatever failed above, the run's thread (not a daemon) must end, or pytest could not exit.
        go.set()
        if not run.done():
            run.cancel()
            with contextlib.suppress(Exception):
                run.wait(60)
    after = direct.messages(sid)
    assert after == before, "a failed write changed the stored transcript"
    check.run_transcript(after, STEPS, [], complete=False)
    restore()
    result = agent.Runner().run(spec(store, lease_wait=10), store.messages(sid), children.Steps(STEPS))
    assert result.stop_reason == "answered"
    check.run_transcript(direct.messages(sid), STEPS, [], complete=True)
    return str(failure.value)


def test_connections_killed_mid_run(server: Backend, proxy: Proxy) -> None:
    store = _via(server, proxy)
    if server.name == "postgres":
        def inject() -> None:
            admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                killed = conn.execute(text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": DATABASE}).scalar()
            admin.dispose()
            assert killed, "no connection of the store to terminate"
            _count(server, "pg_terminate_backend")
    elif server.name == "mysql":
        def inject() -> None:
            admin = create_engine(server.url)
            with admin.connect() as conn:
                ids = conn.execute(text("SELECT id FROM information_schema.PROCESSLIST "
                                        "WHERE db = :db AND id <> CONNECTION_ID()"), {"db": DATABASE}).scalars().all()
                for i in ids:
                    conn.execute(text(f"KILL {int(i)}"))
            admin.dispose()
            assert ids, "no connection of the store to kill"
            _count(server, "KILL")
    else:
        def inject() -> None:  # mongoeco has no killOp: cut every connection at the proxy instead
            proxy.stop()
            proxy.start()
            _count(server, "connections reset")
    message = _run_through_fault(server, store, inject, lambda: None)
    assert "session 'fault-" in message and " failed: " in message
    SAID.setdefault(server.name, {})["connections killed"] = message


def test_the_server_stops_mid_run_and_comes_back(server: Backend, proxy: Proxy) -> None:
    store = _via(server, proxy)

    def inject() -> None:
        proxy.stop()
        _count(server, "server stopped")

    message = _run_through_fault(server, store, inject, proxy.start)
    assert "session 'fault-" in message
    SAID.setdefault(server.name, {})["server stopped"] = message
