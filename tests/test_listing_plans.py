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
from psycopg import sql as psycopg_sql
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
    # PostgreSQL's walk carries its window; the others read the window's end first
    walk = ["count", "walk"] if store.windowed_walk else ["count", "window end", "walk"]
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


def _explain_generic(store: SQLStore, statement: str, parameters: dict[str, Any]) -> str:
    """PostgreSQL's generic plan of ``statement`` (its plan for any values), with its estimates, run with
    ``parameters``."""
    order: list[str] = []

    def numbered(match: re.Match[str]) -> str:
        if match[1] not in order:
            order.append(match[1])
        return f"${order.index(match[1]) + 1}"

    text = re.sub(r"%\((\w+)\)s", numbered, statement)
    raw = store.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE generic_walk AS {text}")
        values = psycopg_sql.SQL(", ").join(psycopg_sql.Literal(parameters[name]) for name in order)
        cursor.execute(psycopg_sql.SQL("EXPLAIN (ANALYZE) EXECUTE generic_walk ({})").format(values))
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("DEALLOCATE generic_walk")
        cursor.execute("RESET plan_cache_mode")
        return plan
    finally:
        raw.close()


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
        # as sent, and as psycopg runs it once prepared (at its fifth use), when PostgreSQL may choose a
        # plan made for any values: one that knows the window's size (a LIMIT it cannot see, it takes for
        # a tenth of the rows, and at 100,000 sessions it sorted the table's tenth: 40 ms, against 2.5)
        generic = _explain_generic(store, statement, parameters)
        window = r"Limit  \(cost=\S+ rows=(\d+).*\n.*Index Scan Backward[^(]*\(cost=\S+ rows=(\d+)"
        cut, read = map(int, re.findall(window, generic)[0])
        assert cut == min(listing.window(51), read), generic
        for each in (plan, generic):
            assert re.search(r"Index (Only )?Scan Backward using agent_sessions_by_updated", each), each
            assert "Sort" not in each, each
            # the tag lookups stop at the page: about 10 per row of it for a tenth, not the whole window
            probes = [int(n) for n in re.findall(r"agent_session_tags_pkey.*loops=(\d+)", each)]
            assert probes and max(probes) < listing.WALK_PER_ROW * 51 * 3 / 4, each
    else:
        derived = [line for line in plan.splitlines() if "agent_sessions | range" in line]
        assert derived and "agent_sessions_by_updated" in derived[0] and "filesort" not in derived[0], plan


def test_the_window_end_and_the_counts_read_indexes_in_order_up_to_their_cap(store: SQLStore) -> None:
    _check_counts_and_window_end(store)


def _check_counts_and_window_end(store: SQLStore) -> None:
    """The count reads the value's range of the tags' index, never the table (PostgreSQL, knowing the value
    has 2,000 entries, may read them all into a bitmap rather than stop at 510: its choice, bounded by the
    value's range); the window end, where it is read first, reads the index (updated, session_id) in order,
    no sort, no bitmap."""
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
    assert kinds == (["count", "walk"] if store.windowed_walk else ["count", "window end", "walk"])


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
