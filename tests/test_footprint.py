"""What a test run leaves on servers it did not start: nothing of its own (issue 28, item 9). A pytest run
of tests/footprint_child.py with a prefix of its own makes a database on PostgreSQL and one on MariaDB;
once it has exited, no database of that prefix is on either server. With AGENT_SESSIONS_KEEP_DATABASES=1
they are kept, which shows the listing sees them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import servers

ROOT = Path(__file__).resolve().parents[1]
CHILD_PREFIX = f"{servers.PREFIX}_fp"
CHILD_DATABASES = {f"{CHILD_PREFIX}_pg", f"{CHILD_PREFIX}_my"}


def child_run(**env: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/footprint_child.py"],
                         cwd=ROOT, env={**os.environ, "AGENT_SESSIONS_TEST_PREFIX": CHILD_PREFIX, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    return out


def left(prefix: str = CHILD_PREFIX) -> set[str]:
    return {name for url in servers.SQL_SERVERS for name in servers.list_databases(url, prefix)}


@pytest.fixture
def clean() -> object:
    for url in servers.SQL_SERVERS:
        servers.drop_databases(url, servers.list_databases(url, CHILD_PREFIX))
    yield None
    for url in servers.SQL_SERVERS:
        servers.drop_databases(url, servers.list_databases(url, CHILD_PREFIX))


def test_a_run_leaves_no_database_of_its_own_on_either_server(clean: object) -> None:
    assert left() == set()
    child_run()
    assert left() == set()


def test_the_listing_sees_them_when_a_run_keeps_them(clean: object) -> None:
    child_run(AGENT_SESSIONS_KEEP_DATABASES="1")
    assert left() == CHILD_DATABASES


def test_databases_there_before_a_run_are_not_its_to_drop(clean: object) -> None:
    servers.database_url(servers.POSTGRES_URL, f"{CHILD_PREFIX}_pg")
    child_run()
    assert left() == {f"{CHILD_PREFIX}_pg"}
