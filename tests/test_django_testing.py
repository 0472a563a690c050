"""The app's test support, each in a process of its own (Django's settings are per process): ``reset()``
closes every connection the store opened to the database (the engine's pool and PostgreSQL's listener),
which is what lets Django drop a test database; ``empty_store()`` refuses a database that is not Django's
test database. ``manage.py test`` with the store used plainly and with ``StoreTestMixin``, end to end, is
tests/test_django_wheel.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, make_url

from tests import servers

ROOT = Path(__file__).resolve().parents[1]

COUNT_AND_RESET = """\
import django, psycopg, sys, time
django.setup()
from agent_sessions.contrib.django import reset, store

def others():
    with psycopg.connect(sys.argv[1], autocommit=True) as admin:
        return admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (sys.argv[2],)).fetchone()[0]

store().info("none")
store().wait_for_events("none", 0, 0.05)  # starts the listener: a connection of its own
print(others())
reset()
deadline = time.monotonic() + 5  # a closed connection's server process leaves pg_stat_activity a moment later
while others() and time.monotonic() < deadline:
    time.sleep(0.05)
print(others())
"""

REFUSE = """\
import django
django.setup()
from django.core.exceptions import ImproperlyConfigured
import agent_sessions as agent
from agent_sessions.contrib.django import store
from agent_sessions.contrib.django.testing import empty_store

agent.open("kept", store()).save([agent.Message.user("hello")])
try:
    empty_store()
except ImproperlyConfigured as e:
    print("refused:", e)
print("kept:", store().info("kept").messages)
"""


def child(code: str, *args: str, **env: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DJANGO_SETTINGS_MODULE": "examples.django_app.project.settings", **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_reset_closes_the_pool_and_the_listener_on_postgresql() -> None:
    name = servers.database_name("djreset")
    url = servers.database_url(servers.POSTGRES_URL, name)
    engine = create_engine(url)
    servers.fresh_schema(engine)
    engine.dispose()
    try:
        admin = make_url(url).set(drivername="postgresql", database="postgres").render_as_string(False)
        django_url = make_url(url).set(drivername="postgresql").render_as_string(False)
        before, after = child(COUNT_AND_RESET, admin, name, DJANGO_DB_URL=django_url)
        assert int(before) >= 2, before  # a pooled connection and the listener's
        assert after == "0"
    finally:
        servers.drop_databases(servers.POSTGRES_URL, {name})


def test_empty_store_refuses_a_database_that_is_not_the_test_database(tmp_path: Path) -> None:
    refused, kept = child(REFUSE, DJANGO_APP_STATE=str(tmp_path), DJANGO_DB_URL="")
    assert refused.startswith("refused: empty_store() deletes every session; it runs only on the test database of "
                              "a test run")
    assert kept == "kept: 1"
