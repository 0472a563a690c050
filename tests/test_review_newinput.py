"""New input after a run that stopped among its tools (docs/runs/journal.md), where it meets other operations:
an idempotent call that was running, the default turn policy (the queue goes on with the stopped turn), a
compacted session's tail, a cancel handed with the lease, and a resume that finished the turn first. Written
by a second engineer's review of the change."""

from __future__ import annotations

import pathlib

import pytest

import agent_sessions as agent
from agent_sessions.journal import NOT_RUN_SUPERSEDED, UNKNOWN_OUTCOME
from stores import memory, sqlite
from storetest.mixin import no_orphans as assert_no_orphans
from storetest.scripted import Answer, ToolsThenAnswer


class _Died(BaseException):
    """A worker dying inside a tool: nothing of the run's code handles it."""


def _store(backend: str, tmp_path: pathlib.Path) -> agent.RunStore:
    return memory.Store() if backend == "memory" else sqlite.open(str(tmp_path / "s.db"))


def _tools(ran: list[str], die_in: str, *, lookup_idempotent: bool = True) -> list[agent.Tool]:
    """``charge`` and ``ship`` (not idempotent) and ``lookup``: each notes its call in ``ran``, and the one named
    ``die_in`` kills its worker the first time it runs."""

    def step(name: str, done: str, description: str, idempotent: bool) -> agent.Tool:
        def run(n: int) -> str:
            ran.append(name)
            if die_in == name and ran.count(name) == 1:
                raise _Died
            return done

        return agent.tool(name=name, description=description, idempotent=idempotent)(run)

    return [step("charge", "charged", "Charge.", False), step("ship", "shipped", "Ship.", False),
            step("lookup", "order 7: 3 items", "Look the order up.", lookup_idempotent)]


# -- problems --------------------------------------------------------------------------------------------


def test_an_idempotent_call_that_was_running_is_not_said_to_have_never_started() -> None:
    """The reply calls ``charge`` (not idempotent, finishes: journalled) then ``lookup`` (idempotent),
    and the worker dies inside ``lookup``. The journal cannot say an idempotent call started (only
    non-idempotent calls are marked), so the put-back reply closes it with ``NOT_RUN_SUPERSEDED``: "not run:
    the run that made this call stopped before it". It did run (it was running). Harmless for an idempotent
    tool (the model may call it again), but the text states as fact something the journal does not know."""
    ran: list[str] = []
    store = memory.Store()
    spec = agent.Spec(session=agent.open("s", store), tools=_tools(ran, "lookup"))
    with pytest.raises(_Died):
        agent.Runner().run(spec, [agent.Message.user("pay order 7")], ToolsThenAnswer(["charge", "lookup"]))
    assert ran == ["charge", "lookup"]
    agent.Runner().run(spec, [*store.messages("s"), agent.Message.user("and my invoice?")], Answer("ok"))
    stored = store.messages("s")
    assert_no_orphans(stored)
    closed = {c.tool_call_id: c.text for c in stored[2].content}
    assert closed["call_0_0"] == "charged"
    assert "stopped before it" not in closed["call_0_1"], closed  # it was running, not "before it"


# -- behaviour pinned (passes) ---------------------------------------------------------------------------


def test_default_turn_policy_goes_on_with_the_stopped_turn_instead_of_closing_it() -> None:
    """PIN (and a doc point). docs/runs/journal.md and the CHANGELOG say ``Runner.turn`` of another key puts
    the stopped reply back closed (the never-started call "not run"). That is so only for ``if_busy`` other
    than the default on a QueueStore (every library store is one): the default ``"queue"`` goes on with the
    unfinished turn first (busy._unfinished_first): the never-started ``ship`` RUNS and the model is asked
    again for the old turn, then the new message is answered. Both honour at-most-once; the two paths
    differ in whether a never-started call runs and in the requests made."""
    ran: list[str] = []
    store = memory.Store()
    spec = agent.Spec(session=agent.open("s", store), tools=_tools(ran, "charge"), lease_ttl=1.0, lease_wait=10)
    with pytest.raises(_Died):
        agent.Runner().turn(spec, "pay order 7", "k1", ToolsThenAnswer(["charge", "ship"]))
    model = ToolsThenAnswer(["charge", "ship"])
    result = agent.Runner().turn(spec, "and my invoice?", "k2", model)  # if_busy="queue"
    assert result.stop_reason == "answered"
    assert ran == ["charge", "ship"]  # charge not again; ship, never started, ran now
    stored = store.messages("s")
    assert_no_orphans(stored)
    assert [c.text for c in stored[2].content] == [UNKNOWN_OUTCOME, "shipped"]
    assert NOT_RUN_SUPERSEDED not in [c.text for m in stored for c in m.content]
    assert model.requests == 2  # one for k1's turn, one for k2


def test_a_tail_of_a_compacted_session_gets_the_reply_back_at_its_stored_index() -> None:
    """PIN. A long compacted session run from ``session.messages(recent=True)`` (a Tail, start > 0): the
    journal's index is a stored index; the put-back reply lands at ``journal.at - start`` of the Tail and
    the save from ``start`` stores it in its place, nothing run again."""
    ran: list[str] = []
    store = memory.Store()
    long_ago = [m for n in range(300) for m in (agent.Message.user(f"q {n}"), agent.Message.assistant("ok"))]
    record = agent.Message(agent.Role.USER, [agent.Content.compaction("summary", 0, 500)])
    store.save("s", [*long_ago, record])
    session = agent.open("s", store)
    spec = agent.Spec(session=session, tools=_tools(ran, "ship"))
    msgs = session.messages(recent=True)
    assert isinstance(msgs, agent.Tail) and msgs.start > 0
    with pytest.raises(_Died):
        agent.Runner().run(spec, msgs + [agent.Message.user("pay order 7")],  # noqa: RUF005 - a Tail keeps its start
                           ToolsThenAnswer(["charge", "ship"]))
    at = len(store.messages("s"))
    tail = session.messages(recent=True)
    assert isinstance(tail, agent.Tail) and tail.start > 0
    result = agent.Runner().run(spec, tail + [agent.Message.user("and my invoice?")],  # noqa: RUF005 - a Tail
                                ToolsThenAnswer(["charge", "ship"]))
    assert ran == ["charge", "ship"] and result.stop_reason == "answered"
    stored = store.messages("s")
    assert_no_orphans(stored)
    assert stored[at].tool_calls and [c.text for c in stored[at + 1].content] == ["charged", UNKNOWN_OUTCOME]
    assert stored[at + 2].text == "and my invoice?" and store.journal("s") is None


def test_a_cancelled_stopped_turn_is_closed_by_the_cancel_branch_not_the_new_one() -> None:
    """PIN. A worker dies inside ``ship`` (``charge`` finished); the turn is cancelled while its lease is still
    the dead worker's, which lapses (as tests/test_recover.py makes one): the next lease carries the cancel.
    New input: the ``closing`` branch comes first and closes the reply as a cancel closes it (the
    never-started call says the turn was cancelled, not "the conversation went on"), and answers."""
    from agent_sessions.approvals import CANCELLED_APPROVED
    from agent_sessions.journal import Journal, fingerprint
    from agent_sessions.lease import claimant

    ran: list[str] = []
    store = memory.Store()
    holder = store.acquire("s", agent.Holder("dead", 1, claimant().token, 0.0), 30)
    asked = agent.Message.user("pay order 7")
    store.save_fenced("s", holder, [asked], take_steers=False)
    reply = agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call("c1", "charge", '{"n": 7}'),
                                                 agent.Content.tool_call("s1", "ship", '{"n": 7}'),
                                                 agent.Content.tool_call("l1", "lookup", '{"n": 7}')])
    journal = Journal(1, fingerprint([asked]), reply, started=["c1", "s1"],
                      results={"c1": agent.Content.tool_result("c1", "charged")})
    store.put_journal("s", holder, journal.to_json())
    assert store.cancel("s")
    store.release("s", holder)
    spec = agent.Spec(session=agent.open("s", store), tools=_tools(ran, ""))
    result = agent.Runner().run(spec, [*store.messages("s"), agent.Message.user("stop, do this")], Answer("ok"))
    assert result.stop_reason == "answered" and ran == []
    stored = store.messages("s")
    assert_no_orphans(stored)
    assert [c.text for c in stored[2].content] == ["charged", UNKNOWN_OUTCOME, CANCELLED_APPROVED]


def test_a_resume_that_finished_the_stopped_turn_first_refuses_the_stale_new_input_run() -> None:
    """PIN. A caller read the stored transcript (the dead run's reply only in the journal); before it runs,
    another worker resumes the stopped turn and finishes it. The new-input run then holds the lease, finds
    no journal, and its first save (a compare-and-swap) refuses the stale transcript: nothing ran twice."""
    ran: list[str] = []
    store = memory.Store()
    spec = agent.Spec(session=agent.open("s", store), tools=_tools(ran, "ship"))
    with pytest.raises(_Died):
        agent.Runner().run(spec, [agent.Message.user("pay order 7")], ToolsThenAnswer(["charge", "ship"]))
    stale = [*store.messages("s"), agent.Message.user("and my invoice?")]
    agent.Runner().run(spec, store.messages("s"), ToolsThenAnswer(["charge", "ship"]))  # the resume wins
    with pytest.raises(agent.TranscriptConflict):
        agent.Runner().run(spec, stale, ToolsThenAnswer(["charge", "ship"]))
    assert ran == ["charge", "ship"]
    assert_no_orphans(store.messages("s"))


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_a_cancel_between_the_journal_read_and_the_first_save_closes_the_reply_and_runs_nothing(
    backend: str, tmp_path: pathlib.Path
) -> None:
    """A worker dies inside ``ship`` (``charge`` finished). New input comes, and a cancel lands exactly between
    the new run's read of the journal and its first save (the store's ``journal`` cancels as it returns).
    The save reports the cancel: the run stops before asking the model, with the stopped reply put back and
    its calls closed as they stood, nothing run again, and the new message kept after it; the journal is
    gone, so a later run neither replays nor repeats it."""
    ran: list[str] = []
    store = _store(backend, tmp_path)
    spec = agent.Spec(session=agent.open("s", store), tools=_tools(ran, "ship"))
    with pytest.raises(_Died):
        agent.Runner().run(spec, [agent.Message.user("pay order 7")], ToolsThenAnswer(["charge", "ship"]))
    assert store.journal("s") is not None

    read = type(store).journal
    taken = type(store).journal_as_taken

    def journal_then_cancel(self: agent.RunStore, session: str, holder: agent.Holder) -> str | None:
        text = taken(self, session, holder)
        if text is not None:
            self.cancel(session)  # lands before the run's first save
        return text

    store.__class__ = type("CancelledAfterItsJournalRead", (type(store),),
                           {"journal_as_taken": journal_then_cancel})
    model = ToolsThenAnswer(["charge", "ship"])
    result = agent.Runner().run(spec, [*store.messages("s"), agent.Message.user("and my invoice?")], model)
    assert result.stop_reason == "cancelled" and ran == ["charge", "ship"]
    stored = store.messages("s")
    assert_no_orphans(stored)
    assert [c.text for c in stored[2].content] == ["charged", UNKNOWN_OUTCOME]
    assert stored[3].text == "and my invoice?" and len(stored) == 4
    assert read(store, "s") is None
