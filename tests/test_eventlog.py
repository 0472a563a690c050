"""Joining the events that point at a message (``eventlog.resolve``), beyond what every store checks in
storetest/events.py: the transcript moving between the join's two reads, a store that does not keep a
message's JSON verbatim, one without the lifecycle, and where the Publisher writes an event whole."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any
from unittest import mock

import pytest

import agent_sessions as agent
from agent_sessions import Content, Message, Role, StoredEvent, eventlog
from agent_sessions.contract import when
from agent_sessions.events import SILENT, ModelResponse, Sink, ToolCalled, ToolFinished
from agent_sessions.run.publisher import LOOKBACK, Pointing, Publisher
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
    event = Pointing(ModelResponse(1, reply, 0.5))
    called = Pointing(ToolCalled(1, call))
    finished = Pointing(ToolFinished(1, call, result, 0.25))
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


def _published(listening: bool) -> list[str]:
    """What a Publisher stores of one event of each kind (``time.time()`` fixed, the reply's ``seconds``
    blanked: a clock's): the events about a message pointing at them, then whole, then ``finished`` and
    ``failed``, and what it appended on its own before the request (the steer and the text, flushed)."""
    appended: list[list[str]] = []
    call = Content.tool_call("c1", "grep", '{"z":1,"a":[1, 2],"z":3}')
    odd = Content.tool_call('q"\\\ud800', "gr\u00e9p", "not json")
    reply = Message(Role.ASSISTANT, [Content.from_text("looking \ud800 \u00e9 \U0001F600"), call, odd])
    result = Content.tool_result("c1", "found \x00 it", True)
    results = Message(Role.USER, [result, Content.tool_result(odd.id, "x")])
    with mock.patch("time.time", return_value=1234.5678):
        publisher = Publisher(Sink(lambda event: None) if listening else SILENT, appended.append)
        publisher.step_started(3)
        publisher.steer_applied(3, 'stop "that"', 7, "session")
        publisher.compacted(3, 0, 5, 6, 1000, 200)
        publisher.text_delta(3, "hel")
        publisher.text_delta(3, "lo \ud800")
        publisher.model_response(3, reply, publisher.model_request(3, 9))
        publisher.tool_finished(3, call, result, 0.1234567 + 0 * publisher.tool_called(3, call))
        publisher.tool_called(3, odd)
        publisher.tool_finished(3, odd, results.content[1], 2.0)
        publisher.approval_requested(3, call)
        publisher.approval_decided(3, call, False, "no \u00e9", "deadline")
        records = publisher.take()
        texts = [*Publisher.render(records, [Message.user("q"), reply, results], 10), *Publisher.render(records)]
        texts.append(publisher.finishing(agent.Result(
            messages=[], text="done \ud800", steps=3, stop_reason="awaiting_approval", unapplied_steers=["s"],
            usage={"prompt_tokens": 5},
            pending_approvals=[agent.PendingApproval("c1", "grep", "{}", when(0.0), None)])))
        publisher.take()
        publisher.failing(KeyError("x \u00e9"))
    texts += [text for batch in appended for text in batch]
    return [re.sub(r'"seconds":[0-9.e-]+}}$', '"seconds":S}}', text) if '"model_response"' in text else text
            for text in texts]


STORED = "46af81861f1079837b361479613e5224004667b962e383a9f250f3dfeeafa6ae"
"""The sha256 of what ``_published`` gives (its texts, a line each): each kind's stored text as the templates
and ``encode_flat`` of an earlier version wrote it, byte for byte, so a log written before reads as it did
and a reader sees no change."""


@pytest.mark.parametrize("listening", [False, True], ids=["silent", "listened"])
def test_each_kind_is_stored_as_declared_byte_for_byte(listening: bool) -> None:
    """Every kind's stored text, derived from its declaration (``agent_sessions.events``), whole and pointing:
    the bytes docs/runs/events.md describes, with or without a listener of the run's own."""
    texts = _published(listening)
    parsed = [text.replace('"seconds":S', '"seconds":0') for text in texts]
    assert [json.loads(text)["kind"] for text in parsed] == [
        "model_response", "tool_called", "tool_finished", "tool_called", "tool_finished", "approval_requested",
        "approval_decided", "model_response", "tool_called", "tool_finished", "tool_called", "tool_finished",
        "approval_requested", "approval_decided", "finished", "step_started", "steer_applied", "compacted", "text",
        "failed"]
    assert all(text.isascii() and json.dumps(json.loads(text), separators=(",", ":")) == text for text in parsed)
    assert hashlib.sha256("\n".join(texts).encode()).hexdigest() == STORED, "\n".join(texts)
