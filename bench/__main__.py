"""What persistence costs per store, measured in one run.

    python -m bench [--stores sqlite,postgres,...] [--rounds N] [--json PATH]

For each store: an appending save (one message onto transcripts of 10, 100 and 1,000 messages), loading
1,000 messages, add_steer, and take_steers with nothing waiting (what every model request pays). Beside
each store, its floor: one append-only INSERT (+ COMMIT) of the same bytes through the raw driver.
Servers come from the same AGENT_SESSIONS_*_URL variables the tests use (scripts/servers start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import agent_sessions as agent

SIZES = (10, 100, 1000)


def step_messages(i: int) -> list[agent.Message]:
    """One ReAct step: a tool call with ~200 bytes of arguments, and a ~1 KB tool result."""
    args = json.dumps({"path": f"src/module_{i}.py", "pattern": "lease.*expir", "context": 3,
                       "note": "x" * 120})
    return [
        agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call(f"call_{i}", "grep", args)]),
        agent.Message(agent.Role.USER, [agent.Content.tool_result(f"call_{i}", ("line of code\n" * 80)[:1024])]),
    ]


def timed(fn: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": statistics.median(ordered), "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}


def measure_store(name: str, store: agent.Store, rounds: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for n in SIZES:
        result.update(measure_size(store, f"bench-{name}-{n}-{time.time_ns()}", n, rounds))
    return result


def measure_size(store: agent.Store, sid: str, n: int, rounds: int) -> dict[str, Any]:
    msgs = [agent.Message.user("start")]
    while len(msgs) < n:
        msgs.extend(step_messages(len(msgs)))
    msgs = msgs[:n]
    store.save(sid, msgs)
    extra = iter(range(10**9))

    def append() -> None:
        msgs.append(step_messages(next(extra))[1])
        store.save(sid, msgs)

    result: dict[str, Any] = {f"save_append_{n}": summary(timed(append, rounds))}
    if n == 1000:
        result["messages_1000"] = summary(timed(lambda: store.messages(sid), max(5, rounds // 10)))
        result["add_steer"] = summary(timed(lambda: store.add_steer(sid, "check the lease expiry"), rounds))
        store.take_steers(sid)
        result["take_steers_empty"] = summary(timed(lambda: store.take_steers(sid), rounds))
    return result


def floor_sqlite(path: str, rounds: int) -> list[float]:
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS floor (session TEXT, seq INTEGER, body TEXT, PRIMARY KEY (session, seq))")
    body = step_messages(0)[1].to_json()
    seq = iter(range(10**9))
    return timed(lambda: (conn.execute("BEGIN"), conn.execute("INSERT INTO floor VALUES ('s', ?, ?)",
                                                                (next(seq), body)), conn.execute("COMMIT")), rounds)


def floor_sql(engine: Any, rounds: int) -> list[float]:
    """One INSERT + COMMIT on a raw DB-API connection from the engine's pool."""
    raw = engine.raw_connection()
    cursor = raw.cursor()
    cursor.execute("DROP TABLE IF EXISTS bench_floor")
    body_type = "LONGTEXT" if engine.dialect.name in ("mysql", "mariadb") else "TEXT"
    cursor.execute(f"CREATE TABLE bench_floor (session VARCHAR(255), seq INTEGER, body {body_type}, "
                   "PRIMARY KEY (session, seq))")
    raw.commit()
    body = step_messages(0)[1].to_json()
    seq = iter(range(10**9))

    def insert() -> None:
        cursor.execute("INSERT INTO bench_floor VALUES ('s', %s, %s)", (next(seq), body))
        raw.commit()

    try:
        return timed(insert, rounds)
    finally:
        raw.close()


def floor_mongo(database: Any, rounds: int) -> list[float]:
    database.drop_collection("bench_floor")
    body = step_messages(0)[1].to_json()
    return timed(lambda: database.bench_floor.insert_one({"session": "s", "body": body}), rounds)


def open_stores(names: list[str], tmp: str, rounds: int) -> list[tuple[str, agent.Store, list[float] | None]]:
    out: list[tuple[str, agent.Store, list[float] | None]] = []
    for name in names:
        if name == "memory":
            from stores import memory

            out.append(("memory", memory.Store(), None))
        elif name == "sqlite":
            from stores import sqlite

            floor = floor_sqlite(str(Path(tmp) / "floor.db"), rounds)
            out.append(("sqlite", sqlite.open(Path(tmp) / "bench.db"), floor))
        elif name in ("postgres", "mysql"):
            from sqlalchemy import create_engine, make_url

            from stores import mysql, postgres
            from tests import servers  # the same databases and SCHEMA step the tests use

            url = make_url(servers.POSTGRES_URL if name == "postgres" else servers.MYSQL_URL)
            url = url.set(database="agent_sessions_bench")
            servers.create_database(url.render_as_string(hide_password=False))
            engine = create_engine(url)
            servers.fresh_schema(engine)
            store = postgres.Store(engine) if name == "postgres" else mysql.Store(engine)
            out.append((name, store, floor_sql(engine, rounds)))
        elif name == "mongodb":
            import pymongo

            from stores import mongodb

            url = os.environ.get("AGENT_SESSIONS_MONGO_URL", "mongodb://127.0.0.1:27017/?directConnection=true")
            db = pymongo.MongoClient(url)["agent_sessions_bench"]
            for collection in (mongodb.SESSIONS, mongodb.STEERS, mongodb.COUNTERS):
                db.drop_collection(collection)
            mongodb.create_indexes(db)
            out.append(("mongodb", mongodb.Store(db), floor_mongo(db, rounds)))
        else:
            raise SystemExit(f"unknown store {name!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="memory,sqlite,postgres,mysql,mongodb")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "latest.json"))
    args = parser.parse_args()

    report: dict[str, Any] = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                          "platform": platform.platform()}, "rounds": args.rounds, "stores": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, store, floor in open_stores(args.stores.split(","), tmp, args.rounds):
            row = measure_store(name, store, args.rounds)
            if floor is not None:
                row["floor_insert"] = summary(floor)
            report["stores"][name] = row

    cols = [f"save_append_{n}" for n in SIZES] + ["messages_1000", "add_steer", "take_steers_empty", "floor_insert"]
    print(f"{'median ms (p99)':<10}" + "".join(f"{c:>22}" for c in cols) + f"{'save@1000/floor':>17}")
    for name, row in report["stores"].items():
        cells = [f"{row[c]['median_ms']:.3f} ({row[c]['p99_ms']:.2f})" if c in row else "-" for c in cols]
        ratio = (f"{row['save_append_1000']['median_ms'] / row['floor_insert']['median_ms']:.2f}x"
                 if "floor_insert" in row else "-")
        print(f"{name:<10}" + "".join(f"{c:>22}" for c in cells) + f"{ratio:>17}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
