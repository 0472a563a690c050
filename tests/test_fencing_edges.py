"""Fenced runs at their edges, found by an adversarial review (each failed before its fix): a crash on a
cut fork, MongoDB pages left by refused writes, a replacing resume, a cancel during a lapsed lease, a call
skipped by a cancel, a fork racing a first acquire, MySQL's concurrent first acquires.

Real stores on real servers, real threads; the only wrappers are thin delegating ones (storetest.stalls)
that hold a call back or stand in for a process dying right after a store call returned.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pymongo
import pytest
from sqlalchemy import create_engine, insert

import agent_sessions as agent
from agent_sessions import Content, Holder, Message, Role, RunStore
from agent_sessions.backend import empty_row
from agent_sessions.journal import UNKNOWN_OUTCOME
from stores import memory, mongodb, mysql, postgres, sqlite
from stores._sql.tables import sessions
from storetest.crossprocess import wait_for
from storetest.scripted import Answer, ToolsThenAnswer
from storetest.stalls import Stalled
from tests import servers

DATABASE = servers.database_name("edges")


class _Crash(BaseException):
    """A worker dying: nothing in the loop catches it."""


def _sid(tag: str) -> str:
    return f"review-{tag}-{uuid.uuid4().hex}"


def _claimant(name: str) -> Holder:
    return Holder(name, 1, uuid.uuid4().hex, 0.0)


def _results(msgs: list[Message], at: int) -> dict[str, Content]:
    return {c.tool_call_id: c for c in msgs[at].content}


# -- the stores: a factory of store objects on the same data (another factory call = another worker) ---


@pytest.fixture(scope="module")
def mongo_database() -> Iterator[Any]:
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(servers.MONGO_URL, serverSelectionTimeoutMS=10_000)
    db = client[DATABASE]
    for name in mongodb.COLLECTIONS:
        db.drop_collection(name)
    yield db
    client.close()


def _sql_factory(base: str, store: type[Any]) -> Iterator[Callable[[], RunStore]]:
    url = servers.database_url(base, DATABASE)
    engine = create_engine(url, pool_size=4, max_overflow=8)
    servers.fresh_schema(engine)
    yield lambda: store(engine)
    engine.dispose()


@pytest.fixture(scope="module", params=["memory", "sqlite", "postgres", "mysql", "mongodb"])
def stores(request: pytest.FixtureRequest) -> Iterator[Callable[[], RunStore]]:
    kind = request.param
    if kind == "memory":
        shared = memory.Store()
        yield lambda: shared
    elif kind == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/review.db"
            yield lambda: sqlite.open(path)
    elif kind == "postgres":
        yield from _sql_factory(servers.POSTGRES_URL, postgres.Store)
    elif kind == "mysql":
        yield from _sql_factory(servers.MYSQL_URL, mysql.Store)
    else:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(servers.MONGO_URL, serverSelectionTimeoutMS=10_000)
        for name in mongodb.COLLECTIONS:
            client[DATABASE].drop_collection(name)
        yield lambda: mongodb.Store(client[DATABASE])
        client.close()


# -- 1. A resume of a crashed run on a cut fork runs its non-idempotent tool again ------------------------


def test_a_resumed_crash_on_a_cut_fork_does_not_run_the_non_idempotent_tool_again(
    stores: Callable[[], RunStore],
) -> None:
    """A fork cut right after a reply with tool calls stores that reply without its results; a run on it
    answers the calls first (Leased.resume's retry path). Its journal records the reply at index n-1 while
    the stored transcript (what the resumer reads) has n messages, so Journal.answers() never matches and
    the next resume runs the started non-idempotent tool again instead of reporting "outcome unknown"."""
    store = stores()
    source, target = _sid("src"), _sid("cut")
    call = Message(Role.ASSISTANT, [Content.tool_call("call_0_0", "charge", json.dumps({"n": 0}))])
    store.save(source, [Message.user("charge it"), call,
                        Message(Role.USER, [Content.tool_result("call_0_0", "old")]), Message.assistant("old")])
    agent.open(source, store).fork(target, at=2, allow_unanswered=True)  # ends with the call, as asked
    charges: list[int] = []

    @agent.tool(idempotent=False)
    def charge(n: int) -> str:
        """Charges, then (the first time) the worker dies before the result is saved."""
        charges.append(n)
        if len(charges) == 1:
            raise _Crash
        return "charged"

    with pytest.raises(_Crash):
        agent.Runner().run(agent.Spec(session=agent.open(target, store), tools=[charge]),
                           store.messages(target), ToolsThenAnswer(["charge"]))
    assert store.journal(target) is not None  # it recorded charge as started

    worker = stores()  # the redelivered task, in another worker
    result = agent.Runner().run(agent.Spec(session=agent.open(target, worker), tools=[charge]),
                                worker.messages(target), ToolsThenAnswer(["charge"]))
    assert charges == [0], f"the non-idempotent tool ran {len(charges)} times"
    assert _results(result.messages, 2)["call_0_0"].text == UNKNOWN_OUTCOME


# -- 2. MongoDB: a page written by a write that then failed wedges the session's generation ----------------


def test_mongodb_a_refused_first_write_does_not_wedge_the_session(mongo_database: Any) -> None:
    """_append writes the full pages *before* its guarded update. When the update then fails (here: the
    CAS of a run whose known version is stale; the slow path raises TranscriptConflict as it should), the
    page <generation>:0 stays behind holding that run's messages. The next run that legitimately crosses
    the same page boundary finds the page with other bodies, _put_pages returns False, and save_fenced
    loops 1000 times and raises StoreError; every later fenced save crossing the boundary does the same,
    until a plain save() rewrites the generation."""
    first, stale = mongodb.Store(mongo_database), mongodb.Store(mongo_database)
    sid = _sid("wedge")
    history = [Message.user(f"m{i}") for i in range(30)]
    first.save(sid, history)
    assert stale.messages(sid) == history  # this worker knows version <g>:30

    held = first.acquire(sid, _claimant("first"), 30)  # a turn that stops at 31 (say its model call failed)
    first.save_fenced(sid, held, [*history, Message.user("first question")], take_steers=True)
    first.release(sid, held)

    held = stale.acquire(sid, _claimant("stale"), 30)  # a stale worker's first write, two new messages
    with pytest.raises(agent.TranscriptConflict):
        stale.save_fenced(sid, held, [*history, Message.user("x"), Message.user("y")], take_steers=True)
    stale.release(sid, held)

    retry = mongodb.Store(mongo_database)  # reload and run again, as TranscriptConflict says to
    msgs = retry.messages(sid)
    held = retry.acquire(sid, _claimant("retry"), 30)
    started = time.monotonic()
    try:
        retry.save_fenced(sid, held, [*msgs, Message.assistant("answer")], take_steers=True)
    except agent.StoreError as exc:
        pytest.fail(f"a legitimate save failed after {time.monotonic() - started:.1f} s: {exc}")
    assert retry.messages(sid) == [*msgs, Message.assistant("answer")]


def test_mongodb_a_zombies_late_save_does_not_wedge_the_live_holder(mongo_database: Any) -> None:
    """The same through whole runs: run A stalls inside an idempotent tool past its ttl; B takes over and
    saves its question (31 messages), then waits on its model; A thaws and its save of reply + result
    (32 messages) writes page <g>:0 before its fenced update is refused (LeaseLost, as it should be). B's
    final save then needs page <g>:0 with its own bodies, and fails with StoreError: the live holder's
    answer is lost, and so is every later turn's."""
    store = mongodb.Store(mongo_database)
    stalled, other = Stalled(store), mongodb.Store(mongo_database)
    sid = _sid("zombie")
    store.save(sid, [Message.user(f"m{i}") for i in range(29)])
    inside, thawed = threading.Event(), threading.Event()

    @agent.tool
    def lookup(n: int) -> str:
        """Idempotent; the zombie stalls in here."""
        stalled.freeze()
        inside.set()
        thawed.wait(60)
        return "looked up"

    zombie = agent.Runner().start(
        agent.Spec(session=agent.open(sid, stalled), tools=[lookup], lease_ttl=0.6),
        [*store.messages(sid), Message.user("A's question")], ToolsThenAnswer(["lookup"]))
    assert inside.wait(60)
    wait_for(lambda: other.holder(sid) is None, "A's lease to lapse", timeout=30)
    b_waiting, zombie_done = threading.Event(), threading.Event()

    def hold(messages: object) -> None:
        b_waiting.set()
        zombie_done.wait(60)

    live = agent.Runner().start(agent.Spec(session=agent.open(sid, other)),
                                [*other.messages(sid), Message.user("B's question")], Answer("B", before=hold))
    assert b_waiting.wait(60)
    stalled.thaw()
    thawed.set()
    with pytest.raises(agent.LeaseLost):
        zombie.wait(60)
    zombie_done.set()
    result = live.wait(120)  # StoreError: "save of session ... kept racing with other takers"
    assert result.stop_reason == "answered"
    assert store.messages(sid) == result.messages


# -- 3. replace_transcript=True on a resume drops the journal before the results are saved -----------------


def test_a_resume_with_replace_transcript_keeps_the_journal_until_the_results_are_saved(
    stores: Callable[[], RunStore],
) -> None:
    """Leased.resume's first save (transcript[:-1], replace=True) always writes, and a write drops the
    journal, while the reply's calls are still being finished. A second crash in that window (here inside
    the idempotent call that follows the replayed one) leaves no journal and no reply: the next resume asks
    the model again and the non-idempotent tool runs a second time."""
    store = stores()
    sid = _sid("replace")
    charges: list[int] = []
    lookups: list[int] = []

    @agent.tool(idempotent=False)
    def charge(n: int) -> str:
        """Charges; the first worker dies right after."""
        charges.append(n)
        if len(charges) == 1:
            raise _Crash
        return "charged"

    @agent.tool
    def lookup(n: int) -> str:
        """Idempotent; the second worker dies in here."""
        lookups.append(n)
        if len(lookups) == 1:
            raise _Crash
        return "looked up"

    def spec(replace: bool) -> agent.Spec:
        return agent.Spec(session=agent.open(sid, stores()), tools=[charge, lookup], replace_transcript=replace)

    with pytest.raises(_Crash):
        agent.Runner().run(spec(False), [Message.user("go")], ToolsThenAnswer(["charge", "lookup"]))
    with pytest.raises(_Crash):  # the resume: charge replayed as unknown, then lookup dies
        agent.Runner().run(spec(True), store.messages(sid), ToolsThenAnswer(["charge", "lookup"]))
    journal = store.journal(sid)
    agent.Runner().run(spec(False), store.messages(sid), ToolsThenAnswer(["charge", "lookup"]))
    assert charges == [0], (
        f"the non-idempotent tool ran {len(charges)} times (the journal after the second crash: {journal})"
    )


# -- 4. A cancel sent while the holder's lease has lapsed (but nobody took it) is lost --------------------


def test_a_cancel_is_not_lost_while_the_holders_lease_is_lapsed(stores: Callable[[], RunStore]) -> None:
    """A lapsed lease nobody took is still its holder's (the run renews and carries on: documented), but
    cancel() only marks a *live* lease: it answers False ("no run holds it") and the run goes on to its
    next model request and tools. A renewal that is late by more than the ttl is exactly when an operator
    reaches for cancel."""
    store = stores()
    stalled = Stalled(store)
    sid = _sid("cancel")
    asked: list[bool] = []

    @agent.tool
    def slow(n: int) -> str:
        """Renewals stall (a GC pause, a slow database) past the ttl; the operator cancels meanwhile."""
        if asked:
            return "slow"
        stalled.freeze()
        wait_for(lambda: store.holder(sid) is None, "the lease to lapse", timeout=30)
        asked.append(agent.open(sid, stores()).cancel())
        stalled.thaw()
        return "slow"

    result = agent.Runner().run(agent.Spec(session=agent.open(sid, stalled), tools=[slow], lease_ttl=0.3),
                                [Message.user("go")], ToolsThenAnswer(["slow"], rounds=3))
    assert asked == [True], "cancel() said no run held the session"
    assert result.stop_reason == "cancelled" and result.steps == 1, (result.steps, result.stop_reason)


# -- 5. A call refused by a cancel is journalled as started --------------------------------------------


class DiesAfterCancelledJournal(Stalled):
    """The worker dies right after a journal write that reported a cancel (before its next write)."""

    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        cancelled = self.store.put_journal(session, holder, journal, unless_cancelled=unless_cancelled)
        if cancelled and json.loads(journal)["started"][-1] == "call_0_1":
            raise _Crash
        return cancelled


def test_a_call_skipped_by_a_cancel_is_not_reported_as_outcome_unknown(stores: Callable[[], RunStore]) -> None:
    """The journal write that records a call about to start is not made once the run is cancelled
    (``unless_cancelled``): before, the call was skipped but the stored journal said it started, and after
    a crash before the next save the resume told the model "outcome unknown" about a call that never ran."""
    store = stores()
    sid = _sid("skipped")
    ran: list[str] = []

    @agent.tool(idempotent=False)
    def first(n: int) -> str:
        """Runs; a cancel lands while it does."""
        ran.append("first")
        assert store.cancel(sid)
        return "first done"

    @agent.tool(idempotent=False)
    def second(n: int) -> str:
        """Never runs: the cancel is seen before it."""
        ran.append("second")
        return "second done"

    with pytest.raises(_Crash):
        agent.Runner().run(agent.Spec(session=agent.open(sid, DiesAfterCancelledJournal(store)),
                                      tools=[first, second]),
                           [Message.user("go")], ToolsThenAnswer(["first", "second"]))
    assert ran == ["first"]
    result = agent.Runner().run(agent.Spec(session=agent.open(sid, stores()), tools=[first, second]),
                                store.messages(sid), ToolsThenAnswer(["first", "second"]))
    results = _results(result.messages, 2)
    assert results["call_0_0"].text == "first done"  # its result was journalled, cancel or not
    # The call the cancel skipped was never recorded as started: the resume tells the model it was not
    # run, not that its outcome is unknown. (A cancel is of the turn: the dead run's lease hands it to the
    # resume, which goes on with that turn, so it does not run the call either.)
    assert results["call_0_1"].text.startswith("not run") and ran == ["first"]
    assert UNKNOWN_OUTCOME not in results["call_0_1"].text


# -- 6. SQL fork into a new id loses to a concurrent first acquire of that id with SessionExists ---------


@pytest.fixture(scope="module", params=["postgres", "mysql"])
def sql_engine(request: pytest.FixtureRequest) -> Iterator[tuple[Any, type[Any]]]:
    base, store = (servers.POSTGRES_URL, postgres.Store) if request.param == "postgres" else (
        servers.MYSQL_URL, mysql.Store)
    engine = create_engine(servers.database_url(base, DATABASE), pool_size=4, max_overflow=40)
    servers.fresh_schema(engine)
    yield engine, store
    engine.dispose()


def test_a_fork_racing_the_first_acquire_of_its_target_is_not_refused(sql_engine: tuple[Any, type[Any]]) -> None:
    """SQLStore.fork reads the target's row without a lock and inserts it when missing; a run's first
    acquire of that id (NEW_LEASE, in its own transaction) that commits in between makes the fork's insert
    fail on the key, which fork reports as SessionExists "just created", although the row holds only a
    lease (fork fills such a row when it finds it: "a row holding only a lease has no transcript")."""
    engine, store_class = sql_engine
    store = store_class(engine)
    source, target = _sid("fsrc"), _sid("ftgt")
    store.save(source, [Message.user("q"), Message.assistant("a")])
    outcome: list[BaseException | None] = []
    row = replace(empty_row(target), exists=True, incarnation="i" * 32, token="t" * 32, epoch=1)
    with engine.begin() as conn:  # a first acquire(target), caught between making the row and its COMMIT
        conn.execute(insert(sessions).values(
            {c.name: getattr(row, "session" if c.name == "session_id" else c.name.rstrip("_")) for c in sessions.c}))

        def fork() -> None:
            try:
                store.fork(source, target, None)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        forking = threading.Thread(target=fork)
        forking.start()
        time.sleep(1.0)  # the fork is now waiting on the uncommitted key
        assert forking.is_alive()
    forking.join(30)
    assert outcome == [None], f"fork failed: {outcome[0]!r}"
    assert store.messages(target) == [Message.user("q"), Message.assistant("a")]


# -- 7. MySQL: concurrent first acquires of a new session exhaust the deadlock retries -------------------


def test_mysql_concurrent_first_acquires_of_a_new_session_never_raise_store_error() -> None:
    """acquire's SELECT ... FOR UPDATE of a missing row takes a gap lock in every acquirer, and their
    INSERTs then deadlock; _transaction retries 1213 only 4 times, so with a couple of dozen concurrent
    acquirers some acquire() calls raise StoreError (a 503) instead of returning the live holder (which
    Lease turns into SessionBusy, a 409)."""
    engine = create_engine(servers.database_url(servers.MYSQL_URL, DATABASE), pool_size=34, max_overflow=10)
    servers.fresh_schema(engine)
    workers = 32
    stores_ = [mysql.Store(engine) for _ in range(workers)]
    sids = [_sid("acq") for _ in range(40)]
    barrier = threading.Barrier(workers)
    failures: list[str] = []

    def worker(i: int) -> None:
        for sid in sids:
            barrier.wait(60)
            try:
                stores_[i].acquire(sid, _claimant(f"w{i}"), 30)
            except agent.StoreError as exc:
                failures.append(str(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    engine.dispose()
    assert not failures, f"{len(failures)} of {workers * len(sids)} acquires raised StoreError: {failures[0]}"
