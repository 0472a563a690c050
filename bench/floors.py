"""Each backend's physical floor: the same step (two message rows, the same bytes) appended through the
raw driver, INSERT + COMMIT, nothing else. No store can do less and stay durable."""

from __future__ import annotations

import itertools
import sqlite3
import uuid
from pathlib import Path
from typing import Any, Protocol

from .workload import step_messages

BODIES = [m.to_json() for m in step_messages(0)]


class Floor(Protocol):
    def append(self) -> None: ...


class SQLiteFloor:
    def __init__(self, tmp: str) -> None:
        self.seq = itertools.count()
        self.conn = sqlite3.connect(Path(tmp) / f"floor-{uuid.uuid4().hex}.db", isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")  # as stores.sqlite by default
        self.conn.execute("CREATE TABLE IF NOT EXISTS floor (session TEXT, seq INTEGER, body TEXT, "
                          "PRIMARY KEY (session, seq))")

    def append(self) -> None:
        i = next(self.seq)
        self.conn.execute("BEGIN")
        self.conn.executemany("INSERT INTO floor VALUES ('s', ?, ?)", [(2 * i, BODIES[0]), (2 * i + 1, BODIES[1])])
        self.conn.execute("COMMIT")


class SQLFloor:
    """On a raw DB-API connection (psycopg or PyMySQL) of an engine of its own."""

    def __init__(self, engine: Any) -> None:
        self.seq = itertools.count()
        self.raw = engine.raw_connection()
        self.cursor = self.raw.cursor()
        body = "LONGTEXT" if engine.dialect.name in ("mysql", "mariadb") else "TEXT"
        self.table = f"bench_floor_{uuid.uuid4().hex[:8]}"
        self.cursor.execute(f"DROP TABLE IF EXISTS {self.table}")
        self.cursor.execute(f"CREATE TABLE {self.table} (session VARCHAR(255), seq INTEGER, body {body}, "
                            "PRIMARY KEY (session, seq))")
        self.raw.commit()

    def append(self) -> None:
        i = next(self.seq)
        self.cursor.executemany(f"INSERT INTO {self.table} VALUES ('s', %s, %s)",
                                [(2 * i, BODIES[0]), (2 * i + 1, BODIES[1])])
        self.raw.commit()


class MongoFloor:
    def __init__(self, database: Any) -> None:
        self.seq = itertools.count()
        database.drop_collection("bench_floor")
        self.collection = database.bench_floor

    def append(self) -> None:
        i = next(self.seq)
        self.collection.insert_many([{"session": "s", "seq": 2 * i, "body": BODIES[0]},
                                     {"session": "s", "seq": 2 * i + 1, "body": BODIES[1]}])


def floor_for(name: str, tmp: str) -> Floor | None:
    from . import backends

    if name == "sqlite":
        return SQLiteFloor(tmp)
    if name in ("postgres", "mysql", *backends.VARIANTS):
        from sqlalchemy import create_engine

        return SQLFloor(create_engine(backends.sql_url(name.split("-")[0])))
    if name == "mongodb":
        import pymongo

        return MongoFloor(pymongo.MongoClient(backends.mongo_url())[backends.bench_db()])
    return None
