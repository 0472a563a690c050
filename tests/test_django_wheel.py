"""The Django app as a user gets it: the wheel built from the tree, installed with its `django,sqlite` extras
into a fresh venv, a new Django project with the app in INSTALLED_APPS, and every management command run
there as its own process: migrate, steer, show, sessions, prune, cancel, and `migrate agent_sessions zero`.

Nothing comes from the network: one `pip download`, pinned to the versions in this venv (pip's cache or
the machine's local index), fills a wheelhouse, and the install runs with --no-index from it."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("agent_sessions", "stores", "storetest", "setup.cfg", "pyproject.toml", "README.md", "LICENSE",
          "MANIFEST.in", "CHANGELOG.md")
DRIVERS = ("sqlalchemy", "psycopg", "pymysql", "pymongo", "bson", "django")
EXTRAS = "django,sqlite,postgres"


def run(cmd: list[str], *, timeout: float = 120, cwd: Path | None = None, env: dict[str, str] | None = None,
        code: int = 0) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if out.returncode != code:
        pytest.fail(f"{' '.join(cmd)} exited {out.returncode}, not {code}\n--- stdout\n{out.stdout}\n"
                    f"--- stderr\n{out.stderr}")
    return out


def clean_env(**extra: str) -> dict[str, str]:
    """No pip configuration, no PYTHONPATH, no settings module of this process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV", "DJANGO_"))}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no pip of its own) holding the wheel with the django, sqlite and postgres extras: its
    python."""
    base = tmp_path_factory.mktemp("django_wheel")
    tree = base / "tree"
    tree.mkdir()
    for name in SOURCE:  # a clean copy: a build in the working tree would read its stale egg-info
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, tree / name)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
         str(base / "dist"), str(tree)], timeout=300)
    [wheel] = (base / "dist").glob("stored_agent_sessions-*.whl")

    frozen = run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"]).stdout
    pins = [line for line in frozen.splitlines() if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==\S+", line)]
    house = base / "wheelhouse"
    house.mkdir()
    (house / "constraints.txt").write_text("\n".join(pins) + "\n")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary", ":all:",
         "--dest", str(house), "--constraint", str(house / "constraints.txt"), f"{wheel}[{EXTRAS}]"], timeout=300)

    home = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(home)])
    python = home / "bin" / "python"
    offline = clean_env(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(house),
                        PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", f"{wheel}[{EXTRAS}]"],
        timeout=300, env=offline)
    return python


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
        {"agent_sessions", "agent_messages", "agent_steers", "agent_session_tags", "agent_events", "agent_steer_keys",
         "agent_queue"},
        5)

    where = run([str(venv), "save.py", "w-1", "review lease.go", "and token.go"], cwd=project, env=clean_env()).stdout
    assert Path(where.strip()).is_relative_to(venv.parent.parent)  # the installed wheel, not this tree

    assert manage(venv, project, "agent_sessions", "steer", "w-1", "check the expiry").stdout == \
        "steer left for session w-1\n"
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
                   ".read_text(), end='')"], cwd=project).stdout
    assert out == shipped
    assert out.startswith('"""The store\'s tables, schema ')


# A new project on PostgreSQL whose tests use the store, as a user writes them: two TestCases, each of
# which sees an empty store, saves, and starts the PostgreSQL listener (the connection that used to keep
# Django from dropping the test database).
PG_SETTINGS = """\
SECRET_KEY = "test-only"
INSTALLED_APPS = ["agent_sessions.contrib.django", "shop"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {name!r}, "USER": {user!r}, "HOST": {host!r},
    "PORT": {port!r}, "PASSWORD": {password!r}, "TEST": {{"NAME": {test_name!r}}},
}}}}
USE_TZ = True
"""

PG_TESTS = """\
from django.test import TestCase

import agent_sessions as agent
from agent_sessions.contrib.django import store
from agent_sessions.contrib.django.testing import StoreTestMixin


class Story(StoreTestMixin):
    mine = ""
    other = ""

    def test_the_store_starts_empty_and_keeps_what_a_test_saves(self):
        self.assertIsNone(store().info(self.other), "a row of the other TestCase leaked into this one")
        self.assertEqual(store().list_sessions().sessions, [])
        self.assertEqual(store().pending_steers(self.other), [])
        session = agent.open(self.mine, store())
        session.save([agent.Message.user("review lease.go")])
        session.steer("and token.go")
        self.assertEqual(store().wait_for_events(self.mine, 0, 0.05), 0)  # starts the LISTEN connection
        self.assertEqual(store().info(self.mine).messages, 1)


class FirstTests(Story, TestCase):
    mine, other = "first-1", "second-1"


class SecondTests(Story, TestCase):
    mine, other = "second-1", "first-1"
"""


def test_manage_py_test_on_postgresql_runs_twice_isolates_tests_and_leaves_no_database(
        venv: Path, tmp_path: Path) -> None:
    from sqlalchemy import make_url

    from tests import servers

    url = make_url(servers.POSTGRES_URL)
    names = {servers.database_name("djwheel"), servers.database_name("djwheel_test")}
    home = tmp_path / "pgproject"
    (home / "shop").mkdir(parents=True)
    (home / "shop" / "__init__.py").write_text("")
    (home / "shop" / "tests.py").write_text(PG_TESTS)
    (home / "site_settings.py").write_text(PG_SETTINGS.format(
        name=servers.database_name("djwheel"), test_name=servers.database_name("djwheel_test"),
        user=url.username or "", password=url.password or "", host=url.host or "", port=str(url.port or "")))
    (home / "manage.py").write_text(MANAGE)
    try:
        for _ in range(2):  # a database left behind would stop the second run at Django's prompt (or fail it)
            out = manage(venv, home, "test", "--noinput", "-v", "2")
            assert "Ran 2 tests" in out.stderr and "\nOK\n" in out.stderr, out.stderr
            assert "Applying agent_sessions.0001_initial... OK" in out.stderr + out.stdout
            assert servers.list_databases(servers.POSTGRES_URL) & names == set()
    finally:
        servers.drop_databases(servers.POSTGRES_URL, names)


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
