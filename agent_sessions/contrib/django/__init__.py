"""agent-sessions as a Django app: the store's tables in Django's migration history, a store built from
``DATABASES``, and ``manage.py agent_sessions``: the command line (``python -m agent_sessions``) on that store.

    INSTALLED_APPS = [..., "agent_sessions.contrib.django"]
    AGENT_SESSIONS = {"DATABASE": "default"}     # the DATABASES alias that holds the tables (the default)

Then ``manage.py migrate`` creates the tables, and ``agent_sessions.contrib.django.store()`` is the store,
in views, Celery tasks and commands alike. ``views.events`` streams a session's event log as server-sent
events; it is served only where a project ``include``s ``agent_sessions.contrib.django.urls`` (behind the
project's own authorization: docs/django.md).

Why not hand the store Django's connection? Django keeps one DB-API connection per thread, opened and
closed around requests, with its own autocommit and ``atomic()`` bookkeeping; the store needs connections
it can check out from any thread (a run's lease heartbeat is a thread of its own) and transactions of its
own. So the store gets an SQLAlchemy engine over the same database, one per process (the SQL stores drop
an inherited pool after a fork, so prefork servers and Celery workers are safe).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.utils.module_loading import import_string  # type: ignore[import-untyped]

import agent_sessions as agent

log = logging.getLogger(__name__)

SETTINGS = ("DATABASE", "STORE", "SSE_SECONDS", "RESOLVE")
"""The keys of ``settings.AGENT_SESSIONS``: ``DATABASE``, the DATABASES alias holding the tables
("default"); ``STORE``, the dotted path of a function of no arguments returning the store, for a store
that is not built from DATABASES (MongoDB; ``stores.memory`` in tests). With ``STORE`` set the migration
creates no table. ``SSE_SECONDS`` (30): how long one response of the events view lasts at most
(``views.events``), so a browser that left holds no worker for long. ``RESOLVE``: the dotted path of the
project's ``agent.recover`` resolve function (``info -> (Spec, Endpoint) | None``), which the console's
"recover" calls to finish a stranded session (without it, the console offers no recover)."""

SSE_SECONDS = 30.0

_lock = threading.Lock()
_store: agent.Store | None = None
_engine: Any = None
"""The SQLAlchemy engine the app built for ``_store`` (``None`` for a store of ``STORE`` or SQLite, which
closes its own): the app's to dispose of, since ``postgres.Store.close`` leaves the caller's engine open."""


def store() -> agent.Store:
    """The process's store, built on first use from ``AGENT_SESSIONS`` and ``DATABASES``, then shared by
    every thread: it holds a pool (a connection per thread on SQLite), so it is made once, never per
    request."""
    global _store, _engine
    built = _store
    if built is not None:
        return built
    with _lock:
        if _store is None:
            _store, _engine = _build()
        return _store


def reset() -> None:
    """Forget the store, closing every connection it holds (PostgreSQL's listener and the pool of the
    engine the app built), so the next ``store()`` builds it again from the settings: a test that changes
    DATABASES or AGENT_SESSIONS (the app calls it on ``setting_changed``), and the end of a test class
    (``testing.StoreTestMixin``), since Django cannot drop a test database a pooled connection still holds."""
    global _store, _engine
    with _lock:
        old, _store = _store, None
        engine, _engine = _engine, None
    close = getattr(old, "close", None)
    if close is not None:
        close()
    if engine is not None:
        engine.dispose()
    elif close is None:
        dispose = getattr(getattr(old, "engine", None), "dispose", None)
        if dispose is not None:
            dispose()


def options() -> dict[str, Any]:
    """``settings.AGENT_SESSIONS``, checked, with its defaults."""
    conf = getattr(settings, "AGENT_SESSIONS", {})
    if not isinstance(conf, Mapping):
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS must be a dict, got {type(conf).__name__}")
    unknown = sorted(set(conf) - set(SETTINGS))
    if unknown:
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS has unknown keys {unknown}; the keys are {list(SETTINGS)}")
    alias = conf.get("DATABASE", "default")
    if alias not in settings.DATABASES:
        raise ImproperlyConfigured(
            f"settings.AGENT_SESSIONS['DATABASE'] is {alias!r}, which is not in DATABASES "
            f"({sorted(settings.DATABASES)})"
        )
    seconds = conf.get("SSE_SECONDS", SSE_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS['SSE_SECONDS'] must be a number of seconds > 0, "
                                   f"got {seconds!r}")
    resolve = conf.get("RESOLVE")
    if resolve is not None and (not isinstance(resolve, str) or "." not in resolve):
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS['RESOLVE'] must be the dotted path of a function "
                                   f"(e.g. 'myproject.agent.resolve'), got {resolve!r}")
    return {"DATABASE": alias, "STORE": conf.get("STORE"), "SSE_SECONDS": float(seconds), "RESOLVE": resolve}


def _build() -> tuple[agent.Store, Any]:
    """The store, and the engine the app made for it (``None``: the store closes its own, or is not ours)."""
    conf = options()
    if conf["STORE"] is not None:
        made = import_string(conf["STORE"])()
        if not isinstance(made, agent.Store):
            raise ImproperlyConfigured(f"settings.AGENT_SESSIONS['STORE'] ({conf['STORE']}) returned "
                                       f"{type(made).__name__}, not an agent_sessions Store")
        return made, None
    from django.db import connections  # type: ignore[import-untyped]

    connection = connections[conf["DATABASE"]]
    made = _from_database(conf["DATABASE"], connection.vendor, connection.settings_dict)
    log.info("agent-sessions store for DATABASES[%r]: %r", conf["DATABASE"], made)
    return made, None if connection.vendor == "sqlite" else getattr(made, "engine", None)


# Keys of a DATABASES entry's OPTIONS that Django's backends read themselves; the rest go to the driver,
# as Django passes them (sslmode, connect_timeout, ssl, ...).
_DJANGO_ONLY = {"isolation_level", "server_side_binding", "pool", "assume_role", "cursor_factory", "context"}


def _from_database(alias: str, vendor: str, db: Mapping[str, Any]) -> agent.Store:
    """The store for one DATABASES entry (as its connection has it: under the test runner, the test
    database). The URL is assembled by SQLAlchemy from the parts, so a password is never formatted into
    a string."""
    from agent_sessions.shadowing import check_stores

    check_stores()  # a project's own `stores` app: say so, not "cannot import name 'sqlite'"
    if vendor == "sqlite":
        from django.db.backends.sqlite3.creation import DatabaseCreation  # type: ignore[import-untyped]

        from stores import sqlite

        if not db.get("NAME") or DatabaseCreation.is_in_memory_db(db["NAME"]):  # Django's test database too
            raise ImproperlyConfigured(
                f"DATABASES[{alias!r}] is an SQLite database in memory ({db.get('NAME')!r}); the store needs a "
                f"file, which other processes can open too (under the test runner, set DATABASES[{alias!r}]"
                f"['TEST']['NAME'] to a file path)"
            )
        return sqlite.open(str(db["NAME"]))  # the file of Django's own tables
    if vendor not in ("postgresql", "mysql"):
        raise ImproperlyConfigured(
            f"DATABASES[{alias!r}] is a {vendor!r} database; agent-sessions builds a store for sqlite, postgresql "
            f"and mysql (MariaDB) only. For another store set AGENT_SESSIONS['STORE'] to a function returning it"
        )
    from sqlalchemy import URL, create_engine

    connect_args = {k: v for k, v in (db.get("OPTIONS") or {}).items() if k not in _DJANGO_ONLY}
    host = db.get("HOST") or None
    port = int(db["PORT"]) if db.get("PORT") else None
    if vendor == "postgresql":
        from stores import postgres

        url = URL.create("postgresql+psycopg", db.get("USER") or None, db.get("PASSWORD") or None, host, port,
                         db.get("NAME") or None)
        return postgres.Store(create_engine(url, pool_size=5, connect_args=connect_args))
    from stores import mysql

    if host is not None and host.startswith("/"):  # as Django's backend reads it: a Unix socket
        connect_args["unix_socket"], host = host, None
    connect_args["charset"] = "utf8mb4"  # the store's text is utf8mb4, whatever Django's connections use
    url = URL.create("mysql+pymysql", db.get("USER") or None, db.get("PASSWORD") or None, host, port,
                     db.get("NAME") or None)
    return mysql.Store(create_engine(url, pool_size=5, connect_args=connect_args))


__all__ = ["SETTINGS", "options", "reset", "store"]
