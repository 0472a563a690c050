"""Where the test databases are, and how a test (or a spawned child process) reaches them.

scripts/servers starts the servers when they are not already listening and exports these variables;
the defaults are the servers a python-svc machine runs.
"""

from __future__ import annotations

import os
from typing import Any

import pymongo
from sqlalchemy import Engine, create_engine, make_url, text

from stores import mongodb, mysql, postgres

POSTGRES_URL = os.environ.get(
    "AGENT_SESSIONS_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/agent_sessions_test"
)
MYSQL_URL = os.environ.get(
    "AGENT_SESSIONS_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/agent_sessions_test?charset=utf8mb4"
)
MONGO_URL = os.environ.get("AGENT_SESSIONS_MONGO_URL", "mongodb://127.0.0.1:27017/?directConnection=true")


def create_database(url: str) -> None:
    """CREATE DATABASE if it is missing, through the server's administrative database."""
    target = make_url(url)
    name = target.database
    assert name and name.replace("_", "").isalnum(), name
    if target.get_backend_name() == "postgresql":
        admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            if conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first() is None:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    else:
        admin = create_engine(target.set(database=""))
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
    admin.dispose()


def database_url(base: str, database: str) -> str:
    """``base`` pointed at ``database``, which is created if it is missing: a suite's own database."""
    url = make_url(base).set(database=database).render_as_string(hide_password=False)
    create_database(url)
    return url


def fresh_schema(engine: Engine) -> None:
    """Drop this library's tables and run the store's SCHEMA, as a user's migration would."""
    with engine.begin() as conn:
        for table in ("agent_journals", "agent_runs", "agent_steers", "agent_messages", "agent_sessions"):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(postgres.SCHEMA)
        else:
            for statement in mysql.SCHEMA:
                conn.exec_driver_sql(statement)


def postgres_store(url: str = POSTGRES_URL) -> postgres.Store:
    return postgres.Store(create_engine(url, pool_size=2))


def mysql_store(url: str = MYSQL_URL) -> mysql.Store:
    return mysql.Store(create_engine(url, pool_size=2))


def mongo_store(url: str = MONGO_URL, database: str = "agent_sessions_test", **client_options: Any) -> mongodb.Store:
    return mongodb.Store(pymongo.MongoClient(url, **client_options)[database])
