"""How the PostgreSQL store's listings read their indexes (the shared ``SQLBackend._listing``, with the store's
clock read once per statement), on 20,000 sessions written straight into the tables, newest last: ``tenant``
``t-0`` .. ``t-9`` (a tenth each, spread evenly), ``user`` (100 sessions each), ``even`` (true or false,
alternately), and ``archived`` on the oldest tenth only. That the pages are right is storetest's property;
this is their cost, read from PostgreSQL's own ``EXPLAIN ANALYZE``. Its plans are the planner's, from the
statistics, so the tests say what must hold of any good plan: the index read, and the rows it gave.
(SQLite's and MariaDB's: tests/test_listing_plans.py.)"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text

from agent_sessions.backend import Idle, Open, Recent, meta_index
from stores import postgres
from tests import servers

SESSIONS = 20_000
PAGE = 50


@pytest.fixture(scope="module")
def backend() -> Iterator[postgres.Backend]:
    engine = create_engine(servers.database_url(servers.POSTGRES_URL, servers.database_name("plans")))
    servers.fresh_schema(engine)
    _load(engine)
    yield postgres.Backend(engine)
    engine.dispose()


def _load(engine: Engine) -> None:
    now = time.time() - SESSIONS
    rows, tags = [], []
    for i in range(SESSIONS):
        sid = f"s-{i:06d}"
        meta: dict[str, object] = {"tenant": f"t-{i % 10}", "user": f"u-{i // 100}", "even": i % 2 == 0}
        if i < SESSIONS // 10:
            meta["archived"] = True
        open_since = now + i if i % 1000 == 0 else None  # twenty open turns
        rows.append({"sid": sid, "at": now + i, "meta": json.dumps(meta), "open": open_since})
        tags += [{"sid": sid, "name": k, "value": meta_index(v)} for k, v in meta.items()]
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO agent_sessions VALUES (:sid, true, 'i', :at, :at, 1, 1, 1, NULL, 0, 0, '', "
                          "0, NULL, NULL, false, NULL, false, NULL, :open, :meta, 0, 0, 0)"), rows)
        conn.execute(text("INSERT INTO agent_metadata VALUES (:sid, :name, :value)"), tags)
        conn.exec_driver_sql("ANALYZE agent_sessions")
        conn.exec_driver_sql("ANALYZE agent_metadata")


def _plan(backend: postgres.Backend, query: Recent | Open | Idle, **walk: object) -> str:
    statement = backend._listing(query, **walk).compile(dialect=backend.engine.dialect)  # type: ignore[arg-type]
    with backend.engine.connect() as conn:
        lines = conn.exec_driver_sql("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + str(statement),
                                     statement.params).scalars().all()
    return "\n".join(lines)


def _rows_of(plan: str, node: str) -> int:
    """The rows the plan's node naming ``node`` (an index) gave, in all its loops."""
    found = re.search(rf"{re.escape(node)}[^\n]*\(actual rows=(\d+) loops=(\d+)\)", plan)
    assert found, plan
    return int(found[1]) * int(found[2])


def test_the_newest_page_is_the_updated_index_read_backwards_for_one_page(backend: postgres.Backend) -> None:
    plan = _plan(backend, Recent(limit=PAGE))
    assert "Index Scan Backward using agent_sessions_updated" in plan, plan
    assert _rows_of(plan, "Index Scan Backward using agent_sessions_updated") == PAGE, plan


def test_a_page_after_a_cursor_starts_at_the_cursor(backend: postgres.Backend) -> None:
    newest = backend.sessions(Recent(limit=PAGE))
    cut = (newest[-1].updated, newest[-1].session)
    plan = _plan(backend, Recent(limit=PAGE, after=cut))
    assert "Index Scan Backward using agent_sessions_updated" in plan, plan
    assert _rows_of(plan, "Index Scan Backward using agent_sessions_updated") <= PAGE + 1, plan


def test_a_rare_value_is_found_by_the_metadata_index(backend: postgres.Backend) -> None:
    plan = _plan(backend, Recent(where=(("user", meta_index("u-5")),), limit=PAGE))
    assert "agent_metadata_lookup" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_a_common_value_stops_soon_after_its_page(backend: postgres.Backend) -> None:
    """A tenth of the sessions have it: whichever index the plan walks, it reads a few pages' worth, not the
    20,000 sessions."""
    plan = _plan(backend, Recent(where=(("tenant", meta_index("t-0")),), limit=PAGE))
    assert "Seq Scan" not in plan, plan
    read = [int(n) * int(loops) for n, loops in re.findall(r"Index[^\n]*\(actual rows=(\d+) loops=(\d+)\)", plan)]
    assert read and max(read) <= 20 * PAGE, plan


def test_a_common_values_walk_reads_the_updated_index_down_to_its_window(backend: postgres.Backend) -> None:
    """The walk a common value's page takes (``SQLBackend._page``): the newest sessions, each one's tag looked
    up by its key, never more than the window (1,020 sessions for a page of 50), whether the planner stops
    at the page's end or reads the window's range of the index and sorts what matched."""
    query = Recent(where=(("tenant", meta_index("t-0")),), limit=PAGE)
    window = backend.sessions(Recent(limit=20 * (PAGE + 1)))
    plan = _plan(backend, query, walk=True, end=(window[-1].updated, window[-1].session))
    assert "Seq Scan" not in plan and "agent_metadata_lookup" not in plan, plan
    assert _rows_of(plan, "agent_sessions_updated") <= 20 * (PAGE + 1), plan
    assert _rows_of(plan, "agent_metadata_pkey") <= 20 * (PAGE + 1), plan
    assert [r.session for r in backend.sessions(query)] == [f"s-{i:06d}" for i in range(19_990, 19_490, -10)]


def test_idle_and_open_are_bounded_by_the_clock_in_the_index(backend: postgres.Backend) -> None:
    """The clock is read once per statement (an InitPlan), so the index scan is bounded by it: an Idle
    listing of sessions idle for longer than any has been reads none of them."""
    idle = _plan(backend, Idle(idle_for=10 * SESSIONS, limit=PAGE))
    assert "agent_sessions_updated" in idle and "Rows Removed by Filter" not in idle, idle
    assert re.search(r"Index Cond: \(.*updated < ", idle), idle
    stale = _plan(backend, Idle(idle_for=0.0, limit=PAGE))
    assert _rows_of(stale, "agent_sessions_updated") == PAGE, stale
    opened = _plan(backend, Open(limit=PAGE))
    assert "agent_sessions_open" in opened and "Seq Scan" not in opened, opened
