"""The EventStore contract: a session's event log. Numbers are consecutive and only grow; every append is
fenced by the run's lease; the cap keeps the newest; the log goes with its session; concurrent appends
never share a number; a run with ``publish_events`` publishes the documented kinds in order, each once;
and a follower in another thread sees a live run's events in order, and after reconnecting with the last
number it saw misses nothing and sees nothing twice.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import EventStore, Holder, Message, StoredEvent
from agent_sessions.eventlog import decode, encode

from .capabilities import Capability
from .crossprocess import wait_for
from .scripted import Answer, ToolsThenAnswer


def _sid(tag: str = "") -> str:
    return f"storetest-events-{tag}{uuid.uuid4().hex}"


def _claimant() -> Holder:
    return Holder("storetest", 4321, uuid.uuid4().hex, 0.0)


def _texts(n: int, tag: str = "") -> list[str]:
    return [encode("note", {"n": i, "tag": tag, "ünï": "😀 \"q\" \\ \x00"}) for i in range(n)]


def _consecutive(events: Sequence[StoredEvent]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"not consecutive: {seqs}"


def _grep(n: int) -> str:
    """Look something up."""
    return f"found {n}"


GREP = agent.tool(name="grep")(_grep)

RUN_KINDS = [
    "step_started", "steer_applied", "model_response", "tool_called", "tool_finished", "tool_called",
    "tool_finished", "step_started", "model_response", "finished",
]
"""A run with a waiting steer and a reply calling two tools, then an answer (ToolsThenAnswer)."""


class EventContract:
    """Mixed into StoreContract; ``make_store``, ``requires`` and ``another`` come from there."""

    capabilities: frozenset[Capability]

    def make_store(self) -> Any:
        raise NotImplementedError

    def requires(self, capability: Capability) -> None:
        raise NotImplementedError

    def another(self, store: Any) -> Any:
        raise NotImplementedError

    def event_store(self) -> EventStore:
        self.requires(Capability.EVENTS)
        store = self.make_store()
        if not isinstance(store, EventStore):
            pytest.fail(f"the store declares Capability.EVENTS, but {type(store).__name__} does not implement "
                        "agent_sessions.EventStore (append_events, save_fenced_events, events)")
        return store

    # -- the log ---------------------------------------------------------------------------------------

    def test_appends_get_consecutive_growing_numbers_and_read_back_verbatim(self) -> None:
        store = self.event_store()
        sid = _sid()
        assert store.events(sid, 0, 100) == []
        holder = store.acquire(sid, _claimant(), 30)
        first = _texts(3, "a")
        last = store.append_events(sid, holder, first, keep=100)
        got = store.events(sid, 0, 100)
        assert [e.seq for e in got][-1] == last and len(got) == 3 and got[0].seq >= 1
        assert got == [decode(e.seq, text) for e, text in zip(got, first, strict=True)]
        assert got[0].kind == "note" and got[0].data["ünï"] == "😀 \"q\" \\ \x00" and got[0].at.tzinfo is not None
        later = self.another(store).append_events(sid, holder, _texts(2, "b"), keep=100)
        assert later == last + 2
        every = store.events(sid, 0, 100)
        _consecutive(every)
        assert [e.data["tag"] for e in every] == ["a", "a", "a", "b", "b"]
        assert store.events(sid, last, 100) == every[3:]
        assert store.events(sid, 0, 2) == every[:2] and store.events(sid, later, 100) == []

    @pytest.mark.parametrize(("after", "limit"), [(-1, 10), (0, 0), (0, 1001), ("1", 10), (True, 10), (0, 2.5)])
    def test_bad_reads_are_refused(self, after: Any, limit: Any) -> None:
        store = self.event_store()
        with pytest.raises(agent.ArgumentError):
            store.events(_sid(), after, limit)

    def test_a_superseded_holder_appends_nothing(self) -> None:
        store = self.event_store()
        sid = _sid("fence-")
        a = store.acquire(sid, _claimant(), 0.2)
        store.save_fenced(sid, a, [Message.user("q")], take_steers=False)
        store.append_events(sid, a, _texts(1, "a"), keep=100)
        wait_for(lambda: store.holder(sid) is None, "the lease to expire on the store's clock")
        b = self.another(store).acquire(sid, _claimant(), 30)
        before = store.events(sid, 0, 100), store.messages(sid)
        with pytest.raises(agent.LeaseLost):
            store.append_events(sid, a, _texts(2, "late"), keep=100)
        with pytest.raises(agent.LeaseLost):
            store.save_fenced_events(sid, a, [Message.user("q"), Message.assistant("late")], take_steers=False,
                                     events=_texts(1, "late"), keep=100)
        assert (store.events(sid, 0, 100), store.messages(sid)) == before
        store.append_events(sid, b, _texts(1, "b"), keep=100)
        every = store.events(sid, 0, 100)
        _consecutive(every)
        assert [e.data["tag"] for e in every] == ["a", "b"]

    def test_events_ride_in_a_save_atomically(self) -> None:
        store = self.event_store()
        sid = _sid("ride-")
        holder = store.acquire(sid, _claimant(), 30)
        store.add_steer(sid, "steer")
        saved = store.save_fenced_events(sid, holder, [Message.user("q")], take_steers=True, events=_texts(2, "s"),
                                         keep=100)
        assert saved.steers == ["steer"] and store.messages(sid) == [Message.user("q"), Message.user("steer")]
        assert [e.data["tag"] for e in store.events(sid, 0, 100)] == ["s", "s"]
        # nothing new to save: the events are appended all the same
        store.save_fenced_events(sid, holder, store.messages(sid), take_steers=False, events=_texts(1, "t"), keep=100)
        # no events: a plain fenced save
        store.save_fenced_events(sid, holder, [*store.messages(sid), Message.assistant("a")], take_steers=False,
                                 events=[], keep=100)
        assert len(store.messages(sid)) == 3
        with pytest.raises(agent.TranscriptConflict):
            store.save_fenced_events(sid, holder, [Message.user("other")], take_steers=False, events=_texts(1, "x"),
                                     keep=100)
        every = store.events(sid, 0, 100)
        _consecutive(every)
        assert [e.data["tag"] for e in every] == ["s", "s", "t"]

    def test_the_cap_keeps_the_newest_and_numbers_go_on(self) -> None:
        store = self.event_store()
        sid = _sid("cap-")
        holder = store.acquire(sid, _claimant(), 30)
        first = store.append_events(sid, holder, _texts(3), keep=5)
        last = store.append_events(sid, holder, _texts(4), keep=5)
        kept = store.events(sid, 0, 100)
        assert [e.seq for e in kept] == list(range(last - 4, last + 1)) and last == first + 4
        store.save_fenced_events(sid, holder, [Message.user("q")], take_steers=False, events=_texts(2), keep=3)
        assert [e.seq for e in store.events(sid, 0, 100)] == [last - 0, last + 1, last + 2]

    def test_the_log_goes_with_its_session_and_a_new_one_numbers_above_it(self) -> None:
        self.requires(Capability.LIFECYCLE)
        store = self.event_store()
        sid = _sid("delete-")
        holder = store.acquire(sid, _claimant(), 30)
        old = store.append_events(sid, holder, _texts(5), keep=100)
        assert agent.open(sid, store).delete(force=True) is True
        assert store.events(sid, 0, 100) == []
        with pytest.raises(agent.LeaseLost):
            store.append_events(sid, holder, _texts(1), keep=100)  # its lease went with the session
        again = store.acquire(sid, _claimant(), 30)
        new = store.append_events(sid, again, _texts(1, "new"), keep=100)
        assert new > old, "a recreated session's log must number above the deleted one's"
        assert [e.data["tag"] for e in store.events(sid, old, 100)] == ["new"]

    def test_concurrent_appenders_never_share_a_number(self) -> None:
        store = self.event_store()
        sid = _sid("race-")
        holder = store.acquire(sid, _claimant(), 30)
        barrier = threading.Barrier(6, timeout=30)
        returned: list[int] = []
        errors: list[BaseException] = []

        def append(worker: int) -> None:
            mine = self.another(store)
            try:
                barrier.wait()
                for batch in range(10):
                    returned.append(mine.append_events(sid, holder, _texts(1 + batch % 3, f"{worker}-{batch}"),
                                                       keep=10_000))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=append, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        every = store.events(sid, 0, 1000)
        _consecutive(every)
        assert len(every) == 6 * sum(1 + b % 3 for b in range(10))
        assert len(set(returned)) == len(returned) and set(returned) <= {e.seq for e in every}
        for worker in range(6):  # each batch landed whole, in one run of numbers, its events in order
            for batch in range(10):
                mine = [e for e in every if e.data["tag"] == f"{worker}-{batch}"]
                assert [e.data["n"] for e in mine] == list(range(1 + batch % 3))
                _consecutive(mine)

    # -- runs that publish -----------------------------------------------------------------------------

    def test_a_run_publishes_each_kind_in_order_exactly_once(self) -> None:
        store = self.event_store()
        session = agent.open(_sid("run-"), store)
        session.steer("be brief")
        seen: list[Any] = []
        spec = agent.Spec(session=session, tools=[GREP], publish_events=True)
        result = agent.Runner().run(spec, [Message.user("q")], ToolsThenAnswer(["grep", "grep"]), seen.append)
        events = session.events()
        _consecutive(events)
        assert [e.kind for e in events] == RUN_KINDS
        assert [e.data.get("step") for e in events[:-1]] == [1, 1, 1, 1, 1, 1, 1, 2, 2]
        assert events[1].data == {"step": 1, "text": "be brief", "index": 1, "source": "session"}
        assert Message.from_dict(events[2].data["message"]) == result.messages[2]
        assert events[3].data["call"] == {"id": "call_0_0", "name": "grep", "arguments": '{"n": 0}'}
        assert events[4].data["call_id"] == "call_0_0" and events[4].data["result"] == {
            "text": "found 0", "is_error": False}
        assert Message.from_dict(events[8].data["message"]).text == result.text
        assert events[-1].data["stop_reason"] == "answered" and events[-1].data["steps"] == 2
        assert events[-1].data["text"] == result.text
        in_process = [type(e).__name__ for e in seen if not isinstance(e, (agent.events.Saved,
                                                                           agent.events.ModelRequest))]
        assert in_process == ["StepStarted", "SteerApplied", "ModelResponse", "ToolCalled", "ToolFinished",
                              "ToolCalled", "ToolFinished", "StepStarted", "ModelResponse", "Finished"]
        agent.Runner().run(spec, [*session.messages(), Message.user("again")], Answer("ok"))
        more = session.events(after=events[-1].seq)
        assert [e.kind for e in more] == ["step_started", "model_response", "finished"]
        _consecutive([*events, *more])

    def test_a_failed_run_publishes_failed(self) -> None:
        store = self.event_store()
        session = agent.open(_sid("fail-"), store)

        def boom(msgs: Sequence[Message]) -> None:
            raise RuntimeError("the model is down")

        with pytest.raises(RuntimeError):
            agent.Runner().run(agent.Spec(session=session, publish_events=True), [Message.user("q")], Answer("x", boom))
        events = session.events()
        assert [e.kind for e in events] == ["step_started", "failed"]
        assert events[-1].data == {"type": "builtins.RuntimeError", "message": "the model is down"}

    def test_publish_events_needs_an_event_store(self) -> None:
        model = Answer("never asked")
        for spec in (agent.Spec(publish_events=True),
                     agent.Spec(session=agent.open(_sid(), _PlainStore()), publish_events=True)):
            with pytest.raises(agent.ArgumentError, match="EventStore"):
                agent.Runner().run(spec, [Message.user("q")], model)
        assert model.requests == 0

    def test_a_follower_sees_a_live_run_and_a_reconnect_misses_nothing_and_repeats_nothing(self) -> None:
        store = self.event_store()
        sid = _sid("follow-")
        first: list[StoredEvent] = []
        second: list[StoredEvent] = []
        cut = threading.Event()

        def follow_until_cut() -> None:
            for event in agent.open(sid, self.another(store)).follow(timeout=60):
                first.append(event)
                if event.kind == "tool_finished":
                    cut.set()  # the connection drops mid-run
                    return

        def wait_for_the_cut(msgs: Sequence[Message]) -> None:
            if len(msgs) > 1:  # the second request: the follower saw the tools live, before the answer
                assert cut.wait(30), "the follower never saw the run's tools while it ran"

        follower = threading.Thread(target=follow_until_cut)
        follower.start()
        session = agent.open(sid, store)
        spec = agent.Spec(session=session, tools=[GREP], publish_events=True)
        agent.Runner().run(spec, [Message.user("q")], _Both(ToolsThenAnswer(["grep"]), wait_for_the_cut))
        follower.join(60)
        assert first and first[-1].kind == "tool_finished"
        for event in agent.open(sid, self.another(store)).follow(after=first[-1].seq, timeout=30):
            second.append(event)
            if event.kind == "finished":
                break
        assert [*first, *second] == session.events()
        assert [e.kind for e in [*first, *second]] == [
            "step_started", "model_response", "tool_called", "tool_finished", "step_started", "model_response",
            "finished"]

    def test_follow_ends_at_its_timeout(self) -> None:
        store = self.event_store()
        started = time.monotonic()
        assert list(agent.open(_sid(), store).follow(timeout=0.3)) == []
        assert 0.25 < time.monotonic() - started < 10


class _Both:
    """``model``'s replies, with ``before`` run inside each request first."""

    def __init__(self, model: ToolsThenAnswer, before: Any) -> None:
        self.model, self.before = model, before

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        self.before(messages)
        return self.model.complete(system, messages, tools)


class _PlainStore:
    """A Store with only the four methods."""

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        pass

    def messages(self, session: str) -> list[Message]:
        return []

    def add_steer(self, session: str, text: str) -> None:
        pass

    def take_steers(self, session: str) -> list[str]:
        return []
