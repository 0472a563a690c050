"""A store made before a prefork server forks (Celery, gunicorn) works in each child on connections of
the child's own, and the parent's connections survive the child."""

from __future__ import annotations

import gc
import os
import select
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

import agent_sessions as agent
from agent_sessions.backed import BackedStore as SQLStore
from stores import sqlite
from tests import servers

SERVER_ID = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}


def _backend_id(store: SQLStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text(SERVER_ID[store.engine.dialect.name])).scalar_one())


CHILD_TIMEOUT = 60.0
"""Seconds the forked child gets (it takes well under one): a child stuck on a connection it shares with
the parent, the very bug these tests look for, would otherwise hang the suite."""


def _in_child(work: object) -> str:
    """Run ``work`` in a forked child; return what it reported (or its exception's text)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            out = str(work())  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001
            out = f"error: {type(exc).__name__}: {exc}"
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + CHILD_TIMEOUT
    chunks = []
    with os.fdopen(read, "rb") as f:
        while True:  # until the child closes its end (exits), or the deadline
            ready, _, _ = select.select([f], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # prompt: it was just SIGKILLed
                raise AssertionError(f"the forked child did not finish within {CHILD_TIMEOUT} s")
            chunk = os.read(f.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)  # it has closed the pipe: exiting, if not gone
    return b"".join(chunks).decode()


@pytest.mark.parametrize("base", [servers.POSTGRES_URL, servers.MYSQL_URL], ids=["postgres", "mysql"])
def test_a_forked_child_opens_connections_of_its_own(base: str) -> None:
    url = servers.database_url(base, servers.database_name("fork"))
    store: SQLStore = (servers.postgres_store if url.startswith("postgresql") else servers.mysql_store)(url)
    servers.fresh_schema(store.engine)
    sid = f"fork-{os.getpid()}"
    store.save(sid, [agent.Message.user("parent")])
    parent_id = _backend_id(store)

    def child() -> str:
        store.save(sid, [agent.Message.user("parent"), agent.Message.user("child")])
        return f"{_backend_id(store)} {len(store.messages(sid))}"

    child_id, seen = _in_child(child).split()
    assert int(child_id) != parent_id, "the child talked over the parent's connection"
    assert seen == "2"
    assert _backend_id(store) == parent_id  # the parent's pooled connection is still alive
    assert store.messages(sid) == [agent.Message.user("parent"), agent.Message.user("child")]


def test_a_forked_child_reopens_the_sqlite_file(tmp_path: Path) -> None:
    store = sqlite.open(tmp_path / "fork.db")
    store.save("s", [agent.Message.user("parent")])
    out = _in_child(lambda: (store.save("s", [agent.Message.user("parent"), agent.Message.user("child")]),
                             len(store.messages("s")))[1])
    assert out == "2"
    assert store.messages("s")[-1] == agent.Message.user("child")


CONNECTIONS = {
    # Each of the server's connections to the test database but the caller's own, and what moves whenever
    # a connection is sent anything: MariaDB's id of its last query, PostgreSQL's time of its last change.
    "postgresql": "SELECT pid, state_change, query FROM pg_stat_activity WHERE datname = current_database() "
                  "AND pid <> pg_backend_pid()",
    "mysql": "SELECT ID, QUERY_ID, INFO FROM information_schema.PROCESSLIST WHERE DB = DATABASE() "
             "AND ID <> CONNECTION_ID()",
}


@pytest.mark.parametrize("base", [servers.POSTGRES_URL, servers.MYSQL_URL], ids=["postgres", "mysql"])
def test_a_forked_child_sends_nothing_on_the_parents_connections(base: str) -> None:
    """Seen from the server: each connection the parent's store holds is as the parent left it after a
    child was forked, worked with the store on connections of its own, collected what it dropped of the
    parent's, and exited."""
    url = servers.database_url(base, servers.database_name("forksilent"))
    store: SQLStore = (servers.postgres_store if url.startswith("postgresql") else servers.mysql_store)(url)
    servers.fresh_schema(store.engine)
    observer = create_engine(url, poolclass=NullPool)
    sid = f"fork-{os.getpid()}"
    holder = store.acquire(sid, agent.Holder("parent", os.getpid(), "p" * 32, 0.0), 30)
    msgs = [agent.Message.user("parent")]
    for i in range(3):  # a run's steps: the store holds whatever connections its steps need
        msgs.append(agent.Message.user(f"step {i}"))
        store.save_fenced(sid, holder, msgs, take_steers=True)

    def seen() -> dict[object, tuple[object, ...]]:
        with observer.connect() as conn:
            return {row[0]: tuple(row) for row in conn.execute(text(CONNECTIONS[store.engine.dialect.name]))}

    before = seen()
    assert before, "the parent's store holds connections"

    def child() -> str:
        store.save(f"{sid}-child", [agent.Message.user("child")])
        gc.collect()  # whatever the child dropped of the parent's is collected now
        return "done"

    assert _in_child(child) == "done"
    after = seen()
    assert {key: after.get(key) for key in before} == before, "the child sent something on a parent's connection"
    msgs.append(agent.Message.user("after the child"))
    store.save_fenced(sid, holder, msgs, take_steers=True)
    assert store.messages(sid) == msgs
    getattr(store, "close", lambda: None)()
    store.engine.dispose()
    observer.dispose()
