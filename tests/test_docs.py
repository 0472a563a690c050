"""Every ```python block of README.md and docs/**/*.md runs, against the installed wheel, so a doc cannot drift
from the code, nor lean on the repository.

Where the blocks run: in a fresh venv holding the wheel built from this tree (tests/wheel.py), as a pip user
has the library: ``test_the_blocks_run_against_the_installed_wheel`` runs this module again there, in a
child pytest, from a copy of ``tests/``, ``docs/`` and ``README.md`` alone (no ``agent_sessions``, ``stores``,
``examples`` beside them), and fails with the child's report unless every block passed. Set
``AGENT_SESSIONS_DOCS_FROM=tree`` to run the blocks here, against the tree, one test per block (quicker to
look into one).

How the blocks run:

- Each block is a test, ``<page>#<n>`` (``docs/runs/leases.md#2``: the page's second python block). The
  blocks of one page run in order in one namespace, so a block may use what an earlier block of its page
  defined; a page defines everything it uses (nothing is injected). Running one block on its own
  (``'tests/test_docs.py::test_block[docs/runs/leases.md#2]'``) runs the blocks before it first.
- The working directory is a fresh temporary directory per page (``sessions.db`` is made there), and each
  block must finish within ``BLOCK_SECONDS``.
- A block the reader cannot run as it stands (a fragment of their own code) is preceded in the markdown by
  ``<!-- not run: the reason -->``. It is only compiled, and the test is skipped with that reason.
- The outside addresses a reader would use are replaced in the code, textually, by the test's own; these
  and no others (``SUBSTITUTIONS``):

  | in the docs                                    | replaced by                                      |
  |------------------------------------------------|--------------------------------------------------|
  | ``http://127.0.0.1:8080/v1``                   | the page's scripted model server (its url + /v1) |
  | ``postgresql+psycopg://app@db/app``            | tests.servers.POSTGRES_URL, database DATABASE    |
  | ``mysql+pymysql://app@db/app?charset=utf8mb4`` | tests.servers.MYSQL_URL, database DATABASE       |
  | ``mongodb://db:27017/app``                     | tests.servers.MONGO_URL, database DATABASE       |
  | ``redis://db:6379/0``                          | tests.servers.REDIS_URL                          |
  | ``"myapp:agent:"`` (a Redis store's prefix)    | the suite's own prefix (REDIS_PREFIX)            |

  DATABASE is ``<prefix>_docs_<pid>`` (tests/servers.py): made for this run, emptied before each page that uses
  it, dropped at the end.
- A page that talks to the model has its replies scripted in ``SCRIPTS``, so each of its runs answers
  the same way every time; when the page ends, every scripted reply must have been used, and every
  thread the page started must have ended. ``CHECKS`` holds what a page's code claims beyond not raising.
- A page of ``SHIPPED`` talks to the scripted model server the wheel ships
  (``agent_sessions.testing.model_server``, its default script) instead of replies scripted here: what a
  reader gets who starts ``python -m agent_sessions.testing.model_server``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import re
import shutil
import sqlite3
import subprocess
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pymongo
import pytest
import redis as redis_py
from pymongo.database import Database
from sqlalchemy import Engine, create_engine, make_url

import agent_sessions as agent
import storetest
from agent_sessions import eventlog
from agent_sessions.events import Reported
from agent_sessions.testing.model_server import ModelServer as Shipped
from agent_sessions.testing.model_server import scripted
from tests import servers
from tests.model_server import ModelServer, Reply, Request, Script, openai, sse

ROOT = Path(__file__).resolve().parent.parent
WHERE = os.environ.get("AGENT_SESSIONS_DOCS_FROM", "wheel")
"""``wheel``: this process runs the blocks in the wheel's venv (a child pytest, ``child`` there); ``tree``:
it runs them itself, against the tree."""
if WHERE == "child":  # the child must see the installed wheel, never a tree
    assert "site-packages" in agent.__file__ and not (ROOT / "agent_sessions").exists(), agent.__file__
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]
BLOCK_SECONDS = 60.0
THREAD_SECONDS = 30.0
DATABASE = servers.database_name(f"docs_{os.getpid()}")

MODEL = "http://127.0.0.1:8080/v1"
POSTGRES = "postgresql+psycopg://app@db/app"
MYSQL = "mysql+pymysql://app@db/app?charset=utf8mb4"
MONGO = "mongodb://db:27017/app"
REDIS = "redis://db:6379/0"
SUBSTITUTIONS = (MODEL, POSTGRES, MYSQL, MONGO, REDIS)
DATABASES = (POSTGRES, MYSQL, MONGO, REDIS)
REDIS_PREFIX_LITERAL = '"myapp:agent:"'
REDIS_PREFIX = f"{servers.REDIS_KEY_PREFIX}docs{os.getpid()}:"
"""What a page's Redis store writes under, in place of the docs' prefix: the suite's own keys."""
ADDRESS = re.compile(r"""["'](?P<url>[a-z][a-z0-9+.-]*://[^"']*)["']""")

OPENING = re.compile(r"^```python\s*$")
ANY_PYTHON_FENCE = re.compile(r"^\s*(```|~~~)\s*(py|python|python3|pycon)\b", re.IGNORECASE)
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    number: int  # 1-based, among the page's python blocks
    line: int  # of the block's first line of code in the page
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.page}#{self.number}"


def blocks_of(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if not OPENING.match(lines[i]):
            i += 1
            continue
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = NOT_RUN.match(before)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a ```python block that never closes"
        found.append(Block(page, len(found) + 1, i + 2, "\n".join(lines[i + 1 : end]) + "\n",
                           marked["reason"] if marked else None))
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


# What the model answers, page by page, in the order the page's runs ask. Each is given the open Page.


def steered(page: Page, text: str) -> Callable[[Request], bool]:
    """Whether ``session.steer(text)`` has been called: the steer is in this request (the run took it
    before asking), or it waits in the page's sessions.db (read without taking it)."""

    def condition(request: Request) -> bool:
        if any(m.get("content") == text for m in request.json["messages"]):
            return True
        try:
            conn = sqlite3.connect(page.dir / "sessions.db", timeout=1)
            try:
                return bool(conn.execute("SELECT COUNT(*) FROM agent_steers").fetchone()[0])
            finally:
                conn.close()
        except sqlite3.Error:
            return False

    return condition


def once(condition: Callable[[Request], bool], reply: Reply, what: str, seconds: float = 10.0) -> Script:
    """``reply``, sent once ``condition`` holds: a model still thinking while the page's next lines run,
    as a real one would be. A 400 saying so if it never holds."""

    def answer(request: Request) -> Reply:
        deadline = time.monotonic() + seconds
        while not condition(request):
            if time.monotonic() > deadline:
                return Reply({"error": {"message": f"test_docs: {what} never happened"}}, status=400)
            time.sleep(0.01)
        return reply

    return answer


def slow(reply: Reply, seconds: float) -> Script:
    """``reply`` after ``seconds``: a model taking a moment, for a page whose next line needs the run alive
    and leaves nothing a reply could wait for."""

    def answer(request: Request) -> Reply:
        time.sleep(seconds)
        return reply

    return answer


FIRST_ANSWER = "The lease is compared with the replica's clock; compare it with the store's."

def streamed(*words: str) -> Reply:
    """An OpenAI stream answering ``words`` joined, a word per delta, with its usage."""
    chunks = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in words]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(words)}})
    return sse("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")


SCRIPTS: dict[str, Callable[[Page], list[Script]]] = {
    "docs/api.md": lambda page: [
        streamed("The", " replica", "'s", " clock."),
        streamed("The", " renewal", " checks", " the", " epoch."),
    ],
    "README.md": lambda page: [
        # The model answers once run.steer and session.steer were sent, so both land in this run.
        once(steered(page, "and the renewal path"),
             openai(calls=[("call_1", "read_file", '{"path": "lease.go"}')]), "session.steer"),
        openai(FIRST_ANSWER),
        openai("Line 42: `return ErrExpired` runs before the renewal is checked."),
    ],
    "docs/sessions.md": lambda page: [
        slow(openai("The token is fine; the expiry is compared with the wrong clock."), 0.5),
        openai("The expiry is compared with the replica's clock."),
        openai("Line 42 returns it."),
    ],
    "docs/runs/fork.md": lambda page: [
        openai("The expiry is compared with the replica's clock."),
        openai("The renewal never checks the epoch."),
        openai("The renewal path is fine; the epoch is checked on the store."),
    ],
    "docs/runs/leases.md": lambda page: [
        openai("Line 42."),
    ],
    "docs/runs/events.md": lambda page: [
        openai(calls=[("call_1", "lookup", '{"order": "1182"}')]),
        openai("Order 1182 was delivered 3 days ago."),
    ],
    "docs/runs/busy.md": lambda page: [
        openai("Yes: order 1183 is within the 30-day window too."),
    ],
    "docs/lifecycle.md": lambda page: [
        openai("Yes: it was delivered 3 days ago, within the 30-day window."),
    ],
    "docs/tracing.md": lambda page: [
        openai(calls=[("call_1", "read_file", '{"path": "lease.go"}')],
               usage={"prompt_tokens": 120, "completion_tokens": 18}),
        openai("It compares the expiry with the local clock.", usage={"prompt_tokens": 170, "completion_tokens": 12}),
        Reply({"error": {"message": "invalid api key"}}, status=401),
    ],
}


SHIPPED = {"docs/runs/approvals.md"}
"""Pages whose model is the scripted server the wheel ships, with its default script."""


def check_approvals(page: Page) -> None:
    # Against the shipped server: the refund of 80 asked for approval, ran once approved, and was answered.
    msgs = page.ns["session"].messages()
    assert page.ns["result"].stop_reason == "answered" and msgs[2].content[0].text == "refunded 80 on 1182"


def check_readme(page: Page) -> None:
    # Both steers landed in the first run, in the order they were sent, before its answer.
    texts = [m.text for m in page.ns["store"].messages("conversation-1")]
    steers = ["check the lease expiry, not the token", "and the renewal path"]
    assert [t for t in texts if t in steers] == steers, texts
    assert texts.index(steers[1]) < texts.index(FIRST_ANSWER) < texts.index("which line returns the error?"), texts


def check_sessions(page: Page) -> None:
    # The protocols as the page shows them are the library's.
    for shown, real in ((page.ns["Store"], agent.Store), (page.ns["Session"], agent.Session)):
        assert methods(shown) == methods(real), f"docs/sessions.md shows {shown.__name__} not as it is"


def check_fork(page: Page) -> None:
    # What the comments say: the whole transcript, and messages 0..2 with a new answer after them.
    original = page.ns["session"].messages()
    assert len(original) == 4 and page.ns["other"].messages() == original
    retry = page.ns["retry"].messages()
    assert retry[:3] == original[:3] and len(retry) == 4 and retry[3] != original[3], retry


def check_tracing(page: Page) -> None:
    # What the second block's comments say: the failed run's three spans, each ERROR with the error's name,
    # and the application's own listener told the run failed.
    spans = page.ns["exporter"].get_finished_spans()
    assert [s.name for s in spans] == ["chat gpt-4o-mini", "step", "invoke_agent"], spans
    for span in spans:
        assert span.status.status_code.name == "ERROR"
        assert span.attributes["error.type"] == "agent_sessions.errors.EndpointError"
        assert span.attributes["gen_ai.conversation.id"] == "review-42"
    assert isinstance(page.ns["seen"][-1], agent.events.Failed)
    assert page.ns["result"].usage == {"prompt_tokens": 290, "completion_tokens": 30}

def check_events(page: Page) -> None:
    # The follower saw the run's events as the page prints them, each once, and they are the stored log.
    seen = page.ns["seen"]
    assert [e.kind for e in seen] == ["step_started", "model_response", "tool_called", "tool_finished",
                                      "step_started", "model_response", "finished"]
    assert seen == page.ns["session"].events()


def check_api(page: Page) -> None:
    # The streamed run's answer is its deltas joined, as the page says.
    assert page.ns["result"].text == "The replica's clock." and page.ns["result"].usage["completion_tokens"] == 4


CHECKS: dict[str, Callable[[Page], None]] = {
    "docs/api.md": check_api,
    "docs/runs/approvals.md": check_approvals,
    "README.md": check_readme,
    "docs/sessions.md": check_sessions,
    "docs/runs/fork.md": check_fork,
    "docs/runs/events.md": check_events,
    "docs/tracing.md": check_tracing,
}


def methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn, eval_str=True) for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_")}


def check_store(page: Page) -> None:
    """A page's ``store`` works: what the page set up (a schema, indexes) is a store it can use."""
    store = page.ns.get("store")
    if isinstance(store, agent.Store):
        msgs = [agent.Message.user("test_docs: the page's store keeps this")]
        store.save("test-docs-check", msgs)
        assert store.messages("test-docs-check") == msgs


def check_store_contracts(page: Page) -> None:
    """A StoreContract subclass on a page overrides only what StoreContract has (no misspelt hook)."""
    for value in page.ns.values():
        if isinstance(value, type) and issubclass(value, storetest.StoreContract):
            for name in vars(value):
                if not name.startswith("_"):
                    assert hasattr(storetest.StoreContract, name), f"{value.__name__}.{name} overrides nothing"


# The test databases: made on first use, emptied before each page that uses one, dropped at the end.

TABLES = ("agent_journals", "agent_runs", "agent_session_tags", "agent_steer_keys", "agent_store", "agent_sessions",
          "agent_messages", "agent_steers", "agent_queue", "agent_keys", "agent_events", "agent_metadata")


class Databases:
    def __init__(self) -> None:
        self.made: dict[str, str] = {}

    def url(self, literal: str) -> str:
        if literal not in self.made:
            if literal == REDIS:
                self.made[literal] = servers.REDIS_URL
            elif literal == MONGO:
                parts = urlsplit(servers.MONGO_URL)
                self.made[literal] = urlunsplit(parts._replace(path="/" + DATABASE))
            else:
                base = servers.POSTGRES_URL if literal == POSTGRES else servers.MYSQL_URL
                self.made[literal] = servers.database_url(base, DATABASE)
        return self.made[literal]

    def empty(self, literal: str) -> None:
        url = self.url(literal)
        if literal == REDIS:
            client = redis_py.Redis.from_url(url)
            for key in client.scan_iter(f"{REDIS_PREFIX}*"):
                client.delete(key)
            client.close()
            return
        if literal == MONGO:
            client: pymongo.MongoClient[Any] = pymongo.MongoClient(url, serverSelectionTimeoutMS=10_000)
            client.drop_database(DATABASE)
            client.close()
            return
        engine = create_engine(url)
        with engine.begin() as conn:
            for table in TABLES:
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        engine.dispose()

    def drop(self) -> None:
        for literal, url in self.made.items():
            if literal == REDIS:
                self.empty(literal)
            elif literal == MONGO:
                client: pymongo.MongoClient[Any] = pymongo.MongoClient(url, serverSelectionTimeoutMS=10_000)
                client.drop_database(DATABASE)
                client.close()
            elif literal == POSTGRES:
                admin = create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
                with admin.connect() as conn:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
                admin.dispose()
            else:
                admin = create_engine(make_url(url).set(database=""))
                with admin.connect() as conn:
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{DATABASE}`")
                admin.dispose()


# A page while its blocks run.


@dataclass
class Page:
    path: str
    dir: Path
    blocks: list[Block]
    ns: dict[str, Any] = field(default_factory=dict)
    done: int = 0
    failed: str | None = None
    model: ModelServer | Shipped | None = None
    scripted: int = 0
    substitutions: dict[str, str] = field(default_factory=dict)
    threads: set[threading.Thread] = field(default_factory=set)
    cwd: str = ""
    environ: dict[str, str | None] = field(default_factory=dict)

    def code(self, block: Block) -> str:
        code = block.code
        for literal, replacement in self.substitutions.items():
            code = code.replace(literal, replacement)
        return code


class Pages:
    """Opens one page at a time: its directory, model server, databases and environment."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.databases = Databases()
        self.current: Page | None = None

    def open(self, path: str) -> Page:
        if self.current is not None and self.current.path == path:
            return self.current
        self.close()
        blocks = [b for b in BLOCKS if b.page == path]
        page = Page(path, self.base / path.replace("/", "__"), blocks, ns={"__name__": f"docs:{path}"})
        page.dir.mkdir()
        page.threads = set(threading.enumerate())
        page.cwd = os.getcwd()
        self.current = page
        used = "".join(b.code for b in blocks if b.not_run is None)
        if MODEL in used and path in SHIPPED:
            page.model = Shipped(scripted)
            page.substitutions[MODEL] = page.model.url + "/v1"
        elif MODEL in used:
            assert path in SCRIPTS, f"{path} talks to the model: script its replies in SCRIPTS"
            page.model = ModelServer()
            replies = SCRIPTS[path](page)
            page.model.push(*replies)
            page.scripted = len(replies)
            page.substitutions[MODEL] = page.model.url + "/v1"
        else:
            assert path not in {*SCRIPTS, *SHIPPED}, f"{path} has scripted replies but no block uses {MODEL}"
        for literal in DATABASES:
            if literal in used:
                self.databases.empty(literal)
                page.substitutions[literal] = self.databases.url(literal)
        if REDIS in used:
            page.substitutions[REDIS_PREFIX_LITERAL] = f'"{REDIS_PREFIX}"'
        os.chdir(page.dir)
        return page

    def environ(self, page: Page, **values: str | None) -> None:
        for name, value in values.items():
            page.environ[name] = os.environ.get(name)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def close(self, check: bool = False) -> None:
        """End the current page: wait for its threads, release what it holds; with ``check``, assert that
        it ended clean (every reply used, no thread left) and what CHECKS says of it."""
        page, self.current = self.current, None
        if page is None:
            return
        try:
            left = self.join(page)
            if check:
                assert not left, f"{page.path} left threads running: {left}"
                if page.model is not None and page.path not in SHIPPED:
                    unused = page.scripted - len(page.model.requests)
                    assert unused == 0, (f"{page.path}: {len(page.model.requests)} model requests, "
                                         f"{page.scripted} replies scripted")
                check_store(page)
                check_store_contracts(page)
                if page.path in CHECKS:
                    CHECKS[page.path](page)
        finally:
            os.chdir(page.cwd)
            for name, value in page.environ.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            release(page.ns)
            if page.model is not None:
                page.model.close()

    def join(self, page: Page) -> list[str]:
        deadline = time.monotonic() + THREAD_SECONDS
        for thread in set(threading.enumerate()) - page.threads:
            if not thread.daemon:
                thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in set(threading.enumerate()) - page.threads if not t.daemon and t.is_alive()]


def release(ns: dict[str, Any]) -> None:
    """Close the connections a page's code opened, so the test databases can be dropped."""
    for value in ns.values():
        if isinstance(value, Engine):
            value.dispose()
        elif isinstance(value, Database):
            value.client.close()
        elif isinstance(value, pymongo.MongoClient):
            value.close()


def shifted(code: types.CodeType, lines: int) -> types.CodeType:
    """``code`` and the code objects it holds (its functions, classes), ``lines`` further down the file."""
    consts = tuple(shifted(c, lines) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_firstlineno=code.co_firstlineno + lines, co_consts=consts)


def run(page: Page, block: Block) -> None:
    """Run ``block`` in the page's namespace, with its line numbers those of the page (so a traceback
    points into the markdown, and shows the block), on a thread joined for at most BLOCK_SECONDS."""
    code = shifted(compile(page.code(block), str(ROOT / page.path), "exec"), block.line - 1)
    raised: list[BaseException] = []

    def target() -> None:
        try:
            exec(code, page.ns)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            raised.append(exc)

    thread = threading.Thread(target=target, name=f"test_docs {block.id}", daemon=True)
    page.threads.add(thread)
    thread.start()
    thread.join(BLOCK_SECONDS)
    if thread.is_alive():
        pytest.fail(f"{block.id} did not finish within {BLOCK_SECONDS:.0f} s")
    if raised:
        raise raised[0]


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pages]:
    opened = Pages(tmp_path_factory.mktemp("docs"))
    try:
        yield opened
    finally:
        try:
            opened.close()
        finally:
            opened.databases.drop()


HERE = BLOCKS if WHERE in ("tree", "child") else []
"""The blocks this process runs: every one, unless it hands them to the wheel's venv."""


@pytest.mark.skipif(WHERE != "wheel", reason="this process runs the blocks itself")
def test_the_blocks_run_against_the_installed_wheel(wheel_python: Path, tmp_path: Path) -> None:
    """This module again, in a child pytest in the wheel's venv, from a copy of the tests and the pages alone:
    every block of every page must pass there, against what ``pip install`` gives."""
    from tests import wheel

    copy = tmp_path / "docs-from-wheel"
    shutil.copytree(ROOT / "tests", copy / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy2(ROOT / "README.md", copy / "README.md")
    env = wheel.clean_env(AGENT_SESSIONS_DOCS_FROM="child")
    done = subprocess.run([str(wheel_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                           "tests/test_docs.py"], cwd=copy, env=env, capture_output=True, text=True, timeout=1500)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"\ndocs' blocks in the wheel's venv ({wheel_python}): {summary}")
    assert done.returncode == 0, f"{done.stdout[-8000:]}\n{done.stderr[-3000:]}"
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


@pytest.mark.parametrize("block", HERE, ids=[b.id for b in HERE])
def test_block(block: Block, pages: Pages) -> None:
    page = pages.open(block.page)
    if page.failed:
        pytest.fail(f"{page.failed} failed, and {block.id} needs what the page did before it")
    try:
        for earlier in page.blocks[page.done : block.number - 1]:
            if earlier.not_run is None:
                run(page, earlier)  # a block run on its own needs the page's blocks before it
            page.done = earlier.number
    except BaseException:
        page.failed = page.blocks[page.done].id
        raise
    if block.not_run is not None:
        ast.parse(page.code(block), filename=block.id)
        page.done = block.number
        if block.number == len(page.blocks):
            pages.close(check=True)
        pytest.skip(f"not run: {block.not_run}")
    try:
        run(page, block)
    except BaseException:
        page.failed = block.id
        raise
    page.done = block.number
    if block.number == len(page.blocks):
        pages.close(check=True)


def test_every_python_block_is_found() -> None:
    """A ```py or an indented ```python fence would be skipped silently: every python fence is a block,
    and every ``not run`` comment marks one, with a reason."""
    for page in PAGES:
        lines = (ROOT / page).read_text().splitlines()
        fences = [n for n, line in enumerate(lines, 1) if ANY_PYTHON_FENCE.match(line)]
        found = [b.line - 1 for b in BLOCKS if b.page == page]
        assert fences == found, f"{page}: python fences on lines {fences}, blocks found on {found}"
        for n, line in enumerate(lines, 1):
            if "not run" in line and line.lstrip().startswith("<!--"):
                assert NOT_RUN.match(line), f"{page}:{n}: write it <!-- not run: the reason -->"
                after = next((x for x in lines[n:] if x.strip()), "")
                assert OPENING.match(after), f"{page}:{n}: a not-run mark must come just before a ```python block"


def test_every_address_is_one_the_test_replaces() -> None:
    """A block that reached for another address would talk to whatever answers there, or hang on a name
    lookup: every URL in code that runs is one of SUBSTITUTIONS."""
    for block in BLOCKS:
        if block.not_run is None:
            for match in ADDRESS.finditer(block.code):
                assert match["url"] in SUBSTITUTIONS, f"{block.id}: {match['url']} is not in SUBSTITUTIONS"


def test_some_blocks_are_found() -> None:
    assert len(BLOCKS) >= 20 and {b.page for b in BLOCKS} >= {"README.md", "docs/sessions.md"}


def _example(kind: type[Reported]) -> Reported:
    """An event of ``kind`` with a value of its type in each field (the first of a ``Literal``'s)."""
    values: dict[object, object] = {
        int: 1, str: "x", float: 0.5, bool: True, agent.Content: agent.Content.tool_call("c1", "grep", "{}"),
        agent.Message: agent.Message.user("q"), agent.Result: agent.Result([], "", 0, "answered", []),
        BaseException: KeyError("x"),
    }
    hints = typing.get_type_hints(kind)
    return kind(**{f.name: (typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is typing.Literal
                            else values[hints[f.name]]) for f in dataclasses.fields(kind)})


def _tables(page: str, heading: str) -> list[list[list[str]]]:
    """The tables of the section ``heading`` of ``page``: each a list of its rows' cells, header and rule left out."""
    text = (ROOT / page).read_text()
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    tables: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            tables.append(rows[2:])
            rows = []
    return tables


FIELD = re.compile(r"`([a-z_]+)(?::[^`]*)?`")
"""A field named in a table's cell: ```step```, or ```ref: {index, digest}```; not ```"run"``` nor ```{id, name}```."""


def test_the_documented_event_kinds_are_the_declared_ones() -> None:
    """docs/runs/events.md's table of what is published is the declaration (``agent_sessions.events``: each
    event's ``kind`` and the fields of its ``data()``), kind by kind in its order; and its table of the events
    that point says, for each kind with ``points``, which field the stored ``ref`` stands for."""
    published, pointing = _tables("docs/runs/events.md", "## What is published")[0], _tables(
        "docs/runs/events.md", "## Events that point at their message")[0]
    declared = {name: list(_example(kind).data()) for name, kind in eventlog.KINDS.items()}
    assert {FIELD.findall(kind)[0]: FIELD.findall(data) for kind, data in published} == declared
    assert [FIELD.findall(kind)[0] for kind, _ in published] == list(declared)
    documented = {FIELD.findall(kind)[0]: (FIELD.findall(stored), FIELD.findall(read))
                  for kind, stored, read in pointing}
    assert documented == {name: (["ref" if field == points else field for field in declared[name]], declared[name])
                          for name, points in eventlog.POINTING.items()}
