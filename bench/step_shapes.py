"""What a loop step's write would cost in other shapes, beside the store's own write and the one-statement floor:
the measured basis for the next data model (docs/performance.md, "Round trips").

    python -m bench.step_shapes [--calls 2000]

On PostgreSQL and MariaDB (local servers), each shape on a connection of its own, the shapes interleaved,
sessions of 20 steps begun by the store's own write, every step two messages (bench/workload.py):

- **the store's write**: ``agent_sessions_write`` (the function or the procedure), the step's guard and change;
- **one guarded statement**: the row's update, guarded by the lease, the transcript's length and edits, no
  steers and no cancel, with the messages' insert, one transaction (PostgreSQL: a data-modifying CTE; MySQL:
  ``BEGIN; UPDATE ...; INSERT ... WHERE ROW_COUNT() = 1; COMMIT`` as one multi-statement query, which needs the
  ``MULTI_STATEMENTS`` client flag on the connection);
- **append only**: the messages' ``INSERT ... SELECT`` from the session's row, share-locked and guarded by the
  lease, no steers and no cancel, and no update of that row (the transcript's length would then be the
  messages' last index, which the primary key guards);
- **the floor**: the two rows as one ``INSERT`` in autocommit.

Per call, medians: the server's CPU on that connection's own server process (PostgreSQL) or thread (MariaDB),
read from ``/proc/.../schedstat``, so the machine's other work does not count; and the call's wall time on
127.0.0.1. The shapes other than the store's are sketches: they hold for a usual step only, answer no row, and
are not what the stores run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from .mysql_cpu import _ns, _server_pid, _thread_of
from .workload import step_messages

STEPS = 20
"""Steps of a session before the next one begins."""

_PG_NOW = "extract(epoch FROM clock_timestamp())"
_PG = {
    "store": "SELECT agent_sessions_write(%(sid)s, CAST(%(guard)s AS jsonb), CAST(%(change)s AS jsonb), '', NULL)",
    "guarded": "WITH u AS (UPDATE agent_sessions SET version = version + 1, length = length + 2, edits = edits + 1, "
               f"updated = greatest(updated, {_PG_NOW}), journal = NULL, open_since = coalesce(open_since, {_PG_NOW}) "
               "WHERE session_id = %(sid)s AND token = %(token)s AND epoch = 1 AND length = %(at)s "
               "AND edits = %(edits)s AND steers = 0 AND NOT cancelled RETURNING session_id) "
               "INSERT INTO agent_messages (session_id, idx, body) SELECT u.session_id, %(at)s + o - 1, t "
               "FROM u, unnest(CAST(%(bodies)s AS text[])) WITH ORDINALITY AS x(t, o)",
    "append": "INSERT INTO agent_messages (session_id, idx, body) SELECT s.session_id, %(at)s + o - 1, t "
              "FROM (SELECT session_id FROM agent_sessions WHERE session_id = %(sid)s AND token = %(token)s "
              "AND epoch = 1 AND steers = 0 AND NOT cancelled FOR SHARE) AS s, "
              "unnest(CAST(%(bodies)s AS text[])) WITH ORDINALITY AS x(t, o)",
    "floor": "INSERT INTO shapes_floor (session_id, body) VALUES ('s', %(first)s), ('s', %(second)s)",
}
_MY = {
    "store": "CALL agent_sessions_write(%(sid)s, %(guard)s, %(change)s, '', 2)",
    "guarded": "BEGIN; UPDATE agent_sessions SET version = version + 1, length = length + 2, edits = edits + 1, "
               "journal = NULL, updated = GREATEST(updated, UNIX_TIMESTAMP(NOW(6))), "
               "open_since = COALESCE(open_since, UNIX_TIMESTAMP(NOW(6))) WHERE session_id = %(sid)s "
               "AND token = %(token)s AND epoch = 1 AND length = %(at)s AND edits = %(edits)s AND steers = 0 "
               "AND NOT cancelled; INSERT INTO agent_messages (session_id, idx, body) SELECT %(sid)s, x.i, x.b "
               "FROM (SELECT %(at)s AS i, %(first)s AS b UNION ALL SELECT %(at)s + 1, %(second)s) AS x "
               "WHERE ROW_COUNT() = 1; COMMIT",
    "append": "INSERT INTO agent_messages (session_id, idx, body) SELECT s.session_id, x.i, x.b FROM agent_sessions "
              "AS s JOIN (SELECT %(at)s AS i, %(first)s AS b UNION ALL SELECT %(at)s + 1, %(second)s) AS x "
              "WHERE s.session_id = %(sid)s AND s.token = %(token)s AND s.epoch = 1 AND s.steers = 0 "
              "AND NOT s.cancelled LOCK IN SHARE MODE",
    "floor": "INSERT INTO shapes_floor (session_id, body) VALUES ('s', %(first)s), ('s', %(second)s)",
}
SHAPES = {"store": "the store's write (agent_sessions_write)", "guarded": "one guarded statement (row + messages)",
          "append": "append only (messages, the row share-locked)", "floor": "floor: one INSERT of the two rows"}


class _Shape:
    """One shape's connection, server clock and sessions."""

    def __init__(self, conn: Any, statement: str, execute: Callable[[str, Any], None], server_ns: Callable[[], int],
                 begin: Callable[[str, str], None]) -> None:
        self.conn, self.statement, self.execute, self.server_ns, self.begin = conn, statement, execute, server_ns, begin
        self.server: list[int] = []
        self.wall: list[float] = []
        self.steps = STEPS

    def step(self, bodies: list[str]) -> None:
        if self.steps == STEPS:
            self.sid, self.token, self.steps = f"shape-{uuid.uuid4().hex}", uuid.uuid4().hex, 0
            self.begin(self.sid, self.token)
        at = 2 * self.steps
        params = {"sid": self.sid, "token": self.token, "at": at, "edits": self.steps, "bodies": bodies,
                  "first": bodies[0], "second": bodies[1],
                  "guard": json.dumps({"length": at, "edits": self.steps, "lease": [self.token, 1], "no_steers": True}),
                  "change": json.dumps({"exist": True, "splice": [at, bodies], "open": "set", "journal": [None]})}
        server, began = self.server_ns(), time.perf_counter()
        self.execute(self.statement, params)
        self.wall.append(time.perf_counter() - began)
        self.server.append(self.server_ns() - server)
        self.steps += 1


def _acquire(token: str) -> tuple[str, str]:
    taking = {"host": "bench", "pid": 1, "token": token, "spec": None, "ttl": 600.0, "turn": None}
    return json.dumps({"lease_free": True}), json.dumps({"exist": True, "lease": {"acquire": taking}})


def _postgres() -> tuple[str, dict[str, _Shape]]:
    import psycopg

    from stores import postgres
    from tests import servers

    url = servers.database_url(servers.POSTGRES_URL.replace("+psycopg", ""), servers.database_name("shapes"))
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute(postgres.SCHEMA)
        setup.execute("DROP TABLE IF EXISTS shapes_floor")
        setup.execute("CREATE TABLE shapes_floor (session_id VARCHAR(64), body TEXT)")

    def shape(statement: str) -> _Shape:
        conn = psycopg.connect(url, autocommit=True)
        stat = open(f"/proc/{conn.info.backend_pid}/schedstat")

        def execute(sql: str, params: Any) -> None:
            cursor = conn.execute(sql, params, prepare=True)
            assert (cursor.fetchone()[0]["done"] if cursor.description else cursor.rowcount == 2), sql  # type: ignore[index]

        def begin(sid: str, token: str) -> None:
            conn.execute("SELECT agent_sessions_write(%s, CAST(%s AS jsonb), CAST(%s AS jsonb), 'i', NULL)",
                         (sid, *_acquire(token)))

        return _Shape(conn, statement, execute, lambda: _ns(stat), begin)

    return servers.POSTGRES_URL, {name: shape(statement) for name, statement in _PG.items()}


def _mysql() -> tuple[str, dict[str, _Shape]]:
    import pymysql  # type: ignore[import-untyped]
    from pymysql.constants import CLIENT  # type: ignore[import-untyped]
    from sqlalchemy import make_url

    from stores import mysql
    from tests import servers

    url = make_url(servers.database_url(servers.MYSQL_URL, servers.database_name("shapes")))
    pid = _server_pid()

    def connect() -> Any:
        return pymysql.connect(host=url.host, port=url.port or 3306, user=url.username, password=url.password or "",
                               database=url.database, charset="utf8mb4", autocommit=True,
                               client_flag=CLIENT.MULTI_STATEMENTS)

    with connect().cursor() as setup:
        for statement in mysql.SCHEMA:
            setup.execute(statement)
        setup.execute("DROP TABLE IF EXISTS shapes_floor")
        setup.execute("CREATE TABLE shapes_floor (session_id VARCHAR(64), body TEXT)")

    def shape(statement: str) -> _Shape:
        conn = connect()
        stat, cursor = _thread_of(pid, conn), conn.cursor()

        def execute(sql: str, params: Any) -> None:
            done = cursor.execute(sql, params)
            assert done == 2 or sql.startswith(("BEGIN", "CALL")), sql
            if sql.startswith("CALL"):
                assert int(json.loads(cursor.fetchone()[0])[0]), sql
            while cursor.nextset():
                pass

        def begin(sid: str, token: str) -> None:
            execute("CALL agent_sessions_write(%s, %s, %s, 'i', 2)", (sid, *_acquire(token)))

        return _Shape(conn, statement, execute, lambda: _ns(stat), begin)

    return servers.MYSQL_URL, {name: shape(statement) for name, statement in _MY.items()}


def run(calls: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per server, per shape: (server CPU, wall) per call, microseconds, medians."""
    from tests import servers

    out = {}
    for server, make in (("postgres", _postgres), ("mysql", _mysql)):
        base, shapes = make()
        try:
            for n in range(calls):
                bodies = [m.to_json() for m in step_messages(n)]
                for shape in shapes.values() if n % 2 else reversed(shapes.values()):
                    shape.step(bodies)
        finally:
            for shape in shapes.values():
                shape.conn.close()
            servers.drop_databases(base, [servers.database_name("shapes")])
        out[server] = {name: (statistics.median(s.server) / 1000, statistics.median(s.wall) * 1e6)
                       for name, s in shapes.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="step calls of each shape")
    figures = run(parser.parse_args().calls)
    print("| server | write | server CPU us/call | x floor | wall us/call (127.0.0.1) | x floor |")
    print("|---|---|---|---|---|---|")
    for server, shapes in figures.items():
        floor_cpu, floor_wall = shapes["floor"]
        for name, (cpu, wall) in shapes.items():
            print(f"| {server} | {SHAPES[name]} | {cpu:.0f} | {cpu / floor_cpu:.2f}x | {wall:.0f} | "
                  f"{wall / floor_wall:.2f}x |")


if __name__ == "__main__":
    main()
