"""Joining the events that point at a message (``eventlog.resolve``), beyond what every store checks in
storetest/events.py: the transcript moving between the join's two reads, a store that does not keep a
message's JSON verbatim, one without the lifecycle, and where the Publisher writes an event whole."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Content, Message, Role, StoredEvent, eventlog
from agent_sessions.contract import EventStore, LifecycleStore, when
from agent_sessions.events import SILENT
from agent_sessions.run.publisher import LOOKBACK, Publisher, _Called, _Finished, _Replied
from stores import memory
from storetest.scripted import ToolsThenAnswer


@agent.tool
def grep(n: int) -> str:
    """Look something up."""
    return f"found {n}"


def _run(store: agent.Store, sid: str = "s") -> list[Message]:
    spec = agent.Spec(session=agent.open(sid, store), tools=[grep], publish_events=True)
    return agent.Runner().run(spec, [Message.user("q")], ToolsThenAnswer(["grep", "grep"])).messages


def _joined(events: Sequence[StoredEvent]) -> list[Any]:
    return [e.data[eventlog.POINTING[e.kind]] for e in events if e.kind in eventlog.POINTING]


class MovingStore(memory.Store):
    """Another writer appends a message between the join's reads of the length (``info``) and the ``tail``."""

    def __init__(self) -> None:
        super().__init__()
        self.moving = False
        self.reads: list[str] = []

    def info(self, session: str) -> agent.SessionInfo | None:
        self.reads.append("info")
        info = super().info(session)
        if self.moving:
            self.save(session, [*super().messages(session), Message.user("written meanwhile")])
        return info

    def tail(self, session: str, last: int) -> list[Message]:
        self.reads.append("tail")
        return super().tail(session, last)

    def messages(self, session: str) -> list[Message]:
        self.reads.append("messages")
        return super().messages(session)


def test_a_transcript_growing_between_the_two_reads_is_read_again_in_one() -> None:
    store = MovingStore()
    transcript = _run(store)
    session = agent.open("s", store)
    still = session.events()
    assert store.reads == ["info", "tail"] and None not in _joined(still)
    store.reads.clear()
    store.moving = True
    moved = session.events()
    # The tail read after the append is one message off: no digest matches there, so the whole transcript is
    # read, in one read, and every pointer joins to its own message.
    assert store.reads == ["info", "tail", "messages"]
    assert moved == still and _joined(moved)[0] == transcript[1].to_dict()


def trouve(n: int) -> str:
    """Look something up, in French."""
    return f"trouvé {n}"


def _rewritten(message: Message) -> Message:
    return Message.from_json(json.dumps(message.to_dict(), indent=1, ensure_ascii=False))


class ReformattingStore(memory.Store):
    """Hands back messages whose JSON is not the text written (pretty-printed, not ASCII), as a store keeping
    them in a JSON column that rewrites them would."""

    def messages(self, session: str) -> list[Message]:
        return [_rewritten(m) for m in super().messages(session)]

    def tail(self, session: str, last: int) -> list[Message]:
        return [_rewritten(m) for m in super().tail(session, last)]


def test_a_store_that_does_not_keep_the_json_verbatim_still_joins() -> None:
    store = ReformattingStore()
    accented = agent.tool(name="grep")(trouve)
    spec = agent.Spec(session=agent.open("s", store), tools=[accented], publish_events=True)
    transcript = agent.Runner().run(spec, [Message.user("q")], ToolsThenAnswer(["grep", "grep"])).messages
    handed = store.messages("s")[2].to_json()
    assert handed != transcript[2].to_json() and not handed.isascii()
    events = agent.open("s", store).events()
    calls = [eventlog.part(c) for c in transcript[1].tool_calls]
    assert _joined(events) == [transcript[1].to_dict(), calls[0], {"text": "trouvé 0", "is_error": False}, calls[1],
                               {"text": "trouvé 1", "is_error": False}, transcript[3].to_dict()]


class NoLifecycle:
    """An EventStore with nothing of the LifecycleStore: a third-party store may be one."""

    def __init__(self) -> None:
        self.inner = memory.Store()
        self.reads = 0

    def messages(self, session: str) -> list[Message]:
        self.reads += 1
        return self.inner.messages(session)


for _name in ("save", "add_steer", "take_steers", "acquire", "renew", "release", "holder", "cancel", "check",
              "save_fenced", "journal", "put_journal", "fork", "append_events", "save_fenced_events", "events"):
    setattr(NoLifecycle, _name, lambda self, *a, _name=_name, **k: getattr(self.inner, _name)(*a, **k))


def test_an_event_store_without_the_lifecycle_joins_from_the_whole_transcript() -> None:
    plain = NoLifecycle()
    store: Any = plain
    assert isinstance(store, EventStore) and not isinstance(store, LifecycleStore)
    transcript = _run(store)
    plain.reads = 0
    events = agent.open("s", store).events()
    assert plain.reads == 1 and _joined(events)[-1] == transcript[3].to_dict()


def test_an_event_without_a_usable_pointer_is_handed_out_as_stored() -> None:
    store = memory.Store()
    odd = [StoredEvent(1, "model_response", when(0.0), {"step": 1, "ref": "not a pointer"}),
           StoredEvent(2, "tool_finished", when(0.0), {"ref": {"index": -1, "digest": "x"}}),
           StoredEvent(3, "note", when(0.0), {"ref": {"index": 0, "digest": "x"}})]
    assert eventlog.resolve(store, "s", odd) == odd


def test_the_publisher_points_only_at_a_message_the_write_stores_and_near_its_end() -> None:
    call = Content.tool_call("c1", "grep", "{}")
    reply = Message(Role.ASSISTANT, [call])
    result = Content.tool_result("c1", "found")
    results = Message(Role.USER, [result])
    event = _Replied(1, reply, 0.5)
    called = _Called(1, call)
    finished = _Finished(1, call, result, 0.25)
    msgs = [Message.user("q"), reply, results]
    digests: dict[int, str] = {}
    assert json.loads(event.render(msgs, digests))["data"] == {
        "step": 1, "ref": {"index": 1, "digest": eventlog.digest(reply)}, "seconds": 0.5}
    assert json.loads(called.render(msgs, digests))["data"]["ref"] == {"index": 1, "digest": digests[1], "id": "c1"}
    assert json.loads(finished.render(msgs, digests))["data"]["ref"] == {
        "index": 2, "digest": eventlog.digest(results), "id": "c1"}
    # Equal is not enough: only the very message the loop reported (an equal one may be another turn's).
    assert "message" in json.loads(event.render([Message.user("q"), Message(reply.role, reply.content)], {}))["data"]
    assert json.loads(event.render(None, {}))["data"] == {"step": 1, "message": reply.to_dict(), "seconds": 0.5}
    assert json.loads(called.render(None, {}))["data"] == {"step": 1, "call": {"id": "c1", "name": "grep",
                                                                               "arguments": "{}"}}
    assert json.loads(finished.render(None, {}))["data"] == {"step": 1, "call_id": "c1", "name": "grep",
                                                             "result": {"text": "found", "is_error": False},
                                                             "seconds": 0.25}
    far = [Message.user("q"), reply, *[Message.user(str(i)) for i in range(LOOKBACK)]]
    assert "message" in json.loads(event.render(far, {}))["data"]


@pytest.mark.parametrize("data", [
    {"step": 3}, {}, {"step": 1, "text": 'a "quoted" \\ \ud800 \x00 é 😀\n'},
    {"step": 2, "start": 0, "end": 7, "index": 9},
    {"seconds": 1e-06, "at": -2.5, "big": 2**70}, {"flag": True}, {"x": None}, {"x": float("nan")}, {"x": float("inf")},
    {"usage": {"in": 3}}, {"ids": ["c1"]},
])
def test_a_flat_event_is_written_as_json_dumps_would(data: dict[str, object]) -> None:
    """``encode_flat`` writes the text itself for str, int and finite float values, and hands anything else
    (a bool, None, NaN, a nested value) to ``encode``: either way, exactly ``encode``'s text."""
    assert eventlog.encode_flat("note", data, 1.5) == eventlog.encode("note", data, 1.5)
    assert eventlog.encode_flat("note", data).isascii()


@pytest.mark.parametrize("text", ["c1", 'a "quoted" \\ id', "\ud800 \x00 é 😀"])
@pytest.mark.parametrize("seconds", [0.25, 1e-06, 0.0, 12345.678901])
def test_the_publishers_own_pointing_events_are_written_as_json_dumps_would(text: str, seconds: float) -> None:
    """Each kind the publisher makes writes its text by a template of its own (``text``): byte for byte what
    ``encode`` writes of the same event with the pointer in place."""
    call = Content.tool_call(text, text, "{}")
    reply = Message(Role.ASSISTANT, [call])
    result = Content.tool_result(text, "found")
    ref = eventlog.pointer(7, "ab" * 16, text)
    for event in (_Replied(3, reply, seconds), _Called(3, call), _Finished(3, call, result, seconds)):
        written = event.text(ref)
        field = eventlog.POINTING[event.kind]
        data = {("ref" if k == field else k): v for k, v in event.data(json.loads(ref)).items()}
        assert written == eventlog.encode(event.kind, data, event.at)
        assert written.isascii()


@pytest.mark.parametrize("step", [0, 1, 12345])
def test_the_step_started_event_is_written_as_json_dumps_would(step: int) -> None:
    """``step_started`` (one on every step) is written by its own template: ``encode``'s text, byte for byte."""
    publisher = Publisher(SILENT, lambda records: None)
    publisher.step_started(step)
    [written] = publisher.take()
    assert isinstance(written, str)
    assert written == eventlog.encode("step_started", {"step": step}, json.loads(written)["at"])
