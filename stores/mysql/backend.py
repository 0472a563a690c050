"""The MySQL/MariaDB backend: every write one ``CALL agent_sessions_write(...)`` (write.sql), every read one
``CALL agent_sessions_read(...)`` (read.sql), each its own transaction inside the procedure (the pool's
connections are not in autocommit: a bare SELECT would leave its transaction open).

Both run on the pooled DBAPI connection itself, checked in without the pool's ROLLBACK (a round trip
PyMySQL sends even with no transaction open) only when the CALL's closing OK packet said no transaction is
open (``SERVER_STATUS_IN_TRANS`` clear): docs/stores/mysql.md, "No ROLLBACK at check-in".

Prune deletes a session a write, in the procedure's READ COMMITTED and ``lock_wait``: a page's transaction
(``delete_many``) at the engine's REPEATABLE READ would hold up writes of other sessions by its gap locks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib import resources
from typing import Any

import pymysql  # type: ignore[import-untyped]
from pymysql.constants import SERVER_STATUS  # type: ignore[import-untyped]
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from agent_sessions.backend import (
    Change,
    Guard,
    Queued,
    Snapshot,
    Steer,
    Want,
    Written,
    change_json,
    guard_json,
    new_incarnation,
)
from agent_sessions.errors import AgentError, SessionLocked, StoreError

from .._sql import SQLBackend
from .._sql.backend import decoded, row_of

WRITE_PROCEDURE: str = resources.files(__package__).joinpath("write.sql").read_text()
"""The procedure every write calls (``agent_sessions_write``), its CREATE statement: part of ``SCHEMA``."""
READ_PROCEDURE: str = resources.files(__package__).joinpath("read.sql").read_text()
"""The procedure every read calls (``agent_sessions_read``), its CREATE statement: part of ``SCHEMA``."""
_DEADLOCK, _LOCK_WAIT_TIMEOUT, _NO_PROCEDURE = 1213, 1205, 1305
_WRITE = "CALL agent_sessions_write(%s, %s, %s, %s, %s)"
_PACKET = text("SELECT @@max_allowed_packet")
_READ = "CALL agent_sessions_read(%s, %s, %s, %s, %s, %s, NULL)"
"""Schema 1's procedure: its last argument asks which keys were accepted (NULL: none asked, none answered)."""


class Backend(SQLBackend):
    """``lock_wait``: seconds a write waits for the row's lock, whole seconds up."""

    hint = "create the tables by running each statement of stores.mysql.SCHEMA in your migration"

    def __init__(self, engine: Engine, lock_wait: float) -> None:
        super().__init__(engine, "MySQL store")
        self.lock_wait = lock_wait
        self._packet: int | None = None

    def retry(self, exc: DBAPIError) -> bool:
        return _code(exc) == _DEADLOCK

    def refine(self, exc: DBAPIError, what: str) -> AgentError | None:
        if _code(exc) == _NO_PROCEDURE:
            return StoreError(f"{self.name}: {str(exc.orig).strip()} ({what}); {self.hint}")
        if _code(exc) != _LOCK_WAIT_TIMEOUT:
            return None
        return SessionLocked(f"{self.name}: {what} waited {self.lock_wait:g} s (lock_wait) for a lock another "
                             "worker holds inside a transaction on the session (stalled, or slow); nothing was "
                             "written")

    def message_limit(self) -> int:
        """What one statement may carry: half the server's ``max_allowed_packet`` less room for the
        statement around it (PyMySQL sends values as escaped literals: a JSON full of quotes doubles, and
        the write's JSON escapes them once more)."""
        if self._packet is None:
            self._packet = int(self._run("message_limit", "", lambda conn: conn.execute(_PACKET).scalar_one()))
        return (self._packet - 64 * 1024) // 4

    # -- one statement a call ----------------------------------------------------------------------------

    def read(self, session: str, want: Want) -> Snapshot | None:
        params = (session.encode(), want.start, want.stop, want.last, bool(want.steers), bool(want.queue))
        head, texts, waiting, queued, _ = self._once("read", session, lambda cur: _sets(cur, _READ, params))
        if not head:
            return None
        got = head[0]
        return Snapshot(row_of(got, got["now_"]), int(got["start_"] or 0), [r["body"] for r in texts],
                        [Steer(int(r["id"]), r["body"], decoded(r["steer_key"])) for r in waiting],
                        [Queued(int(r["id"]), decoded(r["queue_key"]) or "", r["body"]) for r in queued])

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        params = (session.encode(), json.dumps(guard_json(guard), ensure_ascii=False),
                  json.dumps(change_json(change), ensure_ascii=False), new_incarnation() if change.exist else "",
                  max(1, math.ceil(self.lock_wait)))
        got = self._once("write", session, lambda cur: _sets(cur, _WRITE, params), writes=True)
        head = _written(session, got[0][0])  # the first result's one row
        return Written(head["done_"], row_of(head, head["now_"]) if head["present_"] else None)

    @contextmanager
    def _statement(self) -> Iterator[Any]:
        """A cursor of a pooled connection, for one CALL, checked in as the module's docstring says. Through
        SQLAlchemy's ``Connection`` while anything listens for its cursor events (a tracer), so it sees every
        statement (the pool's ROLLBACK is then sent, as for any connection of the engine)."""
        pooled = self._pooled()
        if pooled is None:
            with self.engine.connect() as conn:
                yield _Traced(conn)
            return
        clean = False
        try:
            driver = pooled.driver_connection
            cursor = driver.cursor()  # type: ignore[union-attr]
            try:
                yield cursor
            finally:
                cursor.close()
            clean = driver.open and not driver.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS  # type: ignore[union-attr]
        except pymysql.Error as exc:
            driver = pooled.driver_connection
            if driver is not None and self.engine.dialect.is_disconnect(exc, driver, None):
                pooled.invalidate(exc)
                raise DBAPIError.instance("", None, exc, pymysql.Error, connection_invalidated=True) from exc
            raise DBAPIError.instance("", None, exc, pymysql.Error) from exc
        finally:
            close_clean = getattr(pooled, "_close_special", None)
            if clean and close_clean is not None:
                close_clean(transaction_reset=True)
            else:
                pooled.close()


class _Traced:
    """A PyMySQL cursor's ``execute`` through a SQLAlchemy ``Connection``, whose events a tracer hears; the
    rest is the driver's cursor under SQLAlchemy's result."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.cursor: Any = None

    def execute(self, sql: str, params: Any = ()) -> None:
        self.cursor = self.conn.exec_driver_sql(sql, params).cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cursor, name)


def _code(exc: DBAPIError) -> object:
    args: tuple[object, ...] = getattr(exc.orig, "args", ())
    return args[0] if args else None


def _sets(cursor: Any, sql: str, params: Any) -> list[list[dict[str, Any]]]:
    """Every result ``sql`` answers (a CALL's SELECTs, then its status, which has none), their rows by
    column name: all of one answer, read off the wire with no round trip between."""
    cursor.execute(sql, params)
    out = []
    while True:
        if cursor.description is not None:
            names = [c[0] for c in cursor.description]
            out.append([dict(zip(names, row, strict=True)) for row in cursor.fetchall()])
        if not cursor.nextset():
            return out


_WRITTEN = ("done_", "present_", "now_", "exists_", "incarnation", "created", "updated", "version", "length", "edits",
            "token", "epoch", "expires", "host", "pid", "cancelled", "handed", "open_since", "last_seq", "steers",
            "queued")
"""The fields of the write's ``row_``, a JSON array (write.sql): in one column, not one each, as PyMySQL parses
every column's description in Python (27 of them were a fifth of a write's client CPU). Its long texts come
as columns of their own (a JSON array of them could pass ``max_allowed_packet``)."""
_FLAGS = frozenset({"done_", "present_", "exists_", "cancelled", "handed"})


def _written(session: str, got: Mapping[str, Any]) -> dict[str, Any]:
    """The write's answer by name: ``row_`` spread out. MariaDB writes a procedure's variables into JSON as
    strings ("1", "12.5"), MySQL as numbers: each flag is read as an integer's truth."""
    out: dict[str, Any] = dict(zip(_WRITTEN, json.loads(got["row_"]), strict=True))
    for name in _FLAGS:
        out[name] = bool(int(out[name]))
    out.update(session_id=session, spec=got["spec"], turn=got["turn"], cancelled_turn=got["cancelled_turn"],
               journal=got["journal"], metadata=got["metadata"])
    return out
