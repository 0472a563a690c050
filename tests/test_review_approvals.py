"""Review of approvals, turns and the memory store's lifecycle: reproducers of the defects found."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Content, Message, Role, Tool
from agent_sessions.approvals import CANCELLED_WAITING
from stores import memory

calls: list[str] = []


@agent.tool(idempotent=False, needs_approval=True)
def refund(amount: int = 0) -> str:
    """Refund."""
    calls.append(f"refund {amount}")
    return f"refunded {amount}"


class Model:
    """A reply calling refund once (call id ``cid``), then an answer."""

    def __init__(self, cid: str = "call_0") -> None:
        self.cid = cid
        self.requests = 0

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        self.requests += 1
        if messages[-1].role is Role.USER and messages[-1].content[0].type == "text":
            return Message(Role.ASSISTANT, [Content.tool_call(self.cid, "refund", '{"amount": 80}')])
        return Message.assistant("done")


def _waiting(store: Any, sid: str = "s") -> tuple[agent.Spec, agent.StoreSession]:
    calls.clear()
    session = agent.open(sid, store)
    spec = agent.Spec(session=session, tools=[refund])
    result = agent.Runner().run(spec, [Message.user("refund 80")], Model())
    assert result.stop_reason == "awaiting_approval"
    return spec, session


class CancelWhileResuming(memory.Store):
    """Calls ``hook`` once, inside the first look at the journal made by a run holding the lease."""

    hook: Any = None

    def journal_as_taken(self, session: str, holder: agent.Holder) -> str | None:
        hook, self.hook = self.hook, None
        if hook is not None and self.holder(session) is not None:
            hook()
        return super().journal_as_taken(session, holder)


def test_a_cancel_reaching_a_run_that_finds_the_turn_still_waiting_closes_the_turn() -> None:
    store = CancelWhileResuming()
    spec, session = _waiting(store)
    outcome: list[bool] = []
    store.hook = lambda: outcome.append(agent.open("s", store).cancel())
    model = Model()
    result = agent.Runner().run(spec, session.messages(), model)
    assert outcome == [True]  # cancel() said a live run held the session: that run was to stop
    assert model.requests == 0 and calls == []
    assert result.stop_reason == "cancelled"
    assert session.pending_approvals() == []
    msgs = store.messages("s")
    assert len(msgs) == 3 and not agent.orphaned_tool_calls(msgs)
    assert msgs[2].content[0].text == CANCELLED_WAITING
    with pytest.raises(agent.AlreadyDecided):  # decided "cancel" (issue 29): not an unknown call
        session.approve("call_0")


def test_a_run_given_the_waiting_reply_back_stores_no_call_without_its_result() -> None:
    store = memory.Store()
    spec, session = _waiting(store)
    reply = agent.approvals._journal(store, "s").reply  # type: ignore[union-attr]
    model = Model()
    # e.g. a caller that rebuilt the transcript from the ModelResponse events
    try:
        result = agent.Runner().run(spec, [*session.messages(), reply], model)
    except agent.TranscriptConflict:
        result = None
    msgs = store.messages("s")
    assert not agent.orphaned_tool_calls(msgs), msgs
    assert [p.call_id for p in session.pending_approvals()] == ["call_0"]
    assert result is not None and result.stop_reason == "awaiting_approval" and model.requests == 0


def test_a_new_message_while_a_turn_waits_is_refused_and_nothing_is_dropped() -> None:
    """Review finding: a new turn's first save dropped the waiting reply and its decisions, an approved
    refund among them, without a trace. Now the run refuses (a Conflict: nothing written)."""
    store = memory.Store()
    spec, session = _waiting(store)
    assert session.approve("call_0").approved  # the person was told: approved
    model = Model()
    stored, journal = store.messages("s"), store.journal("s")
    with pytest.raises(agent.AwaitingApproval) as info:
        agent.Runner().run(spec, [*session.messages(), Message.user("also, what is my balance?")], model)
    assert info.value.calls == ["call_0"] and model.requests == 0
    assert store.messages("s") == stored and store.journal("s") == journal
    session.steer("also, what is my balance?")  # what the error suggests: it lands after the waiting turn
    agent.Runner().run(spec, session.messages(), model)  # (this model then asks for another refund: it waits)
    assert calls == ["refund 80"]  # the approved one ran, once
    texts = [m.text for m in store.messages("s")]
    assert texts.index("also, what is my balance?") == 3 and agent.orphaned_tool_calls(store.messages("s")) == []


@pytest.mark.parametrize("arguments", ['{"amount": NaN}', '{"amount": -Infinity}', '{"amount": [NaN]}'])
def test_arguments_that_are_not_plain_json_ask_for_approval(arguments: str) -> None:
    # "Arguments that do not parse as a JSON object ask for approval"; NaN and Infinity are not JSON, but
    # Python's json accepts them, and the docs' own predicate says NaN > 50 is False: the refund ran unasked.
    tool = agent.tool(needs_approval=lambda args: args["amount"] > 50)(refund.fn)
    assert tool.asks_approval(Content.tool_call("c", "refund", arguments))


@pytest.mark.parametrize("raw", ['[NaN,"a"]', '[Infinity,"a"]', '[1e300,"a"]', '[-1e300,"a"]', '[1.5,"a\\u0000"]',
                                 '[1.5,"\\ud800"]'])
def test_a_tampered_cursor_is_an_argument_error_in_every_store(raw: str) -> None:
    # MongoDB turned NaN into a ValueError and 1e300 into an OverflowError (from its datetime
    # conversion), the memory store into an empty page: "every store refuses the same input the same way".
    import base64

    from agent_sessions import lifecycle

    cursor = base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")
    with pytest.raises(agent.ArgumentError):
        lifecycle.decode_cursor(cursor)
    store = memory.Store()
    agent.open("a", store).set_metadata({"k": 1})
    with pytest.raises(agent.ArgumentError):
        store.list_sessions(after=cursor)
