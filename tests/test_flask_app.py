"""examples/flask_app through Flask's test client, and once through a real HTTP server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from werkzeug.serving import make_server

import agent_sessions as agent
from examples.flask_app.app import create_app
from stores import sqlite
from tests.model_server import ModelServer, Reply, openai


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
                                                        "stop_reason": "answered", "steps": 1}
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
