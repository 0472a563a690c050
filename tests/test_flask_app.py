"""examples/flask_app through Flask's test client, and once through a real HTTP server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from werkzeug.serving import make_server

import agent_sessions as agent
from examples.flask_app import app as flask_example
from examples.flask_app.app import create_app
from stores import memory, sqlite
from tests.four_method_store import FourMethodStore
from tests.model_server import ModelServer, Reply, openai
from tests.sse_client import TURN_KINDS, check_event, sse


@pytest.fixture
def store(tmp_path: Path) -> sqlite.Store:
    return sqlite.open(tmp_path / "flask.db")


def endpoint(model: ModelServer) -> agent.endpoints.OpenAIChat:
    return agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)


def test_a_steer_left_over_http_joins_the_next_turn(model: ModelServer, store: sqlite.Store) -> None:
    client = create_app(store, endpoint(model)).test_client()
    assert client.post("/sessions/s1/steer", json={"text": "answer in French"}).status_code == 202
    model.push(openai("bonjour"))
    reply = client.post("/sessions/s1/messages", json={"text": "say hello"})
    assert reply.status_code == 200 and reply.json == {"session": "s1", "answer": "bonjour",
                                                        "stop_reason": "answered", "steps": 1, "approvals": []}
    sent = [m["content"] for m in model.requests[0].json["messages"]]
    assert sent == ["say hello", "answer in French"]
    model.push(openai("again"))
    assert client.post("/sessions/s1/messages", json={"text": "once more"}).json["answer"] == "again"
    assert [m["content"] for m in model.requests[1].json["messages"]][-2:] == ["bonjour", "once more"]


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/sessions/s1/steer", None, 400, '"text"'),
    ("/sessions/s1/steer", {"text": 5}, 400, '"text"'),
    ("/sessions/s1/steer", {"text": ""}, 400, "must not be empty"),
    ("/sessions/s1/steer", {"text": "nul \x00"}, 400, "NUL"),
    ("/sessions/" + "x" * 300 + "/steer", {"text": "hi"}, 400, "at most 255"),
    ("/sessions/s1/messages", {"txt": "typo"}, 400, '"text"'),
])
def test_bad_input_is_a_json_400_never_a_traceback(model: ModelServer, store: sqlite.Store, path: str,
                                                    body: object, status: int, says: str) -> None:
    client = create_app(store, endpoint(model)).test_client()
    reply = client.post(path, json=body) if body is not None else client.post(path, data="not json")
    assert reply.status_code == status
    assert says in reply.json["error"] and "Traceback" not in reply.get_data(as_text=True)


def test_a_failing_model_is_a_502_and_an_unknown_route_a_json_404(model: ModelServer, store: sqlite.Store) -> None:
    client = create_app(store, endpoint(model)).test_client()
    model.push(Reply({"error": {"message": "model overloaded"}}, 503))
    reply = client.post("/sessions/s2/messages", json={"text": "hi"})
    assert reply.status_code == 502 and "model overloaded" in reply.json["error"]
    assert client.get("/nowhere").status_code == 404 and "error" in client.get("/nowhere").json


def test_a_turn_while_another_runs_is_a_409_and_a_broken_store_a_503(model: ModelServer, store: sqlite.Store,
                                                                    tmp_path: Path) -> None:
    client = create_app(store, endpoint(model)).test_client()
    entered, go = threading.Event(), threading.Event()
    model.push(lambda req: (entered.set(), go.wait(10), openai("first"))[2])
    first = threading.Thread(target=lambda: client.post("/sessions/s3/messages", json={"text": "one"}))
    first.start()
    try:
        assert entered.wait(10)
        reply = create_app(store, endpoint(model)).test_client().post("/sessions/s3/messages", json={"text": "two"})
        assert reply.status_code == 409 and reply.json["conflict"] == "SessionBusy"
        assert "held by" in reply.json["error"]
    finally:
        go.set()
        first.join(10)
    assert [m.text for m in store.messages("s3")] == ["one", "first"]
    broken = sqlite.open(tmp_path / "broken.db")
    with broken.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE agent_sessions")
    reply = create_app(broken, endpoint(model)).test_client().post("/sessions/s4/messages", json={"text": "hi"})
    assert reply.status_code == 503 and "agent_sessions" in reply.json["error"]


def test_lease_lost_and_transcript_conflict_are_conflicts_not_store_errors() -> None:
    for kind in (agent.LeaseLost, agent.TranscriptConflict, agent.SessionBusy):
        assert issubclass(kind, agent.Conflict) and not issubclass(kind, agent.StoreError)


@pytest.fixture
def served(model: ModelServer, store: sqlite.Store) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, create_app(store, endpoint(model)), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_over_a_real_http_server(model: ModelServer, served: str) -> None:
    assert requests.post(f"{served}/sessions/real/steer", json={"text": "be brief"}, timeout=5).status_code == 202
    model.push(openai("brief"))
    reply = requests.post(f"{served}/sessions/real/messages", json={"text": "explain leases"}, timeout=10)
    assert reply.status_code == 200 and reply.json()["answer"] == "brief"
    bad = requests.post(f"{served}/sessions/real/steer", data=b"{", headers={"content-type": "application/json"},
                        timeout=5)
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/json"
    transcript = requests.get(f"{served}/sessions/real", timeout=5).json()["messages"]
    assert [m["content"][0]["text"] for m in transcript] == ["explain leases", "be brief", "brief"]


# -- the event stream: server-sent events, from any replica --------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
REFUND = [("call_1", "refund", '{"order": "7", "amount": 5}')]


@pytest.fixture
def refunds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(flask_example, "REFUNDS", str(tmp_path / "refunds.log"))
    return tmp_path / "refunds.log"


def test_events_stream_as_sse_from_last_event_id(model: ModelServer, refunds: Path) -> None:
    store = memory.Store()
    client = create_app(store, endpoint(model)).test_client()
    model.push(openai(calls=REFUND), openai("refunded"))
    assert client.post("/sessions/e1/messages", json={"text": "refund order 7"}).json["answer"] == "refunded"
    reply = client.get("/sessions/e1/events")
    assert reply.status_code == 200 and reply.mimetype == "text/event-stream"
    assert reply.headers["Cache-Control"] == "no-cache"
    blocks = list(sse(reply.get_data(as_text=True).split("\n")))
    assert blocks[0] == {"retry": str(flask_example.SSE_RETRY_MS)}
    events = [check_event(b) for b in blocks[1:]]
    assert [e["kind"] for e in events] == TURN_KINDS
    assert [e["seq"] for e in events] == [e.seq for e in agent.open("e1", store).events()]
    assert events[-1]["data"]["stop_reason"] == "answered" and events[-1]["data"]["text"] == "refunded"
    rest = client.get("/sessions/e1/events", headers={"Last-Event-ID": str(events[3]["seq"])})
    assert [check_event(b)["seq"] for b in sse(rest.get_data(as_text=True).split("\n")) if "id" in b] == [
        e["seq"] for e in events[4:]]
    last = client.get(f"/sessions/e1/events?after={events[5]['seq']}")
    assert [b.get("event") for b in sse(last.get_data(as_text=True).split("\n"))] == [None, "finished"]
    bad = client.get("/sessions/e1/events", headers={"Last-Event-ID": "seven"})
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json["error"]
    assert client.get("/sessions/e1/events?after=-1").status_code == 400



HOSTILE_SEQS = [str(2**63), str(2**64), "9" * 5000, "1" + "0" * 30]
"""Seqs out of a store's range (it keeps them as signed 64-bit ints), and more digits than int() reads."""


@pytest.mark.parametrize("seen", HOSTILE_SEQS, ids=["2**63", "2**64", "5000 digits", "1e30"])
def test_a_seq_beyond_the_largest_is_a_400_before_the_stream_starts(model: ModelServer, store: sqlite.Store,
                                                                   seen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flask_example, "SSE_SECONDS", 0.2)
    client = create_app(store, endpoint(model)).test_client()
    for reply in (client.get("/sessions/e1/events", headers={"Last-Event-ID": seen}),
                  client.get(f"/sessions/e1/events?after={seen}")):
        assert reply.status_code == 400 and reply.mimetype == "application/json"
        assert "Last-Event-ID and ?after=" in reply.json["error"] and str(2**63 - 1) in reply.json["error"]
    largest = client.get("/sessions/e1/events", headers={"Last-Event-ID": str(2**63 - 1)})
    assert largest.status_code == 200 and largest.mimetype == "text/event-stream"
    assert list(sse(largest.get_data(as_text=True).split("\n"))) == [{"retry": str(flask_example.SSE_RETRY_MS)}]


def test_a_store_without_event_logs_answers_501(model: ModelServer) -> None:
    store = FourMethodStore()
    assert isinstance(store, agent.Store) and not isinstance(store, agent.EventStore)
    reply = create_app(store, endpoint(model)).test_client().get("/sessions/s1/events")
    assert reply.status_code == 501 and "EventStore" in reply.json["error"]


def follow_the_turn(replicas: list[str], post: Callable[[], object], model: ModelServer) -> list[dict[str, Any]]:
    """A browser follows a turn posted to ``replicas[0]`` through ``replicas[1]``, is cut off once the
    tool has run (while the model is still answering), and reconnects to ``replicas[2]`` with
    ``Last-Event-ID``. The events it got, in the order it got them."""
    cut = threading.Event()
    model.push(openai(calls=REFUND), lambda req: (cut.wait(30), openai("refunded"))[1])
    got: list[dict[str, Any]] = []
    with requests.get(f"{replicas[1]}/sessions/live/events", stream=True, timeout=30) as first:
        assert first.status_code == 200 and first.headers["content-type"].startswith("text/event-stream")
        turn = threading.Thread(target=post)
        turn.start()
        for block in sse(first.iter_lines(decode_unicode=True)):
            if "id" in block:
                got.append(check_event(block))
                if block["event"] == "tool_finished":
                    break  # the connection drops mid-run
    cut.set()
    again = requests.get(f"{replicas[2]}/sessions/live/events", headers={"Last-Event-ID": str(got[-1]["seq"])},
                         stream=True, timeout=30)
    with again:
        for block in sse(again.iter_lines(decode_unicode=True)):
            if "id" in block:
                got.append(check_event(block))
    turn.join(30)
    return got


def test_a_browser_follows_a_run_on_another_replica_and_reconnects_to_a_third(model: ModelServer,
                                                                             refunds: Path) -> None:
    """Three replicas in this process sharing one memory store: the run on A, the browser on B, then C."""
    store = memory.Store()
    servers = [make_server("127.0.0.1", 0, create_app(store, endpoint(model)), threaded=True) for _ in range(3)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{s.server_port}" for s in servers]
        answers: list[Any] = []
        got = follow_the_turn(urls, lambda: answers.append(requests.post(
            f"{urls[0]}/sessions/live/messages", json={"text": "refund order 7"}, timeout=60).json()), model)
    finally:
        for server in servers:
            server.shutdown()
    assert answers == [{"session": "live", "answer": "refunded", "stop_reason": "answered", "steps": 2,
                        "approvals": []}]
    assert [e["kind"] for e in got] == TURN_KINDS
    assert [e["seq"] for e in got] == [e.seq for e in agent.open("live", store).events()]  # each once, in order


REPLICA = """
import sys
from werkzeug.serving import make_server
import agent_sessions as agent
from examples.flask_app import app as flask_example
from examples.flask_app.app import create_app
from stores import memory, sqlite

app = create_app(sqlite.open(sys.argv[1]), agent.endpoints.OpenAIChat(sys.argv[2], "m", max_retries=0))
server = make_server("127.0.0.1", 0, app, threaded=True)
print(server.server_port, flush=True)
server.serve_forever()
"""


def test_a_browser_follows_a_run_across_three_server_processes(model: ModelServer, tmp_path: Path) -> None:
    """The same story with each replica its own process over one SQLite file: the run on process A, the
    browser on B, cut off mid-run, then reconnected to C with Last-Event-ID."""
    db = tmp_path / "sessions.db"
    sqlite.open(db).close()  # the tables exist before three processes open the file at once
    env = {**os.environ, "REFUNDS_LOG": str(tmp_path / "refunds.log"), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", REPLICA, str(db), model.url + "/v1"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        urls = []
        for proc in procs:
            assert proc.stdout is not None
            urls.append(f"http://127.0.0.1:{int(proc.stdout.readline())}")
        answers: list[Any] = []
        got = follow_the_turn(urls, lambda: answers.append(requests.post(
            f"{urls[0]}/sessions/live/messages", json={"text": "refund order 7"}, timeout=60).json()), model)
        assert answers and answers[0]["answer"] == "refunded"
        assert [e["kind"] for e in got] == TURN_KINDS
        stored = [e.seq for e in agent.open("live", sqlite.open(db)).events()]
        assert [e["seq"] for e in got] == stored  # every event exactly once, in order
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_a_refund_waits_for_a_decision_taken_once_over_http(model: ModelServer, store: sqlite.Store,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import examples.flask_app.app as example

    monkeypatch.setattr(example, "REFUNDS", str(tmp_path / "refunds.log"))
    client = create_app(store, endpoint(model)).test_client()
    model.push(openai(calls=[("r1", "refund", '{"order": "1182", "amount": 80}')]))
    waiting = client.post("/sessions/a1/messages", json={"text": "refund order 1182"})
    assert waiting.status_code == 200 and waiting.json["stop_reason"] == "awaiting_approval"
    assert [a["call_id"] for a in waiting.json["approvals"]] == ["r1"]
    listed = client.get("/sessions/a1/approvals").json["approvals"]
    assert [(a["call_id"], a["tool"], a["arguments"]) for a in listed] == [
        ("r1", "refund", '{"order": "1182", "amount": 80}')]
    assert not (tmp_path / "refunds.log").exists()
    busy = client.post("/sessions/a1/messages", json={"text": "and my balance?"})
    assert busy.status_code == 409 and busy.json["conflict"] == "AwaitingApproval"
    assert client.post("/sessions/a1/approvals/r1", json={"decision": "maybe"}).status_code == 400
    assert client.post("/sessions/a1/approvals/nope", json={"decision": "approve"}).status_code == 404
    model.push(openai("refunded"))
    done = client.post("/sessions/a1/approvals/r1", json={"decision": "approve"})
    assert done.status_code == 200 and done.json["stop_reason"] == "answered" and done.json["answer"] == "refunded"
    assert (tmp_path / "refunds.log").read_text() == "1182 80\n"
    again = client.post("/sessions/a1/approvals/r1", json={"decision": "deny", "reason": "late"})
    assert again.status_code == 404  # its turn is closed: no call r1 waits any more
    assert client.get("/sessions/a1/approvals").json["approvals"] == []
