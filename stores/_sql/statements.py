"""The statements a store runs on every step, built once.

Building a Core statement costs more than running it on SQLite (construction plus its cache key, about
0.1 ms each): statements built per call made a save several times the raw INSERT + COMMIT floor.
Values are bound by name at execution.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BindParameter,
    Integer,
    TextClause,
    and_,
    bindparam,
    delete,
    func,
    insert,
    select,
    text,
    update,
)

from agent_sessions import Message

from .tables import LongText, SessionId, journals, messages, runs, sessions, steers

SID: BindParameter[str] = bindparam("sid")

CLAIM = (
    update(sessions)
    .where(and_(sessions.c.session_id == SID, sessions.c.version == bindparam("known")))
    .values(version=bindparam("new_version"))
)
"""Take the session row if it still has the version this process knows (and lock it either way)."""

TRIM = delete(messages).where(and_(messages.c.session_id == SID, messages.c.seq >= bindparam("start")))
CLEAR = delete(messages).where(messages.c.session_id == SID)
APPEND = insert(messages)

LOAD = (
    select(sessions.c.version, messages.c.body)
    .select_from(sessions.outerjoin(messages, messages.c.session_id == sessions.c.session_id))
    .where(sessions.c.session_id == SID)
    .order_by(messages.c.seq)
)
LENGTH = select(func.count()).select_from(messages).where(messages.c.session_id == SID)

MAX_APPEND = 100
"""Messages one append statement carries; a save adding more runs the general transaction."""


@functools.lru_cache(maxsize=4 * MAX_APPEND)
def append_if_current(count: int, unsteered: bool, lock: str = "") -> TextClause:
    """Insert ``count`` new messages (``:q0``/``:b0`` ...) in one statement, only while the session still
    has the version this process knows (and, when ``unsteered``, no steer waits): the usual step, whole.
    The version is not replaced: an append changes no message another writer knows, and a second writer
    appending at the same positions fails on the primary key instead. ``lock``: what makes the read of
    the session row a locking one where the statement's reads would not be (MySQL's LOCK IN SHARE MODE)."""
    guard = " AND NOT EXISTS (SELECT 1 FROM agent_steers WHERE agent_steers.session_id = :sid)" if unsteered else ""
    rows = " UNION ALL ".join(f"SELECT :q{i} AS seq, :b{i} AS body" for i in range(count))
    statement = text(
        "INSERT INTO agent_messages (session_id, seq, body) "
        f"SELECT s.session_id, v.seq, v.body FROM agent_sessions AS s JOIN ({rows}) AS v ON 1 = 1 "
        f"WHERE s.session_id = :sid AND s.version = :known{guard}{lock}"
    )
    types: list[BindParameter[Any]] = [bindparam("sid", type_=SessionId)]
    types += [bindparam(f"q{i}", type_=Integer()) for i in range(count)]
    types += [bindparam(f"b{i}", type_=LongText) for i in range(count)]
    return statement.bindparams(*types)


def append_params(session: str, known: str, items: Sequence[Message], start: int) -> dict[str, Any]:
    """The values of an append of ``items[start:]`` (``append_if_current``, or a dialect's own)."""
    params: dict[str, Any] = {"sid": session, "known": known}
    for i in range(len(items) - start):
        params[f"q{i}"] = start + i
        params[f"b{i}"] = items[start + i].to_json()
    return params

ADD_STEER = insert(steers)
ANY_STEER = select(steers.c.id).where(steers.c.session_id == SID).limit(1)
TAKE_STEERS = delete(steers).where(steers.c.session_id == SID).returning(steers.c.id, steers.c.text)
LOCK_STEERS = (
    select(steers.c.id, steers.c.text).where(steers.c.session_id == SID).order_by(steers.c.id).with_for_update()
)

HOLDER = select(runs).where(runs.c.session_id == SID)
JOURNAL = select(journals.c.body).where(journals.c.session_id == SID)
DROP_JOURNAL = delete(journals).where(journals.c.session_id == SID)
PUT_JOURNAL = insert(journals)
