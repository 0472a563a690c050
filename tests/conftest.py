from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import json
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url
from sqlalchemy.exc import SQLAlchemyError

from storetest import processes
from tests import servers
from tests.model_server import ModelServer
from tests.reliability import figures

THREAD_GRACE = 10.0
"""Seconds a thread or process still running when the session ends gets to finish (a run saving its last
step, say) before it is reported."""
EXIT_LIMIT = float(os.environ.get("AGENT_SESSIONS_EXIT_TIMEOUT", "120"))
"""Seconds the process may take to exit once the session is over. Interpreter shutdown waits for every
non-daemon thread and joins every non-daemon multiprocessing child: one that never ends kept a run
hanging for 8 minutes after pytest's summary. A finished run exits in well under a second, so past this
limit faulthandler prints every thread's stack and ends the process with status 1, a failure: nothing
that passed is cut short, since every test has already run and reported."""


KEEP_DATABASES = os.environ.get("AGENT_SESSIONS_KEEP_DATABASES") == "1"
"""Set to 1 to keep the databases this run made (to look into a failure); by default it drops them."""
_BEFORE: dict[str, set[str]] = {}
"""Per SQL server, the databases of this run's prefix that were there when it began: not this run's to drop."""


PRELOAD = ["tests.servers", "tests.reliability.children", "tests.reliability.backends", "stores.memory",
           "stores.sqlite", "stores.postgres", "stores.mysql", "stores.mongodb", "psycopg", "pymysql", "pymongo"]
"""What the fork server that every test's child processes come from imports once (storetest/processes.py),
so a child starts forked from it in milliseconds rather than importing a driver again."""


def pytest_sessionstart(session: pytest.Session) -> None:
    processes.context(preload=PRELOAD)  # before any test starts a process, whichever store it is for
    for url in servers.SQL_SERVERS:
        try:
            _BEFORE[url] = servers.list_databases(url, timeout=2)
        except SQLAlchemyError as exc:  # a server that is not running: no database of ours is made there
            print(f"conftest: {make_url(url).render_as_string()} cannot be listed ({type(exc).__name__}); "
                  "its databases made by this run will not be dropped", file=sys.stderr)


def _drop_what_this_run_made() -> list[str]:
    """DROP the databases of this run's prefix made since it began (by its tests or their children), on
    each server listed at the start: a server it did not start keeps nothing of it. Another run's
    databases have another prefix, and ones made before this run began are left alone."""
    dropped = []
    for url, before in _BEFORE.items():
        made = servers.list_databases(url) - before
        servers.drop_databases(url, made)
        dropped += sorted(made)
    return dropped


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A MongoDB test (by its id or a fixture's name) without a MongoDB server is skipped after one short
    probe for the whole run, saying how to get one, rather than waiting out a server-selection timeout
    each; not when the URL was given (scripts/test gives it): then a server that does not answer fails."""
    uses_mongo = "mongo" in item.nodeid.lower() or any("mongo" in f for f in getattr(item, "fixturenames", ()))
    if uses_mongo and "AGENT_SESSIONS_MONGO_URL" not in os.environ and not servers.mongo_reachable():
        pytest.skip(f"no MongoDB server at {servers.MONGO_URL}: run the suite with scripts/test, or start one "
                    "with `eval \"$(scripts/servers start)\"` (or set AGENT_SESSIONS_MONGO_URL)")


@pytest.fixture(scope="session")
def wheel_python(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv holding the wheel built from this tree, with every extra
    (tests/wheel.py): what a pip user has, for the tests that must not see the tree. Built once a run: under
    pytest-xdist, by the first worker to need it, in the run's temp dir that all workers share, while the
    others wait for it (its build failing fails them all with its error, without a build of their own)."""
    from tests import wheel

    if not hasattr(request.config, "workerinput"):
        try:
            return wheel.build(tmp_path_factory.mktemp("wheel"))
        except wheel.Failed as exc:
            pytest.fail(str(exc))
    shared = tmp_path_factory.getbasetemp().parent  # basetemp/popen-gwN's parent: the run's
    built, failed = shared / "wheel" / "python", shared / "wheel-failed.txt"
    with _held(shared / "wheel.lock", WHEEL_BUILD_LIMIT):
        if not built.exists() and not failed.exists():
            try:
                python = wheel.build(shared / "wheel")
            except wheel.Failed as exc:
                failed.write_text(str(exc))
            else:
                built.write_text(str(python))
    if failed.exists():
        pytest.fail(failed.read_text())
    return Path(built.read_text())


WHEEL_BUILD_LIMIT = 1800.0
"""Seconds a worker waits for another to build the wheel: its steps' own timeouts add up to 25 minutes."""


@contextlib.contextmanager
def _held(path: Path, limit: float) -> Iterator[None]:
    """An exclusive flock on ``path``, waited for ``limit`` seconds at most."""
    with path.open("a") as f:
        deadline = time.monotonic() + limit
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{path} was held for {limit:.0f} s")
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    yield server
    server.close()


_LINGERING: list[str] = []
_UNDROPPED: list[str] = []


def _lingering(grace: float) -> list[str]:
    """Non-daemon threads and processes the tests left running, after giving them ``grace`` seconds:
    each would keep the interpreter from exiting. Described with the stack each thread is in."""
    deadline = time.monotonic() + grace
    threads = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    children = [p for p in multiprocessing.active_children() if not p.daemon]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
    frames = sys._current_frames()
    found = []
    for t in threads:
        if t.is_alive():
            frame = frames.get(t.ident or 0)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (no frame)\n"
            found.append(f"thread {t.name!r} (started by a test, not a daemon):\n{stack}")
    for p in children:
        if p.is_alive():
            found.append(f"process {p.name!r} pid {p.pid} (a multiprocessing child, not a daemon): killed")
            p.kill()  # the suite's own child; left alone, the interpreter's exit would join it forever
            p.join(10)
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _LINGERING.extend(_lingering(THREAD_GRACE))
    if not KEEP_DATABASES:
        try:
            _drop_what_this_run_made()
        except SQLAlchemyError as exc:
            _UNDROPPED.append(f"dropping this run's databases failed: {exc!r}")
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # a pytest-xdist worker: the controller reports these and fails the run on them
        output["lingering"], output["undropped"] = _LINGERING, _UNDROPPED
    elif (_LINGERING or _UNDROPPED) and session.exitstatus == pytest.ExitCode.OK:
        # A leak that would have hung the exit is a failure, and so is a footprint left behind.
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # Armed last, once every test has run: a C watchdog thread, so it fires even if the interpreter is
    # stuck in threading._shutdown or an atexit handler. Its own copy of stderr: pytest closes its one.
    faulthandler.dump_traceback_later(EXIT_LIMIT, file=os.dup(2), exit=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist, whole classes and modules to a worker, the longest first (tests/schedule.py)."""
    if config.getvalue("dist") == "each":
        return None
    from tests import schedule

    return schedule.scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object | None) -> None:
    """What a pytest-xdist worker hands over as it ends joins the run's: its reliability figures
    (tests/reliability/conftest.py), and what it left running or could not drop, which fail the run here."""
    output = getattr(node, "workeroutput", {})
    figures.merge(output.get(figures.WORKER_OUTPUT, {}))
    _LINGERING.extend(f"[{node.gateway.id}] {item}" for item in output.get("lingering", []))
    _UNDROPPED.extend(f"[{node.gateway.id}] {item}" for item in output.get("undropped", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    # A pytest-xdist worker's summary is shown nowhere, and its figures are the controller's to write.
    out = None if hasattr(terminalreporter.config, "workerinput") else figures.write()
    if out is not None:
        terminalreporter.write_sep("-", f"reliability figures (also in {out})")
        terminalreporter.write_line(json.dumps(figures.RECORDED, sort_keys=True))
    if _LINGERING:
        terminalreporter.write_sep("=", "left running when the session ended (the run fails)", red=True)
        for item in _LINGERING:
            terminalreporter.write_line(item)
    for item in _UNDROPPED:
        terminalreporter.write_line(f"conftest: {item} (the run fails)", red=True)
