"""The lease's heartbeat, seen from the run: failures are logged and survived, a stuck store call never
holds up the run's return, and any session over a RunStore is leased, whatever its class."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

import agent_sessions as agent
from agent_sessions import lease
from stores import memory
from storetest.scripted import ToolsThenAnswer
from storetest.stalls import Stalled


class RenewalsFail(Stalled):
    """Every renewal fails as a store that is down would."""

    def __init__(self, store: agent.RunStore) -> None:
        super().__init__(store)
        self.failed = 0

    def renew(self, session: str, holder: agent.Holder, ttl: float) -> None:
        self.failed += 1
        raise agent.StoreError(f"renew of session {session!r} failed: the server went away")


class RenewalsHang(Stalled):
    def __init__(self, store: agent.RunStore) -> None:
        super().__init__(store)
        self.unblock = threading.Event()

    def renew(self, session: str, holder: agent.Holder, ttl: float) -> None:
        self.unblock.wait(60)


@agent.tool
def nap(n: int) -> str:
    """Outlive a few heartbeats."""
    time.sleep(0.4)
    return "rested"


def test_failing_renewals_are_logged_and_a_lapsed_lease_nobody_took_stays_the_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = RenewalsFail(memory.Store())
    caplog.set_level(logging.WARNING, logger="agent_sessions.lease")
    result = agent.Runner().run(agent.Spec(session=agent.open("s", store), tools=[nap], lease_ttl=0.15),
                                [agent.Message.user("go")], ToolsThenAnswer(["nap"]))
    assert result.stop_reason == "answered"
    assert store.failed >= 2
    failures = [r for r in caplog.records if r.name == "agent_sessions.lease" and "renewal failed" in r.message]
    assert failures and "the server went away" in failures[0].getMessage()
    assert store.messages("s") == result.messages  # nobody took the lapsed lease: every write went through


def test_a_heartbeat_stuck_in_a_store_call_does_not_hold_up_the_runs_return(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lease, "HEARTBEAT_JOIN", 0.3)
    store = RenewalsHang(memory.Store())
    caplog.set_level(logging.WARNING, logger="agent_sessions.lease")
    started = time.monotonic()
    try:
        result = agent.Runner().run(agent.Spec(session=agent.open("s", store), tools=[nap], lease_ttl=0.15),
                                    [agent.Message.user("go")], ToolsThenAnswer(["nap"]))
        took = time.monotonic() - started
    finally:
        store.unblock.set()
    assert result.stop_reason == "answered"
    assert took < 10, f"the run took {took:.1f} s to return"
    assert any("still inside a store call" in r.message for r in caplog.records)
    assert all(t.daemon for t in threading.enumerate() if t.name == "agent-lease")


class MySession:
    """A session class of the application's own (not agent.StoreSession) over a RunStore."""

    def __init__(self, id: str, store: agent.RunStore) -> None:
        self.id = id
        self.store = store

    def save(self, msgs: Sequence[agent.Message]) -> None:
        self.store.save(self.id, msgs)

    def messages(self) -> list[agent.Message]:
        return self.store.messages(self.id)

    def steer(self, text: str) -> None:
        self.store.add_steer(self.id, text)

    def take_steers(self) -> list[str]:
        return self.store.take_steers(self.id)


def holding() -> tuple[agent.Tool, threading.Event, threading.Event]:
    """A tool that holds its run (and so the session's lease) until ``go`` is set; ``entered`` once it does."""
    entered, go = threading.Event(), threading.Event()

    @agent.tool
    def hold(n: int) -> str:
        """Hold the run."""
        entered.set()
        go.wait(10)
        return "held"

    return hold, entered, go


def test_any_session_over_a_run_store_is_leased_and_fenced() -> None:
    store = memory.Store()
    session = MySession("mine", store)
    assert agent.contract.is_run_session(session)
    hold, entered, go = holding()
    first = agent.Runner().start(agent.Spec(session=session, tools=[hold]), [agent.Message.user("a")],
                                 ToolsThenAnswer(["hold"]))
    try:
        assert entered.wait(10)
        held = store.holder("mine")
        assert held is not None and held.epoch == 1
        with pytest.raises(agent.SessionBusy):
            agent.Runner().run(agent.Spec(session=MySession("mine", store)), [agent.Message.user("b")],
                               ToolsThenAnswer([]))
    finally:
        go.set()
    assert first.wait(10).stop_reason == "answered"
    assert store.holder("mine") is None


@pytest.mark.parametrize("kind", ["sqlite", "mongodb"])
def test_a_takeover_of_an_expired_lease_is_logged_by_the_store(
    kind: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """An operator explaining an incident needs to see that a run's lease expired and another took it."""
    from stores import sqlite
    from tests import servers

    caplog.set_level(logging.INFO)
    store: agent.RunStore = (sqlite.open(tmp_path / "log.db") if kind == "sqlite"
                             else servers.mongo_store(database=servers.database_name("lease_log")))
    sid = f"log-{time.time_ns()}"
    dead = store.acquire(sid, agent.Holder("web-1", 101, "d" * 32, 0.0), 0.1)
    time.sleep(0.3)
    store.acquire(sid, agent.Holder("web-2", 202, "e" * 32, 0.0), 30)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("stores.") and "taken over" in r.getMessage()]
    assert len(said) == 1 and f"epoch {dead.epoch + 1}" in said[0], said
    assert "pid 101 on web-1" in said[0] or "token dddddddd" in said[0]


def test_the_library_is_silent_unless_the_application_configures_logging(tmp_path: Path) -> None:
    """A warning from a store or a lease (a retried deadlock, a failed renewal) reaches no stderr of an
    application that configured no logging: Python's last-resort handler would print it."""
    code = (
        "import logging, stores.sqlite, agent_sessions\n"
        "logging.getLogger('stores._sql.store').warning('from a store')\n"
        "logging.getLogger('agent_sessions.lease').warning('from a lease')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stderr == ""


def test_a_busy_session_says_who_holds_it_until_when_and_how_to_wait(caplog: pytest.LogCaptureFixture) -> None:
    """A second message while the first turn runs: the turn that gives up says who holds the session, when
    that lease ends and the lease_wait it used; one that waits says so when it begins and when it gets it."""
    caplog.set_level(logging.INFO, logger="agent_sessions.lease")
    store = memory.Store()
    hold, entered, go = holding()
    first = agent.Runner().start(agent.Spec(session=agent.open("chat", store), tools=[hold]),
                                 [agent.Message.user("a")], ToolsThenAnswer(["hold"]))
    waited: list[agent.Result] = []
    try:
        assert entered.wait(10)
        held = store.holder("chat")
        assert held is not None
        with pytest.raises(agent.SessionBusy) as busy:
            agent.Runner().turn(agent.Spec(session=agent.open("chat", store), lease_wait=0.3), "b", "msg-2",
                                ToolsThenAnswer([]))
        said = str(busy.value)
        assert busy.value.holder == held and f"is held by {held.describe()}" in said
        assert f"pid {held.pid} on {held.host}" in said and time.strftime("until %Y-%m-%d %H:%M:%S UTC", time.gmtime(
            held.expires)) in said
        assert "Spec.lease_wait=0.3" in said and "Spec(lease_wait=seconds)" in said and "lease_ttl" in said
        patient = threading.Thread(target=lambda: waited.append(agent.Runner().turn(
            agent.Spec(session=agent.open("chat", store), lease_wait=10), "c", "msg-3", ToolsThenAnswer([]))))
        patient.start()
        deadline = time.monotonic() + 10
        while sum("waiting up to 10 s" in r.getMessage() for r in caplog.records) < 1:
            assert time.monotonic() < deadline, "the waiting turn said nothing"
            time.sleep(0.02)
    finally:
        go.set()
    assert first.wait(10).stop_reason == "answered"
    patient.join(10)
    assert waited and waited[0].stop_reason == "answered"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    began = [m for m in lines if "waiting up to" in m]
    assert len(began) == 2 and all(f"'chat' is held by pid {held.pid}" in m for m in began), lines
    assert "waiting up to 0.3 s for it (lease_wait)" in began[0]
    got = [m for m in lines if "got the lease after waiting" in m]
    assert len(got) == 1 and "'chat'" in got[0], lines
