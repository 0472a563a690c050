"""How the SQL stores plan a filtered listing (stores/_sql/listing.py), on 20,000 sessions of each of
SQLite, PostgreSQL and MariaDB: which statements a common, a rare and an out-of-reach value take, and
that the database really walks the index (updated, session_id) backwards and stops at the page's end
(its own EXPLAIN). That the pages are right is storetest's property
(``test_property_filtered_pages_are_the_filter_of_all_sessions``); this is about their cost.

The sessions are written straight into the tables (as bench/reading.py does), newest last: ``tenant``
``t-0`` .. ``t-9`` (a tenth each, spread evenly), ``user`` (100 sessions each), ``even`` (true or false,
alternately), and ``archived`` on the oldest tenth only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, insert

from agent_sessions import lifecycle
from stores import mysql, postgres, sqlite
from stores._sql import SQLStore, listing
from stores._sql.tables import messages, sessions, tags
from tests import servers

SESSIONS = 20_000
CHUNK = 5_000


def _load(engine: Engine) -> None:
    now = time.time() - SESSIONS
    for start in range(0, SESSIONS, CHUNK):
        rows: list[dict[str, Any]] = []
        msgs: list[dict[str, Any]] = []
        tag_rows: list[dict[str, Any]] = []
        for i in range(start, start + CHUNK):
            sid = f"s-{i:06d}"
            meta: dict[str, Any] = {"tenant": f"t-{i % 10}", "user": f"u-{i // 100}", "even": i % 2 == 0}
            if i < SESSIONS // 10:
                meta["archived"] = True
            rows.append({"session_id": sid, "created": now + i, "updated": now + i,
                         "metadata": lifecycle.encode_metadata(meta)})
            msgs.append({"session_id": sid, "seq": 0, "body": '{"role":"user","content":[]}'})
            tag_rows.extend({"session_id": sid, "name": k, "value": lifecycle.metadata_value(k, v)}
                            for k, v in meta.items())
        with engine.begin() as conn:
            conn.execute(insert(sessions), rows)
            conn.execute(insert(messages), msgs)
            conn.execute(insert(tags), tag_rows)


@pytest.fixture(scope="module", params=["sqlite", "postgres", "mysql"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SQLStore]:
    opened: SQLStore
    if request.param == "sqlite":
        path = Path(tmp_path_factory.mktemp("plans")) / "plans.db"
        opened = sqlite.open(path)
        engine = create_engine(f"sqlite:///{path}")
    else:
        base = servers.POSTGRES_URL if request.param == "postgres" else servers.MYSQL_URL
        engine = create_engine(servers.database_url(base, servers.database_name("plans")))
        servers.fresh_schema(engine)
        opened = (postgres.Store if request.param == "postgres" else mysql.Store)(engine)
    _load(engine)  # no statistics yet, as right after a bulk load: the last test gathers them
    yield opened
    engine.dispose()
    opened.engine.dispose()
    if isinstance(opened, (sqlite.Store, postgres.Store)):
        opened.close()


def _sent(store: SQLStore, **kwargs: Any) -> list[tuple[str, Any]]:
    """The statements (and parameters) ``list_sessions(**kwargs)`` sends, checked against its result."""
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        page = store.list_sessions(**kwargs)
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    assert len(page) == kwargs.get("limit", 50)
    return seen


def _kind(statement: str) -> str:
    if statement.lstrip().startswith("SELECT (SELECT count(*)"):
        return "count"
    if "JOIN agent_session_tags" in statement:
        return "tags"
    return "walk" if "agent_session_tags" in statement else "window end"


def test_a_common_value_walks_a_rare_one_and_an_out_of_reach_one_use_the_tags(store: SQLStore) -> None:
    walk = ["count", "window end", "walk"]
    assert [_kind(s) for s, _ in _sent(store, where={"tenant": "t-3"})] == walk
    assert [_kind(s) for s, _ in _sent(store, where={"tenant": "t-3"}, limit=5)] == walk
    assert [_kind(s) for s, _ in _sent(store, where={"user": "u-17"})] == ["count", "tags"]
    # common, but only the oldest have it: the walk gives up after its window, the tags plan answers
    assert [_kind(s) for s, _ in _sent(store, where={"archived": True})] == [*walk, "tags"]
    # two common keys: the walk probes both (and gives up when only old sessions have both); a rare key
    # and a common one: the tags plan
    assert [_kind(s) for s, _ in _sent(store, where={"tenant": "t-4", "even": True})] == walk
    assert [_kind(s) for s, _ in _sent(store, where={"tenant": "t-4", "archived": True})] == [*walk, "tags"]
    assert [_kind(s) for s, _ in _sent(store, where={"tenant": "t-7", "user": "u-17"}, limit=10)] == ["count", "tags"]


def _explain(store: SQLStore, statement: str, parameters: Any) -> str:
    prefix = {"sqlite": "EXPLAIN QUERY PLAN ", "postgresql": "EXPLAIN (ANALYZE, COSTS OFF) "}.get(
        store.engine.dialect.name, "EXPLAIN ")
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(prefix + statement, parameters).all()
    return "\n".join(" | ".join(str(c) for c in row) for row in rows)


@pytest.mark.parametrize("cursor", [False, True], ids=["first page", "a page deep in"])
def test_the_walk_reads_the_updated_index_backwards_and_stops_at_the_page(store: SQLStore, cursor: bool) -> None:
    _check_the_walk(store, cursor)


def _check_the_walk(store: SQLStore, cursor: bool) -> None:
    after = None
    if cursor:
        after = store.list_sessions(where={"tenant": "t-3"}, limit=500).next
    sent = _sent(store, where={"tenant": "t-3"}, limit=50, after=after)
    (statement, parameters), = [(s, p) for s, p in sent if _kind(s) == "walk"]
    plan = _explain(store, statement, parameters)
    dialect = store.engine.dialect.name
    if dialect == "sqlite":
        # one range of the index, in its order: no sort of the walked rows (the one TEMP B-TREE left
        # orders the page's 51 rows, outside the co-routine)
        assert re.search(r"SEARCH agent_sessions USING INDEX agent_sessions_by_updated \(\(?updated", plan), plan
        assert "MULTI-INDEX OR" not in plan and plan.count("TEMP B-TREE") == 1, plan
    elif dialect == "postgresql":
        assert re.search(r"Index (Only )?Scan Backward using agent_sessions_by_updated", plan), plan
        assert "Sort" not in plan, plan
        # the tag lookups stop at the page: about 10 per row of it for a tenth, not the whole window
        probes = [int(n) for n in re.findall(r"agent_session_tags_pkey.*loops=(\d+)", plan)]
        assert probes and max(probes) < listing.WALK_PER_ROW * 51 * 3 / 4, plan
    else:
        derived = [line for line in plan.splitlines() if "agent_sessions | range" in line]
        assert derived and "agent_sessions_by_updated" in derived[0] and "filesort" not in derived[0], plan


def test_the_window_end_and_the_counts_read_indexes_in_order_up_to_their_cap(store: SQLStore) -> None:
    if store.engine.dialect.name == "postgresql":
        # Never analyzed, PostgreSQL reckons these 20,000 rows are 1,660 (from the columns' declared
        # widths), so a window end 1,020 rows in looks cheaper by a sequential scan and a sort: 5-10 ms,
        # measured. At 100,000 it reads the index even so (bench/reading.py), and with statistics always:
        # the last test checks that.
        pytest.skip("PostgreSQL without statistics: checked with them, below")
    _check_counts_and_window_end(store)


def _check_counts_and_window_end(store: SQLStore) -> None:
    """The count reads the value's range of the tags' index, never the table (PostgreSQL, knowing the value
    has 2,000 entries, may read them all into a bitmap rather than stop at 510: its choice, bounded by the
    value's range); the window end reads the index (updated, session_id) in order, no sort, no bitmap."""
    kinds = []
    for statement, parameters in _sent(store, where={"tenant": "t-3"}):
        kind = _kind(statement)
        if kind == "count":
            plan = _explain(store, statement, parameters)
            assert "agent_session_tags_by_value" in plan, plan
            assert not re.search(r"Seq Scan|SCAN agent_session_tags\b|agent_session_tags \| ALL", plan), plan
        elif kind == "window end":
            plan = _explain(store, statement, parameters)
            assert "agent_sessions_by_updated" in plan, plan
            assert not re.search(r"TEMP B-TREE|filesort|Sort|Bitmap|Seq Scan", plan), plan
        kinds.append(kind)
    assert kinds == ["count", "window end", "walk"]


@pytest.mark.parametrize("cursor", [False, True], ids=["first page", "a page deep in"])
def test_the_walk_is_the_plan_with_statistics_too(store: SQLStore, cursor: bool) -> None:
    """Last in the module: ANALYZE, as autovacuum (or a user) does after a while, and the same checks.
    With statistics PostgreSQL knows the window's range is 1,020 rows, and still walks it in order."""
    analyze = {"sqlite": "ANALYZE", "postgresql": "ANALYZE",
               "mysql": "ANALYZE TABLE agent_sessions, agent_session_tags, agent_messages"}
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        result = conn.exec_driver_sql(analyze[store.engine.dialect.name])
        if result.returns_rows:  # MySQL's: a row per table
            result.all()
    _check_the_walk(store, cursor)
    _check_counts_and_window_end(store)
