"""A run that fails while its event log cannot be written still gives its lease back.

Found by the fault trials (seed 13): a run's events were put back after an append that went unanswered,
the run failed, and writing its ``failed`` event flushed those (older than the flush interval) once more;
that raised out of the run's way out before the lease's release, so the heartbeat went on renewing a lease
nobody used, and the resume the docs prescribe got SessionBusy for as long as the process lived."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

import agent_sessions as agent
from agent_sessions.run.publisher import FLUSH_SECONDS
from stores import memory
from tests.model_server import ModelServer, Reply, openai


class EventsDown(memory.Store):
    """The memory store, whose event writes fail (their answer lost) once ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()

    def append_events(self, session: str, holder: agent.Holder, events: Sequence[str], *, keep: int) -> int:
        if self.down.is_set():
            raise agent.OutcomeUnknown(f"append_events of session {session!r} may have happened (test)")
        return super().append_events(session, holder, events, keep=keep)

    def save_fenced_events(
        self, session: str, holder: agent.Holder, msgs: Sequence[agent.Message], *, take_steers: bool,
        replace: bool = False, events: Sequence[str], keep: int, closes: bool = False,
    ) -> agent.Saved:
        if self.down.is_set():
            raise agent.OutcomeUnknown(f"save of session {session!r} may have happened (test)")
        return super().save_fenced_events(session, holder, msgs, take_steers=take_steers, replace=replace,
                                          events=events, keep=keep, closes=closes)


def test_a_run_failing_with_its_events_unwritten_releases_its_lease(model: ModelServer) -> None:
    store = EventsDown()

    @agent.tool
    def slow(key: str) -> str:
        """Look something up, slowly: the store goes down meanwhile."""
        store.down.set()
        time.sleep(FLUSH_SECONDS * 3)  # what the run buffers grows older than the flush interval
        return f"found {key}"

    model.push(openai(calls=[("c1", "slow", '{"key": "k"}')]), Reply({"error": {"message": "down"}}, status=503))
    spec = agent.Spec(session=agent.open("s1", store), tools=[slow], publish_events=True, lease_ttl=30)
    endpoint = agent.endpoints.OpenAIChat(model.url + "/v1", "m", max_retries=0)
    # The run fails: at the flush before its second request (OutcomeUnknown), or at that request (503).
    with pytest.raises((agent.OutcomeUnknown, agent.EndpointError)):
        agent.Runner().run(spec, [agent.Message.user("look k up")], endpoint)

    assert store.holder("s1") is None  # released: not left to a heartbeat that renews it
    assert not [t for t in threading.enumerate() if t.name == "agent-lease"]
    store.down.clear()
    model._script.clear()
    model.push(openai("done"))
    again = agent.Spec(session=agent.open("s1", store), tools=[slow], publish_events=True, lease_wait=0)
    result = agent.Runner().turn(again, "and now?", "k2", endpoint)
    assert result.stop_reason == "answered"
