"""The Django app as a user gets it: the wheel built from the tree, installed with its extras into a fresh
venv (tests/wheel.py), a new Django project with the app in INSTALLED_APPS, and every management command
run there as its own process: migrate, steer, show, sessions, prune, cancel, and `migrate agent_sessions
zero`; `manage.py test` on PostgreSQL and MySQL with Django's default test settings, twice."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests import servers, wheel

DRIVERS = ("sqlalchemy", "psycopg", "pymysql", "pymongo", "bson", "django", "celery")


def run(cmd: list[str], *, timeout: float = 120, cwd: Path | None = None, env: dict[str, str] | None = None,
        code: int = 0) -> subprocess.CompletedProcess[str]:
    try:
        return wheel.run(cmd, timeout=timeout, cwd=cwd, env=env, code=code)
    except wheel.Failed as exc:
        pytest.fail(str(exc))


clean_env = wheel.clean_env


@pytest.fixture(scope="session")
def venv(wheel_python: Path) -> Path:
    """The python of a fresh venv holding the wheel built from this tree (tests/wheel.py)."""
    return wheel_python


SETTINGS = """\
SECRET_KEY = "test-only"
INSTALLED_APPS = ["agent_sessions.contrib.django"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {db!r}}}}}
AGENT_SESSIONS = {{"DATABASE": "default", "SSE_SECONDS": 0.2}}
ROOT_URLCONF = "site_urls"
USE_TZ = True
"""

URLS = """\
from django.urls import include, path

urlpatterns = [path("agent/", include("agent_sessions.contrib.django.urls"))]
"""

MANAGE = """\
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "site_settings")
from django.core.management import execute_from_command_line

execute_from_command_line(sys.argv)
"""

# What a view or a Celery task does: the app's store, from any code of the project.
SAVE = """\
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "site_settings")
import django

django.setup()
import agent_sessions as agent
from agent_sessions.contrib.django import store

session = agent.open(sys.argv[1], store())
session.save([agent.Message.user(text) for text in sys.argv[2:]])
if isinstance(store(), agent.LifecycleStore):
    session.set_metadata({"user": "u-17"})
print(agent.__file__)
"""


# The app's events view, routed by its urls: what a browser's GET gets (the session has no events yet).
EVENTS = """\
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "site_settings")
import django

django.setup()
from django.test import RequestFactory
from django.urls import resolve, reverse

url = reverse("agent_sessions_events", args=[sys.argv[1]])
match = resolve(url)
response = match.func(RequestFactory().get(url, HTTP_LAST_EVENT_ID="7"), **match.kwargs)
print(url, response.status_code, response["Content-Type"], repr(b"".join(response.streaming_content).decode()))
"""


@pytest.fixture(scope="module")
def project(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new Django project beside the venv: settings with the app, a SQLite file, manage.py."""
    home = tmp_path_factory.mktemp("django_project")
    (home / "site_settings.py").write_text(SETTINGS.format(db=str(home / "db.sqlite3")))
    (home / "manage.py").write_text(MANAGE)
    (home / "save.py").write_text(SAVE)
    (home / "site_urls.py").write_text(URLS)
    (home / "events.py").write_text(EVENTS)
    return home


def manage(venv: Path, project: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    return run([str(venv), "manage.py", *args], cwd=project, env=clean_env(), code=code)


def tables(project: Path) -> tuple[set[str], int]:
    conn = sqlite3.connect(project / "db.sqlite3")
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return {n for n in names if n.startswith("agent_")}, conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


def test_the_core_in_the_venv_imports_neither_django_nor_a_driver(venv: Path) -> None:
    out = run([str(venv), "-I", "-c", "import sys, agent_sessions, agent_sessions.contrib\n"
                                      "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"]).stdout
    assert [m for m in DRIVERS if m in out.split()] == []


def test_the_app_installed_from_the_wheel_migrates_and_its_commands_run(venv: Path, project: Path) -> None:
    out = manage(venv, project, "migrate", "--noinput").stdout
    assert "Applying agent_sessions.0001_initial... OK" in out
    assert tables(project) == (
        {"agent_store", "agent_sessions", "agent_messages", "agent_steers", "agent_queue", "agent_keys", "agent_events",
         "agent_metadata"},
        1)

    where = run([str(venv), "save.py", "w-1", "review lease.go", "and token.go"], cwd=project, env=clean_env()).stdout
    assert Path(where.strip()).is_relative_to(venv.parent.parent)  # the installed wheel, not this tree

    assert manage(venv, project, "agent_sessions", "steer", "w-1", "check the expiry").stdout == \
        "steer left for session w-1; no run holds the session now: its next run takes it\n"
    streamed = run([str(venv), "events.py", "w-1"], cwd=project, env=clean_env()).stdout
    assert streamed == "/agent/sessions/w-1/events 200 text/event-stream 'retry: 500\\n\\n'\n"
    refused = manage(venv, project, "agent_sessions", "steer", "w-1", "", code=2)
    assert "must not be empty" in refused.stderr and "Traceback" not in refused.stderr

    shown = manage(venv, project, "agent_sessions", "show", "w-1", "--last", "1").stdout
    assert shown.startswith("session w-1: 2 messages")
    assert "... 1 earlier message (--all shows them)\n#2 user:\n  and token.go\n" in shown
    full = json.loads(manage(venv, project, "agent_sessions", "show", "w-1", "--all", "--json").stdout)
    assert [m["content"][0]["text"] for m in full["messages"]] == ["review lease.go", "and token.go"]

    cancelled = json.loads(manage(venv, project, "agent_sessions", "cancel", "w-1", "--json", code=1).stdout)
    assert cancelled == {"id": "w-1", "cancelled": False, "closed": False}

    listed = json.loads(manage(venv, project, "agent_sessions", "list", "--where", "user=u-17", "--json").stdout)
    assert [s["id"] for s in listed["sessions"]] == ["w-1"] and listed["sessions"][0]["messages"] == 2
    assert json.loads(manage(venv, project, "agent_sessions", "prune", "--idle-for", "30d", "--json").stdout)[
        "deleted"] == 0
    assert json.loads(manage(venv, project, "agent_sessions", "prune", "--idle-for", "0s", "--json").stdout)[
        "deleted"] == 1
    assert manage(venv, project, "agent_sessions", "list").stdout == "no sessions\n"

    out = manage(venv, project, "migrate", "agent_sessions", "zero").stdout
    assert "Unapplying agent_sessions.0001_initial... OK" in out
    assert tables(project) == (set(), 0)


def test_the_schema_helper_runs_from_the_wheel(venv: Path, project: Path) -> None:
    """What regenerates the migration, from the installed package: the same file as the one shipped."""
    out = run([str(venv), "-I", "-m", "agent_sessions.contrib.django.schema"], cwd=project).stdout
    shipped = run([str(venv), "-I", "-c", "import importlib, pathlib; m = importlib.import_module("
                   "'agent_sessions.contrib.django.migrations.0001_initial'); print(pathlib.Path(m.__file__)"
                   ".with_suffix('.json').read_text(), end='')"], cwd=project).stdout
    assert out == shipped
    assert out.startswith('{\n "schema_version": 1,')


# A new project whose tests use the store, as a user writes them, on Django's default test settings (no
# TEST key, no TEST_RUNNER): one module uses the store plainly, as it uses the ORM; the other through
# StoreTestMixin. Each test sees an empty store whatever another test saved, saves, and starts
# PostgreSQL's listener (the connection that used to keep Django from dropping the test database).
DB_SETTINGS = """\
SECRET_KEY = "test-only"
INSTALLED_APPS = ["agent_sessions.contrib.django", "shop"]
DATABASES = {{"default": {{
    "ENGINE": {engine!r}, "NAME": {name!r}, "USER": {user!r}, "HOST": {host!r}, "PORT": {port!r},
    "PASSWORD": {password!r},
}}}}
USE_TZ = True
"""

MYSQL_DRIVER = """\
import pymysql  # Django's MySQL backend is written for mysqlclient; PyMySQL stands in for it here

pymysql.install_as_MySQLdb()
"""

STORY = """\
from django.test import TestCase, TransactionTestCase

import agent_sessions as agent
from agent_sessions.contrib.django import store
{mixin_import}


class Story:
    def check_empty_then_save(self, mine):
        self.assertEqual(store().list_sessions().sessions, [], "a session of another test leaked into this one")
        session = agent.open(mine, store())
        session.save([agent.Message.user("review lease.go")])
        session.steer("and token.go")
        session.enqueue("and the renewal", "msg-2")
        if hasattr(store(), "wait_for_events"):
            self.assertFalse(store().wait_for_events(mine, 0, 0.05))  # PostgreSQL: starts the LISTEN connection
        self.assertEqual(store().info(mine).messages, 1)
        self.assertEqual([s.id for s in store().list_sessions().sessions], [mine])

    def test_one(self):
        self.check_empty_then_save(type(self).__name__ + "-1")

    def test_two(self):
        self.check_empty_then_save(type(self).__name__ + "-2")


class {style}First({bases}Story, TestCase):
    pass


class {style}Second({bases}Story, TestCase):
    pass


class {style}Transactional({bases}Story, TransactionTestCase):
    pass
"""


def write_project(home: Path, vendor: str, url: str, name: str) -> None:
    from sqlalchemy import make_url

    parts = make_url(url)
    (home / "shop").mkdir(parents=True)
    (home / "shop" / "__init__.py").write_text("")
    (home / "shop" / "test_plain.py").write_text(STORY.format(mixin_import="", style="Plain", bases=""))
    (home / "shop" / "test_mixin.py").write_text(STORY.format(
        mixin_import="from agent_sessions.contrib.django.testing import StoreTestMixin", style="Mixin",
        bases="StoreTestMixin, "))
    engine = "django.db.backends.postgresql" if vendor == "postgresql" else "django.db.backends.mysql"
    (home / "site_settings.py").write_text((MYSQL_DRIVER if vendor == "mysql" else "") + DB_SETTINGS.format(
        engine=engine, name=name, user=parts.username or "", password=parts.password or "", host=parts.host or "",
        port=str(parts.port or "")))
    (home / "manage.py").write_text(MANAGE)


@pytest.mark.parametrize("vendor", ["postgresql", "mysql"])
def test_manage_py_test_with_default_settings_runs_twice_isolates_tests_and_leaves_no_database(
        venv: Path, tmp_path: Path, vendor: str) -> None:
    """Django's default test settings: the test database is ``test_`` + NAME, and TEST_RUNNER is Django's.
    Twelve tests in six classes (three plain, three with StoreTestMixin; TestCase and TransactionTestCase),
    run twice: every test starts from an empty store, and no test database is left behind."""
    base = servers.POSTGRES_URL if vendor == "postgresql" else servers.MYSQL_URL
    name = servers.database_name(f"dj{vendor[:2]}")
    test_name = "test_" + name
    home = tmp_path / "project"
    write_project(home, vendor, base, name)
    try:
        for _ in range(2):  # a database left behind would stop the second run at Django's prompt (or fail it)
            out = manage(venv, home, "test", "--noinput", "-v", "2")
            assert "Ran 12 tests" in out.stderr and "\nOK\n" in out.stderr, out.stderr
            assert "Applying agent_sessions.0001_initial... OK" in out.stderr + out.stdout
            assert f"Destroying test database for alias 'default' ('{test_name}')" in out.stderr, out.stderr
            assert servers.list_databases(base, prefix="test_" + servers.PREFIX) == set()
    finally:
        servers.drop_databases(base, {test_name}, prefix="test_" + servers.PREFIX)


def test_the_store_is_refused_outside_a_test_run_and_a_real_database_is_never_emptied(
        venv: Path, tmp_path: Path) -> None:
    """``empty_store()`` (what StoreTestMixin and the test command call) refuses a database that is not a
    test run's, even one named like a test database: nothing is read or deleted (the database need not
    even exist)."""
    home = tmp_path / "project"
    write_project(home, "postgresql", servers.POSTGRES_URL, "test_" + servers.database_name("djreal"))
    (home / "try_empty.py").write_text(
        "import os\nos.environ.setdefault('DJANGO_SETTINGS_MODULE', 'site_settings')\nimport django\n"
        "django.setup()\nfrom django.core.exceptions import ImproperlyConfigured\n"
        "from agent_sessions.contrib.django.testing import empty_store\n"
        "try:\n    empty_store()\nexcept ImproperlyConfigured as e:\n    print('refused:', e)\n")
    out = run([str(venv), "try_empty.py"], cwd=home, env=clean_env()).stdout
    assert out.startswith("refused: empty_store() deletes every session; it runs only on the test database "
                          "of a test run"), out
    assert out.rstrip().endswith("with no test run set up"), out


def test_a_projects_own_stores_package_is_named_from_the_wheel_too(venv: Path, tmp_path: Path) -> None:
    """The installed layout (site-packages, no editable finder): a shop's `stores` app in the project's
    directory, which `python -m` puts first on the path, is named by the CLI and at import."""
    (tmp_path / "stores").mkdir()
    (tmp_path / "stores" / "__init__.py").write_text("")
    foreign = tmp_path / "stores" / "__init__.py"
    out = run([str(venv), "-m", "agent_sessions", "--store", str(tmp_path / "none.db"), "list"], cwd=tmp_path,
              env=clean_env(), code=3)
    assert f"the package 'stores' that Python imports is {foreign}" in out.stderr and "pip install" not in out.stderr
    imported = run([str(venv), "-c", "import agent_sessions\ntry:\n    from stores import sqlite\n"
                    "except agent_sessions.StoresShadowed as e:\n    print(e.found, e.expected)"],
                   cwd=tmp_path, env=clean_env()).stdout.split()
    assert imported[0] == str(foreign) and Path(imported[1]).is_relative_to(venv.parent.parent), imported


def test_check_validates_agent_sessions_and_errors_speak_django(venv: Path, tmp_path: Path) -> None:
    """``manage.py check`` refuses AGENT_SESSIONS with a misspelt key, an alias DATABASES lacks, or a RESOLVE
    that does not import (it used to accept them all, and the error came at the store's first use). On
    PostgreSQL before ``migrate``, a command says to run ``manage.py migrate``, not the SQL the migration
    runs; the store's connections carry an application_name."""
    home = tmp_path / "project"
    name = servers.database_name("djops")
    servers.database_url(servers.POSTGRES_URL, name)  # created, not migrated
    write_project(home, "postgresql", servers.POSTGRES_URL, name)
    settings = (home / "site_settings.py").read_text()
    try:
        for extra, code, says in (
                ('AGENT_SESSIONS = {"DATABASES": "default"}', "E002", "unknown keys ['DATABASES']"),
                ('AGENT_SESSIONS = {"DATABASE": "replica"}', "E002", "'replica', which is not in DATABASES"),
                ('AGENT_SESSIONS = {"RESOLVE": "shop.agent.resolve"}', "E003", "cannot be imported"),
                ('AGENT_SESSIONS = {"SWEEP_SECONDS": -1}', "E002", "SWEEP_SECONDS'] must be a number of seconds >= 0")):
            (home / "site_settings.py").write_text(settings + extra + "\n")
            out = manage(venv, home, "check", code=1)
            assert f"(agent_sessions.{code})" in out.stderr and says in out.stderr, out.stderr
        (home / "site_settings.py").write_text(settings + 'AGENT_SESSIONS = {"RESOLVE": "site_settings.resolve"}\n'
                                               "def resolve(info):\n    return None\n")
        assert "no issues" in manage(venv, home, "check").stdout
        missing = manage(venv, home, "agent_sessions", "list", code=4).stderr
        assert "run `python manage.py migrate`" in missing and "SCHEMA" not in missing, missing
        manage(venv, home, "migrate", "--noinput")
        (home / "names.py").write_text(
            "import os\nos.environ.setdefault('DJANGO_SETTINGS_MODULE', 'site_settings')\nimport django\n"
            "django.setup()\nfrom agent_sessions.contrib.django import store\nstore().info('none')\n"
            "from django.db import connection\nwith connection.cursor() as c:\n"
            "    c.execute('SELECT DISTINCT application_name FROM pg_stat_activity'\n"
            "              ' WHERE datname = current_database()')\n"
            "    print(sorted(r[0] for r in c.fetchall()))\n")
        assert "'agent-sessions'" in run([str(venv), "names.py"], cwd=home, env=clean_env()).stdout
    finally:
        servers.drop_databases(servers.POSTGRES_URL, {name})
