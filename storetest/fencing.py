"""Fenced runs: a run that lost its lease never writes again, and a run writes only over the transcript
it started from. The scenario tests (``test_1_`` ... ``test_6_``; the third, a run that waited for the
lease, is the fourth's loser) drive whole runs through the ways a stale run used to overwrite a newer one.
And concurrent first saves of a new session (PostgreSQL locked a row that did not exist yet, and both
appended), and the cancel flag every fenced save returns."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Content, Holder, Message, RunStore, Saved, Store
from agent_sessions.eventlog import encode
from agent_sessions.journal import UNKNOWN_OUTCOME
from agent_sessions.run.react import CANCELLED

from .capabilities import Capability
from .crossprocess import in_processes, wait_for
from .mixin import ContractMixin, Crash, new_holder, new_id, no_orphans, noting, together
from .scripted import Answer, ToolsThenAnswer
from .stalls import Stalled

TTL = 0.6
"""The lease of a run that is about to stall: short, so the takeover comes soon."""


ROUNDS = 20
"""How many new sessions each race is run on: a lost race shows in most rounds, seldom in one."""
WRITERS = 4


def _transcript(writer: int, round: int) -> list[Message]:
    """Writer ``writer``'s transcript in ``round``: its own from the first message on, several messages long,
    so two writers' rows at the same positions would mix."""
    return [Message.user(f"writer {writer} round {round} message {i}") for i in range(3 + writer % 2)]


def _first_saver(store: Store, i: int, barrier: Any, sids: list[str]) -> None:
    """One writer of the race: a first save of each round's session, all writers at once."""
    for r, sid in enumerate(sids):
        barrier.wait(120)
        store.save(sid, _transcript(i, r))


def _state(store: RunStore, sid: str) -> tuple[list[Message], str | None, Holder | None]:
    """Everything a write could have changed: transcript, journal, lease."""
    return store.messages(sid), store.journal(sid), store.holder(sid)


def _results(msgs: list[Message], at: int) -> dict[str, Content]:
    return {c.tool_call_id: c for c in msgs[at].content}


def _race(store: RunStore, sid: str, holder: Holder, lists: list[list[Message]]) -> list[int]:
    """Save each of ``lists`` from a thread of its own, all at once: the indexes of those saved (the others
    refused with ``TranscriptConflict``; any other error is raised)."""

    def step(i: int) -> bool:
        try:
            store.save_fenced(sid, holder, lists[i], take_steers=True)
            return True
        except agent.TranscriptConflict:
            return False

    return [i for i, saved in enumerate(together(len(lists), step)) if saved]


class FencingContract(ContractMixin):
    def _expire(self, store: RunStore, sid: str) -> None:
        wait_for(lambda: store.holder(sid) is None, "the stalled run's lease to expire on the store's clock")

    def _taken_over(self, stalled: Stalled, other: RunStore, sid: str, newer: dict[str, Any]) -> None:
        """While ``stalled``'s run is stopped, its lease lapses and run B on ``other`` answers a question;
        ``newer`` gets B's result and the state it left."""
        stalled.freeze()
        self._expire(other, sid)
        msgs = [*other.messages(sid), Message.user("B's question")]
        newer["result"] = agent.Runner().run(agent.Spec(session=agent.open(sid, other)), msgs, Answer("B"))
        newer["state"] = _state(other, sid)
        stalled.thaw()

    # -- the rule, store by store ----------------------------------------------------------------------

    def test_a_superseded_holder_can_write_nothing(self) -> None:
        store = self.run_store()
        sid = new_id("rule")
        a = store.acquire(sid, new_holder(), 0.2)
        store.save_fenced(sid, a, [Message.user("a's question")], take_steers=True)
        store.put_journal(sid, a, "a's journal")
        store.append_events(sid, a, [encode("note", {"by": "a"})], keep=100)
        self._expire(store, sid)
        b = self.another(store).acquire(sid, new_holder(), 30)
        assert b.epoch > a.epoch
        store.add_steer(sid, "for b")
        before = _state(store, sid)
        for write in (
            lambda: store.append_events(sid, a, [encode("note", {"by": "late a"})], keep=100),
            lambda: store.save_fenced_events(sid, a, [Message.user("a's question"), Message.assistant("late")],
                                             take_steers=False, events=[encode("note", {"by": "late a"})], keep=100),
            lambda: store.save_fenced(sid, a, [Message.user("a's question"), Message.assistant("late")],
                                      take_steers=True),
            lambda: store.save_fenced(sid, a, [Message.user("a's question")], take_steers=True),
            lambda: store.save_fenced(sid, a, [Message.user("other")], take_steers=False, replace=True),
            # a compaction record is an append like any other: fenced the same
            lambda: store.save_fenced(sid, a, [Message.user("a's question"),
                                               Message(agent.Role.USER, [Content.compaction("a's summary", 0, 1)])],
                                      take_steers=False),
            lambda: store.put_journal(sid, a, "a's late journal"),
            lambda: store.check(sid, a),
            lambda: store.renew(sid, a, 30),
        ):
            with pytest.raises(agent.LeaseLost):
                write()
        # a failed run giving its steers back: none is left under a lease it lost
        assert store.give_back(sid, a, ["a's steer"]) == ["a's steer"]
        store.release(sid, a)
        assert _state(store, sid) == before
        assert store.take_steers(sid) == ["for b"]  # the stale saves took no steer
        store.append_events(sid, b, [encode("note", {"by": "b"})], keep=100)  # nor an event, nor a number
        log = store.events(sid, 0, 100)
        assert [e.data["by"] for e in log] == ["a", "b"] and log[1].seq == log[0].seq + 1  # b's follows a's

    def test_a_save_whose_flags_are_not_bools_is_an_argument_error_and_writes_nothing(self) -> None:
        """Each decides what a save does: a value that is no bool is refused before anything is read or
        written, whatever the store's usual step would have made of it."""
        store = self.run_store()
        sid = new_id("flags")
        held = store.acquire(sid, new_holder(), 30)
        history = [Message.user("q")]
        store.save_fenced(sid, held, history, take_steers=False)
        store.add_steer(sid, "waiting")
        step = [*history, Message.assistant("a")]
        saves: list[Any] = [store.save_fenced,
                            functools.partial(store.save_fenced_events, events=[encode("note", {})], keep=10)]
        for save in saves:
            for bad in ("yes", "", None, 1, 0):
                with pytest.raises(agent.ArgumentError, match="take_steers"):
                    save(sid, held, step, take_steers=bad)
                with pytest.raises(agent.ArgumentError, match="replace"):
                    save(sid, held, step, take_steers=True, replace=bad)
        assert self.another(store).messages(sid) == history and store.events(sid, 0, 10) == []
        assert store.save_fenced(sid, held, step, take_steers=True).steers == ["waiting"]

    def test_the_first_fenced_save_must_extend_the_stored_transcript(self) -> None:
        store = self.run_store()
        sid = new_id("cas")
        history = [Message.user("q1"), Message.assistant("a1")]
        store.save(sid, history)
        store.add_steer(sid, "waiting")
        for cold in (store, self.another(store)):  # what this object knows, and a store object that knows nothing
            held = cold.acquire(sid, new_holder(), 30)
            for given in ([Message.user("q2")], history[:1], [history[0], Message.assistant("other"),
                                                               Message.user("q2")], []):
                with pytest.raises(agent.TranscriptConflict) as conflict:
                    cold.save_fenced(sid, held, given, take_steers=True)
                assert (conflict.value.session, conflict.value.stored, conflict.value.given) == (
                    sid, 2, len(given))
                assert str(len(given)) in str(conflict.value) and sid in str(conflict.value)
            assert store.messages(sid) == history
            cold.release(sid, held)
        held = store.acquire(sid, new_holder(), 30)
        assert store.take_steers(sid) == ["waiting"]  # no refused save took it
        assert store.save_fenced(sid, held, history, take_steers=True).steers == []  # the same: nothing new
        assert store.save_fenced(sid, held, [*history, Message.user("q2")], take_steers=True).steers == []
        assert store.messages(sid) == [*history, Message.user("q2")]
        replaced = [Message.user("a new history")]
        assert store.save_fenced(sid, held, replaced, take_steers=False, replace=True).steers == []
        assert self.another(store).messages(sid) == replaced

    # -- the usual step: new messages appended to the transcript this object knows ---------------------

    def _stepped(self, tag: str) -> tuple[RunStore, str, Holder, list[Message]]:
        """A run two steps in: its list is the very objects this store object saved."""
        store = self.run_store()
        sid = new_id(tag)
        held = store.acquire(sid, new_holder(), 30)
        msgs = [Message.user("q1")]
        store.save_fenced(sid, held, msgs, take_steers=True)
        msgs += [Message.assistant("a1"), Message.user("q2")]
        store.save_fenced(sid, held, msgs, take_steers=True)
        return store, sid, held, msgs

    def test_a_step_over_an_earlier_message_replaced_or_cut_is_refused_and_over_an_equal_one_saved(self) -> None:
        store, sid, held, msgs = self._stepped("step-changed")
        stored = list(msgs)
        changed = [[*msgs[:i], Message.user(f"changed {i}"), *msgs[i + 1:], Message.assistant("a2")]
                   for i in range(len(msgs))]
        shorter = [msgs[:2], [*msgs[:2], Message.assistant("other")], [*msgs[:1], *msgs[2:]]]
        for given in changed + shorter:
            with pytest.raises(agent.TranscriptConflict):
                store.save_fenced(sid, held, given, take_steers=True)
            assert self.another(store).messages(sid) == stored  # nothing of it saved, not silently unsaved
        msgs.append(Message.assistant("a2"))  # a save after the failed ones
        store.save_fenced(sid, held, msgs, take_steers=True)
        msgs[1] = Message.assistant("a1")  # an earlier message replaced by an equal object: saved
        msgs.append(Message.user("q3"))
        store.save_fenced(sid, held, msgs, take_steers=True)
        msgs.append(Message.assistant("a3"))  # and the step after it, over the replacement
        store.save_fenced(sid, held, msgs, take_steers=True)
        assert self.another(store).messages(sid) == msgs and store.messages(sid) == msgs

    def test_threads_stepping_one_session_on_one_store_object_never_lose_a_step(self) -> None:
        """Of two threads stepping from the same transcript one is saved; what the store object knows stays what
        is stored, so the next round steps from the winner's."""
        store, sid, held, msgs = self._stepped("step-threads-")
        for round in range(8):
            lists = [[*msgs, Message.assistant(f"round {round} by {t}")] for t in range(2)]
            saved = _race(store, sid, held, lists)
            assert len(saved) == 1, saved
            msgs = lists[saved[0]]
            assert self.another(store).messages(sid) == msgs
        msgs.append(Message.user("after"))
        store.save_fenced(sid, held, msgs, take_steers=True)
        assert self.another(store).messages(sid) == msgs

    # -- the six scenarios -------------------------------------------------------------------------------

    def test_1_a_run_taken_over_while_it_waited_on_the_model_cannot_save_its_answer(self) -> None:
        store = self.run_store()
        sid = new_id("s1")
        stalled, other = Stalled(store), self.another(store)
        store.save(sid, [Message.user("q1"), Message.assistant("a1")])
        newer: dict[str, Any] = {}

        msgs = [*store.messages(sid), Message.user("A's question")]
        with pytest.raises(agent.LeaseLost):
            agent.Runner().run(agent.Spec(session=agent.open(sid, stalled), lease_ttl=TTL), msgs,
                               Answer("A's late answer", before=lambda _: self._taken_over(stalled, other, sid, newer)))
        assert newer["result"].stop_reason == "answered"
        assert _state(store, sid) == newer["state"]
        assert store.messages(sid) == newer["result"].messages
        assert store.messages(sid)[-1] == Message.assistant("B")

    def test_2_a_run_whose_lapsed_lease_was_taken_and_released_never_runs_its_next_tool(self) -> None:
        store = self.run_store()
        sid = new_id("s2")
        stalled, other = Stalled(store), self.another(store)
        charged: list[str] = []
        newer: dict[str, Any] = {}
        taken_over = self._taken_over
        charge = noting(charged, "charge", "charged", idempotent=False)

        class StallsThenCalls(ToolsThenAnswer):
            def complete(self, system: str, messages: Any, tools: Any) -> Message:
                if not newer:
                    taken_over(stalled, other, sid, newer)
                return super().complete(system, messages, tools)

        with pytest.raises(agent.LeaseLost):
            agent.Runner().run(agent.Spec(session=agent.open(sid, stalled), tools=[charge], lease_ttl=TTL),
                               [Message.user("A's question")], StallsThenCalls(["charge"]))
        assert charged == []
        assert newer["state"][2] is None  # B released the lease, so A's lapsed lease was free
        assert _state(store, sid) == newer["state"]
        no_orphans(store.messages(sid))

    def test_4_of_two_concurrent_resumes_of_a_crashed_run_one_finishes_and_the_tool_runs_once(self) -> None:
        store = self.run_store()
        sid = new_id("s4")
        charges: list[str] = []
        charge = noting(charges, "charge", "charged", False, {"charge"})  # dies the first time, after its effect
        spec = agent.Spec(session=agent.open(sid, store), tools=[charge])
        with pytest.raises(Crash):
            agent.Runner().run(spec, [Message.user("charge the card")], ToolsThenAnswer(["charge"]))
        stores = [store, self.another(store)]
        reads = [s.messages(sid) for s in stores]  # a redelivered task and a retry, each reading first
        models = [ToolsThenAnswer(["charge"]) for _ in stores]
        runs = [agent.Runner().start(agent.Spec(session=agent.open(sid, s), tools=[charge], lease_wait=60), msgs, m)
                for s, msgs, m in zip(stores, reads, models, strict=True)]
        outcomes: list[Any] = []
        for run in runs:
            try:
                outcomes.append(run.wait(60))
            except agent.TranscriptConflict as exc:
                outcomes.append(exc)
        finished = [o for o in outcomes if isinstance(o, agent.Result)]
        assert len(finished) == 1 and len(outcomes) == 2, outcomes
        # the one that waited for the lease refused to write its stale history, before asking its model
        assert [m.requests for m in models] == [int(isinstance(o, agent.Result)) for o in outcomes]
        assert charges == ["charge"] and store.holder(sid) is None
        stored = store.messages(sid)
        assert stored == finished[0].messages
        assert _results(stored, 2)["call_0_0"].text == UNKNOWN_OUTCOME
        assert store.journal(sid) is None
        no_orphans(stored)

    def test_5_a_thawed_zombie_cannot_replace_the_live_holders_journal(self) -> None:
        store = self.run_store()
        sid = new_id("s5")
        stalled, other = Stalled(store), self.another(store)
        ran: list[str] = []
        inside, thawed, go_on = threading.Event(), threading.Event(), threading.Event()

        @agent.tool(idempotent=False)
        def charge(n: int) -> str:
            """The zombie's tool: it stalls in here."""
            ran.append("charge")
            stalled.freeze()
            inside.set()
            thawed.wait(60)
            return "charged"

        @agent.tool(idempotent=False)
        def refund(n: int) -> str:
            """The live holder's tool: it dies in here, after the zombie tried to write."""
            ran.append("refund")
            if ran.count("refund") == 1:
                entered_refund.set()
                go_on.wait(60)
                raise Crash
            return "refunded"

        entered_refund = threading.Event()
        zombie = agent.Runner().start(
            agent.Spec(session=agent.open(sid, stalled), tools=[charge, refund], lease_ttl=TTL),
            [Message.user("charge, then refund")], ToolsThenAnswer(["charge"]))
        assert inside.wait(60)
        self._expire(other, sid)
        spec = agent.Spec(session=agent.open(sid, other), tools=[charge, refund])
        holder_run = agent.Runner().start(spec, other.messages(sid), ToolsThenAnswer(["refund"], rounds=2))
        assert entered_refund.wait(60)
        live = _state(store, sid)
        assert live[1] is not None and "call_1_0" in live[1]  # the holder's journal: refund started
        stalled.thaw()
        thawed.set()
        with pytest.raises(agent.LeaseLost):
            zombie.wait(60)
        assert _state(store, sid) == live
        go_on.set()
        with pytest.raises(Crash):
            holder_run.wait(60)
        result = agent.Runner().run(spec, store.messages(sid), ToolsThenAnswer(["refund"], rounds=2))
        assert result.stop_reason == "answered"
        assert ran == ["charge", "refund"]
        stored = store.messages(sid)
        assert _results(stored, 2)["call_0_0"].text == UNKNOWN_OUTCOME
        assert _results(stored, 4)["call_1_0"].text == UNKNOWN_OUTCOME
        no_orphans(stored)

    def test_6_a_cancelled_resume_keeps_what_ran_and_skips_only_what_never_started(self) -> None:
        store = self.run_store()
        sid = new_id("s6")
        ran: list[str] = []  # lookup finishes, charge dies after its effect, notify never starts
        tools = [noting(ran, "lookup", "looked up"), noting(ran, "charge", "charged", False, {"charge"}),
                 noting(ran, "notify", "notified")]
        with pytest.raises(Crash):
            agent.Runner().run(agent.Spec(session=agent.open(sid, store), tools=tools), [Message.user("go")],
                               ToolsThenAnswer(["lookup", "charge", "notify"]))
        cancelling = Stalled(self.another(store))
        def cancel(session: str, held: Holder) -> None:  # a cancel lands as the run resumes
            assert store.cancel(session)

        cancelling.on_acquire = cancel
        result = agent.Runner().run(agent.Spec(session=agent.open(sid, cancelling), tools=tools),
                                    store.messages(sid), ToolsThenAnswer(["lookup", "charge", "notify"]))
        assert result.stop_reason == "cancelled" and result.steps == 0
        assert ran == ["lookup", "charge"]
        stored = store.messages(sid)
        assert stored == result.messages
        results = _results(stored, 2)
        assert results["call_0_0"].text == "looked up" and not results["call_0_0"].is_error
        assert results["call_0_1"].text == UNKNOWN_OUTCOME
        assert results["call_0_2"].text == CANCELLED
        assert store.journal(sid) is None
        no_orphans(stored)

    # -- concurrent first saves ------------------------------------------------------------------------

    @pytest.mark.parametrize("apart", ["threads", "processes"])
    def test_concurrent_first_saves_of_a_new_session_leave_exactly_one_of_them(self, apart: str) -> None:
        store = self.make_store()
        sids = [new_id("first") for _ in range(ROUNDS)]
        if apart == "processes":
            in_processes(self.factory(), WRITERS, _first_saver, sids, timeout=300)
        else:
            writers, barrier = [self.another(store) for _ in range(WRITERS)], threading.Barrier(WRITERS)
            together(WRITERS, lambda i: _first_saver(writers[i], i, barrier, sids), 300)
        for r, sid in enumerate(sids):
            stored = store.messages(sid)
            assert stored in [_transcript(i, r) for i in range(WRITERS)], f"round {r}: stored {stored}"

    def test_first_fenced_saves_of_successive_holders_leave_one_of_them(self) -> None:
        """Each writer takes the lease over once the previous one's lapsed (a short ttl), so their first fenced
        saves overlap: a superseded one is LeaseLost, and one whole transcript that succeeded is stored."""
        store = self.run_store()
        writers = [self.another(store) for _ in range(WRITERS)]
        for r in range(ROUNDS // 4):
            sid = new_id("fenced")

            def run(i: int, sid: str = sid, r: int = r) -> bool:
                own, mine = writers[i], new_holder()
                deadline = time.monotonic() + 60
                while (held := own.acquire(sid, mine, 0.05)).token != mine.token:
                    assert time.monotonic() < deadline, "the lease never came free"
                    time.sleep(0.01)
                try:
                    own.save_fenced(sid, held, _transcript(i, r), take_steers=True, replace=True)
                    return True
                except agent.LeaseLost:
                    return False  # taken over meanwhile: refused, which is right

            saved = [i for i, ok in enumerate(together(WRITERS, run, 90)) if ok]
            stored = store.messages(sid)
            assert saved and stored in [_transcript(i, r) for i in saved], f"round {r}: stored {stored}, saved {saved}"

    # -- the cancel flag a fenced save returns ---------------------------------------------------------

    def test_every_fenced_save_reports_a_cancel_and_a_takeover_starts_without(self) -> None:
        store = self.run_store()
        saves: list[tuple[str, dict[str, Any]]] = [("save_fenced", {})]
        if Capability.EVENTS in self.capabilities:
            saves.append(("save_fenced_events", {"events": [encode("note", {})], "keep": 100}))
        for name, extra in saves:

            def save(s: Any, sid: str, held: Holder, msgs: list[Message], take: bool,
                     name: str = name, extra: dict[str, Any] = extra) -> Saved:
                saved: Saved = getattr(s, name)(sid, held, msgs, take_steers=take, **extra)
                return saved

            for take in (True, False):
                how = f"{name}(take_steers={take})"
                sid = new_id("cancel")
                msgs = [Message.user(f"m{i}") for i in range(6)]
                a = store.acquire(sid, new_holder(), 0.3)
                assert save(store, sid, a, msgs[:1], take).cancelled is False, f"{how}: the first write"
                assert save(store, sid, a, msgs[:2], take).cancelled is False, f"{how}: an append"
                assert store.cancel(sid) is True
                assert save(store, sid, a, msgs[:3], take).cancelled is True, f"{how}: an append after a cancel"
                assert save(store, sid, a, msgs[:3], take).cancelled is True, f"{how}: nothing new after a cancel"
                cold = self.another(store)  # knows nothing: its save is a first write
                assert save(cold, sid, a, msgs[:4], take).cancelled is True, f"{how}: a first write after a cancel"
                assert store.messages(sid) == msgs[:4], f"{how}: a cancelled run's saves are still stored"
                wait_for(lambda: store.holder(sid) is None, "the lease to lapse on the store's clock")  # noqa: B023
                b = store.acquire(sid, new_holder(), 30)  # handed the cancel; its own lease starts without
                assert b.epoch > a.epoch and b.cancelled is True
                assert save(store, sid, b, msgs[:5], take).cancelled is False, f"{how}: an append after a takeover"
                assert save(store, sid, b, msgs[:5], take).cancelled is False, f"{how}: nothing new after a takeover"
                cold = self.another(store)
                assert save(cold, sid, b, msgs, take).cancelled is False, f"{how}: a first write after a takeover"
                assert store.cancel(sid) is True
                assert save(store, sid, b, [*msgs, Message.user("z")], take).cancelled is True, (
                    f"{how}: the new holder's append after a cancel")
                store.release(sid, b)
