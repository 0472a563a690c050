"""The RunStore part of the contract: fork, the tool journal, the run lease and cancel."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

import pytest

import agent_sessions as agent
from agent_sessions import Content, Message, Role, RunStore
from agent_sessions.contract import CancelWatcher
from agent_sessions.journal import UNKNOWN_OUTCOME
from agent_sessions.run.react import CANCELLED

from . import crossprocess
from .capabilities import Capability
from .crossprocess import wait_for
from .mixin import ContractMixin, Crash, add_and_take, call, new_holder, new_id, no_orphans, noting, stand_in, together
from .scripted import Replies, ToolsThenAnswer


@contextmanager
def _hearing(store: RunStore, sid: str) -> Iterator[None]:
    """Around a cancel of ``sid``'s run made from elsewhere: where ``store`` pushes cancels (``CancelWatcher``),
    wait until it was heard here, when the check before an idempotent tool is promised to see it."""
    holder = store.holder(sid) if isinstance(store, CancelWatcher) else None
    if holder is None:
        yield
        return
    watch = cast(CancelWatcher, store).watch_cancel(sid, holder)
    try:
        listening = watch.listening()
        yield
        if listening is not None:
            wait_for(lambda: watch.cancelled(None) is True or watch.listening() != listening,
                     "the cancel to be heard in this process", 30)
    finally:
        watch.close()


class RunStoreContract(ContractMixin):
    # -- steers taken with the save ------------------------------------------------------------------

    def test_a_fenced_save_appends_the_waiting_steers_and_saves_them_together(self) -> None:
        store = self.run_store()
        sid = new_id()
        held = store.acquire(sid, new_holder(), 30)
        base = [Message.user("q"), call("c1"), Message(Role.USER, [Content.tool_result("c1", "r")])]
        assert store.save_fenced(sid, held, base, take_steers=True) == agent.Saved([], False)
        assert store.messages(sid) == base
        store.add_steer(sid, "first")
        store.add_steer(sid, "second 日本語")
        saved = store.save_fenced(sid, held, base, take_steers=True)
        assert saved == agent.Saved(["first", "second 日本語"], False)
        assert store.messages(sid) == [*base, Message.user("first"), Message.user("second 日本語")]
        assert store.take_steers(sid) == []
        assert self.another(store).messages(sid)[2].content[0].text == "r"
        with pytest.raises(agent.ArgumentError):
            store.save_fenced(sid, held, ["not a message"], take_steers=True)  # type: ignore[list-item]
        store.add_steer(sid, "kept")
        with pytest.raises(agent.ArgumentError):
            store.save_fenced("", held, base, take_steers=True)
        grown = [*base, Message.user("first"), Message.user("second 日本語"), Message.assistant("a")]
        assert store.save_fenced(sid, held, grown, take_steers=False).steers == []
        assert store.messages(sid) == grown
        assert store.take_steers(sid) == ["kept"]

    def test_fenced_saves_hand_each_steer_over_once_beside_concurrent_adders_and_takers(self) -> None:
        store = self.run_store()
        sid = new_id()
        held = store.acquire(sid, new_holder(), 60)
        adders, per_adder = 4, 25
        saved: list[Message] = [Message.user("start")]

        def save(sid: str) -> list[str]:
            """The holder's fenced save, taking the steers."""
            got = store.save_fenced(sid, held, saved, take_steers=True).steers
            saved.extend(Message.user(t) for t in got)
            return got

        by_saver, by_taker = add_and_take(sid, [self.another(store).add_steer for _ in range(adders)],
                                          [save, self.another(store).take_steers], per_adder)
        assert sorted(by_saver + by_taker) == sorted(f"s{i}-{j:04d}" for i in range(adders) for j in range(per_adder))
        stored = store.messages(sid)
        assert stored == saved
        assert [m.text for m in stored[1:]] == by_saver  # each saved exactly where it was taken
        for i in range(adders):
            mine = [t for t in by_saver if t.startswith(f"s{i}-")]
            assert mine == sorted(mine)

    # -- fork ----------------------------------------------------------------------------------------

    def test_a_fork_copies_the_transcript_or_its_head_and_then_each_goes_its_own_way(self) -> None:
        store = self.run_store()
        src, whole, head, empty, cut = (new_id(tag) for tag in ("src", "whole", "head", "empty", "cut"))
        msgs = [Message.user("q"), call("c1"), Message(Role.USER, [Content.tool_result("c1", "r")]),
                Message.assistant("a")]
        store.save(src, msgs)
        store.add_steer(src, "for the original")
        keyed = Capability.STEER_KEYS in self.capabilities
        if keyed:  # and the keys of its steers
            assert store.add_steer_once(src, "for the original", "k") is True
        store.fork(src, whole, None)
        store.fork(src, empty, 0)
        store.fork(src, new_id("end"), len(msgs))
        session = agent.open(src, store)
        fork = session.fork(head, at=3)
        assert store.messages(whole) == msgs and store.messages(empty) == [] and store.messages(head) == msgs[:3]
        assert store.messages(head)[1].tool_calls[0].arguments == '{"z":1,"a":[1, 2],"z":3}'
        with pytest.raises(agent.ArgumentError, match="tool calls whose results would be cut off"):
            store.fork(src, cut, 2)
        with pytest.raises(agent.ArgumentError, match="allow_unanswered"):
            session.fork(cut, at=2)
        assert store.messages(cut) == []
        session.fork(cut, at=2, allow_unanswered=True)
        assert store.messages(cut) == msgs[:2]
        assert fork.take_steers() == []
        assert not keyed or store.add_steer_once(head, "for the fork", "k") is True
        fork.save([*msgs[:3], Message.user("fork only")])
        session.save([*msgs, Message.user("original only")])
        assert store.messages(head) == [*msgs[:3], Message.user("fork only")]
        assert store.messages(src) == [*msgs, Message.user("original only")]
        assert session.take_steers() == ["for the original"] * (1 + keyed)
        assert fork.take_steers() == ["for the fork"] * keyed

    def test_fork_refuses_a_bad_index_a_missing_source_and_an_existing_target(self) -> None:
        store = self.run_store()
        src, taken = new_id("src"), new_id("taken")
        store.save(src, [Message.user("a"), Message.user("b")])
        store.save(taken, [Message.user("kept")])
        for bad in (3, -1, 1.5, True, "1"):
            with pytest.raises(agent.ArgumentError, match="fork"):
                store.fork(src, new_id("bad"), bad)  # type: ignore[arg-type]
        with pytest.raises(agent.ArgumentError, match="no transcript"):
            store.fork(new_id("never-saved"), new_id("x"), None)
        with pytest.raises(agent.SessionExists, match="already has a transcript"):
            store.fork(src, taken, None)
        with pytest.raises(agent.ArgumentError):
            store.fork(src, "", None)
        assert store.messages(taken) == [Message.user("kept")]
        assert store.messages(src) == [Message.user("a"), Message.user("b")]

    def test_concurrent_forks_to_one_target_make_it_once(self) -> None:
        store = self.run_store()
        src, dst = new_id("src"), new_id("dst")
        store.save(src, [Message.user(f"m{i}") for i in range(20)])
        others = [self.another(store) for _ in range(6)]

        def fork(i: int) -> str:
            try:
                others[i].fork(src, dst, i)
                return f"made {i}"
            except agent.SessionExists:
                return "exists"

        outcomes = together(6, fork)
        made = [o for o in outcomes if o.startswith("made")]
        assert len(made) == 1 and len(outcomes) == 6, outcomes
        assert len(store.messages(dst)) == int(made[0].split()[1])

    # -- lease ---------------------------------------------------------------------------------------

    def test_a_lease_is_held_renewed_released_and_each_new_holder_raises_the_epoch(self) -> None:
        store = self.run_store()
        sid = new_id()
        assert store.holder(sid) is None
        a = store.acquire(sid, new_holder("a"), 30)
        assert a.token == "a" * 32 and a.epoch >= 1 and a.cancelled is False
        assert store.holder(sid) == a
        assert store.acquire(sid, new_holder("b"), 30) == a  # live: b is refused and told who holds it
        store.renew(sid, a, 60)
        renewed = store.holder(sid)
        assert renewed is not None and renewed.token == a.token and renewed.epoch == a.epoch
        assert renewed.expires > a.expires
        store.release(sid, a)
        assert store.holder(sid) is None
        b = store.acquire(sid, new_holder("b"), 30)
        assert b.token == "b" * 32 and b.epoch > a.epoch
        store.release(sid, a)  # not a's any more: nothing happens
        assert store.holder(sid) == b
        with pytest.raises(agent.LeaseLost):
            store.renew(sid, a, 30)
        epochs = [b.epoch]
        for i in range(3):
            store.release(sid, store.holder(sid) or b)
            epochs.append(store.acquire(sid, new_holder(str(i)), 30).epoch)
        assert epochs == sorted(set(epochs)), f"the epoch must grow with every new holder: {epochs}"

    def test_a_save_whose_refusal_went_unanswered_still_takes_the_waiting_steer(self) -> None:
        """The first save of a resume is refused (a steer waits) and the answer of that refusal is lost: read
        back, the save did not land, so the run saves again and takes the steer."""
        store: Any = self.run_store()
        if getattr(store, "backend", None) is None:
            pytest.skip("a store without a backend to lose an answer below")
        backend: Any = store.backend
        sid = new_id()
        store.save(sid, [Message.user("the question")])
        store.add_steer(sid, "and mind the expiry")
        lost: list[bool] = []

        class LosesARefusal:
            def __getattr__(self, name: str) -> Any:
                return getattr(backend, name)

            def write(self, session: str, guard: Any, change: Any) -> Any:
                written = backend.write(session, guard, change)
                if not written.done and not lost and guard.no_steers:
                    lost.append(True)
                    raise agent.OutcomeUnknown("the answer of a refused write was lost (test)")
                return written

        model = Replies()
        with stand_in(store, LosesARefusal()):
            agent.Runner().run(agent.Spec(session=agent.open(sid, store)), store.messages(sid), model)
        assert lost == [True]
        assert [[m.text for m in asked] for asked in model.requests] == [["the question", "and mind the expiry"]]
        assert store.pending_steers(sid) == []

    def test_a_failed_run_gives_no_steer_back_to_a_session_deleted_meanwhile(self) -> None:
        """A steer given to the run (``Run.steer``) is given back fenced by its lease (a new conversation under
        the id would take it): it is handed back on the exception instead."""
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id()
        held: list[agent.Run] = []
        started = threading.Event()
        other: Any = self.another(store)

        class DeletesThenFails:
            def complete(self, system: str, messages: Any, tools: Any) -> Message:
                assert started.wait(30)
                held[0].steer("a late thought")
                assert other.delete(sid, force=True)
                raise agent.EndpointError("the model is down")

        run = agent.Runner().start(agent.Spec(session=agent.open(sid, store)), [Message.user("q")],
                                   DeletesThenFails())
        held.append(run)
        started.set()
        with pytest.raises(agent.AgentError) as failed:
            run.wait(30)
        assert getattr(failed.value, "unapplied_steers", None) == ["a late thought"]
        assert other.pending_steers(sid) == [] and other.messages(sid) == []

    def test_cancel_marks_a_held_lease_a_renewal_keeps_it_and_the_next_holder_is_handed_it(self) -> None:
        store = self.run_store()
        sid = new_id()
        assert store.cancel(sid) is False
        a = store.acquire(sid, new_holder("a"), 30)
        assert a.cancelled is False and store.check(sid, a) is False
        assert store.cancel(sid) is True
        assert store.check(sid, a) is True
        store.renew(sid, a, 30)
        assert store.check(sid, a) is True and (store.holder(sid) or a).cancelled is True
        store.release(sid, a)
        assert store.cancel(sid) is False  # nobody holds it now
        b = store.acquire(sid, new_holder("b"), 0.2)
        assert b.cancelled is True, "a released lease's cancel is handed to the next holder"
        # ``Lease`` asks an acquisition whose answer was lost again, with the same token: the same answer
        again = store.acquire(sid, new_holder("b"), 0.2)
        assert (again.token, again.epoch, again.cancelled) == (b.token, b.epoch, True)
        assert store.check(sid, b) is False  # whose own lease starts without one
        store.release(sid, b)
        b1 = store.acquire(sid, new_holder("b1"), 30)
        assert b1.cancelled is True, "a handed cancel its holder did not act on is handed on"
        store.save_fenced(sid, b1, [Message.user("the next question")], take_steers=True, closes=True)
        store.release(sid, b1)
        b2 = store.acquire(sid, new_holder("b2"), 0.2)
        assert b2.cancelled is False, "a handed cancel a save closed is spent"
        wait_for(lambda: store.holder(sid) is None, "the lease to expire on the store's clock")
        store.renew(sid, b2, 0.2)  # lapsed, but nobody took it: still b2's, its epoch unchanged, and it writes
        held = store.holder(sid)
        assert held is not None and held == replace(b2, expires=held.expires)
        assert store.save_fenced(sid, b2, [Message.user("the next question"), Message.user("still mine")],
                                 take_steers=True).steers == []
        wait_for(lambda: store.holder(sid) is None, "the lease to expire on the store's clock")
        assert store.cancel(sid) is True  # lapsed, but nobody took it: b2 may be alive, renewing late
        assert store.check(sid, b2) is True
        c = store.acquire(sid, new_holder("c"), 30)
        assert c.cancelled is True, "a dead holder's cancel is handed to the run taking over"
        assert store.check(sid, c) is False
        held = self.another(store).holder(sid)
        assert held is not None and held.token == c.token and not held.cancelled

    def test_concurrent_acquires_give_the_lease_to_one(self) -> None:
        store = self.run_store()
        sid = new_id()
        others = [self.another(store) for _ in range(8)]
        got = together(8, lambda i: others[i].acquire(sid, new_holder(str(i)), 30))
        winners = [h for i, h in enumerate(got) if h.token == new_holder(str(i)).token]
        assert len(winners) == 1, winners
        assert store.holder(sid) == winners[0]

    def test_a_second_run_of_a_held_session_is_refused_or_waits(self) -> None:
        store = self.run_store()
        sid = new_id()
        entered, release = threading.Event(), threading.Event()

        @agent.tool
        def hold(n: int) -> str:
            """Keep the run busy."""
            entered.set()
            release.wait(30)
            return "held"

        first = agent.Runner().start(agent.Spec(session=agent.open(sid, store), tools=[hold]),
                                     [Message.user("go")], ToolsThenAnswer(["hold"]))
        assert entered.wait(30)
        holder = agent.open(sid, self.another(store)).holder()
        assert holder is not None and holder.expires > time.time()
        assert (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
        with pytest.raises(agent.SessionBusy, match=f"held by pid {os.getpid()}") as busy:
            agent.Runner().run(agent.Spec(session=agent.open(sid, self.another(store))),
                               [Message.user("me too")], ToolsThenAnswer([]))
        assert busy.value.holder == holder
        waiting = agent.Runner().start(agent.Spec(session=agent.open(sid, self.another(store)), lease_wait=30,
                                                  replace_transcript=True),
                                       [Message.user("after you")], ToolsThenAnswer([]))
        time.sleep(0.2)
        assert not waiting.done()
        release.set()
        assert first.wait(30).stop_reason == "answered"
        assert waiting.wait(30).stop_reason == "answered"
        assert agent.open(sid, store).holder() is None
        assert store.messages(sid)[0].text == "after you"  # replaced, as that run asked

    # -- cancel --------------------------------------------------------------------------------------

    def test_a_cancel_between_two_tool_calls_skips_the_second_and_answers_both(self) -> None:
        store = self.run_store()
        sid = new_id()
        ran: list[str] = []

        @agent.tool
        def first(n: int) -> str:
            """Runs, then cancels its own run from elsewhere (and, where the store pushes the cancel, returns
            once this process has heard it: the bound of the check before an idempotent tool)."""
            ran.append("first")
            with _hearing(store, sid):
                assert agent.open(sid, self.another(store)).cancel() is True
            return "first done"

        @agent.tool
        def second(n: int) -> str:
            """Must not run."""
            ran.append("second")
            return "second done"

        model = ToolsThenAnswer(["first", "second"], rounds=5)
        result = agent.Runner().run(agent.Spec(session=agent.open(sid, store), tools=[first, second]),
                                    [Message.user("go")], model)
        assert result.stop_reason == "cancelled" and result.steps == 1 and model.requests == 1
        assert ran == ["first"]
        stored = store.messages(sid)
        assert stored == result.messages and agent.open(sid, store).holder() is None
        no_orphans(stored)
        results = {c.tool_call_id: c for c in stored[-1].content}
        assert results["call_0_0"].text == "first done" and not results["call_0_0"].is_error
        assert results["call_0_1"].is_error and results["call_0_1"].text == CANCELLED

    def test_a_store_that_watches_for_cancels_never_vouches_for_a_lease_cancelled_since(self) -> None:
        """``contract.CancelWatcher``: once a cancel of its lease was committed, ``True`` where the cancel is
        pushed (PostgreSQL), else ``None`` and the run's read finds it (SQLite knows only that something was
        committed). Another session's cancel never answers ``True``."""
        store = self.run_store()
        if not isinstance(store, CancelWatcher):
            pytest.skip("the store does not watch for cancels (agent_sessions.contract.CancelWatcher)")
        sid, other = new_id("push"), new_id("push-other")
        held = store.acquire(sid, new_holder(), 30)
        mine = store.watch_cancel(sid, held)
        theirs = store.watch_cancel(other, store.acquire(other, new_holder(), 30))
        try:
            wait_for(lambda: mine.listening() is not None, "the store to listen", 30)
            since, their_since = mine.listening(), theirs.listening()
            assert mine.cancelled(since) is False and mine.cancelled(None) is None
            assert self.another(store).cancel(other) is True
            wait_for(lambda: theirs.cancelled(their_since) is not False, "the other session's cancel to reach "
                     "its watch", 30)
            pushed = theirs.cancelled(their_since) is True
            assert mine.cancelled(since) is (False if pushed else None)
            since = mine.listening()
            assert self.another(store).cancel(sid) is True
            wait_for(lambda: mine.cancelled(since) is not False, "the cancel to reach the watch", 30)
            if pushed:
                wait_for(lambda: mine.cancelled(since) is True, "the cancel to be pushed", 30)
            else:
                assert mine.cancelled(since) is None
                assert store.check(sid, held) is True  # the read the run makes instead
        finally:
            mine.close()
            theirs.close()

    # -- journal and orphans ---------------------------------------------------------------------------

    def test_journal_round_trips_byte_for_byte_and_a_writing_save_drops_it(self) -> None:
        store = self.run_store()
        a, b = new_id(), new_id()
        ha, hb = store.acquire(a, new_holder(), 30), store.acquire(b, new_holder(), 30)
        assert store.journal(a) is None
        assert store.put_journal(a, ha, '{"z":1,"z":2} ünï \U0001f600') is False
        store.put_journal(b, hb, "other")
        assert store.journal(a) == '{"z":1,"z":2} ünï \U0001f600'
        store.put_journal(a, ha, "replaced")
        assert store.journal(a) == "replaced"
        store.save_fenced(a, ha, [], take_steers=True)  # nothing to write: nothing written
        assert store.journal(a) == "replaced"
        store.save_fenced(a, ha, [Message.user("q")], take_steers=True)
        assert store.journal(a) is None and store.journal(b) == "other"
        store.put_journal(a, ha, "again")
        store.add_steer(a, "a steer alone is something to write")
        assert store.save_fenced(a, ha, [Message.user("q")], take_steers=True).steers == [
            "a steer alone is something to write"]
        assert store.journal(a) is None
        store.cancel(b)
        assert store.put_journal(b, hb, "a call about to start", unless_cancelled=True) is True
        assert store.journal(b) == "other"  # cancelled: nothing written
        assert store.put_journal(b, hb, "a result, kept", unless_cancelled=False) is True
        assert store.journal(b) == "a result, kept"

    def test_the_step_after_a_journal_drops_it_and_keeps_every_guard_of_the_step(self) -> None:
        """A run's usual step right after its journal write (a non-idempotent tool's start) meets a steer, a
        cancel or a takeover landed in between as it would without a journal."""
        store = self.run_store()
        other = self.another(store)
        sid = new_id()
        held = store.acquire(sid, new_holder("a"), 30)

        def step(msgs: list[Message], n: int) -> list[Message]:
            """The transcript after the reply's call ran and the model called again."""
            calls = msgs[-1].tool_calls
            results = [Message(Role.USER, [Content.tool_result(calls[0].id, f"charged {n}")])] if calls else []
            return [*msgs, *results, call(f"c{n}")]

        msgs = [Message.user("q"), call("c0")]
        store.save_fenced(sid, held, msgs, take_steers=True)
        for n, landed in enumerate(("nothing", "steer", "cancel"), 1):
            store.put_journal(sid, held, f'{{"started": {n}}}', unless_cancelled=landed != "cancel")
            if landed == "steer":
                other.add_steer(sid, "between the journal and the step")
            elif landed == "cancel":
                other.cancel(sid)
            msgs = step(msgs, n)
            saved = store.save_fenced(sid, held, msgs, take_steers=True)
            if landed == "steer":
                assert saved.steers == ["between the journal and the step"]
                msgs = [*msgs, Message.user("between the journal and the step")]
            assert saved.cancelled is (landed == "cancel"), landed
            assert store.journal(sid) is None and other.journal(sid) is None, f"{landed}: the journal is dropped"
            assert other.messages(sid) == msgs, landed
        store.put_journal(sid, held, '{"started": "last"}', unless_cancelled=False)
        store.release(sid, held)
        taker = other.acquire(sid, new_holder("b"), 30)
        with pytest.raises(agent.LeaseLost):
            store.save_fenced(sid, held, step(msgs, 9), take_steers=True)
        assert other.journal(sid) == '{"started": "last"}' and other.messages(sid) == msgs
        other.release(sid, taker)

    @pytest.mark.parametrize(("reply", "dies", "runs", "results"), [
        # Idempotent calls first: nothing is journalled until the non-idempotent one starts (their results
        # ride with the next save), so the first resume asks again and they run again.
        (["lookup", "refresh", "charge"], {"refresh", "charge"},
         [["lookup", "refresh"], ["lookup", "refresh", "charge"], []], ["looked up", "refreshed", UNKNOWN_OUTCOME]),
        # A non-idempotent call first: its result is journalled before the calls after it run, and replayed.
        (["charge", "refresh", "lookup"], {"refresh"},
         [["charge", "refresh"], ["refresh", "lookup"]], ["charged", "refreshed", "looked up"]),
    ], ids=["idempotent-first", "non-idempotent-first"])
    def test_a_resumed_run_replays_finished_tools_reruns_idempotent_ones_and_never_repeats_the_rest(
        self, reply: list[str], dies: set[str], runs: list[list[str]], results: list[str]
    ) -> None:
        """The worker dies inside each tool of ``dies`` the first time it runs; each resume (another worker's)
        runs what ``runs`` says, the last to its answer; the reply's results are ``results``."""
        dies = set(dies)  # the parameter's own set is every store class's: each run spends a copy
        store = self.run_store()
        sid = new_id()
        ran: list[str] = []

        tools = [noting(ran, "lookup", "looked up", dies=dies), noting(ran, "refresh", "refreshed", dies=dies),
                 noting(ran, "charge", "charged", False, dies)]
        for i, expected in enumerate(runs):
            worker = store if i == 0 else self.another(store)
            spec, before = agent.Spec(session=agent.open(sid, worker), tools=tools), len(ran)
            msgs = worker.messages(sid) if i else [Message.user("go")]
            if i < len(runs) - 1:
                with pytest.raises(Crash):
                    agent.Runner().run(spec, msgs, ToolsThenAnswer(reply))
                assert store.messages(sid) == [Message.user("go")]  # the reply waits in the journal, if anywhere
            else:
                result = agent.Runner().run(spec, msgs, ToolsThenAnswer(reply))
            assert ran[before:] == expected, f"run {i}"
        assert result.stop_reason == "answered" and result.steps == 1
        stored = no_orphans(store.messages(sid))
        got = {c.tool_call_id: c for c in stored[2].content}
        assert [got[f"call_0_{i}"].text for i in range(3)] == results
        assert all(got[f"call_0_{i}"].is_error == (results[i] == UNKNOWN_OUTCOME) for i in range(3))
        assert store.journal(sid) is None

    # -- across processes ------------------------------------------------------------------------------

    def test_cancel_from_another_process_stops_the_run_within_one_step(self, tmp_path: Any) -> None:
        factory = self.factory()
        self.run_store()
        crossprocess.cancel_from_another_process(factory, new_id(), str(tmp_path))

    def test_a_run_stopped_past_its_lease_and_continued_after_a_takeover_writes_nothing(self, tmp_path: Any) -> None:
        factory = self.factory()
        self.run_store()
        crossprocess.stopped_past_ttl_then_taken_over(factory, new_id(), str(tmp_path))
