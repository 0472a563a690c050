"""A cancel pushed to the run's process (PostgreSQL: NOTIFY on the cancel's commit, heard by the store's
LISTEN connection), against the real server, with the cancels coming from other processes.

Each run here waits on a scripted model that blocks until the test releases it, so the test decides what
happens between the run's save before the request (its last read of the cancel flag) and the tool calls
of the reply. What the run asks of the store is counted (``Counted``): the check before an idempotent tool
is a round trip only when the push cannot answer (docs/runs/leases.md, "What each check costs").
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

import agent_sessions as agent
from agent_sessions import Content, Message, Role
from agent_sessions.contract import CancelWatcher
from agent_sessions.run.react import CANCELLED
from stores import memory, postgres, sqlite
from stores.postgres.listener import CANCEL_CHANNEL, CHANNEL, FOLLOWED, Listener
from storetest.crossprocess import wait_for
from tests import servers

WAIT = 30.0
"""The bound on every wait and join here."""
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def url() -> str:
    return servers.database_url(servers.POSTGRES_URL, servers.database_name("cancelpush"))


@pytest.fixture(scope="module")
def engine(url: str) -> Iterator[Engine]:
    engine = create_engine(url, pool_size=4, connect_args={"connect_timeout": servers.CONNECT_TIMEOUT})
    servers.fresh_schema(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def store(engine: Engine) -> Iterator[Counted]:
    store = Counted(engine)
    yield store
    store.close()


class Counted(postgres.Store):
    """The PostgreSQL store, counting the calls a run makes that read its cancel flag."""

    def __init__(self, engine: Engine, **options: Any) -> None:
        super().__init__(engine, **options)
        self.calls: list[str] = []
        self.before_journal: Callable[[], object] | None = None
        """Runs once, inside the first journal write that would start a tool, before it reaches the server."""

    def check(self, session: str, holder: agent.Holder) -> bool:
        self.calls.append("check")
        return super().check(session, holder)

    def put_journal(self, session: str, holder: agent.Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        self.calls.append("put_journal")
        before, self.before_journal = self.before_journal, None
        if before is not None and unless_cancelled:
            before()
        return super().put_journal(session, holder, journal, unless_cancelled=unless_cancelled)

    def listening(self) -> int | None:
        return self._listener.live


class Gated:
    """A model whose requests each wait for the test to open their gate (bounded), then reply in turn:
    ``replies[i]`` to request ``i``, and an answer after them."""

    def __init__(self, *replies: Message) -> None:
        self.replies = list(replies)
        self.entered = [threading.Event() for _ in range(len(replies) + 1)]
        self.gates = [threading.Event() for _ in range(len(replies) + 1)]
        self.requests = 0

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        i = self.requests
        self.requests += 1
        self.entered[i].set()
        assert self.gates[i].wait(WAIT), f"request {i} was never let through"
        return self.replies[i] if i < len(self.replies) else Message.assistant("done")

    def reach(self, i: int) -> None:
        """Wait until the run has made request ``i`` (its save before it done), and is waiting in it."""
        assert self.entered[i].wait(WAIT), f"the run never made request {i}"

    def let(self, i: int) -> None:
        self.gates[i].set()


def _calls(*names: str, step: int) -> Message:
    return Message(Role.ASSISTANT, [Content.tool_call(f"c{step}_{k}", name, "{}") for k, name in enumerate(names)])


class Tools:
    def __init__(self) -> None:
        self.ran: list[str] = []

        @agent.tool
        def lookup() -> str:
            """Idempotent."""
            self.ran.append("lookup")
            return "looked up"

        @agent.tool(idempotent=False)
        def charge() -> str:
            """Not idempotent."""
            self.ran.append("charge")
            return "charged"

        self.all = [lookup, charge]


CANCELLER = """
import sys
from sqlalchemy import text
from tests import servers
store = servers.postgres_store(sys.argv[1])
if sys.argv[3] == "cancel":
    print(store.cancel(sys.argv[2]), flush=True)
else:  # the flag set, and nobody told: as a notification lost with a connection would leave it
    with store.engine.begin() as conn:
        marked = conn.execute(text("UPDATE agent_sessions SET cancelled = true "
                                   "WHERE session_id = :s AND token IS NOT NULL"), {"s": sys.argv[2]}).rowcount
    print(marked == 1, flush=True)
store.close()
"""


def _from_another_process(url: str, sid: str, how: str = "cancel") -> None:
    """Cancel ``sid`` from a process of its own (``how``: ``cancel``, or ``silent``: set the flag without
    notifying), and return once that committed."""
    child = subprocess.run(
        [sys.executable, "-c", CANCELLER, url, sid, how], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=WAIT * 2,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "True", (child.stdout, child.stderr)


def _start(store: Counted, model: Gated, tools: Tools, sid: str) -> agent.Run:
    spec = agent.Spec(session=agent.open(sid, store), tools=tools.all, max_steps=5)
    return agent.Runner().start(spec, [Message.user("go")], model)


def _watch(store: Counted, sid: str) -> Any:
    (watch,) = store._listener._watches[sid]
    return watch


def _second_request_with_the_listener_live(store: Counted, model: Gated) -> None:
    """Let the first request through once the store listens, so the save before the second request comes
    after the listening began; return with the run waiting in its second request."""
    model.reach(0)
    wait_for(lambda: store.listening() is not None, "the store to listen", WAIT)
    model.let(0)
    model.reach(1)


def _terminate(engine: Engine, store: Counted) -> None:
    """Have the server end the store's listening connection, as an administrator (or a failover) would."""
    pid = store._listener.pid
    assert pid is not None
    with engine.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar() is True


def _finish(run: agent.Run, model: Gated) -> agent.Result:
    for i in range(len(model.gates)):
        model.let(i)
    return run.wait(WAIT * 2)


def _results(result: agent.Result, i: int) -> list[str]:
    return [c.text for c in result.messages[i].content]


def test_of_the_stores_here_postgres_pushes_cancels_and_the_embedded_ones_read(
    store: Counted, tmp_path: Path
) -> None:
    assert isinstance(store, CancelWatcher)
    assert not isinstance(memory.Store(), CancelWatcher)
    assert not isinstance(sqlite.open(str(tmp_path / "s.db")), CancelWatcher)  # tests/test_cancel_sqlite.py


def test_a_cancel_from_another_process_stops_the_idempotent_tool_without_a_round_trip(
    store: Counted, url: str
) -> None:
    sid = f"push-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1), _calls("lookup", "lookup", step=2)), Tools()
    run = _start(store, model, tools, sid)
    try:
        _second_request_with_the_listener_live(store, model)
        before = len(store.calls)
        _from_another_process(url, sid)
        wait_for(lambda: _watch(store, sid).heard, "the cancel to be heard", WAIT)
    finally:
        result = _finish(run, model)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["lookup"]  # the first reply's; neither of the second's
    assert _results(result, 4) == [CANCELLED, CANCELLED]
    assert store.calls[before:] == [], "the push answered: no round trip before the tools"
    assert store._listener._watches.get(sid) is None  # the run closed its watch


def test_a_cancel_nobody_is_told_of_is_seen_at_the_next_read_the_documented_bound(store: Counted, url: str) -> None:
    """The bound, exactly: with the store listening since before the run's last read, a flag set without a
    notification (one lost on its way) does not stop the idempotent tools of that reply; the save before
    the next request reads it, and the run stops there."""
    sid = f"silent-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1), _calls("lookup", step=2)), Tools()
    run = _start(store, model, tools, sid)
    try:
        _second_request_with_the_listener_live(store, model)
        before = len(store.calls)
        _from_another_process(url, sid, "silent")
    finally:
        result = _finish(run, model)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["lookup", "lookup"]
    assert model.requests == 2  # stopped by the save before the third request
    assert store.calls[before:] == []


def test_a_killed_listening_connection_falls_back_to_the_read_and_still_stops_the_tool(
    store: Counted, engine: Engine, url: str
) -> None:
    """The listener's connection is terminated by the server while the run waits on its model; it
    reconnects, so a new connection listens, but not since before the run's last read: the flag set
    meanwhile without a notification (lost with the old connection) is read before the tool."""
    sid = f"killed-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1), _calls("lookup", step=2)), Tools()
    run = _start(store, model, tools, sid)
    try:
        _second_request_with_the_listener_live(store, model)
        listened = store.listening()
        assert listened is not None
        before = len(store.calls)
        _terminate(engine, store)
        wait_for(lambda: store.listening() not in (None, listened), "the store to listen again", WAIT)
        _from_another_process(url, sid, "silent")
    finally:
        result = _finish(run, model)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["lookup"]
    assert _results(result, 4) == [CANCELLED]
    assert store.calls[before:] == ["check"], "the read, since the listening broke after the run's last read"


def test_a_cancel_while_the_store_cannot_listen_is_read_before_the_tool(store: Counted, engine: Engine,
                                                                        url: str) -> None:
    """The listening connection is lost and cannot come back (every reconnect refused) while the run waits
    on its model; a cancel from another process notifies nobody, and the run reads it before the tool."""
    sid = f"down-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1), _calls("lookup", step=2)), Tools()
    listener: Listener = store._listener
    connect = listener._connect
    refused = threading.Event()

    def refusing() -> Any:
        if refused.is_set():
            raise OSError("refused by the test")
        return connect()

    listener._connect = refusing
    run = _start(store, model, tools, sid)
    try:
        _second_request_with_the_listener_live(store, model)
        before = len(store.calls)
        refused.set()
        _terminate(engine, store)
        wait_for(lambda: store.listening() is None, "the store to know its connection lost", WAIT)
        _from_another_process(url, sid)
        assert not _watch(store, sid).heard
    finally:
        result = _finish(run, model)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["lookup"]
    assert store.calls[before:] == ["check"]
    refused.clear()
    wait_for(lambda: store.listening() is not None, "the store to listen again once it may", WAIT)


def test_a_run_that_read_its_flag_before_the_store_listened_reads_before_the_tool(store: Counted, url: str) -> None:
    """Just started: the store's listening connection comes up only after the run's save before its
    request, so the push cannot speak for the time between; the tool is preceded by the read."""
    sid = f"early-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1)), Tools()
    listener: Listener = store._listener
    connect = listener._connect
    connecting = threading.Event()

    def held() -> Any:
        assert connecting.wait(WAIT)
        return connect()

    listener._connect = held
    run = _start(store, model, tools, sid)
    try:
        model.reach(0)
        assert store.listening() is None
        connecting.set()
        wait_for(lambda: store.listening() is not None, "the store to listen", WAIT)
        _from_another_process(url, sid, "silent")
    finally:
        result = _finish(run, model)
    assert result.stop_reason == "cancelled"
    assert tools.ran == []
    assert store.calls == ["check"]


@pytest.mark.parametrize("how", ["cancel", "silent"])
def test_a_cancel_committed_just_before_a_non_idempotent_tool_still_stops_it(store: Counted, url: str,
                                                                             how: str) -> None:
    """The cancel commits from another process inside the journal write that would start the tool, before
    the write reaches the server: notified or not, the write's own check finds it, and the tool never
    starts (nor does the journal say it did)."""
    sid = f"journal-{how}-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1), _calls("charge", step=2)), Tools()
    run = _start(store, model, tools, sid)
    try:
        _second_request_with_the_listener_live(store, model)
        store.before_journal = lambda: _from_another_process(url, sid, how)
    finally:
        result = _finish(run, model)
    assert result.stop_reason == "cancelled"
    assert tools.ran == ["lookup"]
    assert _results(result, 4) == [CANCELLED]
    assert store.journal(sid) is None


def test_notifications_for_other_sessions_and_other_leases_do_not_stop_the_run(
    store: Counted, engine: Engine, url: str
) -> None:
    """While the run waits on its model: another session's lease is cancelled from another process, and
    the channel carries a cancel of an earlier lease of the run's session, a payload that is no cancel,
    and an event notification of the session. None stops the run, and its tools need no round trip."""
    sid, other = f"mine-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    held = store.acquire(other, agent.Holder("test", 1, uuid.uuid4().hex, 0.0), 120)
    model, tools = Gated(_calls("lookup", step=1), _calls("lookup", "lookup", step=2)), Tools()
    run = _start(store, model, tools, sid)
    watch_other = store.watch_cancel(other, held)
    try:
        _second_request_with_the_listener_live(store, model)
        epoch = _watch(store, sid).epoch
        before = len(store.calls)
        with engine.begin() as conn:  # one transaction: delivered before the other session's cancel below
            for channel, payload in ((CANCEL_CHANNEL, f"{epoch - 1} {sid}"), (CANCEL_CHANNEL, f"x {sid}"),
                                     (CANCEL_CHANNEL, sid), (CHANNEL, sid)):
                conn.execute(text("SELECT pg_notify(:c, :p)"), {"c": channel, "p": payload})
        _from_another_process(url, other)
        wait_for(lambda: watch_other.heard, "the other session's cancel to be heard", WAIT)
        assert not _watch(store, sid).heard and not _watch(store, sid).passed
    finally:
        watch_other.close()
        result = _finish(run, model)
    assert result.stop_reason == "answered"
    assert tools.ran == ["lookup"] * 3
    assert store.calls[before:] == []
    store.release(other, held)


def test_a_cancel_of_a_later_lease_of_the_session_makes_the_run_read_and_find_it_lost(store: Counted,
                                                                                   engine: Engine) -> None:
    """A cancel heard for a later epoch of the run's session means its lease passed on: the run reads
    before the tool, and the read says the lease is lost."""
    sid = f"passed-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1), _calls("lookup", step=2)), Tools()
    run = _start(store, model, tools, sid)
    try:
        _second_request_with_the_listener_live(store, model)
        watch = _watch(store, sid)
        before = len(store.calls)
        with engine.begin() as conn:  # taken over (as after an expiry), and that lease cancelled
            conn.execute(text("UPDATE agent_sessions SET token = 'taker', epoch = epoch + 1 WHERE session_id = :s"),
                         {"s": sid})
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_notify(:c, :p)"), {"c": CANCEL_CHANNEL, "p": f"{watch.epoch + 1} {sid}"})
        wait_for(lambda: watch.passed, "the later lease's cancel to be heard", WAIT)
        model.let(1)
        with pytest.raises(agent.LeaseLost):
            run.wait(WAIT * 2)
    finally:
        for i in range(len(model.gates)):
            model.let(i)
    assert tools.ran == ["lookup"]
    assert store.calls[before:] == ["check"]


def test_a_store_made_not_to_push_cancels_reads_before_every_idempotent_tool(engine: Engine, url: str) -> None:
    """``push_cancels=False`` (an engine behind PgBouncer in transaction mode): no listening connection, and
    a read before each idempotent tool, which finds a cancel from another process."""
    store = Counted(engine, push_cancels=False)
    try:
        sid = f"unpushed-{uuid.uuid4().hex[:8]}"
        model, tools = Gated(_calls("lookup", "lookup", step=1), _calls("lookup", step=2)), Tools()
        run = _start(store, model, tools, sid)
        try:
            model.let(0)
            model.reach(1)
            _from_another_process(url, sid)
        finally:
            result = _finish(run, model)
        assert result.stop_reason == "cancelled"
        assert tools.ran == ["lookup", "lookup"]
        assert store.calls == ["check", "check", "check"]
        assert store._listener._thread is None
    finally:
        store.close()


def test_cancel_marks_only_a_held_lease_and_notifies_only_then(store: Counted, engine: Engine) -> None:
    """``cancel`` is one statement: it marks a held (or lapsed) lease and notifies with its epoch as it
    commits; a session nobody holds is neither marked nor notified."""
    sid = f"stmt-{uuid.uuid4().hex[:8]}"
    pooled = engine.raw_connection()
    listening = pooled.driver_connection
    pooled.detach()  # this test's own: it LISTENs, so it never goes back to the pool
    assert listening is not None
    try:
        listening.rollback()
        listening.autocommit = True
        listening.execute(f"LISTEN {CANCEL_CHANNEL}")
        assert store.cancel(sid) is False
        holder = store.acquire(sid, agent.Holder("test", 1, uuid.uuid4().hex, 0.0), 120)
        assert store.cancel(sid) is True
        notes = [n.payload for n in listening.notifies(timeout=2, stop_after=1)]
        assert notes == [f"{holder.epoch} {sid}"]
        assert store.check(sid, holder) is True
        store.release(sid, holder)
        assert store.cancel(sid) is False
        assert [n.payload for n in listening.notifies(timeout=0.3)] == []
    finally:
        listening.close()


class _Recording:
    """A listener's connection, recording the statements its thread sends (its LISTENs)."""

    def __init__(self, conn: Any, sent: list[str]) -> None:
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_sent", sent)

    def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        self._sent.append(query)
        return self._conn.execute(query, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)


def _listens(sent: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: [q for q in queries if q.startswith("LISTEN")] for name, queries in sent.items()}


def test_a_run_publishing_events_listens_for_cancels_alone_and_a_follower_for_events_alone(
    store: Counted, engine: Engine, url: str
) -> None:
    """A process that runs agents with the event log and follows nothing listens on ``agent_cancels`` only,
    so its runs' own event writes never wake it (each wake-up cost a step about 0.15 ms); a follower in the
    same process starts a connection of its own on ``agent_events``, and is woken by a write elsewhere
    while the run's cancel watch still hears cancels."""
    sent: dict[str, list[str]] = {"cancels": [], "events": []}
    for listener, name in ((store._listener, "cancels"), (store._followers, "events")):
        listener._connect = (lambda connect, log: lambda: _Recording(connect(), log))(listener._connect, sent[name])
    sid = f"apart-{uuid.uuid4().hex[:8]}"
    model, tools = Gated(_calls("lookup", step=1), _calls("lookup", step=2)), Tools()
    spec = agent.Spec(session=agent.open(sid, store), tools=tools.all, max_steps=5, publish_events=True)
    run = agent.Runner().start(spec, [Message.user("go")], model)
    try:
        _second_request_with_the_listener_live(store, model)
        assert store._followers._thread is None, "nothing follows: no connection listens for events"
        assert _listens(sent) == {"cancels": [f"LISTEN {CANCEL_CHANNEL}"], "events": []}

        last = max(e.seq for e in store.events(sid, 0, 100))
        woke: list[bool] = []
        follower = threading.Thread(target=lambda: woke.append(store.wait_for_events(sid, last, WAIT)))
        follower.start()
        wait_for(lambda: store._followers.live is not None, "the follower's connection to listen", WAIT)
        _from_another_process(url, sid)  # a cancel, which the run hears, and which writes no event
        wait_for(lambda: _watch(store, sid).heard, "the cancel to be pushed to the run", WAIT)
        other = postgres.Store(engine)
        try:  # an event written elsewhere (the run waits in its request): the follower is woken
            holder = store.holder(sid)
            assert holder is not None
            other.append_events(sid, holder, [agent.eventlog.encode("note", {"from": "elsewhere"})], keep=100)
        finally:
            other.close()
        follower.join(WAIT)
        assert woke == [True]
        assert _listens(sent) == {"cancels": [f"LISTEN {CANCEL_CHANNEL}"], "events": [f"LISTEN {CHANNEL}"]}
    finally:
        result = _finish(run, model)
    assert result.stop_reason == "cancelled" and tools.ran == ["lookup"]  # the second never ran


def test_event_writes_notify_only_while_a_follower_listens(store: Counted, engine: Engine, url: str) -> None:
    """A write of events notifies ``agent_events`` only while some connection listening there holds
    ``FOLLOWED`` (a follower of any store, any process): with none, its NOTIFY is skipped (a connection
    LISTENing without the lock hears nothing); once a follower listens, every write notifies, and that
    connection hears them too; once it stops, writes go quiet again."""
    sid = f"followed-{uuid.uuid4().hex[:8]}"
    holder = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 60)
    pooled = engine.raw_connection()
    bare = pooled.driver_connection  # a LISTEN without the lock: it hears what is sent, and no more
    pooled.detach()
    assert bare is not None
    try:
        bare.rollback()
        bare.autocommit = True
        bare.execute(f"LISTEN {CHANNEL}")

        def heard() -> list[str]:
            return [n.payload for n in bare.notifies(timeout=0.5)]

        note = agent.eventlog.encode("note", {})
        msgs = [Message.user("q")]
        store.save_fenced(sid, holder, msgs, take_steers=True)  # (a general save with events always notifies)
        store.append_events(sid, holder, [note], keep=100)
        msgs.append(Message.assistant("a"))
        store.save_fenced_events(sid, holder, msgs, take_steers=True, events=[note], keep=100)  # the usual step
        assert heard() == [], "nothing follows: no notification"

        follower = postgres.Store(engine)
        try:
            assert follower.wait_for_events(sid, 0, 5) is True  # events there already: it starts listening
            wait_for(lambda: follower._followers.live is not None, "the follower to listen", WAIT)
            store.append_events(sid, holder, [note], keep=100)
            msgs.append(Message.assistant("b"))
            store.save_fenced_events(sid, holder, msgs, take_steers=True, events=[note], keep=100)
            assert heard() == [sid, sid]
        finally:
            follower.close()
        wait_for(lambda: not _follows(engine), "the follower's lock to go with its connection", WAIT)
        store.append_events(sid, holder, [note], keep=100)
        assert heard() == []
    finally:
        bare.close()
        store.release(sid, holder)


def _follows(engine: Engine) -> bool:
    """Does a connection of this database hold ``FOLLOWED`` (a follower listens)?"""
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND ((classid::bigint << 32) | objid::bigint) = :key AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"), {"key": FOLLOWED}).scalar())


ONE_WRITE = """
import random, sys, time
import agent_sessions as agent
from agent_sessions.eventlog import encode
from tests import servers

store = servers.postgres_store(sys.argv[1])
holder = agent.Holder("writer", 2, sys.argv[3], 0.0, epoch=int(sys.argv[4]))
print("ready", flush=True)
for line in sys.stdin:
    time.sleep(float(line))  # somewhere in the follower's start: its connect, its lock, its LISTEN
    store.append_events(sys.argv[2], holder, [encode("note", {})], keep=1000)
    print("written", flush=True)
store.close()
"""


def test_a_write_racing_the_first_followers_start_wakes_it(store: Counted, engine: Engine, url: str) -> None:
    """Nobody follows, so writes skip their NOTIFY, while the first follower starts (connects, takes
    ``FOLLOWED``, LISTENs, reads the last number): a write from another process, landed at a random moment
    of that start, still wakes the wait or is found by its read; never missed until the wait's timeout."""
    sid = f"race-{uuid.uuid4().hex[:8]}"
    holder = store.acquire(sid, agent.Holder("h", 1, uuid.uuid4().hex, 0.0), 300)
    writer = subprocess.Popen(
        [sys.executable, "-c", ONE_WRITE, url, sid, holder.token, str(holder.epoch)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        assert writer.stdout.readline().strip() == "ready"
        rng = random.Random(7)
        for round_ in range(15):
            wait_for(lambda: not _follows(engine), "no follower to hold FOLLOWED", WAIT)
            last = store.append_events(sid, holder, [agent.eventlog.encode("mark", {})], keep=1000)
            follower = postgres.Store(engine)
            try:
                writer.stdin.write(f"{rng.uniform(0, 0.015):.4f}\n")
                writer.stdin.flush()
                if round_ % 3 == 0:  # written (unnotified) before the follower starts: its first read finds it
                    assert writer.stdout.readline().strip() == "written"
                started = time.monotonic()
                woke = follower.wait_for_events(sid, last, 10)
                took = time.monotonic() - started
                if round_ % 3:
                    assert writer.stdout.readline().strip() == "written"
                assert woke is True and took < 5, f"round {round_}: woken {woke} after {took:.2f} s"
            finally:
                follower.close()
    finally:
        writer.stdin.close()
        writer.wait(WAIT)
        store.release(sid, holder)
