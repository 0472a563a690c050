"""The EventStore contract: a session's event log, and the runs that publish to it (``publish_events``).

Events that point: a step's ``model_response`` and ``tool_finished`` ride in the save that writes their
message and point at it (``ref``) rather than repeat it; a reader gets them whole, and a pointer is never
joined to another message than its own, whatever happened to the transcript since.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Content, EventStore, Holder, Message, Role, StoredEvent
from agent_sessions.eventlog import GONE, MAX_SEQ, POINTING, REPLACED, decode, encode, part, resolve
from agent_sessions.run import publisher

from .capabilities import Capability
from .crossprocess import in_processes, wait_for
from .mixin import HUGE, ContractMixin, new_holder, new_id, together
from .scripted import Answer, ToolsThenAnswer


def _texts(n: int, tag: str = "") -> list[str]:
    return [encode("note", {"n": i, "tag": tag, "ünï": "😀 \"q\" \\ \x00"}) for i in range(n)]


def _consecutive(events: Sequence[StoredEvent]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"not consecutive: {seqs}"


def _each_batch_whole(store: EventStore, sid: str, workers: int, batches: int, returned: list[int]) -> None:
    """The log ``workers`` writers of ``batches`` batches each left (batch b: ``1 + b % 3`` events tagged
    "<worker>-<b>"): each batch one run of numbers, in its order, and the numbers ``returned`` among them."""
    every = store.events(sid, 0, 1000)
    _consecutive(every)
    assert len(every) == workers * sum(1 + b % 3 for b in range(batches))
    assert len(set(returned)) == len(returned) and set(returned) <= {e.seq for e in every}
    for worker in range(workers):
        for batch in range(batches):
            mine = [e for e in every if e.data["tag"] == f"{worker}-{batch}"]
            assert [e.data["n"] for e in mine] == list(range(1 + batch % 3)), (worker, batch, mine)
            _consecutive(mine)


def _grep(n: int) -> str:
    """Look something up."""
    return f"found {n}"


GREP = agent.tool(name="grep")(_grep)


def _shapes(events: Sequence[StoredEvent]) -> list[str]:
    """How each pointing event is stored: ``ref`` (a pointer) or ``whole``."""
    return ["ref" if "ref" in e.data else "whole" for e in events if e.kind in POINTING]


def _whole(event: StoredEvent, transcript: Sequence[Message], index: int) -> bool:
    """Does ``event`` (read through a session) carry message ``index`` of ``transcript`` (the message, a call
    of it, its result for the event's call)?"""
    message = transcript[index]
    field = POINTING[event.kind]
    if field == "message":
        return Message.from_dict(event.data["message"]) == message
    if field == "call":
        return event.data["call"] in [part(c) for c in message.tool_calls]
    return event.data["result"] in [part(c) for c in message.content if c.tool_call_id == event.data["call_id"]]


def _unresolved(events: Sequence[StoredEvent]) -> list[tuple[str, int, str] | None]:
    """Each pointing event's ``(kind, index, reason)`` when it could not be joined, else ``None``."""
    out: list[tuple[str, int, str] | None] = []
    for e in events:
        if e.kind in POINTING:
            gone = e.data.get("unresolved")
            assert (gone is None) == (e.data[POINTING[e.kind]] is not None), e.data
            out.append(None if gone is None else (e.kind, gone["index"], gone["reason"]))
    return out


def _joined_as_stored(store: EventStore, sid: str) -> list[int]:
    """Check that every pointer of the session's log joins to the message now at its place; return the places."""
    raw, transcript = store.events(sid, 0, 1000), store.messages(sid)
    joined = agent.open(sid, store).events(limit=1000)
    places = []
    for stored, event in zip(raw, joined, strict=True):
        if stored.kind in POINTING and "ref" in stored.data:
            places.append(stored.data["ref"]["index"])
            assert "unresolved" not in event.data and _whole(event, transcript, places[-1]), event
    return places


def _riding(spec: agent.Spec, msgs: list[Message], model: Any, *listener: Any) -> agent.Result:
    """``Runner().run``, each event riding in the save that stores its message however slow this machine is:
    no watcher write (``FLUSH_SECONDS``), so the shapes checked are the usual step's, not a stalled one's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(publisher, "FLUSH_SECONDS", 60.0)
        return agent.Runner().run(spec, msgs, model, *listener)


def _old_shape(kind: str, data: dict[str, Any]) -> str:
    """An event as the library stored it before events pointed: its message or result whole."""
    return json.dumps({"kind": kind, "at": 1_800_000_000.5, "data": data}, separators=(",", ":"))


PROCESS_BATCHES = 16
"""Batches each of the two publishing processes writes (``_publisher_process``)."""


def _publisher_process(store: Any, worker: int, barrier: Any, sid: str, holder: Holder) -> list[int]:
    """Odd batches appended on their own (their last numbers are returned), even ones riding in a save, retried
    while the other process's save comes first."""
    returned: list[int] = []
    for batch in range(PROCESS_BATCHES):
        events = _texts(1 + batch % 3, f"{worker}-{batch}")
        if batch % 2:
            returned.append(store.append_events(sid, holder, events, keep=10_000))
            continue
        for _ in range(1000):  # bounded: the other process saves 8 times at most
            msgs = store.messages(sid)
            try:
                store.save_fenced_events(sid, holder, [*msgs, Message.assistant(f"{worker}-{batch}")],
                                         take_steers=False, events=events, keep=10_000)
                break
            except agent.TranscriptConflict:
                continue
        else:
            raise AssertionError(f"worker {worker} never saved batch {batch}")
    return returned


class EventContract(ContractMixin):
    def event_store(self, *needs: Capability) -> EventStore:
        return self.capable_store(Capability.EVENTS, "append_events, save_fenced_events, events", *needs)

    # -- the log ---------------------------------------------------------------------------------------

    def test_appends_get_consecutive_growing_numbers_and_read_back_verbatim(self) -> None:
        store = self.event_store()
        sid = new_id()
        assert store.events(sid, 0, 100) == []
        holder = store.acquire(sid, new_holder(), 30)
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
        bad: list[tuple[Any, Any]] = [(-1, 10), (0, 0), (0, 1001), ("1", 10), (True, 10), (0, 2.5)]
        for after, limit in bad:
            with pytest.raises(agent.ArgumentError):  # bad reads are refused
                store.events(sid, after, limit)

    def test_events_ride_in_a_save_atomically(self) -> None:
        store = self.event_store()
        sid = new_id("ride")
        holder = store.acquire(sid, new_holder(), 30)
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

    def test_the_cap_holds_the_newest_keep_after_every_write_of_either_path(self) -> None:
        """A store may skip the cap's drop while it knows the log has room (PostgreSQL's one-statement step),
        so the cap is checked after every write of either path; a second store object writing between them
        may leave a few more until the first writes twice, never fewer than the newest ``keep``."""
        store = self.event_store()
        sid = new_id("cap-each")
        holder = store.acquire(sid, new_holder(), 30)
        msgs = [Message.user("q")]
        given: list[int] = []

        def write(writer: EventStore, i: int) -> None:
            n = 1 + i % 3
            if i % 2:
                last = writer.append_events(sid, holder, _texts(n, f"w{i}"), keep=4)
            else:
                msgs.append(Message.assistant(f"a{i}"))
                writer.save_fenced_events(sid, holder, msgs, take_steers=False, events=_texts(n, f"w{i}"), keep=4)
                last = store.events(sid, 0, 100)[-1].seq
            given.extend(range(last - n + 1, last + 1))

        for i in range(12):
            write(store, i)
            assert [e.seq for e in store.events(sid, 0, 100)] == given[-4:], f"write {i}"
        other = self.another(store)
        for i in range(12, 24):
            write(other if i % 3 == 0 else store, i)
            kept = [e.seq for e in store.events(sid, 0, 100)]
            assert kept[-4:] == given[-4:] and kept == given[-len(kept):], f"write {i}"
            if i % 3 == 2:  # the second write in a row by ``store``
                assert kept == given[-4:], f"write {i}"
        # Then by ``store`` alone, its cap known: a save with more events than one statement carries
        # (PostgreSQL's ``MAX_RIDING``, 16), or one taking the general transaction (``replace=True``), then a
        # save with one event: exactly the newest ``keep`` after each.
        for big in (True, False):
            msgs.append(Message.assistant(f"big {big}"))
            store.save_fenced_events(sid, holder, msgs, take_steers=False, replace=not big,
                                     events=_texts(20 if big else 2, "big"), keep=4)
            after_big = [e.seq for e in store.events(sid, 0, 100)]
            assert len(after_big) == 4, after_big
            msgs.append(Message.assistant("small"))
            store.save_fenced_events(sid, holder, msgs, take_steers=False, events=_texts(1, "small"), keep=4)
            kept = [e.seq for e in store.events(sid, 0, 100)]
            assert kept == list(range(after_big[-1] - 2, after_big[-1] + 2)), (big, kept)

    def test_concurrent_appenders_never_share_a_number(self) -> None:
        store = self.event_store()
        sid = new_id("race")
        holder = store.acquire(sid, new_holder(), 30)
        others = [self.another(store) for _ in range(6)]

        def append(worker: int) -> list[int]:
            return [others[worker].append_events(sid, holder, _texts(1 + batch % 3, f"{worker}-{batch}"), keep=10_000)
                    for batch in range(10)]

        _each_batch_whole(store, sid, 6, 10, [seq for seqs in together(6, append) for seq in seqs])

    def test_no_number_is_given_again_after_the_cap_dropped_it_or_the_session_was_deleted(self) -> None:
        """A follower resumes from the last number it saw (``Last-Event-ID``): a number given again would hand it
        another event under a number it already passed."""
        store = self.event_store(Capability.LIFECYCLE)
        sid = new_id("again")
        holder = store.acquire(sid, new_holder(), 30)
        given: list[int] = []
        msgs = [Message.user("q")]
        for i in range(4):
            last = store.append_events(sid, holder, _texts(3, f"append-{i}"), keep=1)
            given += [last - 2, last - 1, last]
            msgs.append(Message.assistant(f"a{i}"))
            store.save_fenced_events(sid, holder, msgs, take_steers=False, events=_texts(2, f"save-{i}"), keep=1)
            (kept,) = store.events(sid, 0, 100)
            assert kept.data["tag"] == f"save-{i}" and kept.data["n"] == 1
            given += [kept.seq - 1, kept.seq]
        assert given == list(range(given[0], given[0] + len(given))), f"a number given twice or skipped: {given}"
        assert store.events(sid, given[3], 100) == [kept]  # after a number the cap dropped: only what is newer
        assert agent.open(sid, store).delete(force=True) is True
        assert store.events(sid, 0, 100) == []  # the log goes with its session, and so does its lease
        with pytest.raises(agent.LeaseLost):
            store.append_events(sid, holder, _texts(1), keep=100)
        other = self.another(store)  # a store object that never saw the old log
        again = other.acquire(sid, new_holder(), 30)
        new = [Message.user("again")]
        other.save_fenced_events(sid, again, new, take_steers=False, events=_texts(2, "new-0"), keep=100)
        store.save_fenced_events(sid, again, [*new, Message.assistant("b")], take_steers=False,
                                 events=_texts(2, "new-1"), keep=100)
        other.append_events(sid, again, _texts(1, "new-2"), keep=100)
        log = store.events(sid, 0, 100)
        _consecutive(log)
        assert [e.data["tag"] for e in log] == ["new-0", "new-0", "new-1", "new-1", "new-2"]
        assert log[0].seq > given[-1], "a recreated session's log must number above every number the old one gave"
        assert store.events(sid, given[-1], 100) == log  # a follower that kept its number sees the new log whole

    def test_a_session_deleted_and_made_again_at_once_numbers_above_its_old_log(self) -> None:
        """A new log starts from the store's clock, which must have moved past every number the old log gave
        (a clock read to the millisecond did not: within one, the new log began at the old one's first)."""
        store = self.event_store(Capability.LIFECYCLE)
        sid = new_id("at-once")
        reused = []
        for _ in range(30):
            holder = store.acquire(sid, new_holder(), 30)
            old = store.append_events(sid, holder, _texts(5), keep=100)
            store.delete(sid, force=True)
            again = store.acquire(sid, new_holder(), 30)
            new = store.append_events(sid, again, _texts(1), keep=100)
            store.delete(sid, force=True)
            if new <= old:
                reused.append((old, new))
        assert not reused, f"a new log numbered from within its deleted one's numbers (old last, new first): {reused}"

    def test_two_processes_publishing_at_once_get_distinct_increasing_numbers(self) -> None:
        """Each appends batches of its own and saves steps whose events ride in the save, retried when the
        other's save came first (a conflicting save writes no event)."""
        store = self.event_store()
        factory = self.factory()
        sid = new_id("processes")
        holder = store.acquire(sid, new_holder(), 120)
        store.save_fenced(sid, holder, [Message.user("q")], take_steers=False)
        reports = in_processes(factory, 2, _publisher_process, sid, holder, timeout=300)
        _each_batch_whole(store, sid, 2, PROCESS_BATCHES, [seq for seqs in reports for seq in seqs])
        saved = [m.text for m in store.messages(sid)[1:]]
        assert sorted(saved) == sorted(f"{w}-{b}" for w in range(2) for b in range(0, PROCESS_BATCHES, 2))

    # -- hostile numbers: an ``after`` is a seq, a signed 64-bit integer to every store --------------------

    def _events_with_a_log(self) -> tuple[EventStore, str]:
        store = self.event_store()
        sid = new_id("after")
        holder = store.acquire(sid, new_holder(), 30)
        store.append_events(sid, holder, [encode("note", {"n": 1})], keep=10)
        return store, sid

    def test_the_largest_seq_reads_nothing_rather_than_overflowing(self) -> None:
        store, sid = self._events_with_a_log()
        assert MAX_SEQ == 2**63 - 1
        assert store.events(sid, MAX_SEQ, 10) == []
        assert store.events(new_id("none"), MAX_SEQ, 10) == []
        session = agent.open(sid, store)
        assert session.events(after=MAX_SEQ) == []
        assert list(session.follow(after=MAX_SEQ, timeout=0)) == []
        assert [e.data for e in session.events(after=0)] == [{"n": 1}]

    @pytest.mark.parametrize("after", [2**63, 2**64, 10**30, HUGE, -HUGE], ids=["2**63", "2**64", "1e30", "huge",
                                                                               "-huge"])
    def test_an_after_beyond_a_seq_is_refused_before_any_query(self, after: int) -> None:
        store, sid = self._events_with_a_log()
        session = agent.open(sid, store)
        with pytest.raises(agent.ArgumentError, match="after="):
            store.events(sid, after, 10)
        with pytest.raises(agent.ArgumentError, match="after="):
            session.events(after=after)
        with pytest.raises(agent.ArgumentError, match="after="):
            session.follow(after=after, timeout=0)
        assert [e.data for e in session.events(after=0)] == [{"n": 1}]  # the store still answers

    # -- runs that publish -----------------------------------------------------------------------------

    def test_a_run_publishes_each_kind_in_order_exactly_once_pointing_at_its_messages(self) -> None:
        store = self.event_store()
        session = agent.open(new_id("run"), store)
        session.steer("be brief")
        seen: list[Any] = []
        spec = agent.Spec(session=session, tools=[GREP], publish_events=True)
        result = _riding(spec, [Message.user("q")], ToolsThenAnswer(["grep", "grep"]), seen.append)
        events = session.events()
        _consecutive(events)
        assert [e.kind for e in events] == [  # a waiting steer, a reply calling two tools, then an answer
            "step_started", "steer_applied", "model_response", "tool_called", "tool_finished", "tool_called",
            "tool_finished", "step_started", "model_response", "finished"]
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
        raw = store.events(session.id, 0, 100)
        assert _shapes(raw) == ["ref"] * 6, "a quick step's reply, calls and results ride in its save: pointers"
        assert not [e for e in raw if {"message", "call", "result"} & set(e.data)]
        assert [e.seq for e in events] == [e.seq for e in raw] and _unresolved(events) == [None] * 6
        assert _joined_as_stored(store, session.id) == [2, 2, 3, 2, 3, 4]  # the steer is message 1
        assert list(agent.open(session.id, self.another(store)).follow(timeout=0.2)) == events
        assert resolve(store, session.id, raw) == events
        agent.Runner().run(spec, [*session.messages(), Message.user("again")], Answer("ok"))
        more = session.events(after=events[-1].seq)
        assert [e.kind for e in more] == ["step_started", "model_response", "finished"]
        _consecutive([*events, *more])

    def test_a_failed_run_publishes_failed(self) -> None:
        """Its message holds a lone surrogate (a file name, as ``os.listdir`` gives it): stored as an escape."""
        store = self.event_store()
        session = agent.open(new_id("fail"), store)

        def boom(msgs: Sequence[Message]) -> None:
            raise RuntimeError("the model is down: cannot read \udcff")

        spec = agent.Spec(session=session, publish_events=True)
        with pytest.raises(RuntimeError):
            agent.Runner().run(spec, [Message.user("q")], Answer("x", boom))
        events = session.events()
        assert [e.kind for e in events] == ["step_started", "failed"]
        assert events[-1].data == {"type": "builtins.RuntimeError", "message": "the model is down: cannot read \udcff"}
        assert agent.Runner().run(spec, [Message.user("q")], Answer("up again")).text == "up again"

    def test_publish_events_needs_an_event_store_and_a_tool_needing_approval_an_approval_store(self) -> None:
        model = Answer("never asked")
        plain: Any = SimpleNamespace(save=lambda session, msgs: None, messages=lambda session: [],  # a Store only
                                     add_steer=lambda session, text: None, take_steers=lambda session: [])
        for spec in (agent.Spec(publish_events=True),
                     agent.Spec(session=agent.open(new_id(), plain), publish_events=True)):
            with pytest.raises(agent.ArgumentError, match="EventStore"):
                agent.Runner().run(spec, [Message.user("q")], model)
        with pytest.raises(agent.ArgumentError, match="needs approval"):
            agent.Runner().run(agent.Spec(tools=[agent.tool(name="grep", needs_approval=True)(_grep)]),
                               [Message.user("q")], model)
        assert model.requests == 0

    def test_a_follower_sees_a_live_run_and_a_reconnect_misses_nothing_and_repeats_nothing(self) -> None:
        store = self.event_store()
        sid = new_id("follow")
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
        agent.Runner().run(spec, [Message.user("q")], ToolsThenAnswer(["grep"], before=wait_for_the_cut))
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
        started = time.monotonic()  # and with nothing new, a follow ends at its timeout
        assert list(agent.open(sid, self.another(store)).follow(after=second[-1].seq, timeout=0.3)) == []
        assert 0.25 < time.monotonic() - started < 10

    # -- events that point at the messages their save wrote ----------------------------------------------

    def test_events_stored_whole_read_as_they_always_did(self) -> None:
        """Events as an earlier version stored them (the message, the result inside), beside new pointers."""
        store = self.event_store()
        sid = new_id("old")
        reply = Message(Role.ASSISTANT, [Content.tool_call("c1", "grep", '{"n": 0}')])
        old = [
            _old_shape("step_started", {"step": 1}),
            _old_shape("model_response", {"step": 1, "message": reply.to_dict(), "seconds": 0.25}),
            _old_shape("tool_called", {"step": 1, "call": {"id": "c1", "name": "grep", "arguments": '{"n": 0}'}}),
            _old_shape("tool_finished", {"step": 1, "call_id": "c1", "name": "grep",
                                         "result": {"text": "found 0 \u00e9 \ud800", "is_error": False},
                                         "seconds": 0.001}),
            _old_shape("finished", {"stop_reason": "answered", "steps": 1, "text": "", "usage": {},
                                    "pending_approvals": []}),
        ]
        holder = store.acquire(sid, new_holder(), 30)
        store.append_events(sid, holder, old, keep=100)  # no transcript at all: nothing to join, nothing needed
        store.release(sid, holder)
        session = agent.open(sid, store)
        read = session.events()
        assert [(e.kind, e.data) for e in read] == [(e.kind, e.data) for e in (decode(1, t) for t in old)]
        assert read[3].data["result"]["text"] == "found 0 \u00e9 \ud800" and "unresolved" not in read[1].data
        assert list(agent.open(sid, self.another(store)).follow(timeout=0.2)) == read
        _riding(agent.Spec(session=session, tools=[GREP], publish_events=True), [Message.user("q")],
                ToolsThenAnswer(["grep"]))
        every = session.events()
        assert every[:5] == read and _shapes(store.events(sid, 0, 100)) == ["whole"] * 3 + ["ref"] * 4
        assert _unresolved(every) == [None] * 7

    def test_a_replaced_transcript_never_joins_an_earlier_pointer_to_another_message(self) -> None:
        store = self.event_store()
        session = agent.open(new_id("replace"), store)
        first = _riding(agent.Spec(session=session, tools=[GREP], publish_events=True), [Message.user("q")],
                        ToolsThenAnswer(["grep"])).messages
        assert len(first) == 4  # q, the call, its result, the answer
        cut = len(session.events())
        # A run that replaces the history on purpose (a summary of it, say): shorter, other messages.
        second = _riding(
            agent.Spec(session=session, publish_events=True, replace_transcript=True),
            [Message.user("summary"), Message.user("go on")], Answer("fresh")).messages
        assert store.messages(session.id) == second and len(second) == 3
        events = session.events()
        assert _unresolved(events[:cut]) == [("model_response", 1, REPLACED), ("tool_called", 1, REPLACED),
                                             ("tool_finished", 2, REPLACED), ("model_response", 3, GONE)]
        assert events[1].data["message"] is None and events[3].data["result"] is None
        assert _unresolved(events[cut:]) == [None] and _whole(events[cut + 1], second, 2)
        # The first history written back as it was (a plain save): its pointers join again, the second's not.
        store.save(session.id, first)
        again = session.events()
        assert _unresolved(again[:cut]) == [None] * 4 and _whole(again[1], first, 1) and _whole(again[3], first, 2)
        assert _unresolved(again[cut:]) == [("model_response", 2, REPLACED)]

    def test_a_fork_leaves_each_logs_pointers_to_its_own_session(self) -> None:
        store = self.event_store()
        source = agent.open(new_id("fork"), store)
        _riding(agent.Spec(session=source, tools=[GREP], publish_events=True), [Message.user("q")],
                ToolsThenAnswer(["grep"]))
        target = source.fork(new_id("forked"), at=1)
        _riding(agent.Spec(session=target, publish_events=True), target.messages(), Answer("other"))
        assert store.messages(target.id)[1] != store.messages(source.id)[1]
        assert _joined_as_stored(store, source.id) == [1, 1, 2, 3]
        assert _joined_as_stored(store, target.id)[-1:] == [1]

    @pytest.mark.parametrize("erase", ["delete", "prune"])
    def test_pointers_read_after_their_session_was_erased_say_gone(self, erase: str) -> None:
        """A reader that had read the events just before the erasure finds no messages: it says so, never
        an error."""
        store = self.event_store(Capability.LIFECYCLE)
        session = agent.open(new_id(erase + "-"), store)
        _riding(agent.Spec(session=session, tools=[GREP], publish_events=True), [Message.user("q")],
                ToolsThenAnswer(["grep"]))
        raw = store.events(session.id, 0, 100)
        if erase == "prune":
            wait_for(lambda: store.prune(0) >= 1 or store.info(session.id) is None, "prune to take the session", 10)
        else:
            assert session.delete()
        assert session.events() == []
        joined = resolve(self.another(store), session.id, raw)
        assert _unresolved(joined) == [("model_response", 1, GONE), ("tool_called", 1, GONE),
                                       ("tool_finished", 2, GONE), ("model_response", 3, GONE)]
        assert [(e.seq, e.kind) for e in joined] == [(e.seq, e.kind) for e in raw]
        assert [e.data for e in joined if e.kind not in POINTING] == [e.data for e in raw if e.kind not in POINTING]

    def test_the_cap_drops_events_and_the_kept_ones_still_join(self) -> None:
        store = self.event_store()
        session = agent.open(new_id("capped"), store)
        spec = agent.Spec(session=session, tools=[GREP], publish_events=True, events_kept=4)
        _riding(spec, [Message.user("q")], ToolsThenAnswer(["grep", "grep"], rounds=2))
        events, transcript = session.events(), store.messages(session.id)
        assert [e.kind for e in events] == ["tool_finished", "step_started", "model_response", "finished"]
        assert _shapes(store.events(session.id, 0, 100)) == ["ref", "ref"] and _unresolved(events) == [None, None]
        assert _whole(events[0], transcript, 4) and _whole(events[2], transcript, 5)

    def test_events_written_before_their_message_is_stored_carry_it_whole(self) -> None:
        """The watcher writes what waited ``FLUSH_SECONDS`` while a slow tool runs: the reply, its calls and
        the first tool's result are not stored yet (the save comes after the reply's last call), so those
        events carry them whole; the slow tool's own result rides in the next save."""
        store = self.event_store()
        sid = new_id("early")
        reader = agent.open(sid, self.another(store))
        during: list[StoredEvent] = []

        def slow(n: int) -> str:
            """Take a while."""
            wait_for(lambda: [e.kind for e in reader.events()][-1:] == ["tool_called"]
                     and len(reader.events()) == 5, "the watcher to write the waiting events", 30)
            during.extend(reader.events())
            time.sleep(publisher.FLUSH_SECONDS)
            return f"slow {n}"

        spec = agent.Spec(session=agent.open(sid, store), tools=[GREP, agent.tool(name="slow")(slow)],
                          publish_events=True)
        agent.Runner().run(spec, [Message.user("q")], ToolsThenAnswer(["grep", "slow"]))
        transcript = store.messages(sid)
        assert [e.kind for e in during] == ["step_started", "model_response", "tool_called", "tool_finished",
                                            "tool_called"]
        assert len(store.messages(sid)) == 4 and _unresolved(during) == [None] * 4
        assert _whole(during[1], transcript, 1) and _whole(during[3], transcript, 2)
        assert _shapes(store.events(sid, 0, 100))[:4] == ["whole"] * 4  # then pointers, unless a stall flushed them
        events = agent.open(sid, store).events()
        assert events[:5] == during and _unresolved(events) == [None] * 6
        assert _whole(events[5], transcript, 2) and events[5].data["result"]["text"] == "slow 1"

    def test_a_reply_waiting_for_approval_is_published_whole(self) -> None:
        """Its reply waits in the journal, not the transcript: no save writes it, so its event carries it."""
        store = self.event_store(Capability.APPROVALS)
        session = agent.open(new_id("approve"), store)
        ask = agent.tool(name="grep", needs_approval=True)(_grep)
        spec = agent.Spec(session=session, tools=[ask], publish_events=True)
        model = ToolsThenAnswer(["grep"])
        waiting = _riding(spec, [Message.user("q")], model)
        assert waiting.stop_reason == "awaiting_approval" and len(store.messages(session.id)) == 1
        session.approve("call_0_0")
        _riding(spec, store.messages(session.id), model)
        events, transcript = session.events(), store.messages(session.id)
        assert [e.kind for e in events] == [
            "step_started", "model_response", "approval_requested", "finished", "approval_decided",
            "tool_called", "tool_finished", "step_started", "model_response", "finished"]
        assert _shapes(store.events(session.id, 0, 100)) == ["whole", "ref", "ref", "ref"]
        assert _unresolved(events) == [None] * 4 and _whole(events[1], transcript, 1)
        assert _joined_as_stored(store, session.id) == [1, 2, 3]
