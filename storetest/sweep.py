"""A turn ends once: a run that returned is no stranded run, and the sweep (``agent.recover``) gives a turn
a worker left open only what is left of its budget. Other tests share the database, so the sweep's
``resolve`` takes only this test's session.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Content, Message, Role, Tool
from agent_sessions.journal import UNKNOWN_OUTCOME

from .capabilities import Capability
from .mixin import ContractMixin, Crash, new_holder, new_id, no_orphans, refund
from .scripted import Answer
from .stranded import stranded_ids


class Charges:
    """A model calling the non-idempotent ``charge`` on every request (a run only ends by its budget), and the
    tool, which dies (after its effect) in its charge number ``die_at``."""

    def __init__(self, die_at: int = 0) -> None:
        self.requests = 0
        self.charges = 0
        self.die_at = die_at

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        self.requests += 1
        return Message(Role.ASSISTANT, [Content.tool_call(f"charge-{uuid.uuid4().hex[:8]}", "charge", "{}")])

    def tool(self) -> Tool:
        def charge() -> str:
            """Charge the card (not idempotent)."""
            self.charges += 1
            if self.charges == self.die_at:
                raise Crash()
            return f"charged {self.charges}"

        return agent.tool(name="charge", idempotent=False)(charge)


class _RefundThenAnswer:
    """Calls ``refund`` for "refund order 7", and answers anything else."""

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        if messages[-1].role is Role.USER and messages[-1].text == "refund order 7":
            return Message(Role.ASSISTANT, [Content.tool_call("r1", "refund", '{"order": "7"}')])
        return Message.assistant(f"re: {messages[-1].text}")


class SweepContract(ContractMixin):
    @staticmethod
    def _sweep(store: Any, sid: str, spec: agent.Spec, model: Any) -> list[agent.Recovered]:
        """The sweep, ``(spec, model)`` resolving this test's session and nothing else: what it did with that."""
        def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
            return (spec, model) if info.id == sid else None

        return [r for r in agent.recover(store, resolve, grace=0) if r.session == sid]

    def _charging(self, tag: str, max_steps: int, die_at: int = 0, **options: Any
                  ) -> tuple[Any, str, Charges, agent.Spec]:
        """The store, a new session, a ``Charges`` model and the spec of its runs."""
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id(tag)
        model = Charges(die_at)
        return store, sid, model, agent.Spec(session=agent.open(sid, store), tools=[model.tool()], max_steps=max_steps,
                                             **options)

    def test_a_run_stopped_at_max_steps_is_not_stranded_and_no_sweep_runs_it_again(self) -> None:
        store, sid, model, spec = self._charging("sweep-spent", 2)
        result = agent.Runner().run(spec, [Message.user("charge me")], model)
        assert (result.stop_reason, model.requests, model.charges) == ("max_steps", 2, 2)
        no_orphans(store.messages(sid))  # its last reply's calls answered
        assert sid not in stranded_ids(store), "a run that returned left its turn listed as stranded"
        assert self._sweep(store, sid, spec, model) == []
        assert (model.requests, model.charges) == (2, 2), "the sweep ran a turn that had ended at max_steps"

    @pytest.mark.parametrize(("die_at", "last"), [(1, "charged 2"), (2, UNKNOWN_OUTCOME)],
                             ids=["one-request-left", "budget-spent"])
    def test_the_sweep_gives_a_plain_turn_only_what_is_left_of_its_budget(self, die_at: int, last: str) -> None:
        """The worker dies inside the charge of its first request (one left: its charge runs, the first is not
        run again) or of its last allowed one (the sweep runs nothing, and asks nothing more)."""
        store, sid, model, spec = self._charging(f"sweep-left-{die_at}", 2, die_at=die_at, lease_ttl=5.0)
        with pytest.raises(Crash):
            agent.Runner().run(spec, [Message.user("charge me")], model)
        assert sid in stranded_ids(store)
        (swept,) = self._sweep(store, sid, spec, model)
        assert swept.outcome == "recovered" and swept.result is not None
        assert swept.result.stop_reason == "max_steps"
        assert (model.requests, model.charges) == (2, 2), "the sweep asked again past the turn's budget"
        outcome = [c.text for m in store.messages(sid) for c in m.content if c.type is agent.ContentType.TOOL_RESULT]
        assert outcome[-1] == last, outcome
        assert sid not in stranded_ids(store)

    @pytest.mark.parametrize("comes", ["queued", "plain", "keyed steer"])
    def test_input_behind_a_turn_that_stopped_at_max_steps_is_answered_by_the_sweep_and_that_turn_not_run_again(
            self, comes: str) -> None:
        """The input that ``comes`` behind the stopped turn (its caller or worker gone) is a turn of its own,
        open: the sweep answers it, once, and runs nothing more of the ended turn."""
        store, sid, model, spec = self._charging("sweep-" + comes.replace(" ", "-"), 2)
        answering = Answer("the refund is on its way")
        if comes == "queued":
            assert agent.Runner().run(spec, [Message.user("charge me")], model).stop_reason == "max_steps"
            agent.open(sid, store).enqueue("and the refund?", "q-1")
        else:
            assert agent.Runner().turn(spec, "charge me", "k-1", model).stop_reason == "max_steps"
        if comes == "plain":
            holder = store.acquire(sid, new_holder(), 30)
            store.save_fenced(sid, holder, [*store.messages(sid), Message.user("and the refund?")], take_steers=False)
            store.release(sid, holder)
        elif comes == "keyed steer":
            assert agent.open(sid, store).steer("and the refund?", key="s-1") is True
        assert sid in stranded_ids(store)

        class Either:
            """``model`` for the ended turn (what a sweep must not go on with), ``answering`` for the rest."""

            def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
                asked = [m.text for m in messages if m.role is Role.USER and m.text]
                return (answering if asked[-1] == "and the refund?" else model).complete(system, messages, tools)

        swept = self._sweep(store, sid, spec, Either())
        assert (model.requests, model.charges) == (2, 2), "the sweep went on with a turn that had ended at max_steps"
        assert [r.outcome for r in swept] == ["recovered"] and answering.requests == 1, swept
        assert store.messages(sid)[-1].text == "the refund is on its way"
        assert store.pending_steers(sid) == [] and store.queued(sid) == [] and sid not in stranded_ids(store)
        assert self._sweep(store, sid, spec, Either()) == [] and answering.requests == 1
        assert comes != "queued" or agent.open(sid, store).answer("q-1") is not None

    def test_a_turn_sent_again_after_it_stopped_leaves_a_later_plain_runs_turn_to_the_sweep(self) -> None:
        """A plain run dies inside the tool its reply called after turn k stopped: k sent again must not finish
        that reply under its name and clear the session's mark (no sweep would answer the new message)."""
        store, sid, model, spec = self._charging("sweep-later-plain", 1, lease_ttl=5.0)
        assert agent.Runner().turn(spec, "charge me", "k-1", model).stop_reason == "max_steps"
        dying = Charges(die_at=1)
        with pytest.raises(Crash):
            agent.Runner().run(replace(spec, tools=[dying.tool()]), [*store.messages(sid), Message.user("again")],
                               dying)
        assert sid in stranded_ids(store)
        again = agent.Runner().turn(spec, "charge me", "k-1", model)
        assert (again.stop_reason, again.steps, model.requests, model.charges) == ("max_steps", 0, 1, 1), again
        assert sid in stranded_ids(store), "a turn sent again hid a later turn from the sweep"

    def test_a_run_waiting_for_a_decision_is_not_stranded_until_one_is_made(self) -> None:
        store = self.run_store(Capability.LIFECYCLE, Capability.APPROVALS)
        sid = new_id("sweep-asks")
        refunds: list[str] = []
        spec = agent.Spec(session=agent.open(sid, store), tools=[refund(refunds, needs_approval=True)])
        result = agent.Runner().run(spec, [Message.user("refund order 7")], _RefundThenAnswer())
        assert result.stop_reason == "awaiting_approval"
        assert sid not in stranded_ids(store), "a run waiting for a person left its turn listed as stranded"
        agent.open(sid, store).approve("r1")
        assert sid in stranded_ids(store), "a decision must open the turn for the sweep"

        (swept,) = self._sweep(store, sid, spec, _RefundThenAnswer())
        assert swept.outcome == "recovered" and swept.result is not None and refunds == ["7"]
        assert sid not in stranded_ids(store)

    def test_a_redelivered_turn_that_stopped_at_max_steps_never_takes_a_later_answer(self) -> None:
        store, sid, model, spec = self._charging("sweep-later", 1)
        first = agent.Runner().turn(spec, "charge me", "k-1", model)
        assert first.stop_reason == "max_steps"
        later = agent.Runner().run(spec, [*store.messages(sid), Message.user("and now?")], Answer("the later answer"))
        assert later.text == "the later answer"
        again = agent.Runner().turn(spec, "charge me", "k-1", model)
        assert (again.stop_reason, again.text, again.steps) == ("max_steps", "", 0), again
        assert model.charges == 1

    def test_a_cancelled_turn_whose_calls_were_decided_lets_the_queue_behind_it_be_answered(self) -> None:
        """The sweep closes the cancelled turn (its approved refund does not run) and answers the message."""
        store = self.run_store(Capability.LIFECYCLE, Capability.APPROVALS)
        sid = new_id("sweep-decided")
        refunds: list[str] = []
        spec = agent.Spec(session=agent.open(sid, store), tools=[refund(refunds, needs_approval=True)])
        assert agent.Runner().run(spec, [Message.user("refund order 7")], _RefundThenAnswer()).stop_reason == (
            "awaiting_approval")
        agent.open(sid, store).approve("r1")
        holder = store.acquire(sid, new_holder(), 30)
        assert agent.open(sid, store).cancel() is True  # a run held it: that run was to stop
        store.release(sid, holder)
        assert store.enqueue(sid, "q-1", "what next?") == 1

        (swept,) = self._sweep(store, sid, spec, _RefundThenAnswer())
        assert swept.outcome == "recovered", swept
        assert refunds == [], "the cancelled turn's approved call ran"
        assert store.messages(sid)[-1].text == "re: what next?" and store.queued(sid) == []
