"""How the SQL stores read a listing (stores/_sql/backend.py, ``SQLBackend._listing``), on 20,000 sessions of
SQLite and MariaDB: each page reads an index in its order and stops at the page's end, which the database's
own EXPLAIN shows (no sort of the matching rows, no scan of the table). That the pages are right is
storetest's property (``test_property_filtered_pages_are_the_filter_of_all_sessions``); this is their cost.

The sessions are written straight into the tables (as bench/reading.py does), one second apart; a tenth of
them are open. (PostgreSQL's plans: the PostgreSQL store's own tests.)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, insert

from agent_sessions import lifecycle
from agent_sessions.backed import BackedStore
from agent_sessions.backend import Idle, Open, Recent, empty_row, indexed, meta_index, new_incarnation
from stores import mysql, sqlite
from stores._sql.tables import messages, sessions, tags
from tests import servers

SESSIONS = 20_000
CHUNK = 5_000
NOW = time.time()


def _load(engine: Engine) -> None:
    start = NOW - 10 * SESSIONS
    for first in range(0, SESSIONS, CHUNK):
        rows: list[dict[str, Any]] = []
        msgs: list[dict[str, Any]] = []
        tag_rows: list[dict[str, Any]] = []
        for i in range(first, first + CHUNK):
            sid = f"s-{i:06d}"
            meta = {"tenant": f"t-{i % 10}", "user": f"u-{i // 100}"}
            row = dataclasses.replace(empty_row(sid), exists=True, incarnation=new_incarnation(), created=start + i,
                                      updated=start + i, version=1, length=1, edits=1,
                                      open_since=start + i if i % 10 == 0 else None,
                                      metadata=lifecycle.encode_metadata(meta))
            rows.append({c.name: getattr(row, {"session_id": "session", "exists_": "exists"}.get(c.name, c.name))
                         for c in sessions.columns})
            msgs.append({"session_id": sid, "idx": 0, "body": '{"role":"user","content":[]}'})
            tag_rows.extend({"session_id": sid, "name": k, "value": v} for k, v in indexed(row.metadata))
        with engine.begin() as conn:
            conn.execute(insert(sessions), rows)
            conn.execute(insert(messages), msgs)
            conn.execute(insert(tags), tag_rows)


@pytest.fixture(scope="module", params=["sqlite", "mysql"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackedStore]:
    opened: BackedStore
    if request.param == "sqlite":
        opened = sqlite.open(Path(tmp_path_factory.mktemp("plans")) / "plans.db")
        engine = opened.engine  # type: ignore[attr-defined]
    else:
        engine = create_engine(servers.database_url(servers.MYSQL_URL, servers.database_name("plans")))
        servers.fresh_schema(engine)
        opened = mysql.Store(engine)
    _load(engine)
    if request.param == "mysql":
        with engine.begin() as conn:
            for table in ("agent_sessions", "agent_metadata"):
                conn.exec_driver_sql(f"ANALYZE TABLE {table}")
    yield opened
    opened.close()
    engine.dispose()


def _plan(store: BackedStore, query: Recent | Open | Idle, **walk: Any) -> str:
    """The database's EXPLAIN of the listing's statement (``walk``: the walk's), flattened to one text."""
    engine: Engine = store.engine  # type: ignore[attr-defined]
    compiled = store.backend._listing(query, **walk).compile(dialect=engine.dialect)  # type: ignore[attr-defined]
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            params = tuple(compiled.params[k] for k in compiled.positiontup or ())
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", params).all()
        else:
            processed = compiled.construct_params()
            binds = {k: compiled.binds[k].type.dialect_impl(engine.dialect).bind_processor(engine.dialect)
                     for k in processed}
            params2 = {k: (binds[k](v) if binds[k] else v) for k, v in processed.items()}
            rows = conn.exec_driver_sql(f"EXPLAIN {compiled}", params2).all()
    return " | ".join(" ".join(str(c) for c in r) for r in rows)


def _sorts(plan: str) -> bool:
    return "TEMP B-TREE FOR ORDER BY" in plan or "filesort" in plan.lower()


@pytest.mark.parametrize("query", [
    Recent(limit=50),
    Recent(limit=50, after=(NOW - 10 * SESSIONS + 15_000, "s-015000")),
    Idle(idle_for=60, limit=50),
], ids=["recent", "recent-after-a-cursor", "idle"])
def test_recent_and_idle_walk_the_updated_index_in_order(store: BackedStore, query: Recent | Idle) -> None:
    plan = _plan(store, query)
    assert "agent_sessions_updated" in plan and not _sorts(plan), plan
    assert len(store.backend.sessions(query)) == 50


def test_open_reads_the_index_of_the_open_sessions_in_order(store: BackedStore) -> None:
    plan = _plan(store, Open(limit=50))
    assert "agent_sessions_open" in plan and not _sorts(plan), plan
    page = store.backend.sessions(Open(limit=50))
    assert [r.session for r in page] == [f"s-{i:06d}" for i in range(0, 500, 10)]


def test_a_rare_metadata_value_starts_from_the_lookup_index(store: BackedStore) -> None:
    plan = _plan(store, Recent(where=(("user", meta_index("u-7")),), limit=50))
    assert "agent_metadata_lookup" in plan, plan
    page = store.backend.sessions(Recent(where=(("user", meta_index("u-7")),), limit=50))
    assert [r.session for r in page] == [f"s-{i:06d}" for i in range(799, 749, -1)]


def test_a_common_metadata_value_walks_the_updated_index_down_to_a_window(store: BackedStore) -> None:
    """A tenth of the sessions have it: the page walks the newest sessions, each one's tag looked up by its
    key, down to the window's end (1,020 sessions for a page of 50), instead of sorting all 2,000 of the value."""
    query = Recent(where=(("tenant", meta_index("t-3")),), limit=50)
    end = (NOW - 10 * SESSIONS + 18_980, "s-018980")
    plan = _plan(store, query, walk=True, end=end)
    assert "agent_sessions_updated" in plan and not _sorts(plan), plan
    assert [r.session for r in store.backend.sessions(query)] == [f"s-{i:06d}" for i in range(19_993, 19_493, -10)]
