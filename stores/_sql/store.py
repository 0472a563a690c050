"""The SQL store logic, once, for every dialect.

Saving appends: a Store remembers, per session, the transcript it last wrote or read and the version
token that went with it. A save whose transcript starts with that one, while the token in the database is
still the same, writes only the new messages (and deletes a diverged tail); otherwise it rewrites the
transcript. Either way it is one transaction, and the session row is locked first, so concurrent writers
of one session queue behind each other instead of deadlocking.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from sqlalchemy import Connection, Engine, and_, delete, insert, select, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from agent_sessions import ArgumentError, Message, MessageError, StoreError, validate

from .._known import Known, common_prefix
from .tables import TABLES, messages, sessions, steers

T = TypeVar("T")

_RETRIES = 4


class SQLStore:
    """Subclasses say what differs: the upsert, how steers are taken, which errors mean what."""

    backend: ClassVar[str] = "SQL"
    schema_hint: ClassVar[str] = "create them first"
    read_options: ClassVar[dict[str, Any]] = {}
    dialects: ClassVar[tuple[str, ...]] = ()
    """SQLAlchemy dialect names the store accepts; empty: any."""
    engine_hint: ClassVar[str] = ""

    def __init__(self, engine: Engine, *, remember: int = 1024) -> None:
        if not isinstance(engine, Engine) or (self.dialects and engine.dialect.name not in self.dialects):
            raise ArgumentError(
                f"{type(self).__module__}.Store needs a SQLAlchemy Engine for {self.backend}, got {engine!r}; "
                f"{self.engine_hint}"
            )
        self.engine = engine
        self._known = Known(remember)

    # -- the Store protocol --------------------------------------------------------------------------

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        validate.session_id(session)
        items = validate.messages(msgs)
        for m in items:
            m.to_json()  # encode before the transaction opens: no lock is held while we serialise
        version = uuid.uuid4().hex
        known = self._known.get(session)

        def write(conn: Connection) -> None:
            start = 0
            if known is not None and self._claim(conn, session, known[0], version, len(items)):
                start = common_prefix(known[1], items)
                if start < len(known[1]):
                    conn.execute(
                        delete(messages).where(
                            and_(messages.c.session_id == session, messages.c.seq >= start)
                        )
                    )
            else:
                conn.execute(self.upsert_session(session, version, len(items)))
                conn.execute(delete(messages).where(messages.c.session_id == session))
            if start < len(items):
                conn.execute(
                    insert(messages),
                    [{"session_id": session, "seq": i, "body": items[i].to_json()} for i in range(start, len(items))],
                )

        try:
            self._transaction("save", session, write)
        except BaseException:
            self._known.forget(session)
            raise
        self._known.put(session, version, items)

    def messages(self, session: str) -> list[Message]:
        validate.session_id(session)
        query = (
            select(sessions.c.version, messages.c.body)
            .select_from(
                sessions.outerjoin(
                    messages,
                    and_(messages.c.session_id == sessions.c.session_id, messages.c.seq < sessions.c.length),
                )
            )
            .where(sessions.c.session_id == session)
            .order_by(messages.c.seq)
        )

        def read(conn: Connection) -> list[Any]:
            return list(conn.execute(query))

        rows = self._transaction("messages", session, read, read_only=True)
        if not rows:
            return []
        try:
            items = tuple(Message.from_json(body) for _, body in rows if body is not None)
        except MessageError as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt message: {exc}") from exc
        self._known.put(session, rows[0][0], items)
        return list(items)

    def add_steer(self, session: str, text: str) -> None:
        validate.session_id(session)
        validate.steer_text(text)

        def add(conn: Connection) -> None:
            conn.execute(insert(steers).values(session_id=session, text=text))

        self._transaction("add_steer", session, add)

    def take_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        return self._transaction("take_steers", session, lambda conn: self.take(conn, session))

    # -- what dialects override ----------------------------------------------------------------------

    def upsert_session(self, session: str, version: str, length: int) -> Any:
        raise NotImplementedError

    def take(self, conn: Connection, session: str) -> list[str]:
        """Delete and return the session's steers, oldest first. DELETE ... RETURNING: rows another
        taker deleted first are simply not there, so each steer goes to exactly one taker."""
        rows = conn.execute(
            delete(steers).where(steers.c.session_id == session).returning(steers.c.id, steers.c.text)
        ).all()
        return [text for _, text in sorted(rows)]

    def is_transient(self, exc: DBAPIError) -> bool:
        """A deadlock or serialisation failure: the transaction may simply be run again."""
        return False

    # -- plumbing ------------------------------------------------------------------------------------

    def _claim(self, conn: Connection, session: str, known: str, version: str, length: int) -> bool:
        """Take the session row if it still has the version this process knows; lock it either way."""
        result = conn.execute(
            update(sessions)
            .where(and_(sessions.c.session_id == session, sessions.c.version == known))
            .values(version=version, length=length)
        )
        return result.rowcount == 1

    @contextmanager
    def _connection(self, read_only: bool) -> Iterator[Connection]:
        if read_only:
            with self.engine.connect().execution_options(**self.read_options) as conn, conn.begin():
                yield conn
        else:
            with self.engine.begin() as conn:
                yield conn

    def _transaction(
        self, op: str, session: str, work: Callable[[Connection], T], read_only: bool = False
    ) -> T:
        attempt = 0
        while True:
            try:
                with self._connection(read_only) as conn:
                    return work(conn)
            except DBAPIError as exc:
                if self.is_transient(exc) and attempt < _RETRIES:
                    attempt += 1
                    time.sleep(0.005 * (2**attempt) * random.random())
                    continue
                raise self._error(op, session, exc) from exc
            except SQLAlchemyError as exc:
                raise self._error(op, session, exc) from exc

    def _error(self, op: str, session: str, exc: SQLAlchemyError) -> StoreError:
        cause = str(getattr(exc, "orig", None) or exc)
        missing = _TABLE_NAME.search(cause) if _looks_missing(cause) else None
        if missing:
            return StoreError(
                f"{self.backend} store: table {missing.group(0)!r} does not exist ({op} of session "
                f"{session!r}); {self.schema_hint}"
            )
        return StoreError(f"{self.backend} store: {op} of session {session!r} failed: {cause}")

    def __repr__(self) -> str:
        return f"{type(self).__module__}.Store({self.engine.url!r})"


_TABLE_NAME = re.compile(r"\b(?:" + "|".join(t.name for t in TABLES) + r")\b")


def _looks_missing(message: str) -> bool:
    text = message.lower()
    return any(s in text for s in ("no such table", "does not exist", "doesn't exist", "undefinedtable"))
