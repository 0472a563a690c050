"""Work on different sessions never contends on MySQL: no statement of a session's write locks rows or gaps
of the sessions beside it in an index (InnoDB's next-key and gap locks under REPEATABLE READ, the default),
so concurrent writers of different sessions neither deadlock nor wait for each other, even while one of
them stalls inside its transaction (a write is one CALL, its transaction inside it: the stall is made in
the server, by a trigger on the session's row that waits for a lock the test holds)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Connection, create_engine, make_url

import agent_sessions as agent
from stores import mysql
from tests import servers
from tests.reliability.proxy import Proxy

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = 8
SESSIONS = 10
"""Sessions each process creates, one after another."""
MSGS = [agent.Message.user("hello"), agent.Message.assistant("hi")]


@pytest.fixture(scope="module")
def url() -> str:
    return servers.fresh_database(servers.MYSQL_URL, "contend")


CREATOR = """
import json, logging, sys
from sqlalchemy import create_engine
import agent_sessions as agent
from stores import mysql

url, run, me, sessions = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
retried = []

class Retries(logging.Handler):
    def emit(self, record):
        retried.append(record.getMessage())

logging.getLogger("stores").addHandler(Retries(logging.WARNING))  # stores.mysql.backend's retries
store = mysql.Store(create_engine(url, pool_size=2))
assert store.max_message_bytes  # what a store reads once, and a connection, before the start
print("ready", flush=True)
sys.stdin.readline()  # all at once
failed = []
for i in range(sessions):
    try:  # the sessions made at the same moment by the processes are neighbours in every index
        store.save(f"{run}-{i:02d}-{me}", [agent.Message.user("hello"), agent.Message.assistant("hi")])
    except Exception as exc:
        failed.append(repr(exc))
print(json.dumps({"retried": retried, "failed": failed}))
"""


def test_processes_creating_sessions_at_once_never_deadlock(url: str) -> None:
    """Eight processes each save ten new sessions at once, the server a network hop away (about 1 ms more
    a round trip): every save lands at its first attempt, none meets a deadlock (the store retries those,
    with a warning: none is logged)."""
    run = uuid.uuid4().hex[:8]
    proxy = Proxy(int(make_url(url).port or 3306), delay=0.0005).start()
    via = make_url(url).set(port=proxy.port).render_as_string(hide_password=False)
    children = [
        subprocess.Popen([sys.executable, "-c", CREATOR, via, run, str(p), str(SESSIONS)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        for p in range(PROCESSES)
    ]
    reports = []
    try:
        deadline = time.monotonic() + 60
        for child in children:  # each started, its store connected
            assert child.stdout is not None
            assert select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))[0], "not ready"
            assert child.stdout.readline().strip() == "ready", child.stderr
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        for child in children:
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err
            reports.append(json.loads(out))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        proxy.stop()
    assert [r["failed"] for r in reports] == [[]] * PROCESSES
    assert [r["retried"] for r in reports] == [[]] * PROCESSES
    store = mysql.Store(create_engine(url, pool_size=1))
    try:
        assert all(store.messages(f"{run}-{i:02d}-{p}") == MSGS for i in range(SESSIONS) for p in range(PROCESSES))
    finally:
        store.close()
        store.engine.dispose()


# -- a writer that stalls inside its transaction holds up no other session ------------------------------------

LOCK_WAIT = 1.0
"""The stores' ``lock_wait``: what a write waiting on another session's locks would wait, and fail after."""


def _first_save(store: mysql.Store, sid: str) -> None:
    store.save(sid, MSGS)


def _rewrite(store: mysql.Store, sid: str) -> None:
    store.save(sid, MSGS)
    mysql.Store(store.engine).save(sid, [agent.Message.user("another")])  # a store that knows nothing: all of it


def _logged_run(store: mysql.Store, sid: str) -> None:
    """A run's steps with the event log on, each trimming it to its newest two events."""
    held = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
    note = [agent.eventlog.encode("note", {})]
    for n in range(1, 4):
        store.save_fenced_events(sid, held, [*MSGS, *[agent.Message.user("more")] * n], take_steers=True,
                                 events=note * 2, keep=2)


def _metadata(store: mysql.Store, sid: str) -> None:
    store.set_metadata(sid, {"user": "u", "topic": "t"})
    store.set_metadata(sid, {"topic": None, "lang": "en"})


STALLED: dict[str, tuple[Callable[[mysql.Store, str], None], int]] = {
    "first save": (_first_save, 1),
    "rewrite": (_rewrite, 2),
    "metadata": (_metadata, 2),
    "event log": (_logged_run, 4),
}
"""What the stalled writer does to its session, and the version whose write stalls at the row's UPDATE (the
procedure's last statement before its COMMIT, after the child tables)."""
_LOCK = f"{servers.PREFIX}_stall"
"""The user lock the trigger waits on: a name is the whole server's, so it is the run's (and worker's) own."""
_STALL = """CREATE TRIGGER agent_sessions_stall BEFORE UPDATE ON agent_sessions FOR EACH ROW
BEGIN
  IF NEW.session_id = CAST('{sid}' AS BINARY) AND NEW.version = {version} THEN
    DO GET_LOCK('{lock}', 30);
    DO RELEASE_LOCK('{lock}');
  END IF;
END"""

OTHERS: dict[str, Callable[[mysql.Store, str], object]] = {
    "first save": _first_save,
    "rewrite": _rewrite,
    "leased run": lambda store, sid: _leased_run(store, sid),
    "steer": lambda store, sid: store.add_steer(sid, "s"),
    "keyed steer": lambda store, sid: store.add_steer_once(sid, "s", "k"),
    "enqueue": lambda store, sid: store.enqueue(sid, "k", "t"),
    "metadata": lambda store, sid: store.set_metadata(sid, {"user": "u"}),
    "event log": _logged_run,
    "delete": lambda store, sid: (_first_save(store, sid), store.delete(sid)),
}
"""What another writer does, meanwhile, to a session beside the stalled one."""


def _leased_run(store: mysql.Store, sid: str) -> None:
    held = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 30)
    store.save_fenced(sid, held, MSGS, take_steers=True)
    store.save_fenced(sid, held, [*MSGS, agent.Message.user("more")], take_steers=True)
    store.release(sid, held)


@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize("stalled", STALLED)
def test_a_writer_stalled_in_its_transaction_holds_up_no_other_session(url: str, stalled: str, other: str) -> None:
    """A writer stalls inside its transaction just before its COMMIT (a trigger waits on its row's UPDATE),
    its locks held:
    another writer's work on the sessions just before and just after it in every index goes on at once."""
    run = uuid.uuid4().hex[:8]
    sid = f"{run}-m"
    admin = create_engine(url, pool_size=1)
    work, version = STALLED[stalled]
    stalling = mysql.Store(create_engine(url, pool_size=2), lock_wait=LOCK_WAIT)
    # Every statement of the other writer waits at most LOCK_WAIT for a lock, the store's own too.
    others = mysql.Store(create_engine(url, pool_size=3, connect_args={
        "init_command": f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT:.0f}"}), lock_wait=LOCK_WAIT)
    worker = threading.Thread(target=lambda: _quietly(work, stalling, sid), daemon=True)
    with admin.connect() as holder:
        try:
            holder.exec_driver_sql("DROP TRIGGER IF EXISTS agent_sessions_stall")
            holder.exec_driver_sql(_STALL.format(sid=sid, version=version, lock=_LOCK))
            assert holder.exec_driver_sql(f"SELECT GET_LOCK('{_LOCK}', 0)").scalar() == 1
            worker.start()
            deadline = time.monotonic() + 10
            while not _waiting_in_trigger(holder):
                assert time.monotonic() < deadline, "the stalled writer never reached its row's UPDATE"
                time.sleep(0.005)
            for beside in (f"{run}-l", f"{run}-n"):
                # SessionLocked after LOCK_WAIT if it waited on the stalled writer, which holds its locks until
                # the end: a wait would fail here, so no clock is read (a loaded machine's second is no proof).
                OTHERS[other](others, beside)
        finally:
            holder.exec_driver_sql(f"DO RELEASE_LOCK('{_LOCK}')")
            worker.join(30)
            holder.exec_driver_sql("DROP TRIGGER IF EXISTS agent_sessions_stall")
            for store in (stalling, others):
                store.close()
                store.engine.dispose()
            admin.dispose()
    assert not worker.is_alive()


def _waiting_in_trigger(conn: Connection) -> bool:
    """Whether a connection to this database waits for the trigger's lock (the stalled writer, inside its
    transaction, its child tables written)."""
    return bool(conn.exec_driver_sql(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() AND STATE = 'User lock' "
        "AND ID <> CONNECTION_ID()").scalar())


def _quietly(work: Callable[[mysql.Store, str], None], store: mysql.Store, sid: str) -> None:
    try:
        work(store, sid)
    except agent.StoreError:
        pass  # its connection was cut at the end of the test
