"""The Django app (agent_sessions.contrib.django) and the example project using it (examples/django_app):
a view starts a turn, `manage.py steer` steers it, the store comes from Django's own DATABASES; in-process
(Django's test client, call_command) and as real processes (`runserver`, `manage.py migrate` on SQLite,
PostgreSQL and MariaDB). Also: the app's migration is the stores' DDL, frozen, and its commands' output.
The app installed from the built wheel into a fresh venv is tests/test_django_wheel.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from stores._sql.tables import TABLES
from tests import servers
from tests.four_method_store import FourMethodStore
from tests.model_server import ModelServer, Reply, Request, openai
from tests.sse_client import TURN_KINDS, check_event, sse

ROOT = Path(__file__).resolve().parents[1]
MANAGE = ROOT / "examples" / "django_app" / "manage.py"


@pytest.fixture(scope="module")
def django_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("django")
    os.environ["DJANGO_APP_STATE"] = str(state)
    os.environ["DJANGO_SETTINGS_MODULE"] = "examples.django_app.project.settings"
    import django

    django.setup()
    yield state


WAIT = 60.0
"""Seconds a test waits for something another thread or process does in well under one: generous, so a
loaded machine (a manage.py process takes seconds to start beside a CPU-bound job) is not a failure."""


def steer_held_until(steered: threading.Event, reply: Reply) -> Any:
    """A model reply that waits until the test has steered: the steer must land in the next request."""
    def answer(request: Request) -> Reply:
        assert steered.wait(WAIT)
        return reply
    return answer


def wait_for_request(model: ModelServer) -> None:
    deadline = time.monotonic() + WAIT
    while not model.requests:
        assert time.monotonic() < deadline, "the run made no model request"
        time.sleep(0.01)


def wait_for_answer(get: Any, timeout: float = WAIT) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = get()
        if not state["running"] and state["messages"] and state["messages"][-1]["role"] == "assistant":
            return state  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"no answer within {timeout} s")


def test_a_view_starts_a_turn_and_the_management_command_steers_it(django_state: Path, model: ModelServer) -> None:
    from django.conf import settings
    from django.core.management import call_command
    from django.test import Client

    settings.AGENT_MODEL_URL = model.url + "/v1"
    steered = threading.Event()
    model.push(steer_held_until(steered, openai(calls=[("c1", "read_file", '{"path": "lease.go"}')])),
               openai("the expiry is compared with <, not <="))
    client = Client()
    started = client.post("/sessions/dj-1/turn", data=json.dumps({"text": "review lease.go"}),
                          content_type="application/json")
    assert started.status_code == 202
    wait_for_request(model)  # the run is inside its first request: the steer must wait for the next
    call_command("agent_sessions", "steer", "dj-1", "check the expiry, not the token")
    steered.set()
    state = wait_for_answer(lambda: client.get("/sessions/dj-1").json())
    texts = [m["content"][0].get("text", "") for m in state["messages"]]
    assert texts[0] == "review lease.go" and texts[-1] == "the expiry is compared with <, not <="
    assert texts[3] == "check the expiry, not the token"  # after the call and its result: where the run was
    assert model.requests[1].json["messages"][-1] == {"role": "user", "content": "check the expiry, not the token"}
    bad = client.post("/sessions/dj-1/turn", data="{", content_type="application/json")
    assert bad.status_code == 400 and "error" in bad.json()


def test_the_store_lives_in_djangos_own_database_file(django_state: Path) -> None:
    from agent_sessions.contrib.django import store

    assert Path(store().engine.url.database or "") == django_state / "django.sqlite3"
    assert store() is store()  # one per process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STARTUP = 90.0
"""Seconds runserver gets to answer its first request: it imports Django and the project and runs its
system checks first, about a second on an idle machine, many more beside a CPU-bound job."""


class PortTaken(Exception):
    """runserver could not bind the port _free_port found: something took it in between."""


def wait_until_serving(server: subprocess.Popen[bytes], base: str, output: Path) -> None:
    """Poll until runserver answers any HTTP at all, for at most STARTUP seconds. While it starts, a
    request can be refused, reset, cut off or time out: each means "not yet". Fails at once if the process
    exits, and either way shows what it printed."""
    deadline = time.monotonic() + STARTUP
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            break
        try:
            requests.get(f"{base}/sessions/warmup", timeout=5)
            return
        except requests.RequestException as exc:  # ConnectionError, Timeout, ChunkedEncodingError, ...
            last = exc
            time.sleep(0.1)
    said = output.read_text(errors="replace")
    if server.poll() is not None and "already in use" in said:
        raise PortTaken(said)
    state = f"exited with {server.returncode}" if server.poll() is not None else f"not serving after {STARTUP} s"
    raise AssertionError(f"runserver {state} (last error: {last!r}); its output:\n{said[-5000:]}")


def runserver(env: dict[str, str], output: Path, manage: Path = MANAGE,
              *options: str) -> tuple[subprocess.Popen[bytes], str]:
    """A serving `manage.py runserver` (of the example project, or of ``manage``, with ``options``) and its
    base URL. Its port is found free, then bound by another process a second later: another program (a
    second copy of the suite) may take it in between, so a refused bind is tried again on another port,
    three times in all."""
    for _ in range(3):
        port = _free_port()
        with open(output, "wb") as log:  # a file, not a pipe nobody reads: its request log cannot fill it
            server = subprocess.Popen([sys.executable, str(manage), "runserver", f"127.0.0.1:{port}", "--noreload",
                                       *options], env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(server, base, output)
            return server, base
        except PortTaken:
            stop(server)
        except BaseException:
            stop(server)
            raise
    raise AssertionError(f"runserver found each of three free ports taken; its output:\n{output.read_text()}")


def stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(10)  # SIGKILL cannot be refused: this only reaps it


def test_a_real_runserver_and_a_steer_from_another_process(tmp_path: Path, model: ModelServer) -> None:
    env = {**os.environ, "DJANGO_APP_STATE": str(tmp_path), "AGENT_MODEL_URL": model.url + "/v1",
           "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    steered = threading.Event()
    model.push(steer_held_until(steered, openai(calls=[("c1", "read_file", '{"path": "token.go"}')])),
               openai("done"))
    server, base = runserver(env, tmp_path / "runserver.log")
    try:
        assert requests.post(f"{base}/sessions/dj-real/turn", json={"text": "review token.go"},
                             timeout=30).status_code == 202
        wait_for_request(model)
        out = subprocess.run([sys.executable, str(MANAGE), "agent_sessions", "steer", "dj-real",
                              "look at the renewal path"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "steer left for session dj-real" in out.stdout, out.stderr
        steered.set()
        state = wait_for_answer(lambda: requests.get(f"{base}/sessions/dj-real", timeout=30).json())
        assert [m["content"][0].get("text") for m in state["messages"]][3] == "look at the renewal path"
        refused = subprocess.run([sys.executable, str(MANAGE), "agent_sessions", "steer", "dj-real", ""], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "must not be empty" in refused.stderr  # the CLI's code for bad input
    finally:
        stop(server)


def test_migrate_creates_the_store_tables_on_postgresql(tmp_path: Path) -> None:
    url = servers.database_url(servers.POSTGRES_URL, servers.database_name("django"))
    from sqlalchemy import create_engine

    engine = create_engine(url)
    with engine.begin() as conn:
        for table in ("agent_journals", "agent_runs", "agent_session_tags", "agent_steer_keys",
                      *(t.name for t in TABLES), "django_migrations"):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
    env = {**os.environ, "DJANGO_DB_URL": url.replace("postgresql+psycopg", "postgresql"),
           "DJANGO_APP_STATE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    for args in (["migrate", "--noinput"], ["agent_sessions", "steer", "dj-pg", "from a migrated database"]):
        out = subprocess.run([sys.executable, str(MANAGE), *args], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    from stores import postgres

    assert postgres.Store(engine).take_steers("dj-pg") == ["from a migrated database"]
    engine.dispose()


# -- the app's migration: the stores' DDL, frozen --------------------------------------------------------------

REGENERATE = ("the stores' DDL is not the one frozen in agent_sessions/contrib/django/migrations/0001_initial.json: "
              "regenerate it with `python -m agent_sessions.contrib.django.schema > "
              "agent_sessions/contrib/django/migrations/0001_initial.json` (once the app is released, add a "
              "migration running the new schema's upgrade statements instead)")


def test_the_migration_is_the_stores_exported_ddl(django_state: Path) -> None:
    import importlib

    from agent_sessions.contrib.django import schema
    from stores import mysql, postgres

    initial = importlib.import_module("agent_sessions.contrib.django.migrations.0001_initial")
    assert ";\n\n".join(initial.CREATE["postgresql"]) + ";\n" == postgres.SCHEMA, REGENERATE
    assert initial.CREATE["mysql"] == mysql.SCHEMA, REGENERATE
    assert Path(initial.__file__).with_suffix(".json").read_text() == schema.frozen(*schema.current()), REGENERATE
    assert initial.DROP == schema.drops(initial.CREATE)


def sqlite_objects(path: Path) -> tuple[list[tuple[str, ...]], int]:
    """What a file holds of the store: its tables and indexes (their SQL, spaces normalised) and its
    user_version, which stores.sqlite.open reads to decide on upgrades."""
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master WHERE tbl_name LIKE 'agent%' "
                            "ORDER BY name").fetchall()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()
    return [(t, n, tbl, " ".join((sql or "").split())) for t, n, tbl, sql in rows], version


def example_env(state: Path, db_url: str = "") -> dict[str, str]:
    env = {**os.environ, "DJANGO_APP_STATE": str(state), "PYTHONPATH": str(ROOT), "DJANGO_DB_URL": db_url}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def manage(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, str(MANAGE), *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"manage.py {' '.join(args)} exited {out.returncode}\n{out.stdout}{out.stderr}"
    return out.stdout


def test_on_sqlite_migrate_makes_the_file_stores_sqlite_would_and_zero_undoes_it(tmp_path: Path) -> None:
    import agent_sessions as agent
    from stores import sqlite

    sqlite.open(tmp_path / "reference.db").close()
    reference = sqlite_objects(tmp_path / "reference.db")
    assert reference[0] and reference[1] == 1  # schema 1
    env = example_env(tmp_path)
    manage(env, "migrate", "--noinput")
    db = tmp_path / "django.sqlite3"
    assert sqlite_objects(db) == reference
    store = sqlite.open(db)  # takes the file as its own: nothing to create, nothing to upgrade
    store.save("lite-1", [agent.Message.user("kept")])
    store.close()
    assert sqlite_objects(db) == reference
    assert "#1 user:\n  kept\n" in manage(env, "agent_sessions", "show", "lite-1")
    manage(env, "migrate", "agent_sessions", "zero")
    assert sqlite_objects(db) == ([], 0)  # user_version 0: a later sqlite.open takes the file as new
    manage(env, "migrate", "--noinput")
    assert sqlite_objects(db) == reference


def test_on_sqlite_migrate_keeps_the_tables_stores_sqlite_made_before(tmp_path: Path) -> None:
    import agent_sessions as agent
    from stores import sqlite

    before = sqlite.open(tmp_path / "django.sqlite3")
    before.save("made-before", [agent.Message.user("from before the app")])
    before.close()
    objects = sqlite_objects(tmp_path / "django.sqlite3")
    env = example_env(tmp_path)
    manage(env, "migrate", "--noinput")
    assert sqlite_objects(tmp_path / "django.sqlite3") == objects
    assert json.loads(manage(env, "agent_sessions", "show", "made-before", "--json"))["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "from before the app"}]}]


@pytest.mark.parametrize("vendor", ["postgresql", "mysql"])
def test_migrate_keeps_tables_that_exist_and_zero_drops_them(tmp_path: Path, vendor: str) -> None:
    """A user who ran the exported SCHEMA before installing the app: migrate keeps the tables and what
    they hold (MySQL has no CREATE INDEX IF NOT EXISTS: the migration looks before it creates)."""
    from sqlalchemy import create_engine, inspect

    import agent_sessions as agent
    from stores import mysql, postgres

    base = servers.POSTGRES_URL if vendor == "postgresql" else servers.MYSQL_URL
    url = servers.database_url(base, servers.database_name("django"))
    engine = create_engine(url)
    with engine.begin() as conn:
        for table in ("agent_journals", "agent_runs", "agent_session_tags", "agent_steer_keys",
                      *(t.name for t in TABLES), "django_migrations"):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
    servers.fresh_schema(engine)
    store = (postgres if vendor == "postgresql" else mysql).Store(engine)
    store.save("made-before", [agent.Message.user("from before the app")])
    env = example_env(tmp_path, url.replace("+psycopg", "").replace("+pymysql", ""))
    try:
        manage(env, "migrate", "--noinput")
        assert "from before the app" in manage(env, "agent_sessions", "show", "made-before")
        manage(env, "agent_sessions", "steer", "made-before", "after migrate")
        assert store.take_steers("made-before") == ["after migrate"]
        manage(env, "migrate", "agent_sessions", "zero")
        ours = {t.name for t in TABLES}
        assert not ours & set(inspect(engine).get_table_names())
        manage(env, "migrate", "--noinput")  # and on an empty database, creates them
        assert ours <= set(inspect(engine).get_table_names())
        assert store.messages("made-before") == []
    finally:
        engine.dispose()


# -- the store built from DATABASES and AGENT_SESSIONS -------------------------------------------------------------


def test_the_store_is_built_from_the_databases_entry_its_password_intact(django_state: Path) -> None:
    """Through ``stores.urls``: the URL SQLAlchemy renders from the entry's parts (each escaped) is read back
    to the same parts, a password of every special character included."""
    from django.core.exceptions import ImproperlyConfigured

    from agent_sessions.contrib.django import _from_database

    password = "p@ss/w:rd?#%"
    pg: Any = _from_database("default", "postgresql", {
        "NAME": "app", "USER": "u", "PASSWORD": password, "HOST": "db.internal", "PORT": "6432",
        "OPTIONS": {"sslmode": "require", "isolation_level": 1}})[0]
    my: Any = _from_database("default", "mysql", {
        "NAME": "app", "USER": "u", "PASSWORD": password, "HOST": "/run/mysqld/mysqld.sock", "PORT": ""})[0]
    try:
        assert type(pg).__module__ == "stores.postgres" and type(my).__module__ == "stores.mysql"
        u = pg.engine.url
        assert (u.drivername, u.username, u.password, u.host, u.port, u.database) == (
            "postgresql+psycopg", "u", password, "db.internal", 6432, "app")
        u = my.engine.url
        assert (u.drivername, u.password, u.host, u.port, u.database) == ("mysql+pymysql", password, None, None, "app")
    finally:
        pg.engine.dispose()
        my.engine.dispose()
    for memory in (":memory:", "file:memorydb_default?mode=memory&cache=shared"):  # the second: the test runner's
        with pytest.raises(ImproperlyConfigured, match=r"in memory.*TEST'\]\['NAME'\]"):
            _from_database("default", "sqlite", {"NAME": memory})
    with pytest.raises(ImproperlyConfigured, match=r"'oracle' database.*AGENT_SESSIONS\['URL'\]"):
        _from_database("default", "oracle", {"NAME": "x"})


def test_bad_agent_sessions_settings_are_improperly_configured(django_state: Path) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from agent_sessions.contrib.django import store

    for conf, says in (({"DATABSE": "default"}, "unknown keys ['DATABSE']"),
                       ({"DATABASE": "other"}, "'other', which is not in DATABASES"),
                       ({"STORE": "tests.test_django_app.not_a_store"}, "returned str, not an agent_sessions Store"),
                       ({"STORE": "tests.no_such_module.store"}, "['STORE'] (tests.no_such_module.store) cannot be "
                                                                  "imported"),
                       ({"STORE": "tests.test_django_app.NOT_CALLABLE"}, "is not callable"),
                       ({"SSE_SECONDS": 0}, "['SSE_SECONDS'] must be a number of seconds > 0, got 0"),
                       ({"SSE_SECONDS": "30"}, "['SSE_SECONDS'] must be a number of seconds > 0, got '30'"),
                       ({"SSE_SECONDS": float("nan")}, "got nan"),
                       ({"RESOLVE": 3}, "['RESOLVE'] must be the dotted path of a function")):
        with override_settings(AGENT_SESSIONS=conf), pytest.raises(ImproperlyConfigured) as raised:
            store()
        assert says in str(raised.value)


def not_a_store() -> str:
    return "sessions.db"


NOT_CALLABLE = "sessions.db"


# -- the management commands, in-process on the memory store (the reference LifecycleStore) -----------------------


def plain_store() -> FourMethodStore:
    """A store with the four calls of agent_sessions.Store and nothing more: what the commands do with a
    store that cannot list, count or prune."""
    return FourMethodStore()


def memory_store() -> Any:
    from stores import memory

    return memory.Store()


def command(*args: str) -> str:
    """``manage.py agent_sessions ARGS`` in this process (call_command): what it printed; a CommandError
    (carrying the exit code) when it exits with another code than 0."""
    import io

    from django.core.management import call_command

    out = io.StringIO()
    call_command("agent_sessions", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def failed(*args: str) -> tuple[int, str, str]:
    """The exit code, stdout and the error of a command that exits with another code than 0."""
    import io

    from django.core.management import CommandError, call_command

    out = io.StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("agent_sessions", *args, stdout=out, stderr=io.StringIO())
    return caught.value.returncode, out.getvalue(), str(caught.value)


def as_json(*args: str) -> Any:
    return json.loads(command(*args, "--json"))


@pytest.fixture
def memory(django_state: Path) -> Iterator[Any]:
    from django.test import override_settings

    from agent_sessions.contrib.django import store

    with override_settings(AGENT_SESSIONS={"STORE": "tests.test_django_app.memory_store"}):
        yield store()


def test_steer_and_show_a_transcript_its_tail_and_what_waits(memory: Any) -> None:
    import agent_sessions as agent

    assert as_json("steer", "c-1", "first steer") == {"id": "c-1", "steered": True}
    msgs = [agent.Message.user("review lease.go"),
            agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("t1", "read_file", '{"path": "lease.go"}')]),
            agent.Message(agent.Role.USER, [agent.Content.tool_result("t1", "package lease\n// line 2")]),
            agent.Message.user("\x1b[31mred\x1b[0m text"),
            agent.Message.assistant("the expiry uses <")]
    memory.save("c-1", msgs)
    memory.set_metadata("c-1", {"user": "u-17"})
    shown = command("show", "c-1", "--last", "3")
    assert shown.startswith("session c-1: 5 messages, created ")
    assert 'metadata: {"user":"u-17"}' in shown and "steers waiting: 1\n  first steer\n" in shown
    assert "... 2 earlier messages (--all shows them)\n" in shown
    assert "#3 user:\n  tool result [t1]: package lease\n  // line 2\n#4 user:\n  \\x1b[31mred\\x1b[0m text\n" in shown
    assert "\x1b" not in shown  # a message's escape sequence never reaches the terminal
    assert "#1" not in shown and "#5 assistant:\n  the expiry uses <\n" in shown
    full = as_json("show", "c-1", "--all")
    assert [agent.Message.from_dict(m) for m in full["messages"]] == msgs
    assert (full["first"], full["total"], full["pending_steers"], full["holder"]) == (0, 5, ["first steer"], None)
    assert full["info"]["metadata"] == {"user": "u-17"} and full["info"]["messages"] == 5
    assert "tool call read_file [t1] {\"path\": \"lease.go\"}" in command("show", "c-1", "--all")
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="no session 'nobody'"):
        command("show", "nobody")
    with pytest.raises(CommandError, match="must not be empty"):
        command("steer", "c-1", "")
    with pytest.raises(CommandError, match="'-1' is not a whole number"):
        command("show", "c-1", "--last", "-1")


def test_cancel_asks_the_holder_to_stop(memory: Any) -> None:
    from agent_sessions.lease import claimant

    code, out, error = failed("cancel", "c-2", "--json")  # exit 1, as from python -m agent_sessions
    assert (code, json.loads(out)) == (1, {"id": "c-2", "cancelled": False, "closed": False})
    assert "no run holds session 'c-2'" in error and "nothing to cancel" in error
    held = memory.acquire("c-2", claimant(), 30.0)
    assert "asked the run holding session c-2 to stop" in command("cancel", "c-2")
    assert memory.check("c-2", held) is True  # the run sees it at its next check
    holder = as_json("show", "c-2")["holder"]
    assert holder["cancelled"] is True and holder["pid"] == os.getpid() and "token" not in holder


def test_sessions_lists_newest_first_filters_by_metadata_and_pages(memory: Any) -> None:
    import agent_sessions as agent

    for sid, meta in (("a-1", {"user": "u-17"}), ("a-2", {"user": "u-18", "n": 17}), ("b-1", {"n": "17"})):
        memory.save(sid, [agent.Message.user(f"hello from {sid}")])
        memory.set_metadata(sid, meta)
        time.sleep(0.002)  # distinct updated times

    def ids(*args: str) -> list[str]:
        return [s["id"] for s in as_json("list", *args)["sessions"]]

    assert ids() == ["b-1", "a-2", "a-1"]
    assert ids("--prefix", "a-") == ["a-2", "a-1"]
    assert ids("--where", "user=u-17") == ["a-1"]
    assert ids("--where", "n=17") == ["a-2"] and ids("--where", 'n="17"') == ["b-1"]  # values compare as JSON
    assert ids("--where", "n=17", "--where", "user=u-18") == ["a-2"]
    first = as_json("list", "--limit", "2")
    assert [s["id"] for s in first["sessions"]] == ["b-1", "a-2"] and first["next"]
    assert ids("--limit", "2", "--after", first["next"]) == ["a-1"]
    text = command("list", "--limit", "2")
    assert text.splitlines()[0].split() == ["ID", "UPDATED", "(UTC)", "MESSAGES", "METADATA"]
    assert text.splitlines()[1].startswith("b-1") and '{"n":"17"}' in text.splitlines()[1]
    assert f"next page: --after {first['next']}" in text
    assert command("list", "--prefix", "zz") == "no sessions\n"
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="'novalue' is not key=value"):
        command("list", "--where", "novalue")
    with pytest.raises(CommandError, match="must be a page's next cursor"):
        command("list", "--after", "garbage")


def test_prune_deletes_idle_sessions_but_not_a_held_one(memory: Any) -> None:
    import agent_sessions as agent
    from agent_sessions.lease import claimant

    for sid in ("p-1", "p-2", "p-3", "held"):
        memory.save(sid, [agent.Message.user(sid)])
    memory.acquire("held", claimant(), 30.0)
    time.sleep(0.01)
    assert as_json("prune", "--idle-for", "1d12h") == {"deleted": 0, "idle_for": 129600.0}
    assert as_json("prune", "--idle-for", "0s", "--limit", "2") == {"deleted": 2, "idle_for": 0.0}
    assert command("prune", "--idle-for", "0s") == "deleted 1 session not updated for 0s\n"
    assert command("prune", "--idle-for", "365d") == "deleted 0 sessions not updated for 365d\n"
    assert [s.id for s in memory.list_sessions()] == ["held"]
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="'30x' is not a duration"):
        command("prune", "--idle-for", "30x")
    with pytest.raises(CommandError, match="the following arguments are required: --idle-for"):
        command("prune")


def test_on_a_store_without_the_lifecycle_show_reads_the_transcript_and_sessions_says_why_not(
        django_state: Path) -> None:
    from django.core.management import CommandError
    from django.test import override_settings

    import agent_sessions as agent
    from agent_sessions.contrib.django import store

    with override_settings(AGENT_SESSIONS={"STORE": "tests.test_django_app.plain_store"}):
        store().save("p", [agent.Message.user("one"), agent.Message.assistant("two")])
        assert as_json("show", "p", "--last", "1")["messages"] == [agent.Message.assistant("two").to_dict()]
        assert command("show", "p", "--last", "1").startswith("session p: 2 messages\n... 1 earlier message ")
        for args in (["list"], ["prune", "--idle-for", "30d"]):
            with pytest.raises(CommandError, match=r"needs a store implementing agent_sessions.LifecycleStore"):
                command(*args)


def test_approve_lists_the_waiting_calls_and_decides_once(memory: Any) -> None:
    from django.core.management import CommandError

    import agent_sessions as agent

    @agent.tool(idempotent=False, needs_approval=True)
    def refund(order: str) -> str:
        """Refund an order."""
        return f"refunded {order}"

    class Model:
        def complete(self, system: str, messages: Any, tools: Any) -> agent.Message:
            return agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("r1", "refund", '{"order": "7"}')])

    spec = agent.Spec(session=agent.open("c-9", memory), tools=[refund])
    assert agent.Runner().run(spec, [agent.Message.user("refund 7")], Model()).stop_reason == "awaiting_approval"
    waiting = as_json("approvals", "c-9")["pending_approvals"]
    assert [(w["call_id"], w["tool"], w["arguments"]) for w in waiting] == [("r1", "refund", '{"order": "7"}')]
    assert "r1  refund({\"order\": \"7\"})  asked " in command("approvals", "c-9")
    assert "calls waiting for a decision: 1" in command("show", "c-9")
    assert as_json("deny", "c-9", "r1", "--reason", "not today") == {
        "id": "c-9", "call_id": "r1", "decided": True, "approved": False, "reason": "not today"}
    with pytest.raises(CommandError, match="already decided: denied by a person") as caught:
        command("approve", "c-9", "r1")
    assert caught.value.returncode == 5  # a conflict, as from python -m agent_sessions
    code, _, error = failed("approve", "c-9", "r2")
    assert code == 1 and "no call 'r2' waits" in error
    code, _, error = failed("approvals", "c-9")
    assert code == 1 and "no call of session 'c-9' waits for a decision" in error


# -- the events view: a session's event log as server-sent events ---------------------------------------------------

REVIEW = [("c1", "read_file", '{"path": "lease.go"}')]


def streamed(response: Any) -> list[dict[str, str]]:
    """What a streaming response of Django's test client sends, read to its end, as SSE blocks."""
    assert response.streaming and response["Content-Type"] == "text/event-stream"
    return list(sse(b"".join(response.streaming_content).decode().split("\n")))


def test_the_events_view_streams_a_turn_from_last_event_id_or_after(memory: Any, model: ModelServer) -> None:
    from django.test import Client
    from django.urls import reverse

    import agent_sessions as agent
    from agent_sessions.eventlog import SSE_RETRY_MS
    from examples.django_app.turns import agent as setup

    model.push(openai(calls=REVIEW), openai("the expiry is compared with <"))
    endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
    spec = setup.spec("e1")  # the example's: it publishes events, the store keeping a log
    assert spec.publish_events
    assert agent.Runner().run(spec, [agent.Message.user("review lease.go")], endpoint).stop_reason == "answered"

    client = Client()
    url = reverse("agent_sessions_events", args=["e1"])
    assert url == "/sessions/e1/events"  # the app's urls, as the example project includes them
    started = time.monotonic()
    reply = client.get(url)
    assert reply.status_code == 200
    assert reply["Cache-Control"] == "no-cache" and reply["X-Accel-Buffering"] == "no"
    blocks = streamed(reply)
    assert time.monotonic() - started < 20  # it ended at `finished`, not after SSE_SECONDS (30)
    assert blocks[0] == {"retry": str(SSE_RETRY_MS)}
    events = [check_event(b) for b in blocks[1:]]
    assert [e["kind"] for e in events] == TURN_KINDS
    assert [e["seq"] for e in events] == [e.seq for e in agent.open("e1", memory).events()]
    assert events[-1]["data"]["text"] == "the expiry is compared with <"

    rest = streamed(client.get(url, headers={"Last-Event-ID": str(events[3]["seq"])}))
    assert [check_event(b)["seq"] for b in rest if "id" in b] == [e["seq"] for e in events[4:]]
    last = streamed(client.get(url, {"after": events[5]["seq"]}))
    assert [b.get("event") for b in last] == [None, "finished"]
    both = streamed(client.get(f"{url}?after=0", headers={"Last-Event-ID": str(events[5]["seq"])}))
    assert [b.get("event") for b in both] == [None, "finished"]  # the browser's header wins

    for headers, query in (({"Last-Event-ID": "seven"}, ""), ({}, "?after=-1"), ({}, "?after=%C2%B2"),
                           ({"Last-Event-ID": " 7"}, "")):
        bad = client.get(url + query, headers=headers)
        assert bad.status_code == 400 and "Last-Event-ID and ?after=" in bad.json()["error"], (headers, query)
    too_long = client.get(reverse("agent_sessions_events", args=["x" * 10_000]))
    assert too_long.status_code == 400 and "characters long" in too_long.json()["error"]
    posted = client.post(url)
    assert posted.status_code == 405 and posted["Allow"] == "GET" and "use GET" in posted.json()["error"]


def test_the_events_view_ends_after_sse_seconds_and_needs_an_event_log(django_state: Path) -> None:
    from django.test import Client, override_settings

    client = Client()
    with override_settings(AGENT_SESSIONS={"STORE": "tests.test_django_app.memory_store", "SSE_SECONDS": 0.5}):
        started = time.monotonic()
        reply = client.get("/sessions/quiet/events")
        assert reply.status_code == 200 and streamed(reply) == [{"retry": "500"}]  # no event came: ends anyway
        assert 0.5 <= time.monotonic() - started < 0.5 + WAIT
    with override_settings(AGENT_SESSIONS={"STORE": "tests.test_django_app.plain_store"}):
        reply = client.get("/sessions/quiet/events")
        assert reply.status_code == 501 and "EventStore" in reply.json()["error"]


def test_the_events_view_says_why_a_stream_is_silent_and_refuses_a_post_with_json_under_csrf(
        django_state: Path) -> None:
    """A session whose log is empty (its run has no publish_events=True) gets a comment line saying so; a
    POST meets CsrfViewMiddleware, as in any project, and still gets the documented JSON 405."""
    from django.test import Client, override_settings

    from agent_sessions.contrib.django import store
    from agent_sessions.lease import claimant

    settings = {"STORE": "tests.test_django_app.memory_store", "SSE_SECONDS": 0.2}
    with override_settings(AGENT_SESSIONS=settings, MIDDLEWARE=["django.middleware.csrf.CsrfViewMiddleware"]):
        client = Client(enforce_csrf_checks=True)
        body = b"".join(client.get("/sessions/quiet/events").streaming_content).decode()
        assert body.startswith("retry: 500\n\n: this session's event log is empty; only a run with "
                               "Spec(publish_events=True) writes events here."), body
        assert "ends after 0.2 s" in body and list(sse(body.split("\n"))) == [{"retry": "500"}]
        store().acquire("held", claimant(), 30.0)  # a run holds it, and has written no event
        body = b"".join(client.get("/sessions/held/events").streaming_content).decode()
        assert ": a run holds this session and has written no event: it runs without " in body, body
        assert b"".join(client.get("/sessions/quiet/events?after=3").streaming_content) == b"retry: 500\n\n"
        posted = client.post("/sessions/quiet/events")
        assert posted.status_code == 405 and posted["Content-Type"] == "application/json", posted.content[:200]
        assert posted["Allow"] == "GET" and "use GET" in posted.json()["error"]


@pytest.mark.parametrize("seen", [str(2**63), str(2**64), "9" * 5000, "1" + "0" * 30],
                         ids=["2**63", "2**64", "5000 digits", "1e30"])
def test_the_events_view_answers_400_to_a_seq_beyond_the_largest(django_state: Path, seen: str) -> None:
    """On the project's own store (SQLite, Django's database file), whose driver overflows above 2**63 - 1."""
    from django.test import Client, override_settings

    client = Client()
    with override_settings(AGENT_SESSIONS={"DATABASE": "default", "SSE_SECONDS": 0.2}):
        for reply in (client.get("/sessions/e9/events", headers={"Last-Event-ID": seen}),
                      client.get("/sessions/e9/events", {"after": seen})):
            assert reply.status_code == 400 and str(2**63 - 1) in reply.json()["error"]
        largest = client.get("/sessions/e9/events", headers={"Last-Event-ID": str(2**63 - 1)})
        assert largest.status_code == 200 and streamed(largest) == [{"retry": "500"}]


def test_runserver_streams_a_run_of_another_process_to_a_client_that_reconnects(tmp_path: Path,
                                                                                model: ModelServer) -> None:
    """The run is in this process, publishing to the example project's SQLite file; `runserver` (another
    process) streams its events to a client that is cut off mid-run and comes back with Last-Event-ID."""
    import agent_sessions as agent
    from stores import sqlite

    db = tmp_path / "django.sqlite3"  # what the example's settings name under DJANGO_APP_STATE
    store = sqlite.open(db)  # the tables exist before runserver opens the file
    env = example_env(tmp_path)
    server, base = runserver(env, tmp_path / "runserver.log")
    cut = threading.Event()
    model.push(openai(calls=[("c1", "lookup", '{"order": "7"}')]),
               lambda request: (cut.wait(WAIT), openai("delivered"))[1])
    got: list[dict[str, Any]] = []
    try:
        with requests.get(f"{base}/sessions/live/events", stream=True, timeout=WAIT) as first:
            assert first.status_code == 200 and first.headers["content-type"] == "text/event-stream"
            run = agent.Runner().start(
                agent.Spec(session=agent.open("live", store), tools=[agent.tool(lookup)], publish_events=True),
                [agent.Message.user("where is order 7?")],
                agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0))
            # chunk_size=1: runserver's stream is not chunked, so requests' default (512 bytes a read) would
            # hold the events back until 512 bytes had come, here until the stream's end (SSE_SECONDS)
            for block in sse(first.iter_lines(chunk_size=1, decode_unicode=True)):
                if "id" in block:
                    got.append(check_event(block))
                    if block["event"] == "tool_finished":
                        break  # the connection drops mid-run: the model has not answered yet
        cut.set()
        again = requests.get(f"{base}/sessions/live/events", headers={"Last-Event-ID": str(got[-1]["seq"])},
                             stream=True, timeout=WAIT)
        with again:
            assert again.status_code == 200
            for block in sse(again.iter_lines(chunk_size=1, decode_unicode=True)):
                if "id" in block:
                    got.append(check_event(block))
        assert run.wait(WAIT).text == "delivered"
    finally:
        cut.set()  # a failed test leaves no run waiting on the model
        stop(server)
    assert [e["kind"] for e in got] == TURN_KINDS
    assert [e["seq"] for e in got] == [e.seq for e in agent.open("live", store).events()]  # each once, in order
    store.close()


def lookup(order: str) -> str:
    """Look an order up.

    Args:
        order: the order id
    """
    return f"order {order}: delivered 3 days ago"


# -- hostile stored values print as one field each --------------------------------------------------------------

FORGED = "forged 2024-01-01 00:00:00         1  {}"
HOSTILE_IDS = [f"h-lf\n{FORGED}", f"h-cr\r{FORGED}", "h-cls\x1b[2J", f"h-ls\u2028{FORGED}", "h-rlo\u202eevil",
               "h-page\nnext page: --after forged"]
BARE = "[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"


def printed_lines(out: str) -> list[str]:
    import re

    lines = out.split("\n")
    assert lines[-1] == "" and not any(re.search(BARE, line) for line in lines[:-1]), out
    return lines[:-1]


def test_the_commands_print_each_hostile_value_as_one_field(memory: Any) -> None:
    import agent_sessions as agent

    for sid in HOSTILE_IDS:
        memory.save(sid, [agent.Message.user("hi")])
        memory.set_metadata(sid, {"note": f"v\n{FORGED}\u202e"})
    rows = printed_lines(command("list", "--prefix", "h-"))
    assert len(rows) == 1 + len(HOSTILE_IDS) and not any(r.startswith(("forged", "next page")) for r in rows), rows
    assert sorted(s["id"] for s in as_json("list", "--prefix", "h-")["sessions"]) == sorted(HOSTILE_IDS)
    page = printed_lines(command("list", "--prefix", "h-", "--limit", "2"))
    assert len(page) == 4 and page[3].startswith("next page: --after "), page

    sid = HOSTILE_IDS[0]
    memory.add_steer(sid, "hurry\nrun: pid 1 on forged, epoch 9")
    memory.save(sid, [agent.Message.user("lone \ud800 here"), agent.Message(agent.Role.ASSISTANT, [
        agent.Content.tool_call("c\n#9 user:", "grep\u202e", '{"q":\n"x"}')])])
    shown = printed_lines(command("show", sid))
    assert shown[0].startswith("session h-lf\\x0aforged") and not any(line.startswith("run:") for line in shown)
    assert shown[-6:] == ["  hurry\\x0arun: pid 1 on forged, epoch 9", "#1 user:", "  lone \\ud800 here",
                          "#2 assistant:", "  tool call grep\\u202e [c\\x0a#9 user:] {\"q\":", '  "x"}'], shown
    assert as_json("show", sid)["messages"][0]["content"][0]["text"] == "lone \ud800 here"  # exact, as JSON
    printed = printed_lines(command("steer", sid, "more"))
    assert len(printed) == 1 and "h-lf\\x0aforged" in printed[0], printed
    error = failed("cancel", sid)[2]
    assert "\n" not in error and "h-lf\\nforged" in error, error  # the id as Python's repr escapes it


def test_approve_prints_each_waiting_calls_arguments_on_its_own_row(memory: Any) -> None:
    import agent_sessions as agent

    @agent.tool(idempotent=False, needs_approval=True)
    def refund(order: str) -> str:
        """Refund an order."""
        return f"refunded {order}"

    hostile = '{"order":\n"7"}\nr2  refund({})  asked 2024-01-01T00:00:00+00:00\x1b[2J\u2028'

    class Model:
        def complete(self, system: str, messages: Any, tools: Any) -> agent.Message:
            return agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("r1\nr3", "refund", hostile)])

    spec = agent.Spec(session=agent.open("h-approve\n", memory), tools=[refund])
    assert agent.Runner().run(spec, [agent.Message.user("refund 7")], Model()).stop_reason == "awaiting_approval"
    rows = printed_lines(command("approvals", "h-approve\n"))
    assert len(rows) == 1 and rows[0].startswith("r1\\x0ar3  refund({\"order\":\\x0a\"7\"}\\x0ar2  refund({})"), rows
    assert as_json("approvals", "h-approve\n")["pending_approvals"][0]["arguments"] == hostile
    decided = printed_lines(command("approve", "h-approve\n", "r1\nr3"))
    assert decided == ["approved call r1\\x0ar3 of session h-approve\\x0a: once no call waits, the turn goes on and "
                       "runs it, in the session's next run or the sweep's (recover: work, the Celery workers)"], decided


def test_the_command_lists_stranded_turns_and_recovers_them(memory: Any) -> None:
    """``manage.py agent_sessions recover --resolve module:function``: the sweep, from the Django project."""
    import agent_sessions as agent
    from agent_sessions.lease import claimant

    holder = memory.acquire("dj-stranded", agent.Holder("web-1", 1, claimant().token, 0.0, spec="support"), 30)
    memory.save_fenced("dj-stranded", holder, [agent.Message.user("refund order 7", key="t-1")], take_steers=False)
    memory.release("dj-stranded", holder)
    assert [s["id"] for s in as_json("stranded", "--grace", "0s")["sessions"]] == ["dj-stranded"]
    done = as_json("recover", "--resolve", "tests.stranded_resolve:resolve", "--grace", "0s")
    assert done["sessions"][0]["id"] == "dj-stranded" and done["sessions"][0]["outcome"] == "recovered"
    assert memory.messages("dj-stranded")[-1].role is agent.Role.ASSISTANT
    assert as_json("stranded", "--grace", "0s")["sessions"] == []


def test_a_store_url_setting_opens_the_store_it_names_and_reset_closes_it(django_state: Path) -> None:
    """``AGENT_SESSIONS["URL"]``: a store on connections of its own (Redis here), opened through
    ``stores.urls``; ``manage.py agent_sessions`` lists what it keeps."""
    import uuid

    import redis as redis_py
    from django.test import override_settings

    from agent_sessions.contrib.django import reset, store
    from stores import redis

    prefix = f"{servers.REDIS_KEY_PREFIX}django{uuid.uuid4().hex[:6]}:"
    try:
        with override_settings(AGENT_SESSIONS={"URL": f"{servers.REDIS_URL}?prefix={prefix}"}):
            made = store()
            assert isinstance(made, redis.Store)
            made.save("from-url", [])
            assert [s["id"] for s in as_json("list")["sessions"]] == ["from-url"]
    finally:
        reset()
        client = redis_py.Redis.from_url(servers.REDIS_URL)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
