"""The database's clock, as a SQL expression: lease expiry is decided there, never by a replica's clock.

``db_now()`` is seconds since 1970 (a float) read by the server as the statement runs, so replicas whose
clocks disagree still agree on whether a lease has expired. SQLite has no server: its clock is the host's,
read by SQLite itself, which is all a single machine has.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Double
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement


class db_now(FunctionElement[float]):
    type = Double()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _postgres(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # clock_timestamp(), not now(): now() is the transaction's start, which a long transaction holds back.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _mysql(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # Not UNIX_TIMESTAMP(NOW(6)): that converts through the session's time zone, which repeats an hour
    # when daylight saving ends. UNIX_TIMESTAMP() is the statement's start in seconds, NOW(6) the same
    # instant, whose microseconds no time zone changes.
    return "(UNIX_TIMESTAMP() + MICROSECOND(NOW(6)) / 1000000.0)"


@compiles(db_now, "sqlite")
def _sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(db_now)
def _other(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    raise NotImplementedError(f"no database clock for the {compiler.dialect.name} dialect")


class db_micros(FunctionElement[int]):
    """The database's clock in whole microseconds since 1970: what ``eventlog.first_seq`` takes from a
    store's clock, computed exactly where the database allows (``db_now`` is a double, and MySQL's
    decimal division in it keeps only five decimals)."""

    type = BigInteger()
    inherit_cache = True


@compiles(db_micros, "postgresql")
def _postgres_micros(element: db_micros, compiler: SQLCompiler, **kw: Any) -> str:
    # EXTRACT gives numeric (PostgreSQL 14+): exact microseconds.
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"


@compiles(db_micros, "mysql")
@compiles(db_micros, "mariadb")
def _mysql_micros(element: db_micros, compiler: SQLCompiler, **kw: Any) -> str:
    return "(UNIX_TIMESTAMP() * 1000000 + MICROSECOND(NOW(6)))"


@compiles(db_micros, "sqlite")
def _sqlite_micros(element: db_micros, compiler: SQLCompiler, **kw: Any) -> str:
    return "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)"


@compiles(db_micros)
def _other_micros(element: db_micros, compiler: SQLCompiler, **kw: Any) -> str:
    raise NotImplementedError(f"no database clock for the {compiler.dialect.name} dialect")
