"""The MySQL store's write (``CALL agent_sessions_write``): the row it answers is the row a read answers,
texts byte for byte and numbers exactly, though it comes in a few columns (a JSON array of the short fields
beside the long texts) and not one column per field: PyMySQL parses each column's description in Python."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine

from agent_sessions.backend import Acquire, Change, Guard, Renew, Want, change_json, guard_json
from stores import mysql
from tests import servers

ODD = 'a "quoted" \\ back\nslash\t\x01 é 漢字 🙂 \u2028 end '
"""A text JSON must escape (quotes, backslashes, control characters) with characters of every UTF-8 width,
and a trailing space (MariaDB's collations pad)."""


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = create_engine(servers.fresh_database(servers.MYSQL_URL, "mywrite"))
    yield eng
    eng.dispose()


@pytest.fixture
def store(engine: Engine) -> Iterator[mysql.Store]:
    store = mysql.Store(engine)
    yield store
    store.close()


def test_a_writes_row_is_the_row_a_read_answers(store: mysql.Store) -> None:
    backend = store.mysql
    sid = f"w-{uuid.uuid4().hex[:12]}"
    changes = [
        (Guard(lease_free=True), Change(exist=True, lease=Acquire(ODD, 2**31 - 1, uuid.uuid4().hex, ODD, 0.1, ODD),
                                       metadata=json.dumps({"k": ODD}), splice=(0, (ODD,)), open="set")),
        (Guard(length=1), Change(exist=True, journal=ODD, lease=Renew(1e6 / 3), splice=(1, (ODD, "b")))),
        (Guard(version=2), Change()),
    ]
    for guard, change in changes:
        written = backend.write(sid, guard, change)
        snapshot = backend.read(sid, Want())
        assert written.done and written.row is not None and snapshot is not None
        assert dataclasses.replace(written.row, now=0.0) == dataclasses.replace(snapshot.row, now=0.0)
    assert written.row.host == written.row.spec == written.row.turn == ODD
    assert written.row.journal == ODD and json.loads(written.row.metadata) == {"k": ODD}
    assert written.row.expires > written.row.now + 1e5 and written.row.open_since is not None


def test_a_refused_write_answers_the_row_as_it_is(store: mysql.Store) -> None:
    sid = f"w-{uuid.uuid4().hex[:12]}"
    refused = store.mysql.write(sid, Guard(exists=True), Change(exist=True))
    assert not refused.done and refused.row is None
    made = store.mysql.write(sid, Guard(exists=False), Change(exist=True))
    assert made.done and made.row is not None and made.row.exists and made.row.version == 1
    again = store.mysql.write(sid, Guard(exists=False), Change(exist=True))
    assert not again.done and again.row is not None
    assert again.row.exists and again.row.version == 1 and again.row.incarnation == made.row.incarnation


def test_a_write_answers_its_row_in_a_few_columns(engine: Engine) -> None:
    """Six: the short fields as one JSON array, then spec, turn, cancelled_turn, journal and metadata, each
    a column of its own (a JSON array of them all could pass ``max_allowed_packet``)."""
    raw = engine.raw_connection()
    try:
        cursor = raw.driver_connection.cursor()  # type: ignore[union-attr]
        guard = json.dumps(guard_json(Guard(lease_free=True)))
        change = json.dumps(change_json(Change(exist=True, lease=Acquire("h", 1, uuid.uuid4().hex, None, 5.0))))
        cursor.execute("CALL agent_sessions_write(%s, %s, %s, %s, %s)",
                       (f"w-{uuid.uuid4().hex[:12]}".encode(), guard, change, uuid.uuid4().hex, 2))
        assert len(cursor.description) == 6
        while cursor.nextset():
            pass
    finally:
        raw.close()
