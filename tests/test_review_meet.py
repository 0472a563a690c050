"""Review of branch ``meet`` (issue 29, "where operations meet"): reproducers that break its designs.

Each test runs on the five stores (memory, SQLite, and the PostgreSQL, MariaDB and MongoDB test servers)
through real threads and the real loop; the model is a scripted endpoint (storetest.scripted), as in
storetest. Each test's docstring gives the interleaving it pins down.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
import redis as redis_py
from sqlalchemy import create_engine

import agent_sessions as agent
from agent_sessions import Content, Message, Role
from agent_sessions.backend import Acquire
from agent_sessions.messages import incarnations_read
from stores import memory, mongodb, mysql, postgres, redis, sqlite
from storetest.crossprocess import wait_for
from storetest.scripted import Answer
from tests import servers

SECRET = "card 4111 1111 1111 1111"

STORES = ["memory", "sqlite", "postgres", "mysql", "mongodb", "redis"]


@pytest.fixture(scope="module")
def _engines() -> Iterator[dict[str, Any]]:
    made: dict[str, Any] = {}
    yield made
    for name, thing in made.items():
        if name == "mongodb":
            thing.client.close()
        elif name == "redis":
            for key in thing.scan_iter(match=f"{servers.REDIS_KEY_PREFIX}review:*", count=1000):
                thing.delete(key)
            thing.close()
        else:
            thing.dispose()


def _open(kind: str, engines: dict[str, Any], tmp_path: Path) -> Any:
    if kind == "memory":
        return memory.Store()
    if kind == "sqlite":
        return sqlite.open(str(tmp_path / "review.db"))
    if kind == "redis":
        if "redis" not in engines:
            engines["redis"] = redis_py.Redis.from_url(servers.REDIS_URL)
        return redis.Store(engines["redis"], prefix=f"{servers.REDIS_KEY_PREFIX}review:{tmp_path.name}:")
    if kind == "mongodb":
        if "mongodb" not in engines:
            client: pymongo.MongoClient[Any] = pymongo.MongoClient(servers.MONGO_URL, serverSelectionTimeoutMS=10_000)
            db = client[servers.database_name("review")]
            for name in mongodb.COLLECTIONS:
                db.drop_collection(name)
            mongodb.create_indexes(db)
            engines["mongodb"] = db
        return mongodb.Store(engines["mongodb"])
    if kind not in engines:
        base = servers.POSTGRES_URL if kind == "postgres" else servers.MYSQL_URL
        engine = create_engine(servers.database_url(base, servers.database_name("review")), pool_size=4)
        servers.fresh_schema(engine)
        engines[kind] = engine
    return (postgres.Store if kind == "postgres" else mysql.Store)(engines[kind])


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, _engines: dict[str, Any], tmp_path: Path) -> Any:
    return _open(request.param, _engines, tmp_path)


def _sid(tag: str) -> str:
    return f"review-{tag}-{uuid.uuid4().hex[:12]}"


def _holds_secret(store: Any, sid: str) -> bool:
    return any(SECRET in m.text for m in store.messages(sid))


class _Calls:
    """Calls tool ``name`` on every request until ``rounds`` tool-calling replies were made, then answers.
    Counts its requests; ``before`` runs inside each request."""

    def __init__(self, name: str, rounds: int, before: Any = None) -> None:
        self.name, self.rounds, self.before = name, rounds, before
        self.requests = 0

    def complete(self, system: str, messages: Any, tools: Any) -> Message:
        self.requests += 1
        if self.before is not None:
            self.before(self.requests)
        made = sum(1 for m in messages if m.role is Role.ASSISTANT and m.tool_calls)
        if made >= self.rounds:
            return Message.assistant("all done")
        return Message(Role.ASSISTANT, [Content.tool_call(f"c{made}-{uuid.uuid4().hex[:6]}", self.name, "{}")])


# -- 1. erasure stays erased ---------------------------------------------------------------------------


def test_an_incarnation_is_never_that_of_the_session_deleted_before_it(store: Any) -> None:
    """Interleaving: save (the session's row is made: created = C0), read (marked C0), delete, and at
    once the next write of that id makes the row again (created = C1), all within one tick of the store's
    clock (SQLite's julianday('now') and MongoDB's dates are milliseconds): C1 == C0, so the stale read
    passes ``_read_from_now`` and its run writes the erased conversation back."""
    for _ in range(300):
        sid = _sid("tick")
        store.save(sid, [Message.user(f"my {SECRET}")])
        stale = store.messages(sid)
        assert store.delete(sid)
        store.set_metadata(sid, {"fresh": True})  # a new, empty incarnation of the id (a new chat's tag)
        info = store.info(sid)
        assert info is not None
        if incarnations_read(stale, sid) == {info.created}:
            break
    else:
        return  # no two incarnations shared a tick in 300 tries
    spec = agent.Spec(session=agent.open(sid, store))
    try:
        agent.Runner().run(spec, [*stale, Message.user("go on")], Answer("must never be written"))
    except agent.TranscriptDeleted:
        pass
    assert not _holds_secret(store, sid), "two incarnations had one created: the erased conversation came back"


FEW_SHOT = (Message.user("What is 2 + 2?"), Message.assistant("4"))
"""A module's few-shot preamble: the same Message objects begin every conversation the app runs."""


def test_a_new_conversation_from_the_apps_own_messages_is_not_refused_after_a_delete(store: Any) -> None:
    """Interleaving: the app begins conversation ``sid`` with its few-shot constants (objects it made);
    something reads the session (a UI showing it); the user deletes it ("clear chat"); the app begins the
    conversation anew with the same constants. Nothing was read before the erasure by the new run: the
    memory store keeps (and marks, on every read) the very objects it was given, so the app's own
    constants now carry the erased incarnation's mark and the new conversation raises TranscriptDeleted."""
    sid = _sid("fewshot")
    spec = agent.Spec(session=agent.open(sid, store))
    agent.Runner().run(spec, [*FEW_SHOT, Message.user(f"my {SECRET}")], Answer("noted"))
    store.messages(sid)  # a UI shows the conversation
    assert store.delete(sid)
    result = agent.Runner().run(spec, [*FEW_SHOT, Message.user("hello")], Answer("hi"))
    assert result.text == "hi"
    assert not _holds_secret(store, sid)


def test_a_copy_of_a_conversation_does_not_unmark_what_was_read_from_the_original(store: Any) -> None:
    """Interleaving: a worker reads ``a`` (stale); the app copies the conversation to ``b`` with
    ``save(b, messages(a))``; the user deletes ``a``; something reads ``b``; the worker runs ``a`` with
    its stale read. On the memory store ``b`` holds the very objects read from ``a``, and reading ``b``
    re-marks them as ``b``'s: the stale read then carries no mark of ``a`` and the erased conversation is
    written back to ``a`` (fail-open)."""
    a, b = _sid("orig"), _sid("copy")
    agent.Runner().run(agent.Spec(session=agent.open(a, store)), [Message.user(f"my {SECRET}")], Answer("noted"))
    stale = store.messages(a)
    store.save(b, store.messages(a))
    assert store.delete(a)
    store.messages(b)
    with pytest.raises(agent.TranscriptDeleted):
        agent.Runner().run(agent.Spec(session=agent.open(a, store)), [*stale, Message.user("go on")],
                           Answer("must never be written"))
    assert not _holds_secret(store, a)


# -- 2. a cancel is of the turn ------------------------------------------------------------------------


def _cancelled_turn(store: Any, sid: str) -> agent.Spec:
    """A turn the user cancels while it waits on its model: it returns "cancelled", its lease released
    with the cancel kept (handed to the next holder)."""
    other = agent.open(sid, store)

    def cancel(request: int) -> None:
        if request == 1:
            assert other.cancel() is True

    spec = agent.Spec(session=agent.open(sid, store), tools=[_lookup])
    first = agent.Runner().run(spec, [Message.user("a first question")], _Calls("lookup", 3, before=cancel))
    assert first.stop_reason == "cancelled"
    return spec


@agent.tool(name="lookup")
def _lookup() -> str:
    """Look something up (idempotent)."""
    return "found"


def test_a_steered_turn_after_a_cancelled_one_is_not_cancelled(store: Any) -> None:
    """docs/integrations.md's Celery turn: the input is a steer, the task runs
    ``Runner.run(spec, session.messages())``. Interleaving: turn 1 is cancelled (its lease is released
    with the mark kept); the user steers a new question; run_turn runs from the stored transcript. It
    brings no user message of its own (the steer is taken at its first save, after ``resume``), so
    ``_begins_turn`` says it goes on with the cancelled turn: it stops "cancelled" without a request, the
    steer is swallowed into the transcript unanswered, and the mark is handed on to the next such run."""
    sid = _sid("steer")
    spec = _cancelled_turn(store, sid)
    agent.open(sid, store).steer("a new question")
    endpoint = Answer("the new answer")
    result = agent.Runner().run(spec, store.messages(sid), endpoint)
    assert (result.stop_reason, endpoint.requests) == ("answered", 1)


def test_an_edited_question_after_a_cancelled_turn_is_not_cancelled(store: Any) -> None:
    """The chat UI's "edit and resend" after the user stopped a generation: the history up to the
    cancelled question, and the edited question, with ``replace_transcript=True``. The transcript is not
    longer than the stored one, so ``transcript[stored:]`` holds no user message and the new turn is
    taken for the cancelled one: it stops at once."""
    sid = _sid("edit")
    _cancelled_turn(store, sid)
    spec = agent.Spec(session=agent.open(sid, store), replace_transcript=True)
    endpoint = Answer("the edited answer")
    result = agent.Runner().run(spec, [Message.user("the edited question")], endpoint)
    assert (result.stop_reason, endpoint.requests) == ("answered", 1)


def test_a_cancel_of_an_idle_session_is_false_and_stops_nothing_later(store: Any) -> None:
    sid = _sid("idle")
    spec = agent.Spec(session=agent.open(sid, store))
    assert agent.Runner().run(spec, [Message.user("q")], Answer("a")).text == "a"
    assert agent.open(sid, store).cancel() is False
    assert agent.open(_sid("never"), store).cancel() is False
    endpoint = Answer("again")
    assert agent.Runner().run(spec, store.messages(sid), endpoint).stop_reason == "answered"
    assert agent.Runner().turn(spec, "next", "k-2", endpoint).stop_reason == "answered"


class _Died(BaseException):
    """A worker dying: nothing in the loop catches it."""



def test_a_turn_cancelled_before_its_first_save_stays_cancelled_when_redelivered(store: Any) -> None:
    """``cancel()`` returned True ("no call of that turn starts afterwards"). Interleaving: delivery 1 of
    turn k takes the lease; the user cancels (True: a run holds the session); the worker dies before its
    first save, so k's message was never stored; the lease expires. Delivery 2 of k finds no k stored and
    brings k's message as new: ``_begins_turn`` drops the handed cancel, and the cancelled turn runs its
    tool."""
    sid = _sid("early")
    sent: list[str] = []

    @agent.tool(name="email", idempotent=False)
    def email() -> str:
        """Send an email."""
        sent.append("sent")
        return "sent"

    other = agent.open(sid, store)
    outcome: list[bool] = []

    class DiesAfterAcquire:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(store, name)
            if name != "acquire":
                return attr

            def acquire(*args: Any, **kwargs: Any) -> Any:
                attr(*args, **kwargs)
                outcome.append(other.cancel())
                raise _Died()

            return acquire

    spec = agent.Spec(session=agent.open(sid, DiesAfterAcquire()), tools=[email], lease_ttl=0.5)
    with pytest.raises(_Died):
        agent.Runner().turn(spec, "email them", "k", _Calls("email", 1))
    assert outcome == [True]
    wait_for(lambda: store.holder(sid) is None, "the dead worker's lease to expire", 20)
    endpoint = _Calls("email", 1)
    again = agent.Runner().turn(agent.Spec(session=agent.open(sid, store), tools=[email]), "email them", "k",
                                endpoint)
    assert (again.stop_reason, endpoint.requests, sent) == ("cancelled", 0, [])


# -- 3. a redelivered turn's budget --------------------------------------------------------------------



def test_a_turn_resumed_after_its_approval_makes_at_most_max_steps_requests_in_all(store: Any) -> None:
    """turns.py counts the turn's requests as its stored replies. Interleaving: delivery 1 of turn k
    (max_steps=1) makes its one request; the reply's call needs approval, so the reply waits in the
    journal, not in the transcript; a person approves; the turn is delivered again. ``replies`` counts 0,
    so the repeat gets a budget of 1: it runs the approved call and then makes a second request."""
    sid = _sid("budget")
    ran: list[str] = []

    @agent.tool(name="refund", idempotent=False, needs_approval=True)
    def refund() -> str:
        """Refund (a person approves)."""
        ran.append("refund")
        return "refunded"

    endpoint = _Calls("refund", 5)
    spec = agent.Spec(session=agent.open(sid, store), tools=[refund], max_steps=1)
    first = agent.Runner().turn(spec, "refund it", "k", endpoint)
    assert (first.stop_reason, endpoint.requests) == ("awaiting_approval", 1)
    [pending] = agent.open(sid, store).pending_approvals()
    agent.open(sid, store).approve(pending.call_id)
    again = agent.Runner().turn(spec, "refund it", "k", endpoint)
    assert ran == ["refund"]
    assert endpoint.requests == 1, f"turn k (max_steps=1) made {endpoint.requests} requests: {again.stop_reason}"


# -- 4. a run refused at its first write publishes nothing ---------------------------------------------


class _Boom(Exception):
    pass


def test_a_run_that_fails_before_its_first_write_without_being_refused_still_publishes_failed(store: Any) -> None:
    """``Leased.__exit__`` drops every event of a run that fails before its first write, not only of one
    whose first write was refused (what docs/runs/events.md says). Interleaving: the run takes the lease,
    its events callback raises on the first ``StepStarted`` (before the step's save): the run held the
    session and failed, which is none of the documented exceptions (lease lost, store down, SessionBusy,
    a refused first write), yet the log gets no ``failed``."""
    sid = _sid("boom")

    def callback(event: object) -> None:
        if isinstance(event, agent.events.StepStarted):
            raise _Boom("the listener broke")

    spec = agent.Spec(session=agent.open(sid, store), publish_events=True)
    agent.Runner().run(spec, [Message.user("q")], Answer("a"))
    with pytest.raises(_Boom):
        agent.Runner().run(spec, [*store.messages(sid), Message.user("q2")], Answer("a2"), callback)
    kinds = [e.kind for e in agent.open(sid, store).events(limit=1000)]
    assert kinds[-1] == "failed", kinds


def test_a_conversation_moved_to_another_store_goes_on_there(store: Any) -> None:
    """Moving a conversation between stores (a migration from SQLite to PostgreSQL, a copy from one
    database to another) under its id: what was read from the old store carries the old store's
    incarnation, which the new store's session (absent, or created at another time) never has, so the
    run raises TranscriptDeleted ("deleted or pruned") though nothing was erased. It worked before."""
    sid = _sid("moved")
    old = memory.Store()
    agent.Runner().run(agent.Spec(session=agent.open(sid, old)), [Message.user("hello")], Answer("hi"))
    result = agent.Runner().run(agent.Spec(session=agent.open(sid, store)),
                                [*old.messages(sid), Message.user("go on")], Answer("going on"))
    assert result.text == "going on"


def test_a_turn_cancelled_through_run_cancel_stays_cancelled_when_resumed(store: Any) -> None:
    """docs/runs/leases.md: "``Run.cancel()`` does the same for the process holding the ``Run``", right
    after "a cancel is of the turn". Interleaving: ``Runner.start``; ``run.cancel()`` while it waits on its
    model; it stops "cancelled"; a resume of that turn (``Runner.run(spec, stored)``, as after a crash or a
    redelivery) is handed no cancel, since ``Run.cancel`` only set the in-process flag, and goes on."""
    sid = _sid("runcancel")
    holder: list[agent.Run] = []
    spec = agent.Spec(session=agent.open(sid, store), tools=[_lookup])
    gate = threading.Event()

    def wait_then_cancel(request: int) -> None:
        if request == 1:
            assert gate.wait(10)
            holder[0].cancel()

    run = agent.Runner().start(spec, [Message.user("look it up")], _Calls("lookup", 3, before=wait_then_cancel))
    holder.append(run)
    gate.set()
    assert run.wait(timeout=20).stop_reason == "cancelled"
    endpoint = _Calls("lookup", 3)
    resumed = agent.Runner().run(spec, store.messages(sid), endpoint)
    assert (resumed.stop_reason, endpoint.requests) == ("cancelled", 0)


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "mysql"])
def test_a_delete_landing_inside_a_sql_acquire_is_not_an_assertion_error(
    kind: str, _engines: dict[str, Any], tmp_path: Path
) -> None:
    """The old SQLStore.acquire made the session's row in one transaction and locked it in a second.
    Interleaving (storetest's test_29_1_a_run_waiting_for_the_lease_through_a_delete... hit it now and
    then): a run waiting for the lease made the row; a forced delete removed it; the run's locking select
    found no row and ``assert row is not None  # made just before`` failed: an AssertionError, not a typed
    error, and no lease. An acquire is one write now: the delete is landed here just before it, on the
    real database, and the run ends with a typed error."""
    store = _open(kind, _engines, tmp_path)
    sid = _sid("acq")
    agent.Runner().run(agent.Spec(session=agent.open(sid, store)), [Message.user(f"my {SECRET}")], Answer("ok"))
    stale = store.messages(sid)
    eraser = _open(kind, _engines, tmp_path)
    real = store.backend.write
    landed: list[bool] = []

    def landing(session: str, guard: Any, change: Any) -> Any:
        if isinstance(change.lease, Acquire) and not landed:
            landed.append(eraser.delete(sid, force=True))
        return real(session, guard, change)

    store.backend.write = landing
    with pytest.raises(agent.TranscriptDeleted):
        agent.Runner().run(agent.Spec(session=agent.open(sid, store)), [*stale, Message.user("go on")],
                           Answer("must never be written"))
    assert landed == [True] and not _holds_secret(eraser, sid)
