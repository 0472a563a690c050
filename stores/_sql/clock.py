"""The database's clock, as a SQL expression: lease expiry is decided there, never by a replica's clock.

``db_now()`` is seconds since 1970 (a float) read by the server as the statement runs, so replicas whose
clocks disagree still agree on whether a lease has expired. SQLite has no server: its clock is the
process's (``time.time``), which is all a single machine has.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Double
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


@compiles(db_now)
def _other(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    raise NotImplementedError(f"no database clock for the {compiler.dialect.name} dialect")
