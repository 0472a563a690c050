"""Stores named by URL: the one place where a URL's scheme picks the store.

Tools that are told where a store is, rather than handed one (the CLI's ``--store``, the Django app's
``AGENT_SESSIONS["URL"]``, a worker's settings), open it here, on connections of their own::

    from stores.urls import open_url

    opened = open_url("postgresql+psycopg://app@db/app")
    try:
        ...  # opened.store
    finally:
        opened.close()  # the engine or client open_url made

An application that has its engine or client already passes it to the store's own constructor instead.
Another package's store joins by an entry point of the group ``agent_sessions.stores``: its name a URL
scheme, its value a ``Kind``. Only the store a URL names is imported, so its driver alone is loaded.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, unquote_plus

from agent_sessions.errors import BadStoreURL, StoreError, StoresShadowed

if TYPE_CHECKING:
    from agent_sessions import Store

ENTRY_POINTS = "agent_sessions.stores"
DIST = "stored-agent-sessions"


@dataclass(frozen=True)
class Options:
    connect_timeout: float = 10
    """Seconds to wait for a database server to answer."""
    application_name: str = "agent-sessions"
    """What the connections say they are, where the server shows it (PostgreSQL's ``pg_stat_activity``)."""
    create: bool = False
    """Make an embedded store's file when it is missing (SQLite); otherwise a missing file is an error."""
    pool_size: int = 5
    """Connections a SQL store's engine keeps open: about one per thread that uses the store at once."""
    connect_args: Mapping[str, Any] = field(default_factory=dict)
    """More arguments for the driver's connect (a SQL store's), as a framework's settings give them."""


@dataclass
class Opened:
    store: Store
    close: Callable[[], None]
    """Gives back the connections ``open_url`` made (the store's own ``close`` leaves a caller's engine open)."""
    failures: tuple[type[BaseException], ...]
    """The driver's own exceptions: one escaping the store means the store failed."""


@dataclass(frozen=True)
class Kind:
    """A store as URLs name it: ``extra`` is the package extra that installs its driver."""

    name: str
    extra: str
    open: Callable[[str, Options], Opened]
    schema: Callable[[], str]
    """The DDL an operator runs to make the store's tables or indexes; "" when the store makes them itself."""


def hide_credentials(url: str) -> tuple[str, list[str]]:
    """``url`` as messages show it, with every credential it carries as ``***``, and those credentials.

    Read by hand rather than with ``urlsplit`` or SQLAlchemy's ``make_url``, which end the userinfo at the
    first ``/`` or ``@``: a password may hold both, unescaped, and the drivers take it. So the userinfo is
    everything up to the *last* ``@`` after ``://``, and the password what follows its first ``:``;
    when a query holds an ``@`` too, more is hidden than the password, never less. Then each query
    parameter naming a secret (``_SECRET_PARAMETER``) has its value hidden."""
    secrets: list[str] = []
    scheme, sep, rest = url.partition("://")
    head, rest = (f"{scheme}://", rest) if sep else ("", url)
    at = rest.rfind("@") if sep else -1
    if at != -1:
        user, colon, password = rest[:at].partition(":")
        if colon and password:
            secrets.append(password)
            user += ":***"
        elif colon:
            user += ":"
        head, rest = f"{head}{user}@", rest[at + 1:]
    base, question, query = rest.partition("?")
    if question:
        items = re.split(r"([&;])", query)  # MongoDB also separates with ;
        for i in range(0, len(items), 2):
            name, equals, value = items[i].partition("=")
            if equals and value and _SECRET_PARAMETER.search(unquote_plus(name)):
                secrets.append(value)
                items[i] = f"{name}=***"
        rest = f"{base}?{''.join(items)}"
    return head + rest, secrets


_SECRET_PARAMETER = re.compile(r"pass|pwd|secret|token|authmechanismproperties", re.IGNORECASE)
"""A query parameter whose value is a credential: ``password=``/``passwd=`` (libpq, PyMySQL), ``sslpassword``,
``tlsCertificateKeyFilePassword``, MongoDB's ``authMechanismProperties`` (an AWS session token)."""


def shown(url: str) -> str:
    """``url`` without its credentials."""
    return hide_credentials(url)[0]


def scheme_of(url: str) -> str:
    """The scheme naming ``url``'s store: ``sqlite`` for a bare path, and without a driver (``+psycopg``)."""
    if not url:
        raise BadStoreURL("the store URL is empty")
    if "://" not in url:
        return "sqlite"
    return url.split("://", 1)[0].lower().partition("+")[0]


def kind_of(url: str) -> Kind:
    """The store ``url`` names, without connecting (``BadStoreURL`` for a scheme no store serves)."""
    scheme = scheme_of(url)
    kind = _BUILT_IN.get(scheme)
    if kind is not None:
        return kind
    for point in entry_points(group=ENTRY_POINTS, name=scheme):
        found = point.load()
        if not isinstance(found, Kind):
            raise BadStoreURL(f"the entry point {point.value!r} for {scheme!r} stores is not a stores.urls.Kind")
        return found
    raise BadStoreURL(f"unknown store URL scheme {scheme!r} in {shown(url)!r}: use a SQLite path or "
                      "sqlite:///path, postgresql+psycopg://, mysql+pymysql://, mongodb:// or redis://")


def open_url(url: str, options: Options | None = None) -> Opened:
    """The store ``url`` names, on connections of its own. ``BadStoreURL`` for a URL its store cannot read,
    ``ImportError`` (naming the extra to install) for a driver that is missing, ``StoreError`` for a store
    that cannot be opened."""
    kind = kind_of(url)
    try:
        return kind.open(url, options or Options())
    except ImportError as exc:
        if isinstance(exc, StoresShadowed) or "pip install" in str(exc):
            raise
        raise ImportError(f"the {kind.name} store cannot import its driver ({exc}); "
                          f"install it with: pip install '{DIST}[{kind.extra}]'") from exc


# -- the stores of this package ---------------------------------------------------------------------------


def _open_sqlite(url: str, options: Options) -> Opened:
    from sqlalchemy.exc import SQLAlchemyError

    from stores import sqlite

    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") or "://" not in url else ""
    if not path:
        raise BadStoreURL(f"bad SQLite URL {shown(url)!r}: write sqlite:///relative/path.db or sqlite:////abs/path.db")
    if not options.create and not os.path.isfile(path):
        raise StoreError(f"no SQLite store at {shown(path)!r}: no such file (the application's "
                         "stores.sqlite.open(path) makes it)")
    try:
        store = sqlite.open(path)
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot open the SQLite store {shown(path)!r}: {getattr(exc, 'orig', None) or exc}") from exc
    return Opened(store, store.close, (SQLAlchemyError,))


_SQL_STORES = {"postgresql": ("postgres", "psycopg"), "mysql": ("mysql", "pymysql")}
"""Per SQLAlchemy backend: the module of ``stores`` with its store, and the driver it runs on."""


def _open_sql(url: str, options: Options, backend: str) -> Opened:
    """The store of ``backend`` (``_SQL_STORES``) over an engine of its own for ``url``."""
    from sqlalchemy import create_engine, make_url
    from sqlalchemy.exc import ArgumentError as BadURL
    from sqlalchemy.exc import SQLAlchemyError

    module, wanted = _SQL_STORES[backend]
    made = importlib.import_module(f"stores.{module}").Store
    driver = url.split("://", 1)[0].lower().partition("+")[2]
    if driver not in ("", wanted):
        raise BadStoreURL(f"store URL {shown(url)!r}: this store runs on {wanted}; write {backend}+{wanted}://...")
    try:
        parsed = make_url(f"{backend}+{wanted}://{url.split('://', 1)[1]}")
    except (BadURL, ValueError) as exc:  # ValueError: a port that is not a number
        raise BadStoreURL(f"bad store URL {shown(url)!r}: {scrub(str(exc), url)}") from None
    userinfo = url.partition("://")[2].rpartition("@")[0]
    if "@" in userinfo and unquote(userinfo.partition(":")[2]) != parsed.password:
        # SQLAlchemy ends the password at its first @, and would send the rest to DNS as the host name.
        raise BadStoreURL(f"store URL {shown(url)!r}: escape each @ in the user name or password (and any in the "
                          "query) as %40")
    connect = dict(options.connect_args)
    if "connect_timeout" not in parsed.query:
        connect.setdefault("connect_timeout", options.connect_timeout)
    if backend == "mysql" and "charset" not in parsed.query:
        parsed = parsed.update_query_dict({"charset": "utf8mb4"})  # the store keeps any Unicode text
    if backend == "postgresql" and "application_name" not in parsed.query:
        connect.setdefault("application_name", options.application_name)
    engine = create_engine(parsed, connect_args=connect, pool_size=options.pool_size)
    return Opened(made(engine), engine.dispose, (SQLAlchemyError,))


def _open_mongodb(url: str, options: Options) -> Opened:
    from pymongo import MongoClient
    from pymongo.errors import ConfigurationError, InvalidURI, PyMongoError

    from stores import mongodb

    lower = url.lower()
    names = ("serverSelectionTimeoutMS", "connectTimeoutMS")
    timeouts: dict[str, Any] = {name: options.connect_timeout * 1000 for name in names if name.lower() not in lower}
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(url, **timeouts)  # connects lazily
    except (InvalidURI, ConfigurationError, ValueError) as exc:  # ValueError: a bad port
        raise BadStoreURL(f"bad store URL {shown(url)!r}: {scrub(str(exc), url)}") from None
    try:
        database = client.get_default_database()
    except ConfigurationError:
        client.close()
        raise BadStoreURL(f"store URL {shown(url)!r} names no database: write mongodb://host:27017/dbname") from None
    return Opened(mongodb.Store(database), client.close, (PyMongoError,))


def _open_redis(url: str, options: Options) -> Opened:
    import redis as redis_py
    from redis.exceptions import RedisError

    from stores import redis

    base, _, query = url.partition("?")
    params = [p for p in re.split(r"[&;]", query) if p]
    prefix = next((unquote(p.partition("=")[2]) for p in params if p.startswith("prefix=")), "agent_sessions:")
    rest = "&".join(p for p in params if not p.startswith("prefix="))
    try:
        client = redis_py.Redis.from_url(base + (f"?{rest}" if rest else ""), socket_timeout=options.connect_timeout,
                                         socket_connect_timeout=options.connect_timeout)
    except ValueError as exc:
        raise BadStoreURL(f"bad store URL {shown(url)!r}: {scrub(str(exc), url)}") from None
    return Opened(redis.Store(client, prefix=prefix), client.close, (RedisError,))


def _postgres_schema() -> str:
    from stores import postgres

    return postgres.SCHEMA


def _mysql_schema() -> str:
    from stores import mysql

    return "".join(f"{statement};\n\n" for statement in mysql.SCHEMA)


def _mongodb_schema() -> str:
    from stores import mongodb

    return "".join(f"db.getCollection({json.dumps(collection)}).createIndex({json.dumps(dict(keys))}, "
                   f"{json.dumps(options)});\n" for collection, keys, options in mongodb.INDEXES)


def _nothing() -> str:
    return ""


_SQLITE = Kind("sqlite", "sqlite", _open_sqlite, _nothing)
_POSTGRES = Kind("postgres", "postgres", functools.partial(_open_sql, backend="postgresql"), _postgres_schema)
_MYSQL = Kind("mysql", "mysql", functools.partial(_open_sql, backend="mysql"), _mysql_schema)
_MONGODB = Kind("mongodb", "mongodb", _open_mongodb, _mongodb_schema)
_REDIS = Kind("redis", "redis", _open_redis, _nothing)
_BUILT_IN = {"sqlite": _SQLITE, "postgresql": _POSTGRES, "postgres": _POSTGRES, "mysql": _MYSQL,
             "mariadb": _MYSQL, "mongodb": _MONGODB, "mongodb+srv": _MONGODB, "redis": _REDIS, "rediss": _REDIS}


def scrub(text: str, url: str | None) -> str:
    """``text`` without the credentials of ``url``, as written and percent-decoded: the last line of defence
    for a message quoting what a driver or URL parser said (SQLAlchemy quotes a URL it cannot parse)."""
    if not url:
        return text
    forms = {form for secret in hide_credentials(url)[1] for form in (secret, unquote(secret), unquote_plus(secret))}
    for form in sorted(forms, key=len, reverse=True):
        if form:
            text = text.replace(form, "***")
    return text


__all__ = ["ENTRY_POINTS", "BadStoreURL", "Kind", "Opened", "Options", "hide_credentials", "kind_of", "open_url",
           "scheme_of", "scrub", "shown"]
