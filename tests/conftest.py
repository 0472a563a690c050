from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest

from tests.model_server import ModelServer

THREAD_GRACE = 10.0
"""Seconds a thread or process still running when the session ends gets to finish (a run saving its last
step, say) before it is reported."""
EXIT_LIMIT = float(os.environ.get("AGENT_SESSIONS_EXIT_TIMEOUT", "120"))
"""Seconds the process may take to exit once the session is over. Interpreter shutdown waits for every
non-daemon thread and joins every non-daemon multiprocessing child: one that never ends kept a run
hanging for 8 minutes after pytest's summary. A finished run exits in well under a second, so past this
limit faulthandler prints every thread's stack and ends the process with status 1, a failure: nothing
that passed is cut short, since every test has already run and reported."""


@pytest.fixture
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    yield server
    server.close()


_LINGERING: list[str] = []


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
    _LINGERING[:] = _lingering(THREAD_GRACE)
    if _LINGERING and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a leak that would have hung the exit is a failure
    # Armed last, once every test has run: a C watchdog thread, so it fires even if the interpreter is
    # stuck in threading._shutdown or an atexit handler. Its own copy of stderr: pytest closes its one.
    faulthandler.dump_traceback_later(EXIT_LIMIT, file=os.dup(2), exit=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _LINGERING:
        terminalreporter.write_sep("=", "left running when the session ended (the run fails)", red=True)
        for item in _LINGERING:
            terminalreporter.write_line(item)
