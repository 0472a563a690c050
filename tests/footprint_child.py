"""Run by tests/test_footprint.py as a pytest run of its own, with a prefix of its own: it makes a
database on each SQL server, as the suite's tests do, and checks they are there while it runs."""

from __future__ import annotations

from sqlalchemy import create_engine, text

from tests import servers


def test_makes_a_database_on_each_sql_server() -> None:
    for base, suffix in ((servers.POSTGRES_URL, "pg"), (servers.MYSQL_URL, "my")):
        url = servers.database_url(base, servers.database_name(suffix))
        engine = create_engine(url)
        with engine.connect() as conn:  # used, and left in the pool: as a test's store leaves its own
            assert conn.execute(text("SELECT 1")).scalar() == 1
        assert servers.database_name(suffix) in servers.list_databases(base)
