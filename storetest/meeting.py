"""Where operations meet: each promise of the library, kept when another public operation lands beside it
(a delete beside a run waiting for the lease, a cancel beside a resume, a redelivered turn beside a cancel).
Each test is named after the scenario it pins down (``test_29_1_`` ...)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Message, RunStore

from .capabilities import Capability
from .crossprocess import wait_for
from .mixin import ContractMixin, Crash, new_holder, new_id, refund
from .scripted import Answer, ToolsThenAnswer

SECRET = "card 4111 1111 1111 1111"
"""What the user asked to erase: it must never be stored again once the session was deleted."""


def _holds_secret(store: RunStore, sid: str) -> bool:
    return any(SECRET in m.text for m in store.messages(sid))


class Landing:
    """``store``, landing another operation at a chosen point of a run: ``before`` maps a method name to what
    runs (once) just before the run's call of it, ``after`` to what runs just after."""

    def __init__(self, store: Any, before: dict[str, Callable[[], object]] | None = None,
                 after: dict[str, Callable[[], object]] | None = None) -> None:
        self._store = store
        self._before = dict(before or {})
        self._after = dict(after or {})
        self._lock = threading.Lock()

    def _once(self, hooks: dict[str, Callable[[], object]], name: str) -> None:
        with self._lock:
            hook = hooks.pop(name, None)
        if hook is not None:
            hook()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if (name not in self._before and name not in self._after) or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._once(self._before, name)
            out = attr(*args, **kwargs)
            self._once(self._after, name)
            return out

        return call


def _email(sent: list[str]) -> agent.Tool:
    @agent.tool(name="email", idempotent=False)
    def email(to: str) -> str:
        """Send an email: not idempotent."""
        sent.append(to)
        return f"sent to {to}"

    return email


def _emails(to: str, rounds: int = 3, before: Callable[[object], object] | None = None) -> ToolsThenAnswer:
    return ToolsThenAnswer(["email"], rounds, before=before, arguments=json.dumps({"to": to}))


class MeetingContract(ContractMixin):
    def _conversation(self, store: RunStore, sid: str) -> None:
        spec = agent.Spec(session=agent.open(sid, store))
        agent.Runner().run(spec, [Message.user(f"my {SECRET}, please")], Answer("noted"))

    # -- 1. a deleted conversation never comes back --------------------------------------------------

    def test_29_1_a_run_waiting_for_the_lease_through_a_delete_never_writes_the_erased_transcript(self) -> None:
        """When the waiting run gets the lease the store is empty, a prefix of anything: the run must see that
        its messages were read before the (forced) delete and write nothing."""
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("waiting")
        self._conversation(store, sid)
        msgs = [*store.messages(sid), Message.user("and the next question")]
        gate, asking = threading.Event(), threading.Event()

        def hold(_: object) -> None:
            asking.set()
            gate.wait(10)

        holding = agent.Runner().start(agent.Spec(session=agent.open(sid, store)),
                                       [*msgs[:-1], Message.user("held")], Answer("held", before=hold))
        try:
            assert asking.wait(10), "the first run never asked its model"
            spec = agent.Spec(session=agent.open(sid, self.another(store)), lease_wait=20)
            waiting = agent.Runner().start(spec, msgs, Answer("must never be written"))
            assert store.delete(sid, force=True)
        finally:
            gate.set()
        with pytest.raises(agent.LeaseLost):
            holding.wait(timeout=20)
        with pytest.raises(agent.TranscriptDeleted):
            waiting.wait(timeout=20)
        assert not _holds_secret(store, sid), "the deleted conversation came back"
        info = store.info(sid)
        assert info is None or info.messages == 0

    @pytest.mark.parametrize("erase", ["delete", "force", "prune"])
    @pytest.mark.parametrize("read", ["messages", "tail", "another"])
    def test_29_1_messages_read_before_an_erasure_never_recreate_the_session(self, erase: str, read: str) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id(erase)
        self._conversation(store, sid)
        reader: Any = self.another(store) if read == "another" else store
        stored = reader.tail(sid, 2) if read == "tail" else reader.messages(sid)
        assert any(SECRET in m.text for m in stored)
        if erase == "prune":
            wait_for(lambda: store.prune(0) >= 1 or store.info(sid) is None, "prune to take the session", 10)
        else:
            assert store.delete(sid, force=erase == "force")
        spec = agent.Spec(session=agent.open(sid, reader))
        with pytest.raises(agent.TranscriptDeleted):
            agent.Runner().run(spec, [*stored, Message.user("go on")], Answer("must never be written"))
        with pytest.raises(agent.TranscriptDeleted):  # on purpose or not, an erased transcript stays erased
            agent.Runner().run(agent.Spec(session=agent.open(sid, reader), replace_transcript=True),
                               [*stored, Message.user("go on")], Answer("must never be written"))
        assert not _holds_secret(store, sid) and not _holds_secret(reader, sid)
        # A new conversation under the id works, and what was read from the old one still cannot land.
        new = agent.Spec(session=agent.open(sid, store))
        assert agent.Runner().run(new, [Message.user("hello again")], Answer("hi")).text == "hi"
        with pytest.raises(agent.TranscriptDeleted):
            agent.Runner().run(spec, [*stored, Message.user("old")], Answer("must never be written"))
        assert [m.text for m in store.messages(sid)] == ["hello again", "hi"] and not _holds_secret(reader, sid)

    def test_29_1_a_redelivered_turn_whose_read_preceded_a_delete_writes_nothing(self) -> None:
        """``Runner.turn`` reads the session itself; after a delete between that read and its run's first write
        it does not read again and answer the erased conversation anew."""
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("turn")
        self._conversation(store, sid)
        erasing: Any = self.another(store)  # a LifecycleStore too (_erasable)
        landing = Landing(store, after={"messages": lambda: erasing.delete(sid, force=True)})
        spec = agent.Spec(session=agent.open(sid, landing))
        with pytest.raises(agent.TranscriptDeleted):
            agent.Runner().turn(spec, f"about my {SECRET}", "msg-2", Answer("must never be written"))
        assert store.messages(sid) == [] and not _holds_secret(store, sid)

    def test_29_1_a_read_marks_messages_with_the_incarnation_and_a_session_begun_anew_has_another(self) -> None:
        """A store author's check (``agent_sessions.messages.read_from``): a session deleted and begun anew at
        once (within one tick of any clock) has another incarnation."""
        from agent_sessions.messages import incarnations_read

        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("mark")
        self._conversation(store, sid)
        first = incarnations_read(store.messages(sid), sid)
        assert len(first) == 1 and incarnations_read(store.tail(sid, 1), sid) == first
        store.delete(sid)
        self._conversation(store, sid)
        again = incarnations_read(store.messages(sid), sid)
        assert len(again) == 1 and again != first

    def _cancelled_turn(self, tag: str, died: bool = False) -> tuple[RunStore, str, agent.Spec, Any, list[str]]:
        """A turn ("msg-1") that sends one email and is cancelled from ``other`` on its second request: it
        returns, or (``died``) its worker dies there. The store, the session, the spec, ``other``, the emails."""
        store = self.run_store()
        sid = new_id(tag)
        sent: list[str] = []
        other = agent.open(sid, self.another(store))

        def cancel_then(_: object) -> None:
            if first.requests == 2:
                assert other.cancel() is True
                if died:
                    raise Crash()

        spec = agent.Spec(session=agent.open(sid, store), tools=[_email(sent)], max_steps=8, lease_ttl=0.6)
        first = _emails("a@example.com", before=cancel_then)
        if died:
            with pytest.raises(Crash):
                agent.Runner().turn(spec, "email everyone", "msg-1", first)
            wait_for(lambda: store.holder(sid) is None, "the dead worker's lease to expire", 20)
        else:
            assert agent.Runner().turn(spec, "email everyone", "msg-1", first).stop_reason == "cancelled"
        assert sent == ["a@example.com"], "the cancel landed after one email and before the second reply"
        return store, sid, spec, other, sent

    def _waiting_refund(self, tag: str, **options: Any) -> tuple[RunStore, str, list[str], agent.Spec, Any]:
        """A turn whose refund of order B waits for a person (``options`` go to the tool): the store, the
        session, the orders refunded, the turn's spec and its model."""
        store = self.run_store(Capability.APPROVALS)
        sid = new_id(tag)
        ran: list[str] = []
        endpoint = ToolsThenAnswer(["refund"], arguments='{"order": "B"}')
        spec = agent.Spec(session=agent.open(sid, store), tools=[refund(ran, needs_approval=True, **options)])
        assert agent.Runner().run(spec, [Message.user("refund B")], endpoint).stop_reason == "awaiting_approval"
        return store, sid, ran, spec, endpoint

    # -- 2. a redelivered turn does not undo how the turn ended ----------------------------------------

    @pytest.mark.parametrize("steered", [False, True])
    @pytest.mark.parametrize("how", ["returned", "died"])
    def test_29_2_a_redelivered_turn_that_was_cancelled_stays_cancelled(self, how: str, steered: bool) -> None:
        """The worker returns, cancelled, or dies before it sees the cancel; either way the repeat reports the
        cancel without a model request or a tool. A steer waiting by then (``steered``) is no new input for
        the cancelled turn: it waits for the next turn."""
        store, sid, spec, other, sent = self._cancelled_turn("turn-cancel", died=how == "died")
        if steered:
            other.steer("and cc the team")
        again = _emails("b@example.com")
        repeat = agent.Runner().turn(spec, "email everyone", "msg-1", again)
        assert (repeat.stop_reason, again.requests, sent) == ("cancelled", 0, ["a@example.com"])
        third = agent.Runner().turn(spec, "email everyone", "msg-1", again)  # and every delivery after it
        assert (third.stop_reason, again.requests, sent) == ("cancelled", 0, ["a@example.com"])
        assert not agent.orphaned_tool_calls(store.messages(sid))
        if steered:
            assert other.pending_steers() == ["and cc the team"]
        later = agent.Runner().turn(spec, "a new question", "msg-2", Answer("a new answer"))
        assert later.stop_reason == "answered", "a new turn is not cancelled by the cancel of an earlier one"
        assert ("and cc the team" in [m.text for m in later.messages]) == steered

    @pytest.mark.parametrize("fails", ["stale transcript", "events callback"])
    def test_29_2_a_cancelled_turn_stays_cancelled_when_the_next_run_fails_before_closing_it(self, fails: str) -> None:
        """The next run takes the cancel with the lease and brings new input, so it is to close the turn in
        the save before its first request; it fails before that save lands. The turn is still open: its
        redelivery must stop, cancelled, as if that run had never taken the lease."""
        store, sid, spec, _, sent = self._cancelled_turn("turn-cancel-handed")
        stale = [Message.user("read before the turn wrote")]
        failing = _emails("c@example.com")
        if fails == "stale transcript":
            with pytest.raises(agent.TranscriptConflict):
                agent.Runner().run(spec, stale, failing)
        else:
            def callback(event: object) -> None:
                raise RuntimeError("the events callback fails")

            with pytest.raises(RuntimeError, match="callback fails"):
                agent.Runner().run(spec, [*store.messages(sid), Message.user("and c")], failing, callback)
        assert (failing.requests, sent) == (0, ["a@example.com"])
        again = _emails("b@example.com")
        repeat = agent.Runner().turn(spec, "email everyone", "msg-1", again)
        assert (repeat.stop_reason, again.requests, sent) == ("cancelled", 0, ["a@example.com"])
        later = agent.Runner().turn(spec, "a new question", "msg-2", Answer("a new answer"))
        assert later.stop_reason == "answered", "a new turn is not cancelled by the cancel of an earlier one"
        assert not agent.orphaned_tool_calls(store.messages(sid))

    def test_a_new_turn_that_closes_a_cancelled_one_spends_its_cancel(self) -> None:
        """Else a later turn's redelivery, after its worker died, would stop as cancelled, and the sweep would
        never list that turn."""
        store, sid, spec, _, sent = self._cancelled_turn("turn-cancel-spent")
        later = agent.Runner().run(spec, [*store.messages(sid), Message.user("a new question")], Answer("an answer"))
        assert later.stop_reason == "answered" and sent == ["a@example.com"]
        holder = store.acquire(sid, new_holder(), 30)
        try:
            assert not holder.cancelled, "the cancel of a turn closed by new input was handed to the next holder"
        finally:
            store.release(sid, holder)

    def test_29_2_a_turn_whose_worker_died_gets_what_is_left_of_its_budget(self) -> None:
        store = self.run_store()
        sid = new_id("turn-budget")
        sent: list[str] = []

        def die(_: object) -> None:
            if dying.requests == 2:
                raise Crash()

        spec = agent.Spec(session=agent.open(sid, store), tools=[_email(sent)], max_steps=3, lease_ttl=0.6)
        dying = _emails("a", 9, die)
        with pytest.raises(Crash):
            agent.Runner().turn(spec, "email everyone", "msg-1", dying)
        wait_for(lambda: store.holder(sid) is None, "the dead worker's lease to expire", 20)
        again = _emails("b", 9)
        repeat = agent.Runner().turn(spec, "email everyone", "msg-1", again)
        assert (repeat.stop_reason, again.requests) == ("max_steps", 2), "3 requests in all, not 1 + 3"

    def test_29_2_a_redelivered_turn_that_a_later_turn_took_up_runs_nothing(self) -> None:
        """msg-1's worker dies waiting on the model; msg-2 reads both messages and stops at max_steps. msg-1
        redelivered must not go on with msg-2's work under its own budget: it says it was superseded."""
        store = self.run_store()
        sid = new_id("turn-superseded")
        sent: list[str] = []

        def die(_: object) -> None:
            raise Crash()

        spec = agent.Spec(session=agent.open(sid, store), tools=[_email(sent)], max_steps=4)
        with pytest.raises(Crash):
            agent.Runner().turn(spec, "email a", "msg-1", _emails("a", 9, die))
        one_step = agent.Spec(session=agent.open(sid, store), tools=[_email(sent)], max_steps=1)
        second = agent.Runner().turn(one_step, "and email b", "msg-2", _emails("b", 9))
        assert (second.stop_reason, sent) == ("max_steps", ["b"])
        again = _emails("a", 9)
        repeat = agent.Runner().turn(spec, "email a", "msg-1", again)
        assert (repeat.stop_reason, repeat.steps, again.requests, sent) == ("superseded", 0, 0, ["b"])
        answered = agent.Runner().turn(spec, "and email b", "msg-2", Answer("done: b"))  # msg-2 redelivered
        assert answered.text == "done: b"
        assert agent.Runner().turn(spec, "email a", "msg-1", again).text == "done: b"
        assert again.requests == 0 and sent == ["b"]

    # -- 3. a cancel of a waiting turn is never lost to a resume ---------------------------------------

    @pytest.mark.parametrize("point", [("after", "acquire"), ("before", "journal_as_taken"),
                                       ("after", "journal_as_taken"),
                                       ("before", "release"), ("after", "release")])
    @pytest.mark.parametrize("decided", [False, True])
    def test_29_3_a_cancel_landing_anywhere_in_a_resume_stops_every_call_of_the_turn(
        self, point: tuple[str, str], decided: bool
    ) -> None:
        """The refund waits for a person (``decided``: approved already). Once the cancel returned True no call
        of that turn may start: neither in this resume, nor in one after a later decision, nor in a
        redelivery."""
        store, sid, ran, spec, endpoint = self._waiting_refund("waiting-cancel")
        other = agent.open(sid, self.another(store))
        if decided:
            other.approve("call_0_0")
        outcome: list[tuple[bool, int]] = []  # what cancel() returned, and how many refunds had started then
        hooks: dict[str, Callable[[], object]] = {point[1]: lambda: outcome.append((other.cancel(), len(ran)))}
        landing = Landing(store, **{point[0]: hooks})
        first = agent.Runner().run(replace(spec, session=agent.open(sid, landing)), store.messages(sid), endpoint)
        assert len(outcome) == 1, "the cancel never landed"
        cancelled, started = outcome[0]
        if not cancelled:  # only once the resume had finished the turn, the refund run, and let go
            assert (decided, point[1], first.stop_reason, ran) == (True, "release", "answered", ["B"]), outcome
        with pytest.raises((agent.AlreadyDecided, agent.UnknownApproval)):  # no decision after the cancel
            other.approve("call_0_0")
        for _ in range(2):  # a resume after it, and a redelivery of that
            agent.Runner().run(spec, store.messages(sid), endpoint)
        if cancelled:
            assert len(ran) == started, "a call of the cancelled turn started after cancel() returned True"
        assert len(ran) <= 1 and ran in ([], ["B"]) and (decided or ran == [])
        assert not agent.orphaned_tool_calls(store.messages(sid))
        assert agent.open(sid, store).pending_approvals() == []

    def test_29_3_a_cancel_closing_a_waiting_turn_beside_a_forced_delete_is_true_and_writes_nothing(self) -> None:
        """The delete lands just before the cancel's save that closes the turn: that save is refused, and the
        cancel still says True (nothing of the turn is left to start) rather than raise ``LeaseLost``."""
        self.requires(Capability.LIFECYCLE)
        store, sid, ran, spec, _ = self._waiting_refund("cancel-delete")
        eraser = self.another(store)
        deleted: list[bool] = []
        landing = Landing(store, before={"save_fenced": lambda: deleted.append(eraser.delete(sid, force=True))})
        assert agent.open(sid, landing).cancel() is True
        assert deleted == [True]
        assert store.messages(sid) == [] and store.info(sid) is None and store.journal(sid) is None
        again = agent.Runner().run(spec, [Message.user("a new question")], Answer("a new answer"))
        assert again.text == "a new answer" and ran == []

    # -- 7. a repeat that was absorbed reports no failure ----------------------------------------------

    def test_29_7_a_redelivery_absorbed_by_runner_turn_writes_no_failed_event(self) -> None:
        """The second delivery read the session while the first ran, is refused at its first write and returns
        the saved answer: a follower is never told the turn failed."""
        store = self.run_store()
        publish = Capability.EVENTS in self.capabilities
        sid = new_id("absorbed")
        read = threading.Event()

        def after_the_other_read(_: object) -> None:
            assert read.wait(20), "the second delivery never read the session"

        first = agent.Spec(session=agent.open(sid, store), publish_events=publish)
        delivered = agent.Runner().start(first, [Message.user("q", key="msg-1")], Answer("a", after_the_other_read))
        wait_for(lambda: store.holder(sid) is not None, "the first delivery to hold the session", 20)
        second_store = Landing(self.another(store), after={"messages": read.set})
        second = agent.Spec(session=agent.open(sid, second_store), publish_events=publish, lease_wait=20)
        heard: list[object] = []
        repeat = agent.Runner().turn(second, "q", "msg-1", Answer("must not be asked"), heard.append)
        assert delivered.wait(timeout=20).text == "a"
        assert (repeat.stop_reason, repeat.text, repeat.steps) == ("answered", "a", 0)
        assert [m.text for m in store.messages(sid)] == ["q", "a"]
        # Its listener hears nothing of the attempt the other's save refused: it returned the stored answer.
        assert heard == [], heard
        if publish:
            kinds = [e.kind for e in agent.open(sid, store).events(limit=1000)]
            assert kinds.count("finished") == 1 and "failed" not in kinds and kinds[-1] == "finished", kinds

    # -- 12. a decision just after a resume denied the call at its deadline ----------------------------

    @pytest.mark.parametrize("point", [("after", "swap_journal"), ("after", "release")])
    def test_29_12_a_decision_just_after_a_deadline_denial_is_already_decided(self, point: tuple[str, str]) -> None:
        """Whether the journal still holds the resume's denial or the turn's results do, a person deciding just
        after is told it was decided at its deadline, not that the call is unknown."""
        store, sid, ran, spec, endpoint = self._waiting_refund("deadline", approval_deadline=0.05)
        wait_for(lambda: not agent.open(sid, store).pending_approvals(), "the approval deadline to pass", 10)
        other = agent.open(sid, self.another(store))
        late: list[BaseException] = []

        def decide() -> None:
            try:
                other.approve("call_0_0")
            except agent.AgentError as exc:
                late.append(exc)

        hooks: dict[str, Callable[[], object]] = {point[1]: decide}
        landing = Landing(store, **{point[0]: hooks})
        resumed = replace(spec, session=agent.open(sid, landing))
        assert agent.Runner().run(resumed, store.messages(sid), endpoint).stop_reason == "answered"
        assert len(late) == 1 and isinstance(late[0], agent.AlreadyDecided), late
        assert late[0].decision.by == "deadline" and ran == []
