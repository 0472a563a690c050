"""Where each backend is: the servers the tests use (AGENT_SESSIONS_*_URL, started by scripts/servers),
in databases of the benchmark's own (``<prefix>_bench``, after $AGENT_SESSIONS_TEST_PREFIX like every
test database), with fresh tables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import agent_sessions as agent

VARIANTS = ("mysql-noreset",)
"""Rows of the MySQL store over other settings: only the persistence and loop rows measure them."""


def bench_db() -> str:
    """The benchmark's database (SQL and Mongo): the test prefix's, so a benchmark beside a test run (or
    another checkout's) never drops the other's tables."""
    from tests import servers

    return servers.database_name("bench")


_MADE: set[str] = set()
"""The SQL servers (their test URLs) this run made its database on."""


def sql_url(name: str) -> str:
    from tests import servers  # the URLs, CREATE DATABASE and SCHEMA step the tests use

    base = servers.POSTGRES_URL if name == "postgres" else servers.MYSQL_URL
    url = servers.database_url(base, bench_db())
    _MADE.add(base)
    return url


def drop_databases() -> None:
    """Drop the databases this run made on the SQL servers: a benchmark leaves nothing behind on a server it
    did not start (each run makes its tables fresh anyway)."""
    from tests import servers

    while _MADE:
        servers.drop_databases(_MADE.pop(), [bench_db()])


def mongo_url() -> str:
    from tests import servers

    return servers.MONGO_URL


def engine(name: str, **options: Any) -> Any:
    from sqlalchemy import create_engine

    from tests import servers

    eng = create_engine(sql_url(name), **options)
    servers.fresh_schema(eng)
    return eng


def mongo_database() -> Any:
    import pymongo

    from stores import mongodb

    db = pymongo.MongoClient(mongo_url())[bench_db()]
    for collection in mongodb.COLLECTIONS:
        db.drop_collection(collection)
    mongodb.create_indexes(db)
    return db


def open_store(name: str, tmp: str) -> agent.Store:
    if name == "memory":
        from stores import memory

        return memory.Store()
    if name == "sqlite":
        from stores import sqlite

        return sqlite.open(Path(tmp) / f"bench-{os.getpid()}.db")
    if name == "postgres":
        from stores import postgres

        return postgres.Store(engine(name))
    if name == "mysql":
        from stores import mysql

        return mysql.Store(engine(name))
    if name == "mysql-noreset":
        # An engine only the store uses may skip the pool's ROLLBACK on every return: the store always
        # ends its transactions before it gives a connection back (docs/stores/mysql.md).
        from stores import mysql

        return mysql.Store(engine("mysql", pool_reset_on_return=None))
    if name == "mongodb":
        from stores import mongodb

        return mongodb.Store(mongo_database())
    raise SystemExit(f"unknown store {name!r}")


def store_factory(name: str, tmp: str) -> Any:
    """A picklable way to build the same store in another process (for the steer throughput)."""
    import functools

    from tests import servers

    if name == "sqlite":
        from stores import sqlite

        return functools.partial(sqlite.open, str(Path(tmp) / "steers.db"))
    if name == "postgres":
        return functools.partial(servers.postgres_store, sql_url(name))
    if name == "mysql":
        return functools.partial(servers.mysql_store, sql_url(name))
    if name == "mongodb":
        return functools.partial(servers.mongo_store, servers.MONGO_URL, bench_db())
    return None
