"""Issue #25 on MongoDB (mongoeco, through the fault proxy): the proxy's faults at a chosen request, and what
the MongoDB store does under them, items 1-4 and 6.

Where MongoDB differs from the SQL stores: every write of the store is one single-document command, so a
connection that fails after the command was sent (``lose_ack``, and ``cut_before``/``cut_inside`` too, which
the driver cannot tell from it) leaves the outcome unknown: ``OutcomeUnknown``, and the read-back or the
retry the docs prescribe finds what happened. A plain ``StoreError`` ("did not happen") is what comes when no
server could be chosen (a partition seen by a fresh client): then nothing was sent. There are no row locks
(item 1): a worker frozen in the middle of its write holds nothing but its lease, so the others meet
``SessionBusy`` within their ``lease_wait``, take the session over once the lease lapses, and the frozen
write, when it arrives, is fenced. There is no ``terminate``.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import bson
import pymongo
import pytest
from pymongo.database import Database

import agent_sessions as agent
from agent_sessions.lease import Lease
from stores import mongodb
from tests import servers
from tests.model_server import ModelServer, Reply, openai

from . import wire
from .counting import CountingModel, charge, look
from .proxy import FaultProxy, Rule
from .test_outcomes import _transcript, lost_acquisition, lost_release, lost_save, lost_step
from .test_steers_kept import _count, _endpoint, _failed_run, _steered_run, lookup, slow_lookup

pytestmark = pytest.mark.skipif(not servers.mongo_reachable(), reason="no MongoDB server")

UPSTREAM = pymongo.uri_parser.parse_uri(servers.MONGO_URL)["nodelist"][0][1]
DATABASE = servers.database_name("faultmongo")
SAVE = r'^findAndModify agent_sessions .*"edits":\{"\$add"'
"""A transcript's write (its messages spliced)."""
ACQUIRE = r'^findAndModify agent_sessions .*"epoch":\{"\$add"'
"""An acquisition: the update that raises the epoch."""
RELEASE = r'^findAndModify agent_sessions .*"token":null'
EVENTS = r'^findAndModify agent_sessions .*"last_seq":"\$\$last"'
READ = r'^aggregate agent_sessions '
"""A read of a session (what a write whose answer was lost is settled by)."""
"""A write of events (a save's, or events alone)."""


def _client(port: int, **options: Any) -> pymongo.MongoClient[Any]:
    return pymongo.MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true",
                               **{"serverSelectionTimeoutMS": 5000, **options})


OPENED: list[pymongo.MongoClient[Any]] = []


def _store(port: int = UPSTREAM, **options: Any) -> mongodb.Store:
    client = _client(port, **options)
    OPENED.append(client)
    return mongodb.Store(client[DATABASE])


@pytest.fixture(scope="module")
def database() -> Iterator[Database[Any]]:
    client = _client(UPSTREAM)
    db = client[DATABASE]
    for name in mongodb.COLLECTIONS:
        db.drop_collection(name)
    mongodb.create_indexes(db)
    yield db
    client.drop_database(DATABASE)
    client.close()


@pytest.fixture
def proxy(database: Database[Any]) -> Iterator[FaultProxy]:
    with FaultProxy("mongodb", UPSTREAM) as p:
        yield p
    while OPENED:
        OPENED.pop().close()


@pytest.fixture
def via(proxy: FaultProxy) -> mongodb.Store:
    """A store reaching the server through the proxy, connected before any rule is armed."""
    store = _store(proxy.port)
    store.save(f"warm-{uuid.uuid4().hex}", _transcript(1))
    proxy.statements.clear()
    return store


@pytest.fixture
def direct(database: Database[Any]) -> mongodb.Store:
    return _store()


@pytest.fixture
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    yield server
    server.close()


# -- the proxy itself -------------------------------------------------------------------------------------


def _in_a_transaction(client: pymongo.MongoClient[Any], write: Callable[[Any], object]) -> None:
    """``write`` in a transaction, committed. mongoeco refuses a commit after any write to the server since
    the transaction began, in any database: where the suite's workers share one server (a developer's own,
    named by AGENT_SESSIONS_MONGO_URL; scripts/test gives each worker its own) the others write all the
    time, so a refused commit (nothing written) is tried again after a random pause, a bounded number of
    times."""
    for attempt in range(50):
        try:
            with client.start_session() as session, session.start_transaction():
                write(session)
            return
        except pymongo.errors.OperationFailure as exc:
            if "Write conflict" not in str(exc):
                raise
        time.sleep(random.uniform(0, 0.002 * attempt))
    raise AssertionError("50 transactions in a row met another worker's write")


def test_everything_passes_through_and_reads_as_commands(database: Database[Any], proxy: FaultProxy) -> None:
    client = _client(proxy.port)
    try:
        things = client[DATABASE]["proxy_t"]
        things.insert_many([{"_id": i, "v": i} for i in range(3)])
        assert things.find_one_and_update({"_id": 1}, {"$inc": {"v": 10}}, return_document=True) == {"_id": 1, "v": 11}
        _in_a_transaction(client, lambda session: things.update_one({"_id": 2}, {"$inc": {"v": 20}}, session=session))
        assert [d["v"] for d in things.find({}, batch_size=1).sort("_id")] == [0, 11, 22]  # getMore too
        assert [d["n"] for d in things.aggregate([{"$group": {"_id": None, "n": {"$sum": 1}}}])] == [3]
        things.drop()
        names = [s.split(" ")[0] for s in proxy.statements]
        assert names[:2] == ["insert", "findAndModify"] and "commitTransaction" in names and "getMore" in names
        assert '"$inc":{"v":20}' in proxy.statements[2] and "hello" not in names  # hellos are not counted
        assert not proxy.log
    finally:
        client.close()


def _op_query(request_id: int, command: dict[str, Any]) -> bytes:
    """An old driver's command: ``OP_QUERY`` on ``admin.$cmd``."""
    body = struct.pack("<i", 0) + b"admin.$cmd\0" + struct.pack("<ii", 0, -1) + bson.encode(command)
    return struct.pack("<iiii", 16 + len(body), request_id, 0, wire.OP_QUERY) + body


def test_an_old_drivers_op_query_is_answered_by_its_op_reply_and_can_lose_it(proxy: FaultProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        reader = sock.makefile("rb")

        def recv(n: int) -> bytes:
            data = reader.read(n)
            if len(data) < n:
                raise EOFError("closed")
            return data

        sock.sendall(_op_query(7, {"isMaster": 1}))  # the handshake: passed on, not counted
        reply, _, response_to, op_code = wire.mongo_message(recv)
        assert (op_code, response_to) == (wire.OP_REPLY, 7) and bson.decode(reply[36:])["ismaster"] is True
        rule = proxy.arm(Rule("lose_ack", "^ping"))
        sock.sendall(_op_query(8, {"ping": 1}))
        with pytest.raises((EOFError, OSError)):
            wire.mongo_message(recv)
        assert rule.fired == ["ping  {}"] and proxy.statements == ["ping  {}"]


@pytest.mark.parametrize(("fault", "done"), [("lose_ack", True), ("cut_before", False), ("cut_inside", False)])
def test_a_write_loses_its_answer_or_is_cut_before_the_server_has_it(
    database: Database[Any], proxy: FaultProxy, fault: str, done: bool
) -> None:
    client = _client(proxy.port)
    key = uuid.uuid4().hex
    try:
        rule = proxy.arm(Rule(fault, "^insert proxy_t"))
        with pytest.raises(pymongo.errors.AutoReconnect):  # the driver cannot tell one from the others
            client[DATABASE]["proxy_t"].insert_one({"_id": key})
        assert rule.fired
        assert (database["proxy_t"].find_one({"_id": key}) is not None) is done
        client[DATABASE]["proxy_t"].insert_one({"_id": key + "-after"})  # a new connection, after a re-check
    finally:
        database["proxy_t"].drop()
        client.close()
    with pytest.raises(ValueError, match="terminate"):
        proxy.arm(Rule("terminate", "^insert"))


def test_cut_after_delay_and_freeze(database: Database[Any], proxy: FaultProxy) -> None:
    client = _client(proxy.port)
    things = client[DATABASE]["proxy_t"]
    try:
        things.insert_one({"_id": "k", "v": 3})
        proxy.arm(Rule("cut_after", '^find proxy_t .*"k"'))
        assert things.find_one({"_id": "k"}) == {"_id": "k", "v": 3}  # its answer came; then the connection went
        proxy.arm(Rule("delay", '^find proxy_t .*"delayed"', seconds=0.4))
        started = time.monotonic()
        assert things.find_one({"_id": "delayed"}) is None
        assert time.monotonic() - started >= 0.4
        proxy.arm(Rule("freeze", '^find proxy_t .*"frozen"'))
        timer = threading.Timer(0.5, proxy.thaw)
        timer.start()
        started = time.monotonic()
        assert things.find_one({"_id": "frozen"}) is None
        timer.join(5)
        assert time.monotonic() - started >= 0.45
    finally:
        database["proxy_t"].drop()
        client.close()


# -- item 6: "may have happened" and "did not happen" -----------------------------------------------------


def test_a_save_whose_answer_was_lost_may_have_happened_and_did(
    via: mongodb.Store, direct: mongodb.Store, proxy: FaultProxy
) -> None:
    lost_save(via, direct, proxy, SAVE)


@pytest.mark.parametrize("fault", ["cut_before", "cut_inside"])
def test_a_save_cut_before_the_server_had_it_may_have_happened_and_did_not(
    via: mongodb.Store, direct: mongodb.Store, proxy: FaultProxy, fault: str
) -> None:
    """The command was written to the socket: the driver cannot know the server never read it."""
    sid = f"cut-{uuid.uuid4().hex}"
    rule = proxy.arm(Rule(fault, SAVE))
    with pytest.raises(agent.OutcomeUnknown):
        via.save(sid, _transcript(3))
    assert rule.fired and direct.messages(sid) == []


def test_a_write_that_found_no_server_did_not_happen(direct: mongodb.Store, proxy: FaultProxy) -> None:
    """A partition that a fresh client meets: no server is selected, nothing is sent: a plain StoreError."""
    sid = f"part-{uuid.uuid4().hex}"
    proxy.partition()
    try:
        store = _store(proxy.port, serverSelectionTimeoutMS=800, connectTimeoutMS=400)
        for write in (lambda: store.save(sid, _transcript(3)), lambda: store.add_steer(sid, "hi")):
            with pytest.raises(agent.StoreError, match="failed") as raised:
                write()
            assert not isinstance(raised.value, agent.OutcomeUnknown), raised.value
    finally:
        proxy.heal()
    assert direct.messages(sid) == [] and direct.pending_steers(sid) == []


def test_a_fenced_step_whose_answer_was_lost_is_read_back_and_found_landed(
    via: mongodb.Store, direct: mongodb.Store, proxy: FaultProxy
) -> None:
    lost_step(via, direct, proxy, SAVE, unknown=False)


# -- item 4 (and 7): an acquisition or a release whose answer was lost ------------------------------------


def test_an_acquisition_whose_answer_was_lost_gets_the_lease_it_took(
    via: mongodb.Store, direct: mongodb.Store, proxy: FaultProxy
) -> None:
    rule = lost_acquisition(via, direct, proxy, Rule("lose_ack", ACQUIRE))
    assert rule.fired


def test_an_acquisition_whose_answer_was_lost_still_hands_on_the_cancel(
    via: mongodb.Store, direct: mongodb.Store, proxy: FaultProxy
) -> None:
    """The lease it took over had a cancel: the retry, finding the lease its own, says so too (else the new
    run would go on with the turn that was cancelled)."""
    sid = f"acqc-{uuid.uuid4().hex}"
    via.save(sid, _transcript(1))
    before = direct.acquire(sid, agent.Holder("before", 1, "b" * 32, 0.0), 30)
    assert direct.cancel(sid)
    direct.release(sid, before)  # a cancel stays, handed on to the next holder
    rule = proxy.arm(Rule("lose_ack", ACQUIRE))
    with Lease(via, sid, ttl=30, wait=0) as lease:
        assert lease.holder.cancelled and lease.holder.epoch == before.epoch + 1
    assert rule.fired


def test_a_release_whose_answer_was_lost_does_not_fail_the_finished_turn(
    via: mongodb.Store, direct: mongodb.Store, proxy: FaultProxy
) -> None:
    lost_release(via, direct, proxy, RELEASE)


# -- items 2 and 3: a run's steers and events when its save fails or goes unanswered ----------------------


def _resume(sid: str, model: ModelServer) -> list[agent.Message]:
    """The documented resume, on a worker that reaches the server directly."""
    model.push(openai("done"))
    store = _store()
    session = agent.open(sid, store)
    result = agent.Runner().run(agent.Spec(session=session, tools=[lookup]), session.messages(), _endpoint(model))
    assert result.stop_reason == "answered" and store.messages(sid) == result.messages
    return result.messages


def test_a_steer_given_during_a_request_that_fails_is_kept_for_the_resume(
    proxy: FaultProxy, model: ModelServer
) -> None:
    sid = f"s503-{uuid.uuid4().hex[:12]}"
    spec = agent.Spec(session=agent.open(sid, _store(proxy.port)), tools=[lookup])
    failed = _failed_run(spec, model, "and look at b", Reply({"error": {"message": "overloaded"}}, status=503))
    assert isinstance(failed, agent.EndpointError) and not getattr(failed, "unapplied_steers", [])
    assert _store().pending_steers(sid) == ["and look at b"]
    assert _count(_resume(sid, model), "and look at b") == 1


@pytest.mark.parametrize("fault", ["cut_before", "lose_ack"])
def test_a_steer_whose_save_was_cut_or_unanswered_is_stored_once(
    proxy: FaultProxy, model: ModelServer, fault: str
) -> None:
    """The steer is taken into the step-2 transcript, whose save goes unanswered: the run reads the session
    back. Cut before the server had it: not landed, and written again; answer lost: landed. Either way the
    run goes on with the steer stored once."""
    sid = f"scut-{uuid.uuid4().hex[:12]}"
    spec = agent.Spec(session=agent.open(sid, _store(proxy.port)), tools=[lookup])
    rule = Rule(fault, SAVE)
    result = _steered_run(spec, model, "and look at c", "lookup", lambda: proxy.arm(rule))
    assert rule.fired and result.stop_reason == "answered"
    assert _store().messages(sid) == result.messages and _count(result.messages, "and look at c") == 1
    assert _store().pending_steers(sid) == []


def _event_keys(store: mongodb.Store, sid: str) -> list[tuple[Any, ...]]:
    return [(e.kind, e.data.get("step"), e.data.get("text"), e.data.get("call_id"))
            for e in agent.open(sid, store).events(limit=1000)]


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_write_of_events_that_went_unanswered_but_landed_doubles_nothing(
    proxy: FaultProxy, model: ModelServer, nth: int
) -> None:
    """The nth write carrying events (a save's, or events alone) loses its answer: read back, landed, the run
    goes on; each event is in the log once, and the log ends with one ``finished``, no ``failed``."""
    sid = f"sack-{uuid.uuid4().hex[:12]}"
    spec = agent.Spec(session=agent.open(sid, _store(proxy.port)), tools=[slow_lookup], publish_events=True)
    rule = Rule("lose_ack", EVENTS, nth=nth)
    result = _steered_run(spec, model, "and look at d", "slow_lookup", lambda: proxy.arm(rule))
    assert result.stop_reason == "answered" and result.text == "done"
    assert rule.fired, proxy.statements
    direct = _store()
    assert direct.messages(sid) == result.messages and _count(result.messages, "and look at d") == 1
    assert direct.pending_steers(sid) == []
    keys = _event_keys(direct, sid)
    kinds = [k for k, *_ in keys]
    assert len(keys) == len(set(keys)), keys
    assert kinds.count("finished") == 1 and "failed" not in kinds


def test_events_of_a_save_cut_before_it_landed_are_written_once_with_failed(
    proxy: FaultProxy, model: ModelServer
) -> None:
    """The save is cut, and so is the read that would settle it: the run fails (a store error), and its
    events, the save's and ``failed``, are in the log once each."""
    sid = f"sevc-{uuid.uuid4().hex[:12]}"
    spec = agent.Spec(session=agent.open(sid, _store(proxy.port)), tools=[lookup], publish_events=True)
    rules = [Rule("cut_before", SAVE), Rule("cut_before", READ), Rule("cut_before", READ)]  # and pymongo's retry
    failed = _failed_run(spec, model, "and look at f", openai(calls=[("c1", "lookup", '{"key": "a"}')]),
                         arm=lambda: [proxy.arm(rule) for rule in rules])
    assert all(rule.fired for rule in rules) and isinstance(failed, agent.StoreError), proxy.log
    keys = _event_keys(_store(), sid)
    kinds = [k for k, *_ in keys]
    assert len(keys) == len(set(keys)), keys
    assert kinds[-1] == "failed" and "finished" not in kinds


def test_a_run_whose_failed_event_cannot_be_written_either_still_ends_and_frees_the_session(
    proxy: FaultProxy, model: ModelServer
) -> None:
    """The run's first save (its events ride in it) is cut, and so is the read that would settle it; so is
    the write of the events and ``failed`` on the way out. The run raises the read's error, and its lease is
    released (its heartbeat stopped), not renewed for as long as the process lives (found by trial seed
    1499: ``failed``, added to events older than the flush period, flushed them at once, and that write's
    error skipped the lease's release)."""
    sid = f"sfev-{uuid.uuid4().hex[:12]}"
    direct = _store()
    model.push(openai("first"), openai("done"))
    first = agent.Runner().run(agent.Spec(session=agent.open(sid, direct), publish_events=True),
                               [agent.Message.user("go")], _endpoint(model))  # the log begun: a save is one update
    spec = agent.Spec(session=agent.open(sid, _store(proxy.port)), publish_events=True, lease_ttl=30)
    rules = [proxy.arm(Rule("cut_before", SAVE)),  # matched first: the save carrying events
             proxy.arm(Rule("cut_before", READ)),  # the read that would settle it, and pymongo's retry of it
             proxy.arm(Rule("cut_before", READ)),
             proxy.arm(Rule("cut_before", EVENTS))]
    with pytest.raises(agent.StoreError, match="of session .* failed"):
        agent.Runner().run(spec, [*first.messages, agent.Message.user("again")], _endpoint(model))
    assert all(rule.fired for rule in rules), proxy.log
    assert direct.holder(sid) is None and direct.messages(sid) == first.messages
    result = agent.Runner().run(agent.Spec(session=agent.open(sid, direct), lease_wait=0),
                                [*first.messages, agent.Message.user("again")], _endpoint(model))
    assert result.text == "done"


# -- item 1: a worker frozen in the middle of its write ---------------------------------------------------


def test_a_worker_frozen_inside_its_write_holds_only_its_lease_and_its_late_write_is_fenced(
    via: mongodb.Store, direct: mongodb.Store, proxy: FaultProxy
) -> None:
    """No row locks: others wait no longer than their ``lease_wait`` (``SessionBusy``), a cancel answers at
    once, the session is taken over when the frozen worker's lease lapses, and its write, thawed after
    that, matches nothing (``LeaseLost``)."""
    sid = f"frz-{uuid.uuid4().hex[:12]}"
    msgs = _transcript(1)
    via.save(sid, msgs)
    silent = via.acquire(sid, agent.Holder("silent", 1, "s" * 32, 0.0), 1.5)
    rule = proxy.arm(Rule("freeze", SAVE))
    outcome: list[BaseException | agent.Saved] = []

    def write() -> None:
        try:
            outcome.append(via.save_fenced(sid, silent, [*msgs, agent.Message.assistant("late")], take_steers=True))
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            outcome.append(exc)

    worker = threading.Thread(target=write, daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not rule.fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rule.fired, proxy.statements
        started = time.monotonic()
        with pytest.raises(agent.SessionBusy, match="silent"):
            with Lease(direct, sid, ttl=30, wait=0.5):
                pass
        assert time.monotonic() - started < 0.5 + 1.0
        started = time.monotonic()
        assert direct.cancel(sid) is True and time.monotonic() - started < 1.0
        with Lease(direct, sid, ttl=30, wait=5) as lease:  # once the silent lease lapses
            assert lease.holder.epoch == silent.epoch + 1
            proxy.thaw()
            worker.join(10)
            assert not worker.is_alive()
            assert isinstance(outcome[0], agent.LeaseLost), outcome
            assert direct.messages(sid) == msgs  # the late write matched nothing
    finally:
        proxy.thaw()
        worker.join(10)


def test_a_frozen_worker_with_a_socket_timeout_is_bounded_too(proxy: FaultProxy, direct: mongodb.Store) -> None:
    """The frozen worker itself waits as long as its driver lets it: ``socketTimeoutMS`` bounds it, and the
    outcome is unknown (its command was sent)."""
    store = _store(proxy.port, socketTimeoutMS=500)
    sid = f"sto-{uuid.uuid4().hex[:12]}"
    store.save(sid, _transcript(1))
    rule = proxy.arm(Rule("freeze", SAVE))
    started = time.monotonic()
    try:
        with pytest.raises(agent.OutcomeUnknown):
            store.save(sid, _transcript(2))
        assert rule.fired and time.monotonic() - started < 3
    finally:
        proxy.thaw()


# -- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tool", "publish", "step", "start"), [(look, False, 1, 2), (charge, False, 2, 2),
                                                                 (look, True, 1, 2)])
def test_the_round_trips_of_a_runs_start_and_of_its_usual_step(
    via: mongodb.Store, proxy: FaultProxy, tool: agent.Tool, publish: bool, step: int, start: int
) -> None:
    """Counted by the proxy, each request one round trip. A run's start (from ``Runner.run`` to its first
    request to the model, given the transcript it read): the acquire (its answer carries the journal), the
    save of the new input. A usual step: the save (whose answer carries the cancel flag the idempotent tool
    is checked by), and before a non-idempotent tool the journal's write; the events ride in the save.
    Every few dozen messages or events a step also plans a page: the refused update (it
    says it found no room), a read of the layout, the page's insert, the update that names it, and an
    unacknowledged delete of what nothing names (not waited for)."""
    sid = f"rt-{uuid.uuid4().hex[:12]}"
    via.save(sid, _transcript(1))
    read = via.messages(sid)
    proxy.statements.clear()
    model = CountingModel(tool.name, proxy, 40)
    spec = agent.Spec(session=agent.open(sid, via), tools=[tool], max_steps=41, publish_events=publish)
    agent.Runner().run(spec, [*read, agent.Message.user("go")], model)
    steps = [b - a for a, b in zip(model.seen, model.seen[1:], strict=False)]
    print(f"{tool.name}, events {'on' if publish else 'off'}: run start {model.seen[0]}, steps {sorted(steps)}")
    assert model.seen[0] == start
    assert steps.count(step) >= len(steps) - 8 and max(steps) <= step + 5
