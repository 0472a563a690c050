"""What a MySQL loop step's write costs in CPU, server and client, against the one-statement floor.

    python -m bench.mysql_cpu [--calls 3000] [PROCEDURE.sql ...]

Wall times on a shared two-core machine swing by half from run to run; CPU time does not. Each variant of
``agent_sessions_write`` (a file holding its ``CREATE PROCEDURE agent_sessions_write(...)``; none given: the
store's own) is made under a name of its own in a scratch database and called as a loop step's save calls it
(guard ``{length, edits, lease, no_steers}``, change ``{exist, splice of two messages, open, journal}``), each on
a connection of its own, sessions of 20 steps begun by the store's own procedure; the floor (the step's two rows
as one INSERT in autocommit) is interleaved with them. Per call: the server's CPU on that connection's own thread
(``/proc/<mariadbd>/task/<tid>/schedstat``, so the other clients of a shared server do not count; Linux, a local
server with a thread per connection) and the client's (``time.thread_time``: PyMySQL, not the library). Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import IO, Any

import pymysql  # type: ignore[import-untyped]
from sqlalchemy import make_url

from stores import mysql

from .workload import step_messages

_CALL = "CALL {}(%s, %s, %s, %s, %s)"
_FLOOR = "INSERT INTO cpu_floor (session_id, body) VALUES (%s, %s), (%s, %s)"
STEPS = 20
"""Steps of a session before the next one begins (a loop's turns are about as long)."""


def _server_pid() -> int:
    for name in ("mariadbd", "mysqld"):
        found = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout.split()
        if found:
            return int(found[0])
    raise SystemExit("no local mariadbd or mysqld")


def _busy(pid: int) -> dict[str, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            pass
    return out


def _thread_of(pid: int, conn: Any) -> IO[str]:
    """The schedstat of the server thread serving ``conn``: the one a busy query on it keeps busy."""
    before = _busy(pid)
    conn.cursor().execute("SELECT BENCHMARK(3000000, MD5('x'))")
    after = _busy(pid)
    return open(f"/proc/{pid}/task/{max(after, key=lambda t: after[t] - before.get(t, after[t]))}/schedstat")


def _ns(stat: IO[str]) -> int:
    stat.seek(0)
    return int(stat.read().split()[0])


class _Variant:
    """One procedure's connection and its sessions."""

    def __init__(self, pid: int, connect: Any, name: str) -> None:
        self.conn = connect(autocommit=False)
        self.thread = _thread_of(pid, self.conn)
        self.cursor = self.conn.cursor()
        self.name = name
        self.server: list[int] = []
        self.client: list[float] = []
        self.steps = STEPS

    def call(self, procedure: str, guard: dict[str, Any], change: dict[str, Any], incarnation: str = "") -> Any:
        self.cursor.execute(_CALL.format(procedure), (self.sid.encode(), json.dumps(guard), json.dumps(change),
                                                      incarnation, 2))
        rows = self.cursor.fetchall()
        while self.cursor.nextset():
            pass
        return json.loads(rows[0][0])

    def step(self, bodies: list[str]) -> None:
        if self.steps == STEPS:
            self.sid, self.token, self.length, self.steps = f"cpu-{uuid.uuid4().hex}", uuid.uuid4().hex, 0, 0
            acquire = {"host": "bench", "pid": 1, "token": self.token, "spec": None, "ttl": 600.0, "turn": None}
            self.call("agent_sessions_write", {"lease_free": True}, {"exist": True, "lease": {"acquire": acquire}},
                      uuid.uuid4().hex)
        guard = {"length": self.length, "edits": self.steps, "lease": [self.token, 1], "no_steers": True}
        change = {"exist": True, "splice": [self.length, bodies], "open": "set", "journal": [None]}
        server, client = _ns(self.thread), time.thread_time()
        row = self.call(self.name, guard, change)
        self.client.append(time.thread_time() - client)
        self.server.append(_ns(self.thread) - server)
        assert int(row[0]) and int(row[8]) == self.length + 2, row
        self.length, self.steps = self.length + 2, self.steps + 1


def run(files: list[str], calls: int) -> list[tuple[str, float, float]]:
    from tests import servers

    url = make_url(servers.database_url(servers.MYSQL_URL, servers.database_name("bench_cpu")))
    pid = _server_pid()

    def connect(**options: Any) -> Any:
        return pymysql.connect(host=url.host, port=url.port or 3306, user=url.username, password=url.password or "",
                               database=url.database, charset="utf8mb4", **options)

    setup = connect(autocommit=True)
    procedures = [Path(f).read_text() for f in files] or [mysql.WRITE_PROCEDURE]
    with setup.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS cpu_floor")
        cur.execute("CREATE TABLE cpu_floor (session_id VARCHAR(64), body TEXT)")
        for statement in mysql.SCHEMA:
            cur.execute(statement)
        for i, text in enumerate(procedures):
            cur.execute(f"DROP PROCEDURE IF EXISTS agent_sessions_write_{i}")
            named = f"PROCEDURE agent_sessions_write_{i}("
            cur.execute(re.sub(r"PROCEDURE agent_sessions_write\(", named, text.strip(), count=1))
    variants = [_Variant(pid, connect, f"agent_sessions_write_{i}") for i in range(len(procedures))]
    floor = connect(autocommit=True)
    floor_thread, floor_cursor = _thread_of(pid, floor), floor.cursor()
    floor_server: list[int] = []
    floor_client: list[float] = []
    try:
        for n in range(calls):
            bodies = [m.to_json() for m in step_messages(n)]
            for variant in variants if n % 2 else variants[::-1]:
                variant.step(bodies)
            server, client = _ns(floor_thread), time.thread_time()
            floor_cursor.execute(_FLOOR, ("s", bodies[0], "s", bodies[1]))
            floor_client.append(time.thread_time() - client)
            floor_server.append(_ns(floor_thread) - server)
    finally:
        for conn in (*(v.conn for v in variants), floor, setup):
            conn.close()
        servers.drop_databases(servers.MYSQL_URL, [str(url.database)])  # its procedures and tables with it
    rows = [("floor: INSERT of the two rows, autocommit", statistics.median(floor_server) / 1000,
             statistics.median(floor_client) * 1e6)]
    for variant, name in zip(variants, files or ["agent_sessions_write (the store's)"], strict=True):
        rows.append((name, statistics.median(variant.server) / 1000, statistics.median(variant.client) * 1e6))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("procedures", nargs="*", help="files, each a CREATE PROCEDURE agent_sessions_write")
    parser.add_argument("--calls", type=int, default=3000, help="step calls of each variant")
    args = parser.parse_args()
    rows = run(args.procedures, args.calls)
    print(f"{args.calls} calls each; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| write | server CPU us/call | client CPU us/call |\n|---|---|---|")
    for name, server, client in rows:
        print(f"| {name} | {server:.0f} | {client:.0f} |")


if __name__ == "__main__":
    main()
