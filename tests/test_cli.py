"""``python -m agent_sessions``: the CLI run as a real subprocess against SQLite and PostgreSQL, the
semantics of its lifecycle commands in-process over the memory store, and every exit code.

The test process writes sessions (and takes leases) through its own store object; the CLI, another
process, must see them, act on them, and say so in its output and its exit code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pymongo
import pytest
from sqlalchemy import create_engine, text

import agent_sessions as agent
from agent_sessions import cli
from agent_sessions.lease import claimant
from agent_sessions.messages import Content
from stores import memory, mongodb, mysql, postgres, sqlite
from tests import servers

DIST = "stored-agent-sessions"
CALL = Content.tool_call("call_1", "get_weather", '{"city": "Paris",  "city": "Lyon"}')  # raw, odd on purpose
TRANSCRIPT = [
    agent.Message.user("What's the weather?"),
    agent.Message(agent.Role.ASSISTANT, [Content.from_text("Let me look."), CALL]),
    agent.Message(agent.Role.USER, [Content.tool_result("call_1", "18°C\nsunny")]),
    agent.Message.assistant("It is 18°C and sunny."),
]


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def doc(self) -> Any:
        return json.loads(self.out)


def run_cli(*args: str, store: str | None = None, env: dict[str, str] | None = None,
            pythonpath: Path | None = None) -> Ran:
    """The CLI in a process of its own, as an operator's shell runs it."""
    environ = {k: v for k, v in os.environ.items() if k != cli.ENV_STORE}
    environ.update(env or {})
    if pythonpath is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(pythonpath), environ.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "agent_sessions", *(["--store", store] if store else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, env=environ, stdin=subprocess.DEVNULL,
                          timeout=120)  # a command takes about a second; a bound, not a budget
    assert "Traceback" not in done.stderr or "--debug" in args, done.stderr
    return Ran(done.returncode, done.stdout, done.stderr)


def one_line_error(ran: Ran, code: int, *words: str) -> None:
    assert ran.code == code, ran
    assert ran.err.count("\n") == 1 and ran.err.startswith(f"{cli.PROG}: "), ran.err
    for word in words:
        assert word in ran.err, ran.err


# -- the backends ------------------------------------------------------------------------------------------


@dataclass
class Backend:
    url: str
    store: Any  # the test process's own store on the same database


@pytest.fixture(scope="module")
def postgres_url() -> str:
    return servers.database_url(servers.POSTGRES_URL, servers.database_name("cli"))


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "sessions.db"
        store = sqlite.open(path)
        yield Backend(str(path), store)
        store.close()
        return
    url = request.getfixturevalue("postgres_url")
    engine = create_engine(url, pool_size=2)
    servers.fresh_schema(engine)
    yield Backend(url, postgres.Store(engine))
    engine.dispose()


def saved(store: Any, session: str, msgs: list[agent.Message] = TRANSCRIPT) -> str:
    store.save(session, msgs)
    return session


# -- what works on every store that has runs (Store and RunStore) -------------------------------------------


def test_show_prints_the_transcript_with_tool_calls_as_written(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    ran = run_cli("show", "chat-1", "--all", store=backend.url)
    assert ran.code == 0, ran
    lines = ran.out.splitlines()
    assert lines[0].startswith("session chat-1: 4 messages, created ") and lines[0].endswith(" UTC"), lines
    assert lines[1:] == [  # numbered from #1, as fork --at counts: --at 2 keeps #1 and #2
        "#1 user:", "  What's the weather?",
        "#2 assistant:", "  Let me look.", '  tool call get_weather [call_1] {"city": "Paris",  "city": "Lyon"}',
        "#3 user:", "  tool result [call_1]: 18°C", "  sunny",
        "#4 assistant:", "  It is 18°C and sunny.",
    ]
    doc = run_cli("show", "chat-1", "--all", "--json", store=backend.url).doc
    assert [agent.Message.from_dict(m) for m in doc["messages"]] == TRANSCRIPT


def test_show_defaults_to_the_tail(backend: Backend) -> None:
    saved(backend.store, "long", [agent.Message.user(f"m{i}") for i in range(25)])
    doc = run_cli("--json", "show", "long", store=backend.url).doc
    assert [m["content"][0]["text"] for m in doc["messages"]] == [f"m{i}" for i in range(5, 25)]
    ran = run_cli("show", "long", "--last", "2", store=backend.url)
    assert ran.out.splitlines()[1:] == ["... 23 earlier messages (--all shows them)", "#24 user:", "  m23",
                                        "#25 user:", "  m24"]


def test_text_from_the_store_cannot_drive_the_terminal(backend: Backend) -> None:
    saved(backend.store, "evil", [agent.Message.user("red \x1b[31mtext\x1b[0m \u202eevil")])
    ran = run_cli("show", "evil", store=backend.url)
    assert "\x1b" not in ran.out and "\u202e" not in ran.out
    assert "red \\x1b[31mtext\\x1b[0m \\u202eevil" in ran.out


def test_steer_leaves_a_steer_the_next_run_takes(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    ran = run_cli("steer", "chat-1", "answer in French", store=backend.url)
    assert ran.code == 0 and "steer left" in ran.out, ran
    assert run_cli("steer", "chat-1", "and briefly", "--json", store=backend.url).doc == {
        "id": "chat-1", "steered": True}
    assert backend.store.take_steers("chat-1") == ["answer in French", "and briefly"]


def test_a_steer_with_a_key_is_left_once_however_often_the_command_runs(backend: Backend) -> None:
    ran = run_cli("steer", "chat-1", "answer in French", "--key", "req-1", store=backend.url)
    assert ran.code == 0 and "steer left" in ran.out, ran
    again = run_cli("steer", "chat-1", "answer in French", "--key", "req-1", store=backend.url)
    assert again.code == 0 and "already; not stored again" in again.out, again
    assert run_cli("steer", "chat-1", "answer in French", "--key", "req-1", "--json", store=backend.url).doc == {
        "id": "chat-1", "steered": False}
    assert backend.store.take_steers("chat-1") == ["answer in French"]
    one_line_error(run_cli("steer", "chat-1", "x", "--key", "", store=backend.url), 2, "must not be empty")


def test_holder_and_cancel_see_the_run_of_another_process(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    ran = run_cli("holder", "chat-1", "--json", store=backend.url)
    assert (ran.code, ran.doc) == (1, {"id": "chat-1", "holder": None})
    assert "no live run holds session 'chat-1'" in ran.err
    one_line_error(run_cli("cancel", "chat-1", store=backend.url), 1, "nothing to cancel")

    held = backend.store.acquire("chat-1", claimant(), 60)
    ran = run_cli("holder", "chat-1", store=backend.url)
    assert ran.code == 0 and f"pid {os.getpid()}" in ran.out and held.token not in ran.out, ran
    doc = run_cli("holder", "chat-1", "--json", store=backend.url).doc["holder"]
    assert (doc["pid"], doc["epoch"], doc["cancelled"]) == (os.getpid(), held.epoch, False)

    ran = run_cli("cancel", "chat-1", "--json", store=backend.url)
    assert (ran.code, ran.doc) == (0, {"id": "chat-1", "cancelled": True, "closed": False})
    assert backend.store.check("chat-1", held) is True  # the run sees it at its next step


def test_fork(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    ran = run_cli("fork", "chat-1", "chat-2", "--at", "1", store=backend.url)
    assert ran.code == 0 and "first 1 messages" in ran.out, ran
    assert backend.store.messages("chat-2") == TRANSCRIPT[:1]
    assert run_cli("fork", "chat-1", "chat-3", "--json", store=backend.url).doc == {
        "id": "chat-3", "source": "chat-1", "forked": True, "at": None}
    assert backend.store.messages("chat-3") == TRANSCRIPT

    one_line_error(run_cli("fork", "chat-1", "chat-2", store=backend.url), 5, "'chat-2' already has a transcript")
    one_line_error(run_cli("fork", "nobody", "chat-4", store=backend.url), 1, "'nobody' has no transcript")
    # after message 1 the tool call has no result yet: refused unless asked for
    one_line_error(run_cli("fork", "chat-1", "chat-4", "--at", "2", store=backend.url), 2)
    assert run_cli("fork", "chat-1", "chat-4", "--at", "2", "--allow-unanswered", store=backend.url).code == 0
    one_line_error(run_cli("fork", "chat-1", "chat-5", "--at", "9", store=backend.url), 2)


def test_unknown_sessions_exit_1(backend: Backend) -> None:
    for command in (["show", "nobody"], ["show", "nobody", "--all"], ["cancel", "nobody"], ["holder", "nobody"]):
        assert run_cli(*command, store=backend.url).code == 1
    one_line_error(run_cli("show", "nobody", store=backend.url), 1, "no session 'nobody'")


def test_bad_input_the_library_refuses_exits_2(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    one_line_error(run_cli("steer", "chat-1", "", store=backend.url), 2, "must not be empty")
    one_line_error(run_cli("show", "x" * 1000, store=backend.url), 2, "characters long")


def test_the_store_may_come_from_the_environment(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    ran = run_cli("show", "chat-1", "--last", "1", env={cli.ENV_STORE: backend.url})
    assert ran.code == 0 and "It is 18°C" in ran.out, ran
    one_line_error(run_cli("show", "chat-1"), 2, "no store", cli.ENV_STORE)


# -- the lifecycle commands: they need the store's LifecycleStore methods --------------------------------------
# On SQLite and PostgreSQL these pass once the SQL stores implement them (the sqllife branch); until then
# the CLI answers them with exit 4 ("needs a store implementing agent_sessions.LifecycleStore").


def test_lifecycle_list_pages_filters_and_prints_the_next_cursor(backend: Backend) -> None:
    for i in range(5):
        saved(backend.store, f"chat-{i}", TRANSCRIPT[:1])
        backend.store.set_metadata(f"chat-{i}", {"user": "u-17" if i % 2 else "u-3", "n": i})
    saved(backend.store, "other", TRANSCRIPT[:1])

    ran = run_cli("list", "--prefix", "chat-", "--limit", "2", store=backend.url)
    assert ran.code == 0, ran
    rows = ran.out.splitlines()
    assert rows[0].split()[:2] == ["ID", "UPDATED"] and [r.split()[0] for r in rows[1:3]] == ["chat-4", "chat-3"]
    cursor = rows[3].removeprefix("next page: --after ")
    doc = run_cli("list", "--prefix", "chat-", "--limit", "2", "--after", cursor, "--json", store=backend.url).doc
    assert [s["id"] for s in doc["sessions"]] == ["chat-2", "chat-1"] and doc["next"]
    last = run_cli("list", "--prefix", "chat-", "--after", doc["next"], "--json", store=backend.url).doc
    assert ([s["id"] for s in last["sessions"]], last["next"]) == (["chat-0"], None)

    doc = run_cli("list", "--where", "user=u-17", "--json", store=backend.url).doc
    assert [s["id"] for s in doc["sessions"]] == ["chat-3", "chat-1"]
    assert doc["sessions"][0]["metadata"] == {"user": "u-17", "n": 3} and doc["sessions"][0]["messages"] == 1
    # values are JSON when they parse: n=3 is the number 3, n='"3"' the string, which no session has
    assert [s["id"] for s in run_cli("list", "--where", "n=3", "--json", store=backend.url).doc["sessions"]] == [
        "chat-3"]
    assert run_cli("list", "--where", 'n="3"', "--where", "user=u-17", "--json", store=backend.url).doc == {
        "sessions": [], "next": None}
    one_line_error(run_cli("list", "--after", "not-a-cursor", store=backend.url), 2, "cursor")
    one_line_error(run_cli("list", "--where", "bad key=1", store=backend.url), 2, "where key")


def test_lifecycle_info_and_metadata(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    backend.store.add_steer("chat-1", "hurry")
    ran = run_cli("metadata", "chat-1", "user=u-17", "tier=2", "vip=true", 'code="007"', store=backend.url)
    assert (ran.code, ran.out.splitlines()) == (0, ['code="007"', "tier=2", 'user="u-17"', "vip=true"])
    doc = run_cli("metadata", "chat-1", "tier=", "vip=null", "--json", store=backend.url).doc
    assert doc == {"id": "chat-1", "metadata": {"user": "u-17", "code": "007"}}
    assert run_cli("metadata", "chat-1", "--json", store=backend.url).doc == doc

    info = run_cli("info", "chat-1", "--json", store=backend.url).doc
    assert (info["id"], info["messages"], info["metadata"], info["holder"], info["pending_steers"]) == (
        "chat-1", 4, {"user": "u-17", "code": "007"}, None, ["hurry"])
    assert info["created"] <= info["updated"]
    ran = run_cli("info", "chat-1", store=backend.url)
    assert "messages:  4" in ran.out and "run:       none" in ran.out and "1 waiting" in ran.out, ran

    one_line_error(run_cli("metadata", "chat-1", "v=" + "x" * 300, store=backend.url), 2, "255")
    ran = run_cli("metadata", "chat-1", "novalue", store=backend.url)
    assert ran.code == 2 and "'novalue' is not key=value" in ran.err, ran
    # labelling a session creates it: label a conversation before its first run
    assert run_cli("metadata", "new-one", "user=u-1", store=backend.url).code == 0
    assert backend.store.info("new-one").metadata == {"user": "u-1"}


def test_lifecycle_unknown_sessions_exit_1(backend: Backend) -> None:
    for command in (["info", "nobody"], ["metadata", "nobody"], ["delete", "nobody", "--yes"]):
        one_line_error(run_cli(*command, store=backend.url), 1, "no session 'nobody'")


def test_lifecycle_delete_refuses_a_live_run_unless_forced(backend: Backend) -> None:
    saved(backend.store, "chat-1")
    one_line_error(run_cli("delete", "chat-1", store=backend.url), 2, "--yes")  # no terminal to ask on
    held = backend.store.acquire("chat-1", claimant(), 60)
    one_line_error(run_cli("delete", "chat-1", "--yes", store=backend.url), 5, "live run", "--force")
    assert backend.store.messages("chat-1") == TRANSCRIPT
    ran = run_cli("delete", "chat-1", "--yes", "--force", "--json", store=backend.url)
    assert (ran.code, ran.doc) == (0, {"id": "chat-1", "deleted": True})
    assert backend.store.info("chat-1") is None and backend.store.holder("chat-1") is None
    with pytest.raises(agent.LeaseLost):
        backend.store.check("chat-1", held)
    ran = run_cli("delete", "chat-1", "--yes", "--json", store=backend.url)
    assert (ran.code, ran.doc) == (1, {"id": "chat-1", "deleted": False})


def test_lifecycle_prune_deletes_idle_sessions_a_run_does_not_hold(backend: Backend) -> None:
    for name in ("a", "b", "c", "held"):
        saved(backend.store, name, TRANSCRIPT[:1])
    backend.store.acquire("held", claimant(), 60)
    assert run_cli("prune", "--idle-for", "1d", "--json", store=backend.url).doc == {"deleted": 0, "idle_for": 86400}
    ran = run_cli("prune", "--idle-for", "0s", "--limit", "2", store=backend.url)
    assert (ran.code, ran.out) == (0, "deleted 2 sessions not updated for 0s\n")
    assert run_cli("prune", "--idle-for", "0s", "--json", store=backend.url).doc == {"deleted": 1, "idle_for": 0}
    assert [s.id for s in backend.store.list_sessions()] == ["held"]


def test_mongodb_urls_name_their_database() -> None:
    name = servers.database_name("cli")
    url = urlunsplit(urlsplit(servers.MONGO_URL)._replace(path=f"/{name}"))
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(servers.MONGO_URL)
    client.drop_database(name)
    try:
        store = mongodb.Store(client[name])
        saved(store, "chat-1")
        assert run_cli("fork", "chat-1", "chat-2", "--at", "1", store=url).code == 0
        assert store.messages("chat-2") == TRANSCRIPT[:1]
        assert run_cli("steer", "chat-2", "go on", store=url).code == 0
        assert store.take_steers("chat-2") == ["go on"]
        assert run_cli("holder", "chat-1", store=url).code == 1
    finally:
        client.drop_database(name)
        client.close()


# -- schema ------------------------------------------------------------------------------------------------


def test_schema_prints_the_ddl_an_operator_runs(postgres_url: str) -> None:
    ran = run_cli("schema", store=postgres_url)
    assert (ran.code, ran.out) == (0, postgres.SCHEMA.rstrip("\n") + "\n")
    assert run_cli("schema", "--json", store=postgres_url).doc == {"store": "postgres", "ddl": postgres.SCHEMA}
    # what it prints makes a database the CLI then works on (as `... schema | psql` would)
    url = servers.database_url(servers.POSTGRES_URL, servers.database_name("cli_schema"))
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")  # this test's database alone
        conn.exec_driver_sql(ran.out)
        assert conn.execute(text("SELECT count(*) FROM agent_sessions")).scalar() == 0
    saved(postgres.Store(engine), "chat-1")
    assert run_cli("show", "chat-1", "--last", "1", store=url).code == 0
    engine.dispose()


def test_schema_of_the_other_stores() -> None:
    ran = run_cli("schema", store="mysql+pymysql://app@db/app")  # printed, not connected to
    assert ran.code == 0 and ran.out == "".join(f"{s};\n\n" for s in mysql.SCHEMA).rstrip("\n") + "\n"
    ran = run_cli("schema", "--json", store="mongodb://db:27017/app")
    assert (ran.code, ran.doc["store"]) == (0 if mongodb.INDEXES else 1, "mongodb")
    ran = run_cli("schema", store="./sessions.db")
    assert (ran.code, ran.out) == (1, "") and "creates what it needs itself" in ran.err


# -- errors: URLs, drivers, servers -------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "words"), [
    ("cassandra://127.0.0.1/0", ["unknown store URL scheme 'cassandra'"]),
    ("sqlite://", ["bad SQLite URL"]),
    ("postgresql+psycopg2://u:secret@h/db", ["runs on psycopg", "u:***@h"]),
    ("postgresql+psycopg://u@h:notaport/db", ["bad store URL"]),
    ("mongodb://127.0.0.1:1", ["names no database"]),
    ("mongodb://", ["bad store URL"]),
    ("mongodb://u:secret@h:99999/db", ["bad store URL", "u:***@h"]),
])
def test_a_bad_url_exits_2(url: str, words: list[str]) -> None:
    ran = run_cli("holder", "chat-1", store=url)
    one_line_error(ran, 2, *words)
    assert "secret" not in ran.err


@pytest.mark.parametrize(("url", "module", "extra"), [
    ("postgresql+psycopg://postgres@127.0.0.1/db", "psycopg", "postgres"),
    ("mysql+pymysql://root@127.0.0.1/db", "pymysql", "mysql"),
    ("mongodb://127.0.0.1/db", "pymongo", "mongodb"),
    ("sessions.db", "sqlalchemy", "sqlite"),
])
def test_a_missing_driver_exits_3_naming_the_extra(tmp_path: Path, url: str, module: str, extra: str) -> None:
    (tmp_path / f"{module}.py").write_text("raise ImportError('hidden by the test, as in a venv without it')\n")
    if url == "sessions.db":
        url = str(tmp_path / url)
        Path(url).touch()
    ran = run_cli("holder", "chat-1", store=url, pythonpath=tmp_path)
    one_line_error(ran, 3, f"pip install '{DIST}[{extra}]'")


def test_a_store_that_cannot_be_reached_exits_4_saying_where(tmp_path: Path) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:1/nothing?connect_timeout=3"
    one_line_error(run_cli("holder", "chat-1", store=url), 4, "store postgresql+psycopg://postgres@127.0.0.1:1",
                   "PostgreSQL store: ", " failed: connection failed")
    one_line_error(run_cli("show", "chat-1", store=str(tmp_path / "missing.db")), 4, "no SQLite store at",
                   "missing.db")
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    one_line_error(run_cli("show", "chat-1", store=str(tmp_path / "junk.db")), 4, "junk.db")
    ran = run_cli("show", "chat-1", "--debug", store=str(tmp_path / "junk.db"))
    assert ran.code == 4 and "Traceback" in ran.err


def test_a_missing_table_exits_4_with_the_stores_hint() -> None:
    url = servers.database_url(servers.POSTGRES_URL, servers.database_name("cli_empty"))
    engine = create_engine(url)
    with engine.begin() as conn:
        for table in ("agent_journals", "agent_runs", "agent_steers", "agent_messages", "agent_sessions"):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
    engine.dispose()
    one_line_error(run_cli("holder", "chat-1", store=url), 4, "does not exist", "stores.postgres.SCHEMA")


@pytest.mark.parametrize("args", [
    ["prune"], ["prune", "--idle-for", "3x"], ["prune", "--idle-for", "1d", "--limit", "0"],
    ["show", "s", "--last", "-1"], ["show", "s", "--all", "--last", "2"], ["nosuchcommand"], [],
])
def test_usage_errors_exit_2(args: list[str]) -> None:
    ran = run_cli(*args, store="./never-opened.db")
    assert ran.code == 2 and "usage:" in ran.err, ran


def test_help_lists_the_exit_codes() -> None:
    ran = run_cli("--help")
    assert ran.code == 0
    for code in range(6):
        assert f"  {code}  {cli.EXIT_CODES[code]}" in ran.out
    assert "VALUE is read as JSON" in run_cli("list", "--help").out
    assert "KEY= (nothing after =) or KEY=null removes it" in " ".join(run_cli("metadata", "--help").out.split())


def test_importing_the_cli_loads_no_store_and_no_driver() -> None:
    code = "import sys, agent_sessions.cli; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            timeout=120).stdout.split()
    assert [m for m in ("stores", "sqlalchemy", "psycopg", "pymysql", "pymongo", "bson") if m in loaded] == []


# -- the same commands in-process, over the memory store (the reference semantics) ------------------------------


class InProcess:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.store = memory.Store()

    def __call__(self, *args: str) -> Ran:
        code = cli.main(list(args), store=self.store)
        out, err = self.capsys.readouterr()
        return Ran(code, out, err)


@pytest.fixture
def mem(capsys: pytest.CaptureFixture[str]) -> InProcess:
    return InProcess(capsys)


def test_memory_list_where_and_paging(mem: InProcess) -> None:
    for i in range(3):
        saved(mem.store, f"c{i}", TRANSCRIPT[:2])
        mem.store.set_metadata(f"c{i}", {"user": "u-17" if i else "u-3"})
    page = mem("list", "--limit", "1", "--where", "user=u-17", "--json").doc
    assert [s["id"] for s in page["sessions"]] == ["c2"]
    rest = mem("list", "--where", "user=u-17", "--after", page["next"], "--json").doc
    assert ([s["id"] for s in rest["sessions"]], rest["next"]) == (["c1"], None)
    assert mem("list", "--prefix", "zz").out == "no sessions\n"


def test_memory_delete_prune_and_info(mem: InProcess) -> None:
    saved(mem.store, "busy")
    saved(mem.store, "idle")
    mem.store.acquire("busy", claimant(), 60)
    ran = mem("delete", "busy", "--yes")
    assert ran.code == 5 and "--force" in ran.err
    assert mem("prune", "--idle-for", "0s", "--json").doc == {"deleted": 1, "idle_for": 0}
    assert mem("info", "idle").code == 1
    info = mem("info", "busy", "--json").doc
    assert info["holder"]["pid"] == os.getpid() and info["messages"] == 4
    assert mem("delete", "busy", "--force", "--yes").code == 0
    assert mem("list", "--json").doc == {"sessions": [], "next": None}


def test_memory_errors_are_one_line(mem: InProcess) -> None:
    ran = mem("metadata", "s", "k=[1, 2]")
    assert ran.code == 2 and ran.err.count("\n") == 1 and "JSON scalar" in ran.err
    ran = mem("list", "--limit", "5000")
    assert ran.code == 2 and "from 1 to 1000" in ran.err
    ran = mem("metadata", "s", "novalue")  # argparse's own error: returned, not raised as SystemExit
    assert ran.code == 2 and "usage:" in ran.err and "'novalue' is not key=value" in ran.err


def test_memory_show_of_a_session_without_messages(mem: InProcess) -> None:
    mem.store.set_metadata("labelled", {"user": "u-1"})  # exists, with no transcript yet
    shown = mem("show", "labelled")
    assert shown.code == 0 and shown.out.startswith("session labelled: 0 messages, created "), shown
    assert shown.out.endswith(' UTC\nmetadata: {"user":"u-1"}\n'), shown
    assert mem("show", "unknown").code == 1
    ran = mem("steer", "unknown", "hi")
    assert ran.code == 0 and "does not exist yet" in ran.out


# -- credentials never printed ---------------------------------------------------------------------------------

SECRET = "S3cr", "Et9"
"""Two halves of every password below: neither may be printed, whatever stands between them."""


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, never listening: a connection is refused at once
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hidden_urls() -> list[str]:
    """Each with PORT for a closed port, chosen as the test runs (the test ids stay the same)."""
    port = "PORT"
    out = [f"sqlite://u:S3cr/Et9@/{port}.db", "sqlite:///missing.db?password=S3crEt9", "missing.db?password=S3crEt9"]
    for scheme in ("postgresql+psycopg", "mysql+pymysql"):
        out += [f"{scheme}://u:S3cr/Et9@127.0.0.1:{port}/db", f"{scheme}://u:S3cr%40Et9@127.0.0.1:{port}/db",
                f"{scheme}://u:S3cr%2FEt9@127.0.0.1:{port}/db", f"{scheme}://u:S3cr@Et9@127.0.0.1:{port}/db",
                f"{scheme}://u@127.0.0.1:{port}/db?password=S3cr/Et9", f"{scheme}://u:S3cr:Et9@127.0.0.1:{port}/db",
                f"{scheme}://u:S3cr/Et9@127.0.0.1:notaport/db", f"{scheme}://u@127.0.0.1:{port}/db?passwd=S3crEt9"]
    quick = "serverSelectionTimeoutMS=300&connectTimeoutMS=300"
    out += [f"mongodb://u:S3cr/Et9@127.0.0.1:{port}/db?{quick}", f"mongodb://u:S3cr%2FEt9@127.0.0.1:{port}/db?{quick}",
            f"mongodb://u:S3cr@Et9@127.0.0.1:{port}/db?{quick}",
            f"mongodb://u:S3cr%40Et9@127.0.0.1:{port}/db?authSource=admin&{quick}",
            f"mongodb://127.0.0.1:{port}/db?authMechanism=MONGODB-AWS&authMechanismProperties="
            f"AWS_SESSION_TOKEN:S3crEt9&{quick}",
            "mongodb+srv://u:S3cr/Et9@cluster.invalid/db", "mongodb+srv://u:S3cr%40Et9@cluster.invalid/db"]
    return out


@pytest.mark.parametrize("url", hidden_urls())
def test_a_store_urls_credentials_are_never_printed(url: str) -> None:
    """The store cannot be reached (a closed port, no such file, an invalid name) or the URL is refused, so
    the CLI prints its one error line naming the store: with every credential as ***."""
    url = url.replace("PORT", str(_closed_port()))
    for args in (["list"], ["--json", "info", "s1"]):
        ran = run_cli(*args, store=url)
        assert ran.code in (cli.USAGE, cli.MISSING_DRIVER, cli.STORE_FAILED), ran
        assert ran.err.count("\n") == 1 and not ran.out, ran
        assert not any(half in ran.err for half in SECRET), ran.err
        assert "***" in ran.err or "u:" not in ran.err, ran.err


# -- one stored value prints as one field ----------------------------------------------------------------------

FORGED = "forged 2024-01-01 00:00:00         1  {}"
"""What a hostile id or text tries to print as a line of its own: a row of ``list``."""
HOSTILE = {  # a session id each, holding what would start a line, clear the screen or reorder the row
    "lf": f"h-lf\n{FORGED}", "cr": f"h-cr\r{FORGED}", "cls": "h-cls\x1b[2J\x1b[H", "ls": f"h-ls\u2028{FORGED}",
    "nel": f"h-nel\x85{FORGED}", "rlo": "h-rlo\u202eevil", "page": "h-page\nnext page: --after forged",
    "tab": "h-tab\tx",
}
BARE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printed_lines(out: str) -> list[str]:
    """stdout's lines, each checked to hold no character that would drive a terminal or end a line."""
    lines = out.split("\n")
    assert lines[-1] == "" and not any(BARE.search(line) for line in lines[:-1]), out
    return lines[:-1]


def test_hostile_ids_steers_and_metadata_print_as_one_row_each(tmp_path: Path) -> None:
    path = tmp_path / "hostile.db"
    store = sqlite.open(path)
    for sid in HOSTILE.values():
        saved(store, sid, TRANSCRIPT[:1])
        store.set_metadata(sid, {"note": f"v\n{FORGED}\u2028\x1b[2J"})
    store.add_steer(HOSTILE["lf"], "hurry\nrun:       none")
    lone = saved(store, "h-lone", [agent.Message.user("lone \ud800 here\x1b[2J"),
                                   agent.Message(agent.Role.ASSISTANT, [Content.tool_call(
                                       "c\n#9 user:", "grep\u202e", '{"q":\n"\ud800"}')])])
    store.close()

    ran = run_cli("list", "--prefix", "h-", store=str(path))
    assert ran.code == 0, ran
    rows = printed_lines(ran.out)
    assert len(rows) == 1 + len(HOSTILE) + 1, rows  # the header, one row per session, no other line
    assert not any(row.startswith(("forged", "next page")) for row in rows), rows
    assert sorted(row.split()[0] for row in rows[1:]) == sorted([
        "h-lf\\x0aforged", "h-cr\\x0dforged", "h-cls\\x1b[2J\\x1b[H", "h-ls\\u2028forged", "h-nel\\u0085forged",
        "h-rlo\\u202eevil", "h-page\\x0anext", "h-tab\\x09x", "h-lone"])
    page = printed_lines(run_cli("list", "--prefix", "h-", "--limit", "2", store=str(path)).out)
    assert len(page) == 4 and page[3].startswith("next page: --after "), page

    doc = run_cli("list", "--prefix", "h-", "--json", store=str(path)).doc  # exact JSON: every id as stored
    assert sorted(s["id"] for s in doc["sessions"]) == sorted([*HOSTILE.values(), lone])

    info = printed_lines(run_cli("info", HOSTILE["lf"], store=str(path)).out)
    assert [line for line in info if line.startswith("run:")] == ["run:       none"]
    assert info[0] == "id:        h-lf\\x0a" + FORGED and info[-4] == "  hurry\\x0arun:       none"
    assert info[-3:] == ["queued:    0 waiting", "in flight: none", "approvals: 0 waiting"]
    # id, created, updated, messages, metadata, run, steers, the one steer, queued, in flight, approvals
    assert len(info) == 11, info
    assert run_cli("info", HOSTILE["lf"], "--json", store=str(path)).doc["pending_steers"] == [
        "hurry\nrun:       none"]
    assert printed_lines(run_cli("metadata", HOSTILE["cr"], store=str(path)).out) == [
        'note="v\\nforged 2024-01-01 00:00:00         1  {}\\u2028\\u001b[2J"']

    shown = printed_lines(run_cli("show", lone, "--all", store=str(path)).out)
    assert shown[1:] == ["#1 user:", "  lone \\ud800 here\\x1b[2J", "#2 assistant:",
                     "  tool call grep\\u202e [c\\x0a#9 user:] {\"q\":", '  "\\ud800"}'], shown
    assert run_cli("show", lone, "--json", store=str(path)).doc["messages"][0]["content"][0]["text"] == (
        "lone \ud800 here\x1b[2J")
    gone = run_cli("info", "h-nobody\x1b[2J", store=str(path))
    assert gone.code == 1 and "\x1b" not in gone.err, gone


# -- stranded runs (issue 26) -----------------------------------------------------------------------------


def _stranded(store: Any, session: str, spec: str) -> str:
    """A turn whose worker died after storing the user's message: the lease released, no answer."""
    holder = store.acquire(session, agent.Holder("web-1", 1, claimant().token, 0.0, spec=spec), 30)
    store.save_fenced(session, holder, [agent.Message.user("refund order 7", key=f"turn-{session}")],
                      take_steers=False)
    store.release(session, holder)
    return session


def test_stranded_lists_open_turns_and_recover_finishes_those_resolve_knows(backend: Backend) -> None:
    _stranded(backend.store, "chat-support", "support")
    _stranded(backend.store, "chat-other", "billing")
    saved(backend.store, "chat-done")
    listed = run_cli("stranded", "--grace", "0s", "--json", store=backend.url)
    assert listed.code == 0, listed
    assert [(s["id"], s["spec"]) for s in listed.doc["sessions"]] == [("chat-support", "support"),
                                                                     ("chat-other", "billing")]
    assert listed.doc["sessions"][0]["open_since"] is not None
    # Open for less than the grace: not listed. An hour's grace, not the default 10 s, which a loaded machine's
    # two CLI starts since the turns were opened can outlast; the default is the parser's.
    assert run_cli("stranded", "--grace", "1h", store=backend.url).out.startswith("no stranded sessions")
    assert cli.build_parser().parse_args(["stranded"]).grace == 10.0
    ran = run_cli("recover", "--resolve", "tests.stranded_resolve:resolve", "--grace", "0s", "--json",
                  store=backend.url, pythonpath=Path(__file__).parent.parent)
    assert ran.code == 0, ran
    assert sorted((s["id"], s["outcome"]) for s in ran.doc["sessions"]) == [("chat-other", "skipped"),
                                                                            ("chat-support", "recovered")]
    assert backend.store.messages("chat-support")[-1].role is agent.Role.ASSISTANT
    again = run_cli("recover", "--resolve", "tests.stranded_resolve:resolve", "--grace", "0s",
                    store=backend.url, pythonpath=Path(__file__).parent.parent)
    assert again.code == 0 and again.out.split() == ["chat-other", "skipped"], again
    for bad, says in (("tests.nowhere:resolve", "cannot import"), ("resolve", "MODULE:FUNCTION")):
        refused = run_cli("recover", "--resolve", bad, store=backend.url)  # a usage error, as argparse says it
        assert refused.code == 2 and says in refused.err and not refused.out, refused


# -- what waits on a session, and the worker that answers it (issue 44) ----------------------------------------


class Asks:
    """The model: one call of ``refund``, of order 7."""

    def complete(self, system: str, messages: Any, tools: Any) -> agent.Message:
        return agent.Message(agent.Role.ASSISTANT, [Content.tool_call("call_9", "refund", '{"order": "7"}')])


@agent.tool(idempotent=False, needs_approval=True)
def refund(order: str) -> str:
    """Refund an order.

    Args:
        order: the order
    """
    return "refunded"


def test_info_and_show_list_everything_that_waits_on_a_session(mem: InProcess) -> None:
    """A turn waiting for a decision on one call (its reply in the tool journal), a steer, two messages
    queued behind it: info and show print each, and --json has each."""
    session = agent.open("waits", mem.store)
    result = agent.Runner().turn(agent.Spec(session=session, tools=[refund]), "refund 7", "msg-1", Asks())
    assert result.stop_reason == "awaiting_approval"
    session.steer("be brief")
    session.enqueue("and order 8?", "msg-2")
    session.enqueue("and order 9?", "msg-3")
    info = mem("info", "waits").out
    assert "\nsteers:    1 waiting\n  be brief\n" in info, info
    assert "\nqueued:    2 waiting (each answered by a turn of its own, in this order)\n  key msg-2\n  key msg-3\n" \
        in info, info
    assert "\nin flight: a reply with 1 tool call, after message #1\n  call_9  refund: waits for a decision\n" in info
    assert "\napprovals: 1 waiting" in info and '\n  call_9  refund({"order": "7"})' in info, info
    shown = mem("show", "waits").out
    assert "messages queued: 2 (each answered by a turn of its own, in this order)\n  key msg-2\n  key msg-3\n" \
        in shown and "in flight: a reply with 1 tool call" in shown, shown
    doc = mem("info", "waits", "--json").doc
    assert doc["queued"] == ["msg-2", "msg-3"] and doc["pending_steers"] == ["be brief"]
    assert doc["in_flight"] == {"after": 1, "calls": [{"call_id": "call_9", "tool": "refund",
                                                       "state": "waits for a decision"}]}
    session.approve("call_9")
    assert "call_9  refund: approved (person), not run yet" in mem("info", "waits").out
    assert mem("show", "waits", "--json").doc["queued"] == ["msg-2", "msg-3"]


def test_a_call_past_its_approval_deadline_is_said_expired_by_the_cli_and_the_console(mem: InProcess) -> None:
    """Undecided past its deadline, a call can no longer be decided (the next run denies it): ``info`` and the
    console's reading say so alike, never "waits for a decision"."""
    from agent_sessions.cli import waits_on
    from agent_sessions.contrib.django.console.reading import in_flight
    from agent_sessions.journal import EXPIRED

    session = agent.open("expires", mem.store)
    spec = agent.Spec(session=session, tools=[refund], approval_deadline=0.05)
    assert agent.Runner().turn(spec, "refund 7", "msg-7", Asks()).stop_reason == "awaiting_approval"
    time.sleep(0.1)
    info = mem("info", "expires").out
    assert f"\n  call_9  refund: {EXPIRED}\n" in info and "waits for a decision" not in info, info
    journal = waits_on(session).journal
    assert journal is not None
    [call] = in_flight(journal)
    assert (call.status, call.detail) == ("expired", EXPIRED)


def test_steer_says_who_takes_it(mem: InProcess) -> None:
    saved(mem.store, "idle")
    assert mem("steer", "idle", "be brief").out == ("steer left for session idle; no run holds the session now: its "
                                                    "next run takes it\n")
    keyed = mem("steer", "idle", "and order 8?", "--key", "k-1").out
    assert keyed.startswith("steer left for session idle; no run holds the session, so a keyed steer waits as a "
                            "message of its own: the sweep"), keyed
    mem.store.acquire("idle", claimant(), 60)
    assert mem("steer", "idle", "hurry").out == ("steer left for session idle: its run takes it before its next "
                                                 "model request\n")


def test_work_answers_what_is_left_until_a_signal_stops_it(backend: Backend, tmp_path: Path) -> None:
    """``work``: the sweep in a loop. A stranded turn and a message handed over with enqueue are answered;
    SIGTERM ends it (exit 0) with a summary; --for ends it too; without --resolve it is a usage error."""
    import signal

    _stranded(backend.store, "w-stranded", "support")
    _stranded(backend.store, "w-queued", "support")
    backend.store.save("w-queued", [*backend.store.messages("w-queued"), agent.Message.assistant("done")])
    agent.open("w-queued", backend.store).enqueue("and order 8?", "msg-8")
    environ = {k: v for k, v in os.environ.items() if k != cli.ENV_STORE}
    environ["PYTHONPATH"] = str(Path(__file__).parent.parent)
    worker = subprocess.Popen([sys.executable, "-m", "agent_sessions", "--store", backend.url, "work", "--resolve",
                               "tests.stranded_resolve:resolve", "--every", "0.2s", "--grace", "0s"], env=environ,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for session, key in (("w-stranded", "turn-w-stranded"), ("w-queued", "msg-8")):
            answer = agent.open(session, backend.store).answer(key, timeout=60)
            assert answer is not None and answer.role is agent.Role.ASSISTANT, (session, worker.poll())
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    rows = sorted(line.split()[2:4] for line in out.splitlines())
    assert rows == [["w-queued", "recovered"], ["w-stranded", "recovered"]], out
    assert err.endswith("work stopped: 2 recovered\n"), err
    ran = run_cli("work", "--resolve", "tests.stranded_resolve:resolve", "--for", "0.5s", "--json",
                  store=backend.url, env={"PYTHONPATH": str(Path(__file__).parent.parent)})
    assert (ran.code, ran.doc) == (0, {"stopped": {}}) and ran.err.endswith("work stopped: nothing to do\n"), ran
    one_line_error(run_cli("work", store=backend.url), 2, "work needs --resolve MODULE:FUNCTION")
