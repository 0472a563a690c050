"""``agent.recover`` on the memory store, case by case: what it does with a session a live run holds, one
waiting for a person's decision (and again once decided), a turn whose budget is spent, a ``resolve`` that
raises, and a store with nothing stranded. (Real processes and the SQL and MongoDB stores:
tests/reliability/test_stranded.py.)"""

from __future__ import annotations

import pytest

import agent_sessions as agent
from agent_sessions.lease import claimant
from stores import memory
from storetest.scripted import Answer, ToolsThenAnswer
from storetest.stranded import stranded_ids


@agent.tool(idempotent=False, needs_approval=True)
def refund(n: int) -> str:
    """Refund (a person approves it first)."""
    return "refunded"


def _stranded(store: memory.Store, sid: str, spec: str = "support") -> None:
    holder = store.acquire(sid, agent.Holder("dead", 1, claimant().token, 0.0, spec=spec), 30)
    store.save_fenced(sid, holder, [agent.Message.user("refund order 7", key=f"t-{sid}")], take_steers=False)
    store.release(sid, holder)


def _resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
    return agent.Spec(name="support", tools=[refund]), ToolsThenAnswer(["refund"])


def test_nothing_stranded_is_one_empty_listing() -> None:
    store = memory.Store()
    store.save("done", [agent.Message.user("hi"), agent.Message.assistant("hello")])
    assert agent.recover(store, _resolve, grace=0) == []


def test_a_live_run_keeps_its_session() -> None:
    store = memory.Store()
    _stranded(store, "held")
    store.acquire("held", claimant(), 30)  # a redelivered task has it now
    assert [(r.session, r.outcome) for r in agent.recover(store, _resolve, grace=0)] == []  # not listed
    store2 = memory.Store()
    _stranded(store2, "raced")
    listed = store2.list_sessions(stranded=True)
    store2.acquire("raced", claimant(), 30)  # taken between the listing and the sweep's claim
    from agent_sessions.stranded import _recover

    assert _recover(store2, listed.sessions[0], _resolve).outcome == "busy"


def test_a_turn_waiting_for_a_decision_is_left_alone_then_finished_once_decided() -> None:
    store = memory.Store()
    session = agent.open("approve-me", store)
    result = agent.Runner().turn(agent.Spec(session=session, tools=[refund], name="support"), "refund order 7",
                                 "t-1", ToolsThenAnswer(["refund"]))
    assert result.pending_approvals
    assert "approve-me" not in stranded_ids(store)  # the run returned: a person owes it, not a sweep
    assert agent.recover(store, _resolve, grace=0) == []
    session.approve(result.pending_approvals[0].call_id)  # a decision: the turn can go on, nobody resumes it
    done = agent.recover(store, _resolve, grace=0)
    assert [(r.session, r.outcome) for r in done] == [("approve-me", "recovered")]
    assert session.messages()[-1].text.startswith("done") and stranded_ids(store) == []


def test_a_turn_whose_budget_is_spent_is_cleared() -> None:
    store = memory.Store()
    _stranded(store, "spent")

    @agent.tool
    def lookup(n: int) -> str:
        """Look it up."""
        return "found"

    def with_lookup(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint]:
        return agent.Spec(max_steps=1, tools=[lookup]), ToolsThenAnswer(["lookup"])

    (r,) = agent.recover(store, with_lookup, grace=0)
    assert r.outcome == "recovered" and r.result is not None and r.result.stop_reason == "max_steps"
    assert stranded_ids(store) == []  # where the turn ends: no sweep runs it again


def test_a_resolve_that_raises_fails_that_session_only() -> None:
    store = memory.Store()
    _stranded(store, "bad")
    _stranded(store, "good")

    def picky(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
        if info.id == "bad":
            raise RuntimeError("no spec for it")
        return agent.Spec(), Answer("refunded")

    outcomes = {r.session: r.outcome for r in agent.recover(store, picky, grace=0)}
    assert outcomes == {"bad": "failed", "good": "recovered"}
    assert stranded_ids(store) == ["bad"]  # tried again by the next sweep


def test_bad_arguments_are_refused() -> None:
    store = memory.Store()
    with pytest.raises(agent.ArgumentError):
        agent.recover(store, _resolve, limit=0)
    with pytest.raises(agent.ArgumentError):
        agent.recover(store, "resolve")  # type: ignore[arg-type]
    with pytest.raises(agent.ArgumentError):
        agent.recover(object(), _resolve)  # type: ignore[arg-type]


class Echo:
    """A model that answers each turn by naming the message it answers."""

    requests = 0

    def complete(self, system: str, messages: list[agent.Message], tools: object) -> agent.Message:
        self.requests += 1
        return agent.Message.assistant(f"re: {messages[-1].text}")


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_messages_queued_by_callers_that_are_gone_are_answered_by_the_sweep_in_order(
    kind: str, tmp_path: object
) -> None:
    """Runner.turn(if_busy="queue") stored the messages, and every caller died before it got the lease: the
    session is stranded (its queue keeps the turn open), and the sweep answers each once, in the order they
    were accepted; a second sweep finds nothing."""
    from pathlib import Path

    from stores import sqlite

    store: agent.Store = memory.Store() if kind == "memory" else sqlite.open(Path(str(tmp_path)) / "q.db")
    store.save("q", [agent.Message.user("hi", key="k0"), agent.Message.assistant("hello")])
    assert "q" not in stranded_ids(store)
    for i in (1, 2, 3):
        assert store.enqueue("q", f"k{i}", f"question {i}") == i  # type: ignore[attr-defined]
    assert "q" in stranded_ids(store)

    def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint]:
        return agent.Spec(), Echo()

    (r,) = agent.recover(store, resolve, grace=0)
    assert r.outcome == "recovered" and r.result is not None and r.result.text == "re: question 3"
    texts = [(m.key or "", m.text) for m in store.messages("q")]
    assert texts == [("k0", "hi"), ("", "hello"), ("k1", "question 1"), ("", "re: question 1"),
                     ("k2", "question 2"), ("", "re: question 2"), ("k3", "question 3"), ("", "re: question 3")]
    assert store.queued("q") == []  # type: ignore[attr-defined]
    assert agent.recover(store, resolve, grace=0) == [] and "q" not in stranded_ids(store)


@pytest.mark.parametrize("if_busy", ["queue", "steer", "reject", "interrupt"])
def test_a_turn_records_its_spec_name_whatever_its_policy(if_busy: str) -> None:
    """What ``resolve`` chooses by: a queued turn (the default) takes its lease in run/busy.py, not in the run."""
    store = memory.Store()
    seen: list[str | None] = []

    class Looks:
        def complete(self, system: str, messages: list[agent.Message], tools: object) -> agent.Message:
            info = store.info("named")
            seen.append(None if info is None else info.spec)
            return agent.Message.assistant("done")

    spec = agent.Spec(session=agent.open("named", store), name="support")
    agent.Runner().turn(spec, "hello", "t-1", Looks(), if_busy=if_busy)  # type: ignore[arg-type]
    assert seen == ["support"]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_cancel_stops_the_turn_not_the_messages_queued_behind_it(kind: str, tmp_path: object) -> None:
    """A run is cancelled while messages wait in its queue, and every caller that queued them is gone: the
    sweep answers the queue (the first of its turns closes the cancelled turn's reply), in order, once."""
    from pathlib import Path

    from stores import sqlite

    store: agent.Store = memory.Store() if kind == "memory" else sqlite.open(Path(str(tmp_path)) / "c.db")
    holder = store.acquire("c", agent.Holder("dead", 1, claimant().token, 0.0), 30)  # type: ignore[attr-defined]
    store.save_fenced("c", holder, [agent.Message.user("a long job", key="k0")],  # type: ignore[attr-defined]
                      take_steers=False)
    for i in (1, 2):
        store.enqueue("c", f"k{i}", f"question {i}")  # type: ignore[attr-defined]
    assert store.cancel("c")  # type: ignore[attr-defined]
    store.release("c", holder)  # type: ignore[attr-defined]  # its worker died after the cancel: nobody runs it
    assert "c" in stranded_ids(store)  # type: ignore[arg-type]

    def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint]:
        return agent.Spec(), Echo()

    (r,) = agent.recover(store, resolve, grace=0)  # type: ignore[arg-type]
    assert r.outcome == "recovered" and r.result is not None and r.result.text == "re: question 2"
    texts = [(m.key or "", m.text) for m in store.messages("c")]
    assert texts == [("k0", "a long job"), ("k1", "question 1"), ("", "re: question 1"),
                     ("k2", "question 2"), ("", "re: question 2")]
    assert store.queued("c") == []  # type: ignore[attr-defined]
    assert agent.recover(store, resolve, grace=0) == [] and "c" not in stranded_ids(store)  # type: ignore[arg-type]


def test_a_cancelled_session_with_nothing_queued_is_not_swept() -> None:
    store = memory.Store()
    _stranded(store, "stopped")
    holder = store.acquire("stopped", claimant(), 30)
    assert store.cancel("stopped")
    store.release("stopped", holder)
    assert agent.recover(store, _resolve, grace=0) == [] and stranded_ids(store) == []


def test_an_interrupt_that_cannot_wait_leaves_its_message_queued_for_the_sweep() -> None:
    """``if_busy="interrupt"`` with the default ``lease_wait=0``: the running run is cancelled and has not
    stopped yet, so the turn raises ``StillQueued``; the message is stored, not dropped, and the sweep
    answers it once the cancelled run is gone."""
    from tests.test_lease import holding

    store = memory.Store()
    hold, entered, go = holding()
    run = agent.Runner().start(agent.Spec(session=agent.open("i", store), tools=[hold]),
                               [agent.Message.user("a", key="k0")], ToolsThenAnswer(["hold"]))
    assert entered.wait(10)
    with pytest.raises(agent.StillQueued) as waited:
        agent.Runner().turn(agent.Spec(session=agent.open("i", store)), "stop, do this", "k1", Echo(),
                            if_busy="interrupt")
    assert waited.value.key == "k1" and store.queued("i") == ["k1"]
    go.set()
    assert run.wait(10).stop_reason == "cancelled"
    (r,) = agent.recover(store, lambda info: (agent.Spec(), Echo()), grace=0)
    assert r.outcome == "recovered" and r.result is not None and r.result.text == "re: stop, do this"
    assert store.messages("i")[-2:] == [agent.Message.user("stop, do this", key="k1"),
                                        agent.Message.assistant("re: stop, do this")]
    assert store.queued("i") == [] and stranded_ids(store) == []


@pytest.mark.parametrize("shape", ["open turn", "queued"])
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_delete_cannot_land_between_the_sweeps_look_and_its_run(kind: str, shape: str, tmp_path: object) -> None:
    """The sweep looks at a stranded session under its lease and runs what is left under that same lease:
    a delete sent while it looks is refused (a live run holds the session), never one that lands after the
    look and before the run, whose run would then answer (and so bring back) an erased conversation."""
    from pathlib import Path

    from stores import sqlite

    store = memory.Store() if kind == "memory" else sqlite.open(Path(str(tmp_path)) / "d.db")
    if shape == "open turn":
        _stranded(store, "gone")  # type: ignore[arg-type]
    else:
        store.save("gone", [agent.Message.user("hi", key="k0"), agent.Message.assistant("hello")])
        store.enqueue("gone", "k1", "question 1")
    assert "gone" in stranded_ids(store)
    journal = store.journal
    refused: list[BaseException] = []

    def journal_then_delete(session: str) -> str | None:
        text = journal(session)
        if not refused:  # the sweep is looking: the user deletes the conversation now
            with pytest.raises(agent.SessionBusy) as busy:
                store.delete(session)
            refused.append(busy.value)
        return text

    store.journal = journal_then_delete  # type: ignore[method-assign]
    model = Echo()
    (r,) = agent.recover(store, lambda info: (agent.Spec(name="support", tools=[refund]), model), grace=0)
    assert len(refused) == 1 and r.outcome == "recovered" and model.requests == 1, r
    del store.journal
    assert store.delete("gone") and store.messages("gone") == []  # once the sweep is done, it goes
    assert agent.recover(store, lambda info: (agent.Spec(), model), grace=0) == []


@pytest.mark.parametrize("shape", ["open turn", "queued"])
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_delete_as_soon_as_the_lease_is_free_is_the_last_word(kind: str, shape: str, tmp_path: object) -> None:
    """The user deletes the conversation the moment the sweep first gives the lease back. That is after its
    run (it looked and ran under one lease), so the delete is the last word: nothing comes back. (When the
    look gave the lease back before the run, the delete landed in between and the run wrote the erased
    conversation back, its message and an answer.)"""
    from pathlib import Path

    from stores import sqlite

    store = memory.Store() if kind == "memory" else sqlite.open(Path(str(tmp_path)) / "r.db")
    if shape == "open turn":
        _stranded(store, "gone")  # type: ignore[arg-type]
    else:
        store.save("gone", [agent.Message.user("hi", key="k0"), agent.Message.assistant("hello")])
        store.enqueue("gone", "k1", "question 1")
    release = store.release
    model = Echo()
    asked: list[int] = []

    def release_then_delete(session: str, holder: agent.Holder) -> None:
        release(session, holder)
        if not asked:
            asked.append(model.requests)
            assert store.delete(session)

    store.release = release_then_delete  # type: ignore[method-assign]
    (r,) = agent.recover(store, lambda info: (agent.Spec(name="support", tools=[refund]), model), grace=0)
    assert asked == [1] and r.outcome == "recovered", (asked, r)  # the lease was first free after the run
    assert store.messages("gone") == [] and store.info("gone") is None
    assert agent.recover(store, lambda info: (agent.Spec(), model), grace=0) == []


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_forced_delete_while_the_sweep_runs_a_turn_is_not_undone(kind: str, tmp_path: object) -> None:
    """``delete(force=True)`` takes the session from under the sweep's run (its worker is not asked): the
    run's next write is refused, nothing of the erased conversation comes back, and the sweep says so."""
    from pathlib import Path

    from stores import sqlite

    store = memory.Store() if kind == "memory" else sqlite.open(Path(str(tmp_path)) / "f.db")
    _stranded(store, "gone")

    class DeletesFirst:
        requests = 0

        def complete(self, system: str, messages: list[agent.Message], tools: object) -> agent.Message:
            self.requests += 1
            assert store.delete("gone", force=True)
            return agent.Message.assistant("too late")

    model = DeletesFirst()
    (r,) = agent.recover(store, lambda info: (agent.Spec(name="support"), model), grace=0)
    assert model.requests == 1 and r.outcome == "failed" and r.result is None, r
    assert isinstance(r.error, (agent.LeaseLost, agent.TranscriptDeleted)), r.error
    assert store.messages("gone") == [] and store.info("gone") is None
    assert agent.recover(store, lambda info: (agent.Spec(), model), grace=0) == []


class Closes:
    """Answers a tool step by quoting its results, and any other request by naming the message it answers."""

    requests = 0

    def complete(self, system: str, messages: list[agent.Message], tools: object) -> agent.Message:
        self.requests += 1
        last = messages[-1]
        if any(c.tool_call_id for c in last.content):
            return agent.Message.assistant("done: " + " | ".join(c.text for c in last.content))
        return agent.Message.assistant(f"re: {last.text}")


@pytest.mark.parametrize("cancelled", [False, True], ids=["open", "cancelled"])
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_stranded_turn_with_a_journal_is_closed_before_the_queue_is_answered(
    kind: str, cancelled: bool, tmp_path: object
) -> None:
    """A worker died inside its turn's tools (the journal holds its reply: ``charge`` finished, ``ship``
    started; neither idempotent), with a message queued behind it, and, in one case, the turn cancelled. The
    sweep keeps what the journal says before the queue's turn: the reply and its results (``charge``'s result
    replayed, ``ship``'s outcome unknown: neither runs again) go into the transcript, and then the queued
    message is answered. (The cancelled case took the queued message first, which dropped the journal: the
    reply and the result of the charge that happened were lost.)"""
    from pathlib import Path

    from agent_sessions.journal import UNKNOWN_OUTCOME, Journal, fingerprint
    from stores import sqlite
    from storetest.mixin import no_orphans as assert_no_orphans

    ran: list[str] = []

    @agent.tool(idempotent=False)
    def charge(n: int) -> str:
        """Charge the card."""
        ran.append("charge")
        return "charged"

    @agent.tool(idempotent=False)
    def ship(n: int) -> str:
        """Ship the order."""
        ran.append("ship")
        return "shipped"

    store = memory.Store() if kind == "memory" else sqlite.open(Path(str(tmp_path)) / "j.db")
    holder = store.acquire("j", agent.Holder("dead", 1, claimant().token, 0.0), 30)
    asked = agent.Message.user("pay order 7", key="k0")
    store.save_fenced("j", holder, [asked], take_steers=False)
    reply = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("charge-1", "charge", '{"n": 7}'),
                                                 agent.Content.tool_call("ship-1", "ship", '{"n": 7}')])
    journal = Journal(1, fingerprint([asked]), reply, started=["charge-1", "ship-1"],
                      results={"charge-1": agent.Content.tool_result("charge-1", "charged")})
    store.put_journal("j", holder, journal.to_json())  # the worker dies inside ship
    store.enqueue("j", "k1", "question 1")
    if cancelled:
        assert store.cancel("j")
    store.release("j", holder)  # its lease lapses: nobody runs the session
    model = Closes()
    done = agent.recover(store, lambda info: (agent.Spec(tools=[charge, ship]), model), grace=0)
    if not cancelled:  # the turn goes on (its answer) in one sweep, the queue is answered by the next
        assert [r.outcome for r in done] == ["recovered"]
        done = agent.recover(store, lambda info: (agent.Spec(tools=[charge, ship]), model), grace=0)
    assert [r.outcome for r in done] == ["recovered"] and done[0].result is not None
    assert done[0].result.text == "re: question 1"
    assert ran == [], "a tool that was not idempotent ran again"
    stored = store.messages("j")
    assert_no_orphans(stored)
    answer = [] if cancelled else [("assistant", "", f"done: charged | {UNKNOWN_OUTCOME}")]
    assert [(m.role.value, m.key, m.text) for m in stored] == [
        ("user", "k0", "pay order 7"), ("assistant", "", ""), ("user", "", ""), *answer,
        ("user", "k1", "question 1"), ("assistant", "", "re: question 1")]
    assert stored[1] == reply
    results = {c.tool_call_id: c for c in stored[2].content}
    assert results["charge-1"].text == "charged" and not results["charge-1"].is_error  # the result kept
    assert results["ship-1"].is_error and results["ship-1"].text == UNKNOWN_OUTCOME  # not run again
    assert model.requests == len(answer) + 1  # a cancelled turn asks nothing more
    assert store.queued("j") == [] and store.journal("j") is None and stranded_ids(store) == []


def test_one_session_is_recovered_alone_and_only_if_stranded() -> None:
    """``recover(..., session=)``: what an operator asks of one session (the console's recover): that session's
    turn is finished if it is stranded; another stranded one is left; a finished or held one gives ``[]``."""
    store = memory.Store()
    _stranded(store, "mine")
    _stranded(store, "other")
    info = store.info("mine")
    assert info is not None and info.stranded and info.holder is None and not info.cancelled
    done = agent.recover(store, _resolve, session="mine")
    assert [(r.session, r.outcome) for r in done] == [("mine", "recovered")]
    assert agent.recover(store, _resolve, session="mine") == []
    assert "other" in stranded_ids(store)
    store.acquire("other", claimant(), 30)
    held = store.info("other")
    assert held is not None and held.holder is not None and not held.stranded
    assert agent.recover(store, _resolve, session="other") == []
