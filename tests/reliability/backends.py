"""The stores the reliability suite runs on, each buildable in another process (a picklable factory),
in databases of the suite's own so it never disturbs the conformance tests' tables."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine

import agent_sessions as agent
from tests import servers

DATABASE = servers.database_name("reliability")
MONGO_URL = servers.MONGO_URL


@dataclass(frozen=True)
class Backend:
    name: str
    factory: Callable[[], agent.Store]
    url: str = ""
    """The server's URL (empty for SQLite)."""


def prepare(name: str, tmp: Path) -> Backend:
    if name == "sqlite":
        from stores import sqlite

        return Backend(name, functools.partial(sqlite.open, str(tmp / "reliability.db")))
    if name in ("postgres", "mysql"):
        url = servers.database_url(servers.POSTGRES_URL if name == "postgres" else servers.MYSQL_URL, DATABASE)
        engine = create_engine(url)
        servers.fresh_schema(engine)
        engine.dispose()
        build = servers.postgres_store if name == "postgres" else servers.mysql_store
        return Backend(name, functools.partial(build, url), url)
    if name == "mongodb":
        import pymongo

        from stores import mongodb

        client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL)
        for collection in mongodb.COLLECTIONS:
            client[DATABASE].drop_collection(collection)
        client.close()
        return Backend(name, functools.partial(servers.mongo_store, MONGO_URL, DATABASE), MONGO_URL)
    raise ValueError(name)


STORES = ("sqlite", "postgres", "mysql", "mongodb")
