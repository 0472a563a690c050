"""agent-sessions as a Django app (docs/django.md): the store's tables in Django's migrations, a store built
from ``DATABASES``, ``manage.py agent_sessions`` (the command line on that store), the event log as
server-sent events (``urls``), the operator's console in the admin.

Why not hand the store Django's connection? Django keeps one connection per thread, opened and closed
around requests, with its own transaction bookkeeping; the store needs connections it can use from any
thread (a run's lease heartbeat) and transactions of its own. So it gets an SQLAlchemy engine over the
same database, one per process (dropped after a fork, so prefork servers and Celery workers are safe).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.utils.module_loading import import_string  # type: ignore[import-untyped]

import agent_sessions as agent
from agent_sessions.stranded import Resolve

log = logging.getLogger(__name__)

SETTINGS = ("DATABASE", "STORE", "URL", "SSE_SECONDS", "RESOLVE", "SWEEP_SECONDS")
"""The keys of ``settings.AGENT_SESSIONS`` (docs/django.md, Settings). With ``STORE`` (a function making the
store) or ``URL`` (a store URL) set, the store is not built on DATABASES and the migration creates no table."""

SSE_SECONDS = 30.0
SWEEP_SECONDS = 5.0
APPLICATION_NAME = "agent-sessions"
"""What the store's PostgreSQL connections say they are in ``pg_stat_activity`` (beside the project's own
``OPTIONS["application_name"]``, if it sets one), so an operator tells them from Django's."""
MIGRATE_HINT = "run `python manage.py migrate` (the app agent_sessions' migration creates them)"

_lock = threading.Lock()
_store: agent.Store | None = None
_close: Callable[[], None] | None = None
"""Gives back the connections the app opened for ``_store`` (a SQL store's ``close`` leaves its engine
open, since it is usually the caller's); ``None`` for a store of ``STORE``."""


def store() -> agent.Store:
    """The process's store, built on first use from ``AGENT_SESSIONS`` and ``DATABASES``, then shared by
    every thread: it holds a pool, so it is made once, never per request."""
    global _store, _close
    built = _store
    if built is not None:
        return built
    with _lock:
        if _store is None:
            _store, _close = _build()
        return _store


def reset() -> None:
    """Forget the store, closing every connection it holds, so the next ``store()`` builds it again from the
    settings (on ``setting_changed``), and Django can drop a test database no pooled connection holds."""
    global _store, _close
    with _lock:
        old, _store = _store, None
        opened, _close = _close, None
    close = getattr(old, "close", None)
    if close is not None:
        close()
    if opened is not None:
        opened()


def options() -> dict[str, Any]:
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
    sweep = conf.get("SWEEP_SECONDS", SWEEP_SECONDS)
    if isinstance(sweep, bool) or not isinstance(sweep, (int, float)) or not 0 <= sweep < math.inf:
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS['SWEEP_SECONDS'] must be a number of seconds >= 0 "
                                   f"(0: the workers do not sweep), got {sweep!r}")
    for key in ("STORE", "RESOLVE"):
        if conf.get(key) is not None and (not isinstance(conf[key], str) or "." not in conf[key]):
            raise ImproperlyConfigured(f"settings.AGENT_SESSIONS[{key!r}] must be the dotted path of a function "
                                       f"(\"myproject.agent.{key.lower()}\"), got {conf[key]!r}")
    url = conf.get("URL")
    if url is not None and (not isinstance(url, str) or not url):
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS['URL'] must be a store URL (\"mongodb://db/app\", "
                                   f"\"redis://cache/0\"), got {url!r}")
    if url is not None and conf.get("STORE") is not None:
        raise ImproperlyConfigured("settings.AGENT_SESSIONS sets both 'STORE' and 'URL': set one")
    return {"DATABASE": alias, "STORE": conf.get("STORE"), "URL": url, "SSE_SECONDS": float(seconds),
            "RESOLVE": conf.get("RESOLVE"), "SWEEP_SECONDS": float(sweep)}


def function(key: str) -> Callable[..., Any] | None:
    """The function ``AGENT_SESSIONS[key]`` (``STORE``, ``RESOLVE``) names, imported; ``None`` when not set."""
    return _imported(key, options()[key])


def _imported(key: str, path: str | None) -> Callable[..., Any] | None:
    """The function at ``path``, the value of ``AGENT_SESSIONS[key]`` as ``options()`` checked it."""
    if path is None:
        return None
    try:
        found = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS[{key!r}] ({path}) cannot be imported: {exc}") from exc
    if not callable(found):
        raise ImproperlyConfigured(f"settings.AGENT_SESSIONS[{key!r}] ({path}) is not callable")
    return found  # type: ignore[no-any-return]


def resolve() -> Resolve | None:
    return function("RESOLVE")


def _build() -> tuple[agent.Store, Callable[[], None] | None]:
    conf = options()
    factory = _imported("STORE", conf["STORE"])
    if factory is not None:
        made = factory()
        if not isinstance(made, agent.Store):
            raise ImproperlyConfigured(f"settings.AGENT_SESSIONS['STORE'] ({conf['STORE']}) returned "
                                       f"{type(made).__name__}, not an agent_sessions Store")
        return made, None
    if conf["URL"] is not None:
        from agent_sessions.shadowing import check_stores

        check_stores()
        from stores.urls import open_url, shown

        opened = open_url(conf["URL"])
        log.info("agent-sessions store at %s: %r", shown(conf["URL"]), opened.store)
        return opened.store, opened.close
    from django.db import connections  # type: ignore[import-untyped]

    connection = connections[conf["DATABASE"]]
    made, close = _from_database(conf["DATABASE"], connection.vendor, connection.settings_dict)
    log.info("agent-sessions store for DATABASES[%r]: %r", conf["DATABASE"], made)
    return made, close


# Keys of a DATABASES entry's OPTIONS that Django's backends read themselves; the rest go to the driver,
# as Django passes them (sslmode, connect_timeout, ssl, ...).
_DJANGO_ONLY = {"isolation_level", "server_side_binding", "pool", "assume_role", "cursor_factory", "context"}


def _from_database(alias: str, vendor: str, db: Mapping[str, Any]) -> tuple[agent.Store, Callable[[], None] | None]:
    """The store for one DATABASES entry (as its connection has it: the test database, under the test
    runner), its URL assembled by SQLAlchemy from the parts, so a password is never formatted into one."""
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
        return sqlite.open(str(db["NAME"])), None  # the file of Django's own tables; its close is the store's
    if vendor not in ("postgresql", "mysql"):
        raise ImproperlyConfigured(
            f"DATABASES[{alias!r}] is a {vendor!r} database; agent-sessions builds a store for sqlite, postgresql "
            f"and mysql (MariaDB) only. For another store set AGENT_SESSIONS['URL'] (mongodb://..., redis://...)"
        )
    from sqlalchemy import URL

    from stores.urls import Options, open_url

    connect_args = {k: v for k, v in (db.get("OPTIONS") or {}).items() if k not in _DJANGO_ONLY}
    host = db.get("HOST") or None
    port = int(db["PORT"]) if db.get("PORT") else None
    if vendor == "postgresql":
        own = connect_args.get("application_name")
        connect_args["application_name"] = f"{own} ({APPLICATION_NAME})" if own else APPLICATION_NAME
    else:
        if host is not None and host.startswith("/"):  # as Django's backend reads it: a Unix socket
            connect_args["unix_socket"], host = host, None
        connect_args["charset"] = "utf8mb4"  # the store's text is utf8mb4, whatever Django's connections use
    url = URL.create(vendor, db.get("USER") or None, db.get("PASSWORD") or None, host, port, db.get("NAME") or None)
    opened = open_url(url.render_as_string(hide_password=False), Options(connect_args=connect_args))
    backend = getattr(opened.store, "backend", None)
    if isinstance(getattr(backend, "hint", None), str):  # a missing table is an unapplied migration: say so
        backend.hint = MIGRATE_HINT  # type: ignore[union-attr]
    return opened.store, opened.close


__all__ = ["SETTINGS", "options", "reset", "resolve", "store"]
