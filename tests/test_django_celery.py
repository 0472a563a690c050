"""In production with Django and Celery, from the wheel: every message answered, every approved call run,
with nothing scheduled by hand.

A Django project on PostgreSQL, as its developer writes it with nothing but the wheel (tests/wheel.py) and
the Celery docs' own setup (``proj/celery.py``: ``config_from_object`` and ``autodiscover_tasks``; no beat,
no beat schedule): the app ``agent_sessions.contrib.django`` with ``AGENT_SESSIONS["RESOLVE"]``, a support
agent with a non-idempotent tool and a tool needing approval. Every other setting is the library's default.
Two deployments of it, each a real process per worker:

- ``celery``: two Celery workers (prefork, two pool processes each) on the Redis at 127.0.0.1:6379 (every
  key under a prefix of this run's, its own queue name): callers send ``agent_sessions.contrib.celery.turn``;
- ``work``: no Celery; two ``manage.py agent_sessions work`` processes; callers hand their message over with
  ``Session.enqueue``.

Each caller is a process of its own that sends one message and waits for its answer in the store
(``Session.answer``), printing the time it took. Shown for each deployment: a whole worker SIGKILLed inside a
non-idempotent tool, never restarted (answered by another worker, the tool run once, the model told its
outcome is unknown); ten messages to one busy session from ten processes, two of them a web view's own
``Runner.turn`` that gives up at once (``lease_wait=0``: ``StillQueued``), all answered, each once, in
turns of their own; a call approved with ``manage.py agent_sessions approve``, run once, the turn answered.
The model is a scripted server in this process, over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url

from agent_sessions.testing.model_server import ModelServer, Reply, Request, openai
from tests import servers, wheel
from tests import test_django_wheel as wheel_project

LEASE_TTL = 10
"""The project's Spec.lease_ttl (30 by default): how long a dead worker's session stays blocked."""

SETTINGS = """\
import os

SECRET_KEY = "test-only"
INSTALLED_APPS = ["agent_sessions.contrib.django", "shop"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {name!r}, "USER": {user!r}, "HOST": {host!r},
    "PORT": {port!r}, "PASSWORD": {password!r},
}}}}
USE_TZ = True
LOGGING = {{"version": 1, "disable_existing_loggers": False,
           "handlers": {{"console": {{"class": "logging.StreamHandler"}}}},
           "loggers": {{"agent_sessions": {{"handlers": ["console"], "level": "INFO"}}}}}}

AGENT_SESSIONS = {{"RESOLVE": "shop.agent.resolve"}}

# Celery, as its Django guide has it; the prefix and the queue keep this test's keys apart on a shared Redis.
CELERY_BROKER_URL = os.environ["BROKER"]
CELERY_BROKER_TRANSPORT_OPTIONS = {{"global_keyprefix": os.environ["KEYPREFIX"]}}
CELERY_TASK_DEFAULT_QUEUE = os.environ["QUEUE"]
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
"""

CELERY_APP = """\
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

AGENT = """\
import os
import time
from pathlib import Path

from django.conf import settings

import agent_sessions as agent

STATE = Path(os.environ["STATE"])


@agent.tool(idempotent=False)
def file_ticket(title: str) -> str:
    \"\"\"File a ticket (a second call files a second one).

    Args:
        title: the ticket's title
    \"\"\"
    with open(STATE / "tickets.log", "a") as f:
        f.write(f"{os.getpid()} {title}\\n")
    if title.startswith("slow"):
        time.sleep(120)  # the test kills the worker here
    return f"filed: {title}"


@agent.tool(idempotent=False, needs_approval=True)
def issue_refund(order: str, amount: int) -> str:
    \"\"\"Refund an order; a person approves each refund first.

    Args:
        order: the order id
        amount: the amount
    \"\"\"
    with open(STATE / "refunds.log", "a") as f:
        f.write(f"{os.getpid()} {order} {amount}\\n")
    return f"refunded {amount} on {order}"


def resolve(info):
    spec = agent.Spec(name="support", tools=[file_ticket, issue_refund], lease_ttl=LEASE_TTL)
    return spec, agent.endpoints.OpenAIChat(os.environ["MODEL_URL"], "support-model")
"""

MANAGE = wheel_project.MANAGE.replace('"site_settings"', '"proj.settings"')

ASK = """\
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
import django

django.setup()
import agent_sessions as agent
from agent_sessions.contrib.django import store

how, session_id, key, text = sys.argv[1:5]
started = time.monotonic()
if how == "celery":  # a view hands the message to the turn task: stored, then sent
    from agent_sessions.contrib.celery import turn

    turn.delay(session_id, text, key)
elif how == "enqueue":  # a view hands it over to the sweep: manage.py agent_sessions work answers it
    agent.open(session_id, store()).enqueue(text, key)
else:  # "view": a view that runs the turn itself with the default lease_wait=0, giving up if the session is busy
    from shop.agent import resolve

    spec, endpoint = resolve(None)
    spec = dataclasses.replace(spec, session=agent.open(session_id, store()))
    try:
        agent.Runner().turn(spec, text, key, endpoint)
        how = "view: answered itself"
    except agent.StillQueued as e:
        how = f"view: gave up at once, StillQueued at position {e.position}"
answer = agent.open(session_id, store()).answer(key, timeout=float(os.environ.get("ASK_TIMEOUT", "150")))
print(json.dumps({"key": key, "how": how, "seconds": round(time.monotonic() - started, 2), "at": time.time(),
                  "answer": None if answer is None else answer.text}))
"""


class Model:
    """The scripted model: "file X" calls file_ticket(X), "refund ..." calls issue_refund, "hold" answers once
    the test sets ``hold`` (the session stays busy till then), anything else is answered in 0.2 s; a tool's
    result is answered by quoting it. Call ids are unique across the server's life, as a transcript needs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.asked: list[str] = []
        self.hold = threading.Event()
        """What a "hold" message's answer waits for (the test sets it)."""
        self.server = ModelServer(self.respond)

    def respond(self, request: Request) -> Reply:
        messages = request.json["messages"]
        last = messages[-1]
        if last["role"] == "tool":
            return openai(f"done: {last['content']}")
        text = last["content"] if isinstance(last["content"], str) else " ".join(p["text"] for p in last["content"])
        with self.lock:
            self.asked.append(text)
            self.calls += 1
            call = f"call_{self.calls}"
        if text.startswith("file "):
            return openai(calls=[(call, "file_ticket", json.dumps({"title": text[5:]}))])
        if text.startswith("refund"):
            return openai(calls=[(call, "issue_refund", json.dumps({"order": "1182", "amount": 80}))])
        if text.startswith("hold"):
            self.hold.wait(60)
        time.sleep(0.2)
        return openai(f"answer to: {text}")


class Project:
    """The project on disk, its database, and its processes (workers, callers), all under this run's names."""

    def __init__(self, home: Path, python: Path, model: Model, deployment: str) -> None:
        self.home, self.python, self.model, self.deployment = home, python, model, deployment
        self.state = home / "state"
        self.state.mkdir(parents=True)
        self.database = servers.database_name(f"djcel_{deployment}")
        tag = uuid.uuid4().hex[:8]
        self.keyprefix = f"{servers.REDIS_KEY_PREFIX}{tag}:"
        self.broker = "redis://127.0.0.1:6379/9"
        self.env = wheel.clean_env(STATE=str(self.state), MODEL_URL=model.server.url + "/v1", BROKER=self.broker,
                                   KEYPREFIX=self.keyprefix, QUEUE=f"{servers.PREFIX}_{tag}")
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        url = make_url(servers.database_url(servers.POSTGRES_URL, self.database))
        (home / "proj").mkdir()
        (home / "shop").mkdir()
        (home / "proj" / "__init__.py").write_text("from .celery import app as celery_app\n")
        (home / "proj" / "celery.py").write_text(CELERY_APP)
        (home / "proj" / "settings.py").write_text(SETTINGS.format(
            name=self.database, user=url.username or "", password=url.password or "", host=url.host or "",
            port=str(url.port or "")))
        (home / "shop" / "__init__.py").write_text("")
        (home / "shop" / "agent.py").write_text(AGENT.replace("LEASE_TTL)", f"{LEASE_TTL})"))
        (home / "manage.py").write_text(MANAGE)
        (home / "ask.py").write_text(ASK)
        self.manage("migrate", "--noinput")

    def manage(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        return wheel.run([str(self.python), "manage.py", *args], cwd=self.home, env=self.env, code=code, timeout=120)

    def start(self, name: str) -> subprocess.Popen[bytes]:
        """A worker: a Celery worker of two pool processes, or ``manage.py agent_sessions work``, in a process
        group of its own (a kill takes the whole worker), logging to state/<name>.log."""
        if self.deployment == "celery":
            cmd = [str(self.python), "-m", "celery", "-A", "proj", "worker", "-c", "2", "-P", "prefork",
                   "-n", f"{servers.PREFIX}-{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
                   "-l", "info"]
        else:
            cmd = [str(self.python), "manage.py", "agent_sessions", "work"]
        with open(self.state / f"{name}.log", "wb") as log:
            self.workers[name] = subprocess.Popen(cmd, cwd=self.home, env=self.env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True)
        return self.workers[name]

    def ready(self, name: str, timeout: float = 90) -> None:
        """Wait for a Celery worker to say it is ready (a work process is ready once it runs)."""
        if self.deployment != "celery":
            return
        self.wait(lambda: "ready." in (self.state / f"{name}.log").read_text(errors="replace"), f"{name} ready",
                  timeout)

    def ask(self, session: str, key: str, text: str, how: str | None = None) -> subprocess.Popen[str]:
        """A caller, in a process of its own: sends the message and waits for its answer in the store."""
        how = how or ("celery" if self.deployment == "celery" else "enqueue")
        return subprocess.Popen([str(self.python), "ask.py", how, session, key, text], cwd=self.home, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def answered(self, caller: subprocess.Popen[str], timeout: float = 180) -> dict[str, Any]:
        try:
            out, err = caller.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            caller.kill()
            out, err = caller.communicate()
        assert caller.returncode == 0, f"{err[-3000:]}\n{self.logs()}"
        said: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        assert said["answer"] is not None, f"{said} unanswered\n{self.logs()}"
        return said

    def wait(self, check: Any, what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        os.killpg(self.workers[name].pid, signal.SIGKILL)  # the whole worker: its main process and its pool
        self.workers[name].wait(15)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.state.glob("*.log"))

    def lines(self, log: str) -> list[list[str]]:
        path = self.state / log
        return [line.split(" ", 1) for line in path.read_text().splitlines()] if path.exists() else []

    def close(self) -> None:
        for worker in self.workers.values():
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:  # killed by the test already
                pass
            worker.wait(15)
        if self.deployment == "celery":
            import redis

            client = redis.Redis.from_url(self.broker, socket_timeout=10)
            keys = list(client.scan_iter(match=self.keyprefix + "*"))  # this test's keys, nobody else's
            if keys:
                client.delete(*keys)
            client.close()
        servers.drop_databases(servers.POSTGRES_URL, {self.database})


def _deployments() -> list[str]:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        redis = s.connect_ex(("127.0.0.1", 6379)) == 0
    return (["celery"] if redis else []) + ["work"]


@pytest.fixture(params=_deployments())
def project(request: pytest.FixtureRequest, wheel_python: Path, tmp_path: Path) -> Iterator[Project]:
    model = Model()
    made = Project(tmp_path, wheel_python, model, request.param)
    try:
        made.start("w1")
        made.start("w2")
        made.ready("w1")
        made.ready("w2")
        yield made
    finally:
        made.close()
        model.server.close()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _store(project: Project) -> Any:
    from sqlalchemy import create_engine

    from stores import postgres

    return postgres.Store(create_engine(servers.database_url(servers.POSTGRES_URL, project.database), pool_size=1))


def test_a_whole_worker_killed_inside_a_tool_is_answered_by_another_the_tool_run_once(project: Project) -> None:
    caller = project.ask("kill-1", "msg-1", "file slow: the expiry check")
    tickets = project.state / "tickets.log"
    project.wait(lambda: tickets.exists() and tickets.read_text().strip() != "", "the tool to start")
    [[pid, _]] = project.lines("tickets.log")
    running = int(pid)
    victim = next(name for name, p in project.workers.items()
                  if p.pid in (running, _parent(running)))  # the work process, or the Celery pool's worker
    killed_at = time.monotonic()
    project.kill(victim)  # never restarted
    said = project.answered(caller)
    since_kill = time.monotonic() - killed_at
    print(f"\n[{project.deployment}] whole worker {victim} SIGKILLed inside file_ticket: answered "
          f"{said['seconds']:.1f} s after the message was sent, {since_kill:.1f} s after the kill "
          f"(lease_ttl {LEASE_TTL} s)")
    assert project.lines("tickets.log") == [[pid, "slow: the expiry check\n".strip()]], "the tool ran again"
    store = _store(project)
    try:
        msgs = store.messages("kill-1")
        assert [m.key for m in msgs].count("msg-1") == 1 and msgs[-1].text == said["answer"]
        assert msgs[2].content[0].is_error and "outcome of this call is unknown" in msgs[2].content[0].text
        assert store.holder("kill-1") is None and store.queued("kill-1") == []
    finally:
        store.engine.dispose()
    survivor = next(name for name in project.workers if name != victim)
    assert "stranded turn finished" in (project.state / f"{survivor}.log").read_text(), project.logs()


def test_ten_messages_to_one_busy_session_from_ten_processes_are_each_answered_once(project: Project) -> None:
    """A long turn holds the session; ten processes then send a message each: eight through the deployment
    (the turn task, or enqueue), two as a web view's own Runner.turn with the default lease_wait=0, which
    gives up at once (StillQueued) with its message stored. Every message is answered, each by a turn of its
    own, each once: the model is asked once per message."""
    first = project.ask("busy-1", "msg-0", "hold the line")
    project.wait(lambda: "hold the line" in project.model.asked, "the long turn to start")
    hows = ["view" if i in (3, 7) else None for i in range(1, 11)]
    callers = [project.ask("busy-1", f"msg-{i}", f"question {i}", how) for i, how in zip(range(1, 11), hows,
                                                                                         strict=True)]
    store = _store(project)
    try:  # the long turn goes on once every message is stored: each of the ten arrived while it was busy
        project.wait(lambda: len(store.queued("busy-1")) == 10, "the ten messages to be stored")
    finally:
        project.model.hold.set()
        let_go = time.time()
        store.engine.dispose()
    said = [project.answered(c) for c in callers]
    said.insert(0, project.answered(first))
    for s in said:
        print(f"\n[{project.deployment}] {s['key']} ({s['how']}): answered {s['seconds']:.1f} s after it was sent, "
              f"{s['at'] - let_go:.1f} s after the long turn let go of the session")
    assert [s["answer"] for s in said] == ["answer to: hold the line", *(f"answer to: question {i}" for i in
                                                                         range(1, 11))]
    assert sorted(project.model.asked) == sorted(["hold the line", *(f"question {i}" for i in range(1, 11))])
    assert any(s["how"].startswith("view: gave up at once") for s in said), said
    store = _store(project)
    try:
        msgs = store.messages("busy-1")
        keys = [m.key for m in msgs if m.key]
        assert sorted(keys) == sorted(f"msg-{i}" for i in range(11)), keys  # each message once, in the transcript
        for key in keys:  # each followed by its own answer, before the next message
            at = next(i for i, m in enumerate(msgs) if m.key == key)
            assert msgs[at + 1].text == f"answer to: {msgs[at].text}", msgs[at:at + 2]
        assert store.queued("busy-1") == [] and store.holder("busy-1") is None
    finally:
        store.engine.dispose()


def test_a_call_approved_from_the_django_command_runs_once_and_the_turn_is_answered(project: Project) -> None:
    caller = project.ask("refund-1", "msg-1", "refund order 1182, 80 euros")
    store = _store(project)
    try:
        project.wait(lambda: bool(store.journal("refund-1")) and '"approvals"' in (store.journal("refund-1") or ""),
                     "the turn to ask for approval")
        listed = project.manage("agent_sessions", "approvals", "refund-1").stdout
        call = listed.split()[0]
        assert "issue_refund" in listed and not (project.state / "refunds.log").exists()
        approved_at = time.monotonic()
        out = project.manage("agent_sessions", "approve", "refund-1", call).stdout
        assert out.startswith(f"approved call {call} of session refund-1: once no call waits, the turn goes on")
        said = project.answered(caller)
        since = time.monotonic() - approved_at
        print(f"\n[{project.deployment}] call approved with manage.py agent_sessions approve: the turn answered "
              f"{since:.1f} s after the approval")
        assert project.lines("refunds.log") == [[project.lines("refunds.log")[0][0], "1182 80"]], "refunded twice"
        msgs = store.messages("refund-1")
        assert msgs[2].content[0].text == "refunded 80 on 1182" and msgs[-1].text == said["answer"]
        shown = project.manage("agent_sessions", "info", "refund-1").stdout
        assert "in flight: none" in shown and "approvals: 0 waiting" in shown and "queued:    0 waiting" in shown
    finally:
        store.engine.dispose()
