"""The statements a store runs on every step, built once.

Building a Core statement costs more than running it on SQLite (construction plus its cache key, about
0.1 ms each): statements built per call made a save several times the raw INSERT + COMMIT floor.
Values are bound by name at execution.
"""

from __future__ import annotations

from sqlalchemy import BindParameter, and_, bindparam, delete, exists, insert, select, update

from .tables import journals, messages, runs, sessions, steers

SID: BindParameter[str] = bindparam("sid")

CLAIM = (
    update(sessions)
    .where(and_(sessions.c.session_id == SID, sessions.c.version == bindparam("known")))
    .values(version=bindparam("new_version"), length=bindparam("new_length"))
)
"""Take the session row if it still has the version this process knows (and lock it either way)."""

CLAIM_UNSTEERED = CLAIM.where(~exists().where(steers.c.session_id == SID))
"""CLAIM, only while no steer waits: a step with nothing to take is then one statement fewer."""

TRIM = delete(messages).where(and_(messages.c.session_id == SID, messages.c.seq >= bindparam("start")))
CLEAR = delete(messages).where(messages.c.session_id == SID)
APPEND = insert(messages)

LOAD = (
    select(sessions.c.version, messages.c.body)
    .select_from(
        sessions.outerjoin(
            messages, and_(messages.c.session_id == sessions.c.session_id, messages.c.seq < sessions.c.length)
        )
    )
    .where(sessions.c.session_id == SID)
    .order_by(messages.c.seq)
)

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
