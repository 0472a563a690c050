"""What a run logs (issue 28): at INFO its start, its end and a failure with its cause; at DEBUG each
model request, reply and tool call, by names and sizes, never what the messages or the tools said. Real
runs over HTTP (OpenAIChat against tests.model_server) on a SQLite store, read with caplog."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import agent_sessions as agent
from agent_sessions.events import Finished
from stores import sqlite
from tests.model_server import ModelServer, Reply, openai

SECRET = "the-password-is-swordfish"
"""Said by the user, passed to a tool and returned by it: no log line may hold it."""
LOGGER = "agent_sessions.run.react"


@agent.tool
def lookup(order: str) -> str:
    """Look an order up."""
    return f"order {order}: delivered, note {SECRET}"


def run_once(tmp_path: Path, model: ModelServer, *replies: Reply) -> tuple[agent.Result | None, BaseException | None]:
    model.push(*replies)
    store = sqlite.open(tmp_path / "sessions.db")
    try:
        spec = agent.Spec(session=agent.open("log-1", store), tools=[lookup])
        endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
        try:
            return agent.Runner().run(spec, [agent.Message.user(f"where is my order? {SECRET}")], endpoint), None
        except agent.AgentError as exc:
            return None, exc
    finally:
        store.close()


def test_info_says_when_a_run_starts_and_ends_and_debug_each_step_without_contents(
        tmp_path: Path, model: ModelServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="agent_sessions")
    result, error = run_once(tmp_path, model,
                             openai(calls=[("c1", "lookup", '{"order": "' + SECRET + '"}')],
                                    usage={"prompt_tokens": 30, "completion_tokens": 5}),
                             openai(f"It was delivered ({SECRET}).",
                                    usage={"prompt_tokens": 50, "completion_tokens": 7}))
    assert error is None and result is not None and result.stop_reason == "answered"
    mine = [r for r in caplog.records if r.name == LOGGER]
    info = [r.getMessage() for r in mine if r.levelno == logging.INFO]
    assert len(info) == 2, info
    assert info[0] == "run of session 'log-1' starts: new, epoch 1, 1 messages, max_steps 8, tools ['lookup']"
    assert info[1].startswith("run of session 'log-1' ended: answered after 2 steps in ")
    assert "tokens {'prompt_tokens': 80, 'completion_tokens': 12}, 4 messages" in info[1]
    debug = [r.getMessage() for r in mine if r.levelno == logging.DEBUG]
    assert debug == [
        "session 'log-1' step 1: model request with 1 messages",
        "session 'log-1' step 1: model replied 0 chars of text, tool calls ['lookup'], usage "
        "{'prompt_tokens': 30, 'completion_tokens': 5}",
        f"session 'log-1' step 1: tool lookup [c1] called with {len(SECRET) + 13} chars of arguments",
        f"session 'log-1' step 1: tool lookup [c1] returned {len(lookup.fn(SECRET))} chars",
        "session 'log-1' step 2: model request with 3 messages",
        f"session 'log-1' step 2: model replied {len(result.text)} chars of text, tool calls [], usage "
        "{'prompt_tokens': 50, 'completion_tokens': 7}",
    ], debug
    everything = "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET not in everything, everything


def test_a_failure_is_logged_at_info_with_its_cause(tmp_path: Path, model: ModelServer,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent_sessions")
    result, error = run_once(tmp_path, model, Reply({"error": {"message": "invalid api key"}}, status=401))
    assert result is None and isinstance(error, agent.EndpointError)
    [failed] = [r.getMessage() for r in caplog.records if r.name == LOGGER and "failed" in r.getMessage()]
    assert failed.startswith("run of session 'log-1' failed after "), failed
    assert type(error).__name__ in failed and "401" in failed and "invalid api key" in failed, failed
    assert not [r for r in caplog.records if r.levelno < logging.INFO]  # DEBUG was not asked for


def test_an_events_repr_does_not_print_the_transcript(tmp_path: Path, model: ModelServer) -> None:
    seen: list[object] = []
    model.push(openai("done " + "x" * 5000))
    store = sqlite.open(tmp_path / "sessions.db")
    spec = agent.Spec(session=agent.open("log-2", store))
    msgs = [agent.Message.user(f"message {i} {SECRET}") for i in range(50)]
    agent.Runner().run(spec, msgs, agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0), seen.append)
    store.close()
    [finished] = [e for e in seen if isinstance(e, Finished)]
    text = repr(finished)
    assert SECRET not in text and "x" * 100 not in text and len(text) < 300, text
    assert "stop_reason='answered'" in text and "messages=<51>" in text and "text=<5005 chars>" in text


def test_the_library_logs_nothing_unless_the_application_configures_logging(tmp_path: Path,
                                                                             model: ModelServer) -> None:
    """No handler of the application's: Python's last resort would print WARNING and above to stderr;
    the library's NullHandler keeps even a failed run's lines off it."""
    model.push(Reply({"error": {"message": "invalid api key"}}, status=401))
    code = ("import agent_sessions as agent, sys\n"
            "from stores import memory\n"
            "spec = agent.Spec(session=agent.open('s', memory.Store()))\n"
            f"endpoint = agent.endpoints.OpenAIChat({model.url + '/v1'!r}, 'm', max_retries=0)\n"
            "try:\n    agent.Runner().run(spec, [agent.Message.user('hi')], endpoint)\n"
            "except agent.EndpointError:\n    print('failed as expected')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert (done.returncode, done.stdout, done.stderr) == (0, "failed as expected\n", "")
