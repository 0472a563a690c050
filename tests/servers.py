"""Where the test databases are, and how a test (or a spawned child process) reaches them.

scripts/servers starts the servers when they are not already listening and exports these variables;
the defaults are the servers a python-svc machine runs.

Every database, Mongo database, Redis key and Celery worker name the suite makes derives from one
prefix, $AGENT_SESSIONS_TEST_PREFIX (default ``agent_sessions_test``), so two copies of the suite on one
machine, given different prefixes, share the servers and never each other's data. The URL variables
say which server (and who logs in); the database in them is always the prefix's: a URL naming another
database is pointed at the prefix's instead, so no test reaches a database outside its copy's.
Children inherit the environment, so a spawned process computes the same names.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pymongo
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from stores import mongodb, mysql, postgres
from stores._sql import TABLES


def _prefix() -> str:
    """The prefix of this process's names: the run's, except in one of pytest-xdist's workers, which takes
    ``<prefix>_<worker id>`` (``agent_sessions_test_gw0``) so that workers running side by side share no
    database, Redis key, Mongo database or Celery worker name, just as two copies of the suite do not. The
    worker puts its prefix in the environment, with AGENT_SESSIONS_TEST_WORKER saying it is derived already,
    so what it spawns (children inherit both, and the xdist variable) keeps that prefix rather than adding
    the worker's id again, and a child given a prefix of its own (tests/test_footprint.py's) keeps that."""
    prefix = os.environ.get("AGENT_SESSIONS_TEST_PREFIX") or "agent_sessions_test"
    run = prefix
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get("AGENT_SESSIONS_TEST_WORKER") != worker:
        prefix = f"{prefix}_{worker}"
        os.environ.update(AGENT_SESSIONS_TEST_PREFIX=prefix, AGENT_SESSIONS_TEST_WORKER=worker)
    # Lower case, since MySQL's names are case-sensitive files on Linux and PostgreSQL folds unquoted ones;
    # 40 characters leave room for the longest suffix within MySQL's and MongoDB's 64 (PostgreSQL's 63).
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,39}", prefix):
        raise SystemExit(f"AGENT_SESSIONS_TEST_PREFIX={prefix!r}: 1 to 40 of a-z, 0-9 and _, starting with a letter"
                         + (f" (an xdist worker adds _{worker} to the run's {run!r})" if prefix != run else ""))
    return prefix


PREFIX = _prefix()


def database_name(suffix: str = "") -> str:
    """The name of one of the suite's databases: the prefix itself, or ``<prefix>_<suffix>``."""
    assert not suffix or re.fullmatch(r"[a-z0-9_]{1,20}", suffix), suffix
    return f"{PREFIX}_{suffix}" if suffix else PREFIX


def _on_prefix(url: str) -> str:
    return make_url(url).set(database=PREFIX).render_as_string(hide_password=False)


POSTGRES_URL = _on_prefix(os.environ.get(
    "AGENT_SESSIONS_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/agent_sessions_test"
))
MYSQL_URL = _on_prefix(os.environ.get(
    "AGENT_SESSIONS_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/agent_sessions_test?charset=utf8mb4"
))


def _mongo_url() -> str:
    """The MongoDB-protocol server of this process: where scripts/servers started one per pytest-xdist
    worker (AGENT_SESSIONS_MONGO_URLS), worker gwN's is the Nth, so that workers neither queue on one
    single-core mongoeco nor meet its transactions' server-wide conflicts; a spawned child inherits the
    worker's variable and so reaches the same server."""
    urls = os.environ.get("AGENT_SESSIONS_MONGO_URLS", "").split()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if urls and re.fullmatch(r"gw[0-9]+", worker):
        return urls[int(worker[2:]) % len(urls)]
    return os.environ.get("AGENT_SESSIONS_MONGO_URL", "mongodb://127.0.0.1:27017/?directConnection=true")


MONGO_URL = _mongo_url()
MONGO_DATABASE = PREFIX
"""The Mongo database of the conformance tests (the others are ``database_name(suffix)`` too)."""
REDIS_URL = os.environ.get("AGENT_SESSIONS_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_KEY_PREFIX = f"{PREFIX}:"
"""Every Redis key the suite writes starts with this (the Celery tests' broker keys)."""


CONNECT_TIMEOUT = 10
"""Seconds a test waits to connect to PostgreSQL: libpq's own default is to wait as long as TCP does.
(PyMySQL's default is 10 s already; pymongo's 20 s.)"""


def _engine(url: Any, **options: Any) -> Engine:
    if make_url(url).get_backend_name() == "postgresql":
        options.setdefault("connect_args", {"connect_timeout": CONNECT_TIMEOUT})
    return create_engine(url, **options)


def create_database(url: str) -> None:
    """CREATE DATABASE if it is missing, through the server's administrative database."""
    target = make_url(url)
    name = target.database
    assert name and name.replace("_", "").isalnum(), name
    assert name == PREFIX or name.startswith(PREFIX + "_"), f"{name!r} is not one of this run's ({PREFIX}*)"
    if target.get_backend_name() == "postgresql":
        admin = _engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            if conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first() is None:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    else:
        admin = create_engine(target.set(database=""))
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
    admin.dispose()


def database_url(base: str, database: str) -> str:
    """``base`` pointed at ``database``, which is created if it is missing: a suite's own database.
    ``database`` is one of this run's names (``database_name(...)``): anything else is refused."""
    url = make_url(base).set(database=database).render_as_string(hide_password=False)
    create_database(url)
    return url


def fresh_schema(engine: Engine) -> None:
    """Drop this library's tables and run the store's SCHEMA, as a user's migration would."""
    with engine.begin() as conn:
        for table in ("agent_journals", "agent_runs", "agent_session_tags", "agent_steer_keys",
                      *(t.name for t in TABLES)):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(postgres.SCHEMA)
        else:
            for statement in mysql.SCHEMA:
                conn.exec_driver_sql(statement)


def fresh_database(base: str, suffix: str) -> str:
    """The URL of the database ``database_name(suffix)`` on ``base``'s server, made if it is missing, with
    the store's tables made fresh (``fresh_schema``)."""
    url = database_url(base, database_name(suffix))
    engine = create_engine(url)
    fresh_schema(engine)
    engine.dispose()
    return url


def postgres_store(url: str = POSTGRES_URL) -> postgres.Store:
    return postgres.Store(_engine(url, pool_size=2))


def mysql_store(url: str = MYSQL_URL) -> mysql.Store:
    return mysql.Store(create_engine(url, pool_size=2))


def mongo_store(url: str = MONGO_URL, database: str = MONGO_DATABASE, **client_options: Any) -> mongodb.Store:
    return mongodb.Store(pymongo.MongoClient(url, **client_options)[database])


SQL_SERVERS = (POSTGRES_URL, MYSQL_URL)
"""The servers the suite makes databases on (its MongoDB databases live on the MongoDB test server)."""


def _admin(base: str, timeout: int = CONNECT_TIMEOUT) -> Engine:
    target = make_url(base)
    if target.get_backend_name() == "postgresql":
        return create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=NullPool,
                             connect_args={"connect_timeout": timeout})
    return create_engine(target.set(database=""), poolclass=NullPool, connect_args={"connect_timeout": timeout})


def is_ours(name: str, prefix: str = PREFIX) -> bool:
    """Whether ``name`` is one of the names ``database_name`` gives under ``prefix`` (the prefix itself, or
    ``<prefix>_<suffix>``): compared in Python, since LIKE's ``_`` would match any character."""
    return name == prefix or (name.startswith(prefix + "_") and re.fullmatch(r"[a-z0-9_]{1,20}",
                                                                             name[len(prefix) + 1:]) is not None)


def list_databases(base: str, prefix: str = PREFIX, timeout: int = CONNECT_TIMEOUT) -> set[str]:
    """The databases on ``base``'s server whose names are ``prefix``'s (``is_ours``)."""
    admin = _admin(base, timeout)
    try:
        with admin.connect() as conn:
            if admin.dialect.name == "postgresql":
                names = conn.execute(text("SELECT datname FROM pg_database")).scalars().all()
            else:
                names = conn.execute(text("SHOW DATABASES")).scalars().all()
    finally:
        admin.dispose()
    return {n for n in names if is_ours(n, prefix)}


def drop_databases(base: str, names: set[str] | list[str], prefix: str = PREFIX) -> None:
    """DROP each of ``names`` (each one of this run's, ``is_ours``; ``prefix``: Django's test databases of this
    run's are ``test_`` + it) on ``base``'s server, if it exists: on PostgreSQL WITH (FORCE), ending a
    session a test left open (a pooled connection, a listener)."""
    admin = _admin(base)
    try:
        with admin.connect() as conn:
            for name in names:
                assert is_ours(name, prefix) and name.replace("_", "").isalnum(), f"{name!r} is not one of this run's"
                if admin.dialect.name == "postgresql":
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                else:
                    conn.exec_driver_sql("SET SESSION lock_wait_timeout = 30")
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        admin.dispose()


_MONGO_UP: list[bool] = []


def mongo_reachable(timeout_ms: int = 1500) -> bool:
    """Whether the MongoDB server answers a ping, asked once per process and remembered, so a run without
    one spends one short wait on it rather than a server-selection timeout per test."""
    if not _MONGO_UP:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(MONGO_URL, serverSelectionTimeoutMS=timeout_ms,
                                                               connectTimeoutMS=timeout_ms)
        try:
            client.admin.command("ping")
            _MONGO_UP.append(True)
        except pymongo.errors.PyMongoError:
            _MONGO_UP.append(False)
        finally:
            client.close()
    return _MONGO_UP[0]
