"""examples/celery_worker with real Celery worker processes: a steer lands in a running task, and a
worker killed mid-turn hands the task to another process, which resumes from the store without running
the non-idempotent tool again. Broker: kombu's SQLAlchemy transport on SQLite (no server), and Redis
when one is listening.

Isolation: the SQLite broker lives in the test's tmp_path; on Redis (shared by every copy of the suite
on the machine) each test's broker keys are under a prefix of its own, derived from
$AGENT_SESSIONS_TEST_PREFIX, and only those are deleted afterwards; workers are named after the prefix
too. Another copy's workers therefore never see this copy's tasks, nor it theirs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agent_sessions as agent
from stores import sqlite
from tests import servers
from tests.model_server import ModelServer, Reply, Request, openai

ROOT = Path(__file__).resolve().parents[1]


def _redis_listening() -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", 6379)) == 0


BROKERS = ["sqla+sqlite"] + (["redis"] if _redis_listening() else [])


class Workers:
    def __init__(self, state: Path, model: ModelServer, broker: str, keyprefix: str = "", backend: str = "") -> None:
        self.state = state
        self.broker = broker
        self.keyprefix = keyprefix
        """Every Redis key of this test's broker (and result backend) starts with it (empty for the SQLite broker)."""
        self.backend = backend
        """The result backend's URL, empty for none."""
        self.env = {**os.environ, "CELERY_EXAMPLE_STATE": str(state), "AGENT_MODEL_URL": model.url + "/v1",
                    "CELERY_BROKER_URL": broker, "CELERY_BROKER_KEYPREFIX": keyprefix, "CELERY_RESULT_BACKEND": backend,
                    "PYTHONPATH": str(ROOT)}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, app: str = "examples.celery_worker.tasks") -> subprocess.Popen[bytes]:
        with open(self.state / f"{name}.log", "wb") as log:  # the child has its own copy of the descriptor
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, "worker", "-c", "1",
                 "-P", "prefork", "-n", f"{servers.PREFIX}-{name}@%h", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-l", "info"], env=self.env, cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))  # a group of its own: see stop
        return self.procs[-1]

    def stop(self) -> None:
        for p in self.procs:
            # The tests wait for nothing in flight, so the worker and its pool go at once, as a group of their
            # own (a cold shutdown with SIGQUIT took 5 s on the SQLite broker)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is gone already (a test killed the whole worker)
                pass
        for p in self.procs:
            p.wait(15)  # SIGKILL cannot be refused: this only reaps it
        if self.keyprefix:
            import redis

            client = redis.Redis.from_url(self.broker, socket_timeout=10)
            keys = list(client.scan_iter(match=self.keyprefix + "*"))  # this test's keys, nobody else's
            if keys:
                client.delete(*keys)
            client.close()

    def logs(self) -> str:
        return "\n".join((self.state / f).read_text(errors="replace") for f in os.listdir(self.state)
                         if f.endswith(".log"))


@pytest.fixture(params=BROKERS)
def workers(request: pytest.FixtureRequest, tmp_path: Path, model: ModelServer) -> Iterator[Workers]:
    if request.param == "sqla+sqlite":
        w = Workers(tmp_path, model, f"sqla+sqlite:///{tmp_path}/broker.db")
        # The queue's row made before any process looks for it: kombu's SQLAlchemy transport makes it when
        # missing, by a SELECT then an INSERT, so a worker and the producer starting together both insert it
        # and one fails (UNIQUE constraint failed: kombu_queue.name).
        from kombu import Connection

        with Connection(w.broker) as connection:
            connection.SimpleQueue("celery").close()
    else:
        w = Workers(tmp_path, model, "redis://127.0.0.1:6379/9", f"{servers.REDIS_KEY_PREFIX}{uuid.uuid4().hex[:8]}:")
    yield w
    w.stop()


@pytest.fixture
def recipe(tmp_path: Path, model: ModelServer) -> Iterator[Workers]:
    """The documented crash-safe recipe on Redis, as broker and as result backend."""
    if "redis" not in BROKERS:
        pytest.skip("no Redis listening on 127.0.0.1:6379")
    url = "redis://127.0.0.1:6379/9"
    w = Workers(tmp_path, model, url, f"{servers.REDIS_KEY_PREFIX}{uuid.uuid4().hex[:8]}:", backend=url)
    yield w
    w.stop()


def producer(workers: Workers) -> Any:
    from celery import Celery

    app = Celery("producer", broker=workers.broker, backend=workers.backend or None)
    if workers.keyprefix:  # the workers' key prefix, or the task lands in a queue nobody of ours reads
        app.conf.broker_transport_options = {"global_keyprefix": workers.keyprefix}
        app.conf.result_backend_transport_options = {"global_keyprefix": workers.keyprefix}
    # The recipe's, as the workers': a task's error arrives pickled, whole (a result is read as it was written).
    app.conf.update(result_serializer="pickle", result_accept_content=["json", "pickle"])
    return app


def held(event: threading.Event, reply: Reply) -> Any:
    def answer(request: Request) -> Reply:
        assert event.wait(60)
        return reply
    return answer


def wait(check: Any, what: str, workers: Workers, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{workers.logs()[-3000:]}")
        time.sleep(0.05)


def answered(store: sqlite.Store, sid: str) -> bool:
    msgs = store.messages(sid)
    return bool(msgs) and msgs[-1].role is agent.Role.ASSISTANT and not msgs[-1].tool_calls


def test_a_steer_left_while_the_task_runs_lands_in_the_run(workers: Workers, model: ModelServer) -> None:
    workers.start("w1")
    store = sqlite.open(workers.state / "sessions.db")
    session = agent.open("celery-steer", store)
    session.steer("review lease.go")
    steered = threading.Event()
    model.push(held(steered, openai(calls=[("c1", "file_ticket", '{"title": "expiry uses <"}')])),
               openai("filed and checked"))
    producer(workers).send_task("run_turn", args=["celery-steer"])
    wait(lambda: len(model.requests) >= 1, "the task's first model request", workers)
    session.steer("and check the renewal path")
    steered.set()
    wait(lambda: answered(store, "celery-steer"), "the task's answer", workers)
    texts = [m.text for m in store.messages("celery-steer")]
    assert texts[0] == "review lease.go" and texts[3] == "and check the renewal path"
    assert model.requests[1].json["messages"][-1] == {"role": "user", "content": "and check the renewal path"}


def test_a_worker_killed_mid_turn_is_resumed_by_another_without_repeating_the_tool(
    workers: Workers, model: ModelServer
) -> None:
    workers.start("w1")
    workers.start("w2")
    store = sqlite.open(workers.state / "sessions.db")
    agent.open("celery-kill", store).steer("file the ticket")
    model.push(openai(calls=[("c1", "file_ticket", '{"title": "slow: expiry uses <"}')]), openai("done"))
    producer(workers).send_task("run_turn", args=["celery-kill"])
    tickets = workers.state / "tickets.log"
    wait(lambda: tickets.exists() and tickets.read_text().strip() != "", "the tool to start", workers)
    victim = int(tickets.read_text().split()[0])
    os.kill(victim, signal.SIGKILL)  # the pool process running the turn, mid-tool
    wait(lambda: answered(store, "celery-kill"), "another worker to finish the turn", workers)
    runs = [line.split() for line in (workers.state / "workers.log").read_text().splitlines()]
    pids = [int(pid) for pid, sid in runs if sid == "celery-kill"]
    assert len(pids) == 2 and pids[0] == victim and pids[1] != victim
    assert len(tickets.read_text().splitlines()) == 1, "the non-idempotent tool ran again"
    msgs = store.messages("celery-kill")
    assert agent.orphaned_tool_calls(msgs) == []
    assert msgs[2].content[0].is_error and "outcome of this call is unknown" in msgs[2].content[0].text
    assert msgs[-1].text == "done"


def test_a_task_redelivered_after_its_turn_finished_asks_the_model_nothing(
    workers: Workers, model: ModelServer
) -> None:
    """The worker's pool process dies after the turn, before the ack (tests/celery_dies_after_turn.py):
    the broker hands the task out again, and the repeat returns the stored answer with no request."""
    workers.start("w1", app="tests.celery_dies_after_turn")
    store = sqlite.open(workers.state / "sessions.db")
    model.push(openai(calls=[("c1", "file_ticket", '{"title": "expiry uses <"}')]), openai("filed it"))
    producer(workers).send_task("answer", args=["celery-redelivered", "file a ticket", "msg-41"])
    log = workers.state / "workers.log"
    wait(lambda: log.exists() and len(log.read_text().splitlines()) == 2, "the turn and its redelivery", workers)
    runs = [line.split() for line in log.read_text().splitlines()]
    died = int((workers.state / "died-once").read_text())
    assert [r[3] for r in runs] == ["steps=2", "steps=0"] and int(runs[0][0]) == died != int(runs[1][0])
    assert len(model.requests) == 2, "the redelivered task asked the model again"
    assert len((workers.state / "tickets.log").read_text().splitlines()) == 1
    msgs = store.messages("celery-redelivered")
    assert [m.key for m in msgs].count("msg-41") == 1 and msgs[-1].text == "filed it"
    assert agent.orphaned_tool_calls(msgs) == []


def test_a_turn_waiting_for_approval_is_finished_by_the_task_the_decision_enqueues(
    workers: Workers, model: ModelServer
) -> None:
    workers.start("w1")
    store = sqlite.open(workers.state / "sessions.db")
    sid = "celery-approval"
    model.push(openai(calls=[("c1", "issue_refund", '{"order": "1182", "amount": 80}')]), openai("refunded it"))
    producer(workers).send_task("answer", args=[sid, "refund order 1182", "msg-9"])
    session = agent.open(sid, store)
    wait(lambda: [p.call_id for p in session.pending_approvals()] == ["c1"], "the turn to wait for approval", workers)
    assert store.messages(sid) == [agent.Message.user("refund order 1182", key="msg-9")]
    refunds = workers.state / "refunds.log"
    assert not refunds.exists()
    producer(workers).send_task("decide", args=[sid, "c1", True])
    wait(lambda: answered(store, sid), "the decision's task to finish the turn", workers)
    assert len(refunds.read_text().splitlines()) == 1 and len(model.requests) == 2
    msgs = store.messages(sid)
    assert msgs[2].content[0].text == "refunded 80 on 1182" and msgs[-1].text == "refunded it"
    assert agent.orphaned_tool_calls(msgs) == []
    with pytest.raises(agent.UnknownApproval):
        session.approve("c1")  # the turn is closed


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("killed", ["pool process", "whole worker"])
def test_a_worker_killed_inside_a_tool_answers_the_turn_through_the_result_backend(
    recipe: Workers, model: ModelServer, killed: str
) -> None:
    """The documented recipe with nobody acting after the kill: a dead pool process's task is handed back
    at once (reject_on_worker_lost), a whole dead worker's after the Redis visibility timeout
    (tests/celery_recipe.py: 5 s). The next delivery's turn waits out the dead holder's lease, answers the
    started non-idempotent call with "outcome unknown" instead of running it again, and the caller's
    AsyncResult.get() has the answer."""
    workers = {"w1": recipe.start("w1", app="tests.celery_recipe")}
    if killed == "whole worker":
        workers["w2"] = recipe.start("w2", app="tests.celery_recipe")
    store = sqlite.open(recipe.state / "sessions.db")
    sid = f"celery-recipe-{killed.split()[0]}"
    model.push(openai(calls=[("c1", "file_ticket", '{"title": "slow: expiry uses <"}')]), openai("filed, maybe"))
    result = producer(recipe).send_task("answer", args=[sid, "file the ticket", "msg-7"])
    tickets = recipe.state / "tickets.log"
    wait(lambda: tickets.exists() and tickets.read_text().strip() != "", "the tool to start", recipe)
    victim = int(tickets.read_text().split()[0])
    main = _parent(victim)  # the worker whose pool process runs the tool
    assert main in {p.pid for p in workers.values()}
    if killed == "whole worker":
        os.kill(main, signal.SIGKILL)  # first the worker, so that it cannot hand the task back itself
    os.kill(victim, signal.SIGKILL)
    assert result.get(timeout=90) == {"session": sid, "answer": "filed, maybe", "stop_reason": "answered",
                                      "steps": 1, "pending": []}
    assert len(tickets.read_text().splitlines()) == 1, "the non-idempotent tool ran again"
    assert len(model.requests) == 2, "the answering delivery asked the model more than once"
    msgs = store.messages(sid)
    assert [m.key for m in msgs].count("msg-7") == 1 and msgs[-1].text == "filed, maybe"
    assert msgs[2].content[0].is_error and "outcome of this call is unknown" in msgs[2].content[0].text
    assert agent.orphaned_tool_calls(msgs) == []
    # A delivery that finished its turn logged it; one that came again meanwhile (the visibility timeout, set
    # low here, hands out a task still unacknowledged after 5 s) found the answer stored and asked nothing.
    runs = [line.split() for line in (recipe.state / "workers.log").read_text().splitlines()]
    answered_by = [int(pid) for pid, _, _, steps in runs if steps != "steps=0"]
    assert len(answered_by) == 1 and answered_by[0] != victim, runs
    alive = {p.pid for p in workers.values()} - ({main} if killed == "whole worker" else set())
    assert _parent(answered_by[0]) in alive
    logs = recipe.logs()  # the workers log at INFO: the turn said that it waited, and that it got the session
    assert "waiting up to 30 s for it (lease_wait)" in logs and "got the lease after waiting" in logs, logs[-3000:]


def test_session_busy_raised_in_a_task_is_caught_by_its_class_from_async_result_get(
    recipe: Workers, model: ModelServer
) -> None:
    """Another run keeps the session past the task's lease_wait: the task fails with SessionBusy, and the
    caller catches it from AsyncResult.get() by its own class, with the holder, through the result backend."""
    recipe.start("w1", app="tests.celery_recipe")
    store = sqlite.open(recipe.state / "sessions.db")
    held = store.acquire("celery-busy", agent.Holder("web-7", 4242, uuid.uuid4().hex, 0.0), 120)
    result = producer(recipe).send_task("answer_briefly", args=["celery-busy", "are you there?", "msg-1"])
    try:
        result.get(timeout=60)
    except agent.SessionBusy as e:
        assert e.holder == held
        assert "is held by pid 4242 on web-7" in str(e) and "Spec.lease_wait=0.5" in str(e)
    else:
        raise AssertionError("the task did not fail")
    assert store.messages("celery-busy") == [] and model.requests == []


def test_the_beat_task_recover_stranded_finishes_a_turn_whose_task_is_gone(
    workers: Workers, model: ModelServer
) -> None:
    """A turn's message is stored and its worker died with its task (the SQLAlchemy transport loses it):
    ``recover_stranded``, the example's beat task, finishes it once, by the spec its run recorded."""
    from agent_sessions.lease import claimant

    workers.start("w1")
    store = sqlite.open(workers.state / "sessions.db")
    holder = store.acquire("celery-stranded", agent.Holder("dead", 1, claimant().token, 0.0, spec="support"), 30)
    store.save_fenced("celery-stranded", holder, [agent.Message.user("file a ticket", key="msg-7")], take_steers=False)
    store.release("celery-stranded", holder)
    other = store.acquire("celery-not-ours", agent.Holder("dead", 1, claimant().token, 0.0, spec="billing"), 30)
    store.save_fenced("celery-not-ours", other, [agent.Message.user("not ours", key="m-1")], take_steers=False)
    store.release("celery-not-ours", other)
    model.push(openai("filed it"))
    producer(workers).send_task("recover_stranded", kwargs={"grace": 0})
    wait(lambda: answered(store, "celery-stranded"), "the sweep to answer the turn", workers)
    assert store.messages("celery-stranded")[-1].text == "filed it" and len(model.requests) == 1
    assert not answered(store, "celery-not-ours")
