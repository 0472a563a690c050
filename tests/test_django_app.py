"""examples/django_app: a view starts a turn, `manage.py steer` steers it, the store comes from Django's
own DATABASES; in-process (Django's test client, call_command) and as a real `runserver`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests import servers
from tests.model_server import ModelServer, Reply, Request, openai

ROOT = Path(__file__).resolve().parents[1]
MANAGE = ROOT / "examples" / "django_app" / "manage.py"


@pytest.fixture(scope="module")
def django_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("django")
    os.environ["DJANGO_APP_STATE"] = str(state)
    os.environ["DJANGO_SETTINGS_MODULE"] = "examples.django_app.project.settings"
    import django

    django.setup()
    yield state


WAIT = 60.0
"""Seconds a test waits for something another thread or process does in well under one: generous, so a
loaded machine (a manage.py process takes seconds to start beside a CPU-bound job) is not a failure."""


def steer_held_until(steered: threading.Event, reply: Reply) -> Any:
    """A model reply that waits until the test has steered: the steer must land in the next request."""
    def answer(request: Request) -> Reply:
        assert steered.wait(WAIT)
        return reply
    return answer


def wait_for_request(model: ModelServer) -> None:
    deadline = time.monotonic() + WAIT
    while not model.requests:
        assert time.monotonic() < deadline, "the run made no model request"
        time.sleep(0.01)


def wait_for_answer(get: Any, timeout: float = WAIT) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = get()
        if not state["running"] and state["messages"] and state["messages"][-1]["role"] == "assistant":
            return state  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"no answer within {timeout} s")


def test_a_view_starts_a_turn_and_the_management_command_steers_it(django_state: Path, model: ModelServer) -> None:
    from django.conf import settings
    from django.core.management import call_command
    from django.test import Client

    settings.AGENT_MODEL_URL = model.url + "/v1"
    steered = threading.Event()
    model.push(steer_held_until(steered, openai(calls=[("c1", "read_file", '{"path": "lease.go"}')])),
               openai("the expiry is compared with <, not <="))
    client = Client()
    started = client.post("/sessions/dj-1/turn", data=json.dumps({"text": "review lease.go"}),
                          content_type="application/json")
    assert started.status_code == 202
    wait_for_request(model)  # the run is inside its first request: the steer must wait for the next
    call_command("steer", "dj-1", "check the expiry, not the token")
    steered.set()
    state = wait_for_answer(lambda: client.get("/sessions/dj-1").json())
    texts = [m["content"][0].get("text", "") for m in state["messages"]]
    assert texts[0] == "review lease.go" and texts[-1] == "the expiry is compared with <, not <="
    assert texts[3] == "check the expiry, not the token"  # after the call and its result: where the run was
    assert model.requests[1].json["messages"][-1] == {"role": "user", "content": "check the expiry, not the token"}
    bad = client.post("/sessions/dj-1/turn", data="{", content_type="application/json")
    assert bad.status_code == 400 and "error" in bad.json()


def test_the_store_lives_in_djangos_own_database_file(django_state: Path) -> None:
    from examples.django_app.turns import agent as setup

    assert Path(setup.store().engine.url.database or "") == django_state / "django.sqlite3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STARTUP = 90.0
"""Seconds runserver gets to answer its first request: it imports Django and the project and runs its
system checks first, about a second on an idle machine, many more beside a CPU-bound job."""


class PortTaken(Exception):
    """runserver could not bind the port _free_port found: something took it in between."""


def wait_until_serving(server: subprocess.Popen[bytes], base: str, output: Path) -> None:
    """Poll until runserver answers any HTTP at all, for at most STARTUP seconds. While it starts, a
    request can be refused, reset, cut off or time out: each means "not yet". Fails at once if the process
    exits, and either way shows what it printed."""
    deadline = time.monotonic() + STARTUP
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            break
        try:
            requests.get(f"{base}/sessions/warmup", timeout=5)
            return
        except requests.RequestException as exc:  # ConnectionError, Timeout, ChunkedEncodingError, ...
            last = exc
            time.sleep(0.1)
    said = output.read_text(errors="replace")
    if server.poll() is not None and "already in use" in said:
        raise PortTaken(said)
    state = f"exited with {server.returncode}" if server.poll() is not None else f"not serving after {STARTUP} s"
    raise AssertionError(f"runserver {state} (last error: {last!r}); its output:\n{said[-5000:]}")


def runserver(env: dict[str, str], output: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A serving `manage.py runserver` and its base URL. Its port is found free, then bound by another
    process a second later: another program (a second copy of the suite) may take it in between, so a
    refused bind is tried again on another port, three times in all."""
    for _ in range(3):
        port = _free_port()
        with open(output, "wb") as log:  # a file, not a pipe nobody reads: its request log cannot fill it
            server = subprocess.Popen([sys.executable, str(MANAGE), "runserver", f"127.0.0.1:{port}", "--noreload"],
                                      env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(server, base, output)
            return server, base
        except PortTaken:
            stop(server)
        except BaseException:
            stop(server)
            raise
    raise AssertionError(f"runserver found each of three free ports taken; its output:\n{output.read_text()}")


def stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(10)  # SIGKILL cannot be refused: this only reaps it


def test_a_real_runserver_and_a_steer_from_another_process(tmp_path: Path, model: ModelServer) -> None:
    env = {**os.environ, "DJANGO_APP_STATE": str(tmp_path), "AGENT_MODEL_URL": model.url + "/v1",
           "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    steered = threading.Event()
    model.push(steer_held_until(steered, openai(calls=[("c1", "read_file", '{"path": "token.go"}')])),
               openai("done"))
    server, base = runserver(env, tmp_path / "runserver.log")
    try:
        assert requests.post(f"{base}/sessions/dj-real/turn", json={"text": "review token.go"},
                             timeout=30).status_code == 202
        wait_for_request(model)
        out = subprocess.run([sys.executable, str(MANAGE), "steer", "dj-real", "look at the renewal path"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "steered dj-real" in out.stdout, out.stderr
        steered.set()
        state = wait_for_answer(lambda: requests.get(f"{base}/sessions/dj-real", timeout=30).json())
        assert [m["content"][0].get("text") for m in state["messages"]][3] == "look at the renewal path"
        refused = subprocess.run([sys.executable, str(MANAGE), "steer", "dj-real", ""], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "must not be empty" in refused.stderr
    finally:
        stop(server)


def test_migrate_creates_the_store_tables_on_postgresql(tmp_path: Path) -> None:
    url = servers.database_url(servers.POSTGRES_URL, servers.database_name("django"))
    from sqlalchemy import create_engine

    engine = create_engine(url)
    with engine.begin() as conn:
        for table in ("agent_journals", "agent_runs", "agent_steers", "agent_messages", "agent_sessions",
                      "django_migrations"):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
    env = {**os.environ, "DJANGO_DB_URL": url.replace("postgresql+psycopg", "postgresql"),
           "DJANGO_APP_STATE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    for args in (["migrate", "--noinput"], ["steer", "dj-pg", "from a migrated database"]):
        out = subprocess.run([sys.executable, str(MANAGE), *args], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    from stores import postgres

    assert postgres.Store(engine).take_steers("dj-pg") == ["from a migrated database"]
    engine.dispose()
