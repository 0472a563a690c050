"""Cancels on SQLite: before an idempotent tool a run reads its cancel flag (SQLite pushes nothing, so the
store watches for none), and a cancel committed by another process, thread, store object or the run's own
store stops the calls after it.

The cancels and other writes here come from other processes (one long-lived child per test that takes
commands, each answered once it committed), other threads, other store objects and the run's own store
from inside a tool; a tool runs on the run's thread, between two checks, so whatever it commits before it
returns is committed before the next call's check, which must see it. What the run asks of the store is
counted (``Counted``).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import Content, Message, Role
from agent_sessions.run.react import CANCELLED
from stores import sqlite

WAIT = 30.0
ROOT = Path(__file__).resolve().parent.parent


class Counted(sqlite.Store):
    """The SQLite store, counting the calls a run makes that read its cancel flag."""

    def __init__(self, path: Path, **options: Any) -> None:
        super().__init__(sqlite.open(path).engine, **options)
        self.calls: list[str] = []

    def check(self, session: str, holder: agent.Holder) -> bool:
        self.calls.append("check")
        return super().check(session, holder)

    def put_journal(self, session: str, holder: agent.Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        self.calls.append("put_journal")
        return super().put_journal(session, holder, journal, unless_cancelled=unless_cancelled)


CHILD = """
import sqlite3, sys
import agent_sessions as agent
from stores import sqlite
path = sys.argv[1]
store = sqlite.open(path)
raw = sqlite3.connect(path, isolation_level=None, timeout=30)
for line in sys.stdin:
    how, sid = line.split()
    if how == "cancel":
        answer = store.cancel(sid)
    elif how == "silent":  # the flag set by a connection that is not a store's
        answer = raw.execute("UPDATE agent_sessions SET cancelled = 1 WHERE session_id = ? AND token IS NOT NULL",
                             (sid,)).rowcount == 1
    else:  # "write": a commit that has nothing to do with the run's session
        store.save(sid, [agent.Message.user("elsewhere")])
        answer = True
    print(answer, flush=True)
"""


class Other:
    """A process of its own on the same file, taking commands; each returns once its write committed."""

    def __init__(self, path: Path) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def do(self, how: str, sid: str) -> str:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(f"{how} {sid}\n")
        self.child.stdin.flush()
        answer = self.child.stdout.readline().strip()
        assert answer, f"the other process died ({how} {sid})"
        return answer

    def close(self) -> None:
        assert self.child.stdin is not None
        self.child.stdin.close()
        assert self.child.wait(WAIT) == 0


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "cancel.db"


@pytest.fixture
def store(path: Path) -> Iterator[Counted]:
    store = Counted(path)
    yield store
    store.close()


@pytest.fixture
def other(path: Path, store: Counted) -> Iterator[Other]:
    other = Other(path)
    yield other
    other.close()


class Scripted:
    """A model that replies ``replies[i]`` to request ``i`` (then an answer), calling ``before[i]`` first:
    whatever that commits is committed after the save before the request, the run's last read."""

    def __init__(self, *replies: Message, before: Sequence[Callable[[], object] | None] = ()) -> None:
        self.replies = list(replies)
        self.before = list(before)
        self.requests = 0

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        i = self.requests
        self.requests += 1
        action = self.before[i] if i < len(self.before) else None
        if action is not None:
            action()
        return self.replies[i] if i < len(self.replies) else Message.assistant("done")


def _calls(*names: str, step: int) -> Message:
    return Message(Role.ASSISTANT, [Content.tool_call(f"c{step}_{k}", name, "{}") for k, name in enumerate(names)])


class Tools:
    """``act``: idempotent, and runs the next of ``actions`` (so it commits what the test says between two
    checks); ``lookup``: idempotent, does nothing; ``charge``: not idempotent, and runs the next action too."""

    def __init__(self, actions: Sequence[Callable[[], object] | None] = ()) -> None:
        self.ran: list[str] = []
        self.actions = list(actions)

        @agent.tool
        def act() -> str:
            """Idempotent, with a side door."""
            self.ran.append("act")
            action = self.actions.pop(0) if self.actions else None
            if action is not None:
                action()
            return "acted"

        @agent.tool
        def lookup() -> str:
            """Idempotent."""
            self.ran.append("lookup")
            return "looked up"

        @agent.tool(idempotent=False)
        def charge() -> str:
            """Not idempotent, with the same side door."""
            self.ran.append("charge")
            action = self.actions.pop(0) if self.actions else None
            if action is not None:
                action()
            return "charged"

        self.all = [act, lookup, charge]


def _run(store: sqlite.Store, sid: str, model: Scripted, tools: Tools, steps: int = 6) -> agent.Result:
    spec = agent.Spec(session=agent.open(sid, store), tools=tools.all, max_steps=steps, lease_ttl=600)
    return agent.Runner().run(spec, [Message.user("go")], model)


def _results(result: agent.Result, i: int) -> list[str]:
    return [c.text for c in result.messages[i].content]


def _sid(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:8]}"


# -- the watch ----------------------------------------------------------------------------------------------


def test_a_tool_that_waits_for_a_cancel_elsewhere_stops_the_next_call(store: Counted, other: Other) -> None:
    """The first call blocks the loop until another process committed a cancel: the second call's check must
    see it, though the run's last read (the save before the request) found none."""
    sid = _sid("blocking")
    tools = Tools([lambda: other.do("cancel", sid)])
    result = _run(store, sid, Scripted(_calls("act", "lookup", "lookup", step=1)), tools)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["act"]
    assert _results(result, 2)[1:] == [CANCELLED, CANCELLED]
    assert store.calls == ["check"]


def test_a_flag_set_by_a_connection_that_is_no_store_is_seen_too(store: Counted, other: Other) -> None:
    sid = _sid("silent")
    tools = Tools([lambda: other.do("silent", sid)])
    result = _run(store, sid, Scripted(_calls("act", "lookup", step=1)), tools)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["act"]


def test_a_cancel_from_another_thread_of_this_process_stops_the_next_call(store: Counted, path: Path) -> None:
    """Another thread: its own connection, whether it uses the run's store object or another one."""
    for via in ("same store", "another store"):
        sid = _sid("thread")

        def cancel(sid: str = sid, via: str = via) -> None:
            target = store if via == "same store" else sqlite.open(path)
            answers: list[bool] = []
            thread = threading.Thread(target=lambda: answers.append(target.cancel(sid)))
            thread.start()
            thread.join(WAIT)
            assert answers == [True]

        tools = Tools([cancel])
        result = _run(store, sid, Scripted(_calls("act", "lookup", step=1)), tools)
        assert result.stop_reason == "cancelled", via
        assert tools.ran == ["act"], via


def test_a_cancel_on_the_run_s_own_connection_stops_the_next_call(store: Counted) -> None:
    """A tool cancelling its own session through the run's store, on the run's thread: the very connection
    the run reads on, whose own commits do not move its data version. The store notes its own cancels."""
    sid = _sid("own")
    tools = Tools([lambda: agent.open(sid, store).cancel()])
    result = _run(store, sid, Scripted(_calls("act", "lookup", step=1)), tools)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["act"]
    assert store.calls == ["check"]


def test_a_store_closed_and_reopened_on_the_run_s_thread_with_a_cancel_between_makes_it_read(
    store: Counted, other: Other
) -> None:
    """The run's connection closed, a cancel committed elsewhere, then a new connection opened on the run's
    thread (by a read of the tool's): the new connection's data version is its own count, which may equal
    the old one's. The watch compares only versions of one connection, so the run reads."""
    sid = _sid("reopened")

    def close_cancel_reopen() -> None:
        store.close()
        other.do("cancel", sid)
        store.messages(sid)

    tools = Tools([close_cancel_reopen])
    result = _run(store, sid, Scripted(_calls("act", "lookup", step=1)), tools)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["act"]


def test_with_the_event_log_on_a_cancel_elsewhere_still_stops_the_next_call(store: Counted, other: Other) -> None:
    """The run's events are written by its publisher's thread too (another connection): such a write only
    makes the run read; a cancel from another process committed during a call stops the next one."""
    sid = _sid("events")
    tools = Tools([None, lambda: other.do("cancel", sid)])
    spec = agent.Spec(session=agent.open(sid, store), tools=tools.all, max_steps=6, lease_ttl=600,
                      publish_events=True)
    result = agent.Runner().run(spec, [Message.user("go")], Scripted(_calls("act", "act", "lookup", step=1)))
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["act", "act"]
    assert store.events(sid, 0, 100)


def test_a_non_idempotent_call_still_reads_in_its_journal_write(store: Counted, other: Other) -> None:
    sid = _sid("charge")
    tools = Tools([lambda: other.do("cancel", sid)])
    result = _run(store, sid, Scripted(_calls("act", "charge", step=1)), tools)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["act"]


# -- the watch's answers, one by one ------------------------------------------------------------------------


# -- many interleavings ---------------------------------------------------------------------------------------

ACTIONS = ["none", "none", "write-proc", "write-thread", "close", "cancel-proc", "silent-proc", "cancel-thread",
           "cancel-own", "cancel-other-store"]
CANCELS = {"cancel-proc", "silent-proc", "cancel-thread", "cancel-own", "cancel-other-store"}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Other]]:
    path = tmp_path_factory.mktemp("interleave") / "s.db"
    sqlite.open(path).close()
    other = Other(path)
    yield path, other
    other.close()


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_randomized_interleavings_keep_the_promise(shared: tuple[Path, Other], data: st.DataObject) -> None:
    """A run of up to three replies of idempotent calls (now and then a non-idempotent one); at each point
    between two reads of the flag (in the model, after the save before the request; in each call) something
    may be committed, from another process, another thread, another store object or the run's own store
    (on the run's thread: its own connection), or the store closed. The promise: every call before the
    first cancel runs, none after it starts (but the first idempotent call of a reply, whose check is the
    save before the model's request), and the run stops cancelled."""
    path, other = shared
    store = Counted(path)
    try:
        sid = _sid("mix")
        replies = data.draw(st.lists(st.lists(st.sampled_from(["act", "act", "act", "charge"]), min_size=1,
                                              max_size=4), min_size=1, max_size=3), label="replies")
        order: list[str] = []  # the points, in the order they come: the model's request i, then reply i's calls
        for reply in replies:
            order.append("model")
            order.extend(reply)
        actions = data.draw(st.lists(st.sampled_from(ACTIONS), min_size=len(order), max_size=len(order)),
                            label="actions")

        def perform(action: str) -> None:
            if action == "write-proc":
                other.do("write", _sid("elsewhere"))
            elif action == "cancel-proc":
                assert other.do("cancel", sid) == "True"
            elif action == "silent-proc":
                assert other.do("silent", sid) == "True"
            elif action == "close":
                store.close()
            elif action == "cancel-own":
                assert store.cancel(sid)
            elif action == "cancel-other-store":
                another = sqlite.open(path)
                assert another.cancel(sid)
                another.close()
            elif action in ("write-thread", "cancel-thread"):
                answers: list[object] = []

                def work() -> None:
                    if action == "write-thread":
                        store.add_steer(_sid("elsewhere"), "x")
                        answers.append(None)
                    else:
                        answers.append(store.cancel(sid))

                thread = threading.Thread(target=work)
                thread.start()
                thread.join(WAIT)
                assert answers in ([None], [True])

        bound = [None if a == "none" else (lambda a=a: perform(a)) for a in actions]
        model_actions = [b for b, kind in zip(bound, order, strict=True) if kind == "model"]
        call_actions = [b for b, kind in zip(bound, order, strict=True) if kind != "model"]
        tools = Tools(call_actions)
        model = Scripted(*(_calls(*r, step=i + 1) for i, r in enumerate(replies)), before=model_actions)
        result = _run(store, sid, model, tools, steps=len(replies) + 2)

        expected: list[str] = []
        cancelled = False  # committed: the next read of the flag finds it
        after_save = False  # committed during the model's request: the save before it was the first call's check
        for kind, action in zip(order, actions, strict=True):
            if cancelled:
                break
            if kind == "model":
                after_save = action in CANCELS
                continue
            if after_save:  # an idempotent call runs on that check; a non-idempotent one reads in its journal
                after_save, cancelled = False, True
                if kind == "act":
                    expected.append(kind)
                continue
            expected.append(kind)
            cancelled = action in CANCELS
        assert tools.ran == expected, store.calls
        assert (result.stop_reason == "cancelled") == cancelled, result.stop_reason
    finally:
        store.close()


def test_random_schedules_with_a_canceller_racing_the_run(path: Path) -> None:
    """A thread of its own cancels at a random moment while the run goes through a reply of many idempotent
    calls. The canceller notes how many calls had started when its cancel returned (committed): at most one
    more may start after that (the one whose check came just before the commit), and the run stops
    cancelled, with a read only after the commit (nothing else is committed meanwhile)."""
    rng = random.Random(20261205)
    landed = sum(_race(path, rng.uniform(0, 0.03)) for _ in range(30))
    assert landed >= 10, "too few cancels landed while the calls ran to test anything"


def _race(path: Path, delay: float) -> bool:
    """One run against a canceller that waits ``delay`` seconds; ``True`` when the cancel landed mid-run."""
    store = Counted(path)
    sid = _sid("race")
    started: list[int] = []
    after: list[int] = []

    @agent.tool
    def tick() -> str:
        """Idempotent."""
        started.append(len(started))
        threading.Event().wait(0.0001)
        return "tick"

    def cancel() -> None:
        canceller = sqlite.open(path)
        threading.Event().wait(delay)
        if canceller.cancel(sid):
            after.append(len(started))
        canceller.close()

    calls = Message(Role.ASSISTANT, [Content.tool_call(f"t{k}", "tick", "{}") for k in range(300)])
    canceller = threading.Thread(target=cancel)

    class Starting:
        def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
            if not any(m.role is Role.ASSISTANT for m in messages):
                canceller.start()
                return calls
            return Message.assistant("done")

    spec = agent.Spec(session=agent.open(sid, store), tools=[tick], max_steps=3, lease_ttl=600)
    try:
        result = agent.Runner().run(spec, [Message.user("go")], Starting())
        canceller.join(WAIT)
    finally:
        store.close()
    if not after or after[0] >= len(calls.content):
        return False
    assert len(started) <= after[0] + 1, (len(started), after)
    assert result.stop_reason == "cancelled"
    return True
