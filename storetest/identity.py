"""Where operations meet: two tool calls of one reply with one id (some servers send them; the loop gives
the second an id of its own), a lone surrogate (an ``os.listdir`` name) in what a run publishes, and an
events callback that raises after a tool ran.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

import agent_sessions as agent
from agent_sessions import Content, Message, Role, Tool
from agent_sessions.approvals import DENIED
from agent_sessions.events import Event, StepStarted, ToolFinished
from agent_sessions.journal import UNKNOWN_OUTCOME

from .capabilities import Capability
from .mixin import ContractMixin, Crash, new_id, refund
from .scripted import Answer, Replies, ToolsThenAnswer
from .strategies import VERBATIM_ARGUMENTS

LONE = "\udcff"
"""What ``os.listdir`` gives for a file name byte that is not UTF-8 (``surrogateescape``)."""

TWO_WITH_ONE_ID = Message(Role.ASSISTANT, [
    Content.from_text("refunding both"),
    Content.tool_call("c1", "refund", '{"order": "A"}'),
    Content.tool_call("c1", "refund", '{"order": "B"}'),
])


class _Boom(Exception):
    """What an events callback raises."""


def _charge(ran: list[int]) -> Tool:
    def charge(n: int) -> str:
        """Charge a card: not idempotent."""
        ran.append(n)
        return f"charged {n}"

    return agent.tool(idempotent=False)(charge)


def _answered(msgs: Sequence[Message]) -> list[tuple[str, str]]:
    """(order, result text) for each call of the last reply that made calls, its result found by id in the
    message after it; every call has its own id and exactly one result."""
    at = max(i for i, m in enumerate(msgs) if m.role is Role.ASSISTANT and m.tool_calls)
    calls = msgs[at].tool_calls
    assert len({c.id for c in calls}) == len(calls), f"calls share an id: {[c.id for c in calls]}"
    results = [c for c in msgs[at + 1].content if c.type == "tool_result"]
    assert sorted(r.tool_call_id for r in results) == sorted(c.id for c in calls)
    by_id = {r.tool_call_id: r.text for r in results}
    return [(json.loads(c.arguments)["order"], by_id[c.id]) for c in calls]


class IdentityContract(ContractMixin):
    # -- two calls with one id -------------------------------------------------------------------------

    @pytest.mark.parametrize("crash_on", ["", "A", "B"], ids=["none", "killed-in-A", "killed-in-B"])
    def test_two_calls_with_one_id_each_run_once_and_get_their_own_result(self, crash_on: str) -> None:
        """Also when the worker is killed between or inside them: a resume gives each its own result."""
        store = self.run_store()
        sid = new_id(f"crash-{crash_on}")
        ran: list[str] = []
        spec = agent.Spec(session=agent.open(sid, store), tools=[refund(ran, crash_on=crash_on)])
        model = Replies(TWO_WITH_ONE_ID)
        if crash_on:
            with pytest.raises(Crash):
                agent.Runner().run(spec, [Message.user("refund A and B")], model)
            assert ran == ["A", "B"][: 1 + (crash_on == "B")]
            assert store.messages(sid) == [Message.user("refund A and B")]  # the reply waits in the journal
        result = agent.Runner().run(spec, store.messages(sid) or [Message.user("refund A and B")], model)
        assert result.stop_reason == "answered"
        assert ran == ["A", "B"], f"crashed in {crash_on}: then ran {ran}"
        stored = store.messages(sid)
        want = [(order, UNKNOWN_OUTCOME if order == crash_on else f"refunded 60 on {order}") for order in "AB"]
        assert stored == result.messages and _answered(stored) == want
        first, second = stored[1].tool_calls
        assert first.id == "c1" and second.id != "c1" and second.arguments == '{"order": "B"}'
        assert stored[1].text == "refunding both"
        # What the provider is sent next: the reply with the new id, and a result for each of its calls.
        assert model.requests[-1][1] == stored[1] and _answered(model.requests[-1]) == want
        assert store.journal(sid) is None

    def test_two_calls_with_one_id_wait_for_two_approvals(self) -> None:
        store = self.run_store(Capability.APPROVALS)
        sid = new_id("approve")
        session = agent.open(sid, store)
        ran: list[str] = []
        spec = agent.Spec(session=session, tools=[refund(ran, needs_approval=True)])
        model = Replies(TWO_WITH_ONE_ID)
        first = agent.Runner().run(spec, [Message.user("refund A and B")], model)
        assert first.stop_reason == "awaiting_approval"
        waiting = [p.call_id for p in first.pending_approvals]
        assert len(waiting) == 2 and len(set(waiting)) == 2 and waiting[0] == "c1"
        assert [p.arguments for p in first.pending_approvals] == ['{"order": "A"}', '{"order": "B"}']
        assert [p.call_id for p in session.pending_approvals()] == waiting
        session.approve(waiting[0])
        second = agent.Runner().run(spec, session.messages(), model)
        assert second.stop_reason == "awaiting_approval" and ran == []
        assert [p.call_id for p in second.pending_approvals] == [waiting[1]]
        assert [p.call_id for p in session.pending_approvals()] == [waiting[1]]
        session.approve(waiting[1])
        third = agent.Runner().run(spec, session.messages(), model)
        assert third.stop_reason == "answered" and ran == ["A", "B"]
        assert _answered(store.messages(sid)) == [("A", "refunded 60 on A"), ("B", "refunded 60 on B")]
        assert store.journal(sid) is None and session.pending_approvals() == []

    # -- one encoding: a lone surrogate ----------------------------------------------------------------

    def test_a_lone_surrogate_in_a_message_or_a_tool_result_is_published_and_refused_where_it_cannot_be_kept(
            self) -> None:
        store = self.run_store(Capability.EVENTS)
        session = agent.open(new_id("lone"), store)
        name = f"report{LONE}.txt"

        @agent.tool
        def listdir(n: int) -> str:
            """List a directory, as os.listdir names its files."""
            return name

        spec = agent.Spec(session=session, tools=[listdir], publish_events=True)
        result = agent.Runner().run(spec, [Message.user(f"open {LONE}")], ToolsThenAnswer(["listdir"]))
        assert result.stop_reason == "answered"
        stored = session.messages()
        assert stored == result.messages and stored[0].text == f"open {LONE}" and stored[2].content[0].text == name
        events = session.events()
        assert [e.kind for e in events] == ["step_started", "model_response", "tool_called", "tool_finished",
                                            "step_started", "model_response", "finished"]
        assert events[3].data["result"] == {"text": name, "is_error": False}
        assert Message.from_dict(events[1].data["message"]) == stored[1]
        with pytest.raises(agent.ArgumentError, match="surrogate"):
            session.steer(f"steer {LONE}")
        run = agent.Runner().start(spec, [*stored, Message.user("and now?")], Answer(f"still {LONE}"))
        with pytest.raises(agent.ArgumentError, match="surrogate"):
            run.steer(f"steer {LONE}")
        again = run.wait(60)
        assert again.stop_reason == "answered" and session.messages() == again.messages
        more = session.events(after=events[-1].seq)
        assert [e.kind for e in more] == ["step_started", "model_response", "finished"]
        assert more[-1].data["text"] == f"still {LONE}"
        with pytest.raises(agent.ArgumentError, match="surrogate"):
            session.set_metadata({"name": f"file {LONE}"})
        with pytest.raises(agent.ArgumentError, match="surrogate"):
            odd = agent.open(new_id(LONE), store)
            agent.Runner().run(agent.Spec(session=odd, publish_events=True), [Message.user("q")], Answer("x"))

    def test_a_deny_reason_holding_a_lone_surrogate_is_published_and_the_session_goes_on(self) -> None:
        store = self.run_store(Capability.EVENTS, Capability.APPROVALS)
        session = agent.open(new_id("lone-deny"), store)
        ran: list[str] = []
        spec = agent.Spec(session=session, tools=[refund(ran, needs_approval=True)], publish_events=True)
        model = Replies(Message(Role.ASSISTANT, [Content.tool_call("c1", "refund", '{"order": "A"}')]))
        assert agent.Runner().run(spec, [Message.user("refund A")], model).stop_reason == "awaiting_approval"
        reason = f"the order file {LONE} is not ours"
        assert session.deny("c1", reason).reason == reason
        result = agent.Runner().run(spec, session.messages(), model)
        assert result.stop_reason == "answered" and ran == []
        assert _answered(session.messages()) == [("A", f"{DENIED}: {reason}")]
        decided = [e for e in session.events() if e.kind == "approval_decided"]
        assert [(e.data["approved"], e.data["reason"]) for e in decided] == [(False, reason)]
        again = agent.Runner().run(spec, [*session.messages(), Message.user("ok")], Answer("fine"))
        assert again.stop_reason == "answered" and session.events()[-1].kind == "finished"

    def test_published_tool_calls_keep_their_arguments_byte_for_byte(self) -> None:
        store = self.run_store(Capability.EVENTS)
        session = agent.open(new_id("verbatim"), store)

        @agent.tool(name="echo")
        def echo() -> str:
            """Echo."""
            return "echoed"

        reply = Message(Role.ASSISTANT, [Content.tool_call(f"c{i}", "echo", text)
                                         for i, text in enumerate(VERBATIM_ARGUMENTS)])
        spec = agent.Spec(session=session, tools=[echo], publish_events=True)
        result = agent.Runner().run(spec, [Message.user("echo")], Replies(reply))
        assert result.stop_reason == "answered"
        assert [c.arguments for c in session.messages()[1].tool_calls] == VERBATIM_ARGUMENTS
        events = session.events()
        assert [e.data["call"]["arguments"] for e in events if e.kind == "tool_called"] == VERBATIM_ARGUMENTS
        published = Message.from_dict(next(e for e in events if e.kind == "model_response").data["message"])
        assert [c.arguments for c in published.tool_calls] == VERBATIM_ARGUMENTS

    # -- an events callback that raises ----------------------------------------------------------------

    def test_an_events_callback_raising_after_a_tool_ran_fails_the_run_and_keeps_what_ran(self) -> None:
        store = self.run_store(Capability.EVENTS)
        # Where the callback raises: on the ToolFinished of the reply's last call (its result rides with
        # the next save), of a call with one after it (journalled at once), or on the next step's start.
        cases = [("last call", ["charge"], "call_0_0", False), ("last call", ["charge"], "call_0_0", True),
                 ("first of two", ["charge", "charge"], "call_0_0", False), ("next step", ["charge"], "", False)]
        for where, calls, raise_on, publish in cases:
            session = agent.open(new_id("callback"), store)
            ran: list[int] = []
            charge = _charge(ran)

            def callback(event: Event, raise_on: str = raise_on) -> None:
                if isinstance(event, ToolFinished) and event.call.id == raise_on:
                    raise _Boom(f"the listener broke on {event.call.id}")
                if not raise_on and isinstance(event, StepStarted) and event.step == 2:
                    raise _Boom("the listener broke on step 2")

            spec = agent.Spec(session=session, tools=[charge], publish_events=publish)
            model = ToolsThenAnswer(calls)
            with pytest.raises(_Boom):
                agent.Runner().run(spec, [Message.user("charge")], model, callback)
            assert ran == [0], where
            result = agent.Runner().run(spec, session.messages(), model)
            assert result.stop_reason == "answered", where
            assert ran == list(range(len(calls))), f"{where}: a tool that ran was run again, or never"
            replies = [m for m in result.messages if m.role is Role.ASSISTANT and m.tool_calls]
            assert len(replies) == 1, f"{where}: the model was asked again instead of the reply finished"
            texts = [c.text for c in result.messages[2].content]
            assert texts == [f"charged {n}" for n in range(len(calls))], f"{where}: {texts}"
            assert UNKNOWN_OUTCOME not in texts and store.journal(session.id) is None
            if publish:
                kinds = [e.kind for e in session.events()]
                assert "failed" in kinds and kinds[-1] == "finished", kinds
