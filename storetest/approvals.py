"""The ApprovalStore contract: a run stops before a call that needs a person's decision; the decision is
taken from any process, exactly once; the next run executes it at most once."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Content, Message, Role, Store, Tool
from agent_sessions.approvals import CANCELLED_WAITING, DENIED, EXPIRED
from agent_sessions.contract import ApprovalStore
from agent_sessions.journal import UNKNOWN_OUTCOME

from . import processes
from .capabilities import Capability
from .crossprocess import counted, in_processes, lines, wait_for
from .meeting import Landing
from .mixin import ContractMixin, new_holder, new_id, no_orphans, together


def refund_tool(workdir: str, hang: bool = False, **options: Any) -> Tool:
    """A non-idempotent tool a person must approve; each run appends a line to ``workdir/refunds``."""
    return agent.tool(name="refund", idempotent=False, needs_approval=True, **options)(
        counted(str(Path(workdir) / "refunds"), 600 if hang else 0))  # killed in the sleep


def lookup_tool(workdir: str) -> Tool:
    return agent.tool(name="lookup")(counted(str(Path(workdir) / "lookups")))


class RefundThenAnswer:
    """Looks the order up and refunds it in one reply, then answers with the results it read. Counts its
    requests in ``log`` (a file): how a parent process sees that no request was made."""

    def __init__(self, log: str) -> None:
        self.log = log

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        with open(self.log, "a") as f:
            f.write("request\n")
        if not any(m.tool_calls for m in messages if m.role is Role.ASSISTANT):
            return Message(Role.ASSISTANT, [Content.tool_call("call_lookup", "lookup", "{}"),
                                            Content.tool_call("call_refund", "refund", '{"n": 5}')])
        return Message.assistant("done: " + " | ".join(c.text for c in messages[-1].content))


class ApprovalContract(ContractMixin):
    def approval_store(self, *needs: Capability) -> ApprovalStore:
        return self.capable_store(Capability.APPROVALS, "swap_journal", *needs)

    def _stopped(self, store: ApprovalStore, workdir: Path, deadline: float | None = None,
                 **refund: Any) -> tuple[str, agent.Result, agent.Spec]:
        sid = new_id("approval")
        spec = agent.Spec(session=agent.open(sid, store), approval_deadline=deadline,
                          tools=[lookup_tool(str(workdir)), refund_tool(str(workdir), **refund)])
        result = agent.Runner().run(spec, [Message.user("refund order 7")], RefundThenAnswer(str(workdir / "requests")))
        return sid, result, spec

    # -- the journal's compare-and-swap ----------------------------------------------------------------

    def test_swap_journal_replaces_only_the_expected_text(self) -> None:
        store = self.approval_store()
        sid = new_id("approval")
        assert store.swap_journal(sid, "{}", '{"a":1}') is False  # no journal: nothing to swap
        holder = store.acquire(sid, new_holder(), 30)
        store.put_journal(sid, holder, '{"v":1}')
        store.release(sid, holder)
        assert store.swap_journal(sid, '{"v":2}', '{"v":3}') is False
        assert store.journal(sid) == '{"v":1}'
        assert store.swap_journal(sid, '{"v":1}', '{"v":2, "ünï":"😀"}') is True
        assert store.journal(sid) == '{"v":2, "ünï":"😀"}'
        assert store.swap_journal(sid, '{"v":1}', '{"v":9}') is False

    # -- the stop --------------------------------------------------------------------------------------

    def test_a_call_needing_approval_stops_the_run_before_any_call_of_its_reply_runs_and_a_cancel_closes_it(
            self, tmp_path: Path) -> None:
        store = self.approval_store()
        sid, result, spec = self._stopped(store, tmp_path)
        assert result.stop_reason == "awaiting_approval" and result.text == ""
        assert [(p.call_id, p.tool, p.arguments) for p in result.pending_approvals] == [
            ("call_refund", "refund", '{"n": 5}')]
        assert no_orphans(store.messages(sid)) == [Message.user("refund order 7")]  # the reply waits in the journal
        assert store.holder(sid) is None  # the lease is released
        session = agent.open(sid, store)
        assert [p.call_id for p in session.pending_approvals()] == ["call_refund"]
        again = agent.Runner().run(spec, session.messages(), RefundThenAnswer(str(tmp_path / "requests")))
        assert again.stop_reason == "awaiting_approval" and again.steps == 0
        assert len(lines(tmp_path / "requests")) == 1, "a run started while a call waits made a model request"
        assert session.cancel() is True  # a cancel while it waits closes the turn
        msgs = no_orphans(store.messages(sid))
        assert len(msgs) == 3 and store.journal(sid) is None
        results = {c.tool_call_id: c for c in msgs[2].content}
        assert results["call_refund"].is_error and results["call_refund"].text == CANCELLED_WAITING
        assert results["call_lookup"].is_error
        with pytest.raises(agent.AlreadyDecided) as closed:
            session.approve("call_refund")
        assert closed.value.decision.by == "cancel"
        assert session.cancel() is False
        assert lines(tmp_path / "refunds") == [] and lines(tmp_path / "lookups") == []

    def test_a_decision_landing_before_an_unanswered_journal_write_is_read_back_keeps_the_request(
            self, tmp_path: Path) -> None:
        """The read-back finds the journal with the decision: it landed, so the run announces the request and
        does not fail; the approved call runs once, when the turn goes on."""
        store = self.approval_store()
        sid = new_id("approval")
        other: Any = self.another(store)

        class LosesTheAnswer:
            def __getattr__(self, name: str) -> Any:
                attr = getattr(store, name)
                if name != "put_journal":
                    return attr

                def put_journal(session: str, holder: agent.Holder, journal: str, **options: Any) -> bool:
                    cancelled = bool(attr(session, holder, journal, **options))
                    if '"approvals"' in journal and '"approved"' not in (other.journal(session) or ""):
                        agent.open(session, other).approve("call_refund")
                        raise agent.OutcomeUnknown("the answer of the journal write was lost (test)")
                    return cancelled

                return put_journal

        heard: list[str] = []
        spec = agent.Spec(session=agent.open(sid, LosesTheAnswer()), tools=[lookup_tool(str(tmp_path)),
                                                                           refund_tool(str(tmp_path))])
        result = agent.Runner().run(spec, [Message.user("refund order 7")], RefundThenAnswer(str(tmp_path / "req")),
                                    lambda event: heard.append(type(event).__name__))
        assert "ApprovalRequested" in heard, heard
        assert result.stop_reason in ("awaiting_approval", "answered"), result
        again = agent.Runner().run(agent.Spec(session=agent.open(sid, store), tools=spec.tools),
                                   store.messages(sid), RefundThenAnswer(str(tmp_path / "req")))
        assert again.stop_reason == "answered"
        assert lines(tmp_path / "refunds") == ["ran"]
        no_orphans(store.messages(sid))

    def test_an_approved_call_runs_once_and_a_denied_one_gets_the_reason(self, tmp_path: Path) -> None:
        store = self.approval_store()
        for approve in (True, False):
            work = tmp_path / str(approve)
            work.mkdir()
            sid, _, spec = self._stopped(store, work)
            session = agent.open(sid, store)
            if approve:  # a steer left while the call waits lands before the next request
                session.steer("and email the customer")
            decision = session.approve("call_refund") if approve else session.deny("call_refund", "over the limit")
            assert decision.approved is approve and decision.by == "person"
            seen: list[Any] = []
            result = agent.Runner().run(spec, session.messages(), RefundThenAnswer(str(work / "requests")), seen.append)
            assert result.stop_reason == "answered" and result.steps == 1
            assert len(lines(work / "refunds")) == (1 if approve else 0) and len(lines(work / "lookups")) == 1
            msgs = no_orphans(store.messages(sid))
            assert not approve or (msgs[3].text, msgs[4].role) == ("and email the customer", Role.ASSISTANT)
            refund = next(c for c in msgs[2].content if c.tool_call_id == "call_refund")
            if approve:
                assert not refund.is_error and refund.text.startswith("done")
            else:
                assert refund.is_error and refund.text == f"{DENIED}: over the limit"
            decided = [e for e in seen if isinstance(e, agent.events.ApprovalDecided)]
            assert [(e.call.id, e.approved) for e in decided] == [("call_refund", approve)]
            assert store.journal(sid) is None and session.pending_approvals() == []
            if approve:
                with pytest.raises(agent.UnknownApproval):
                    session.approve("call_refund")  # its turn is closed: it ran
            else:
                with pytest.raises(agent.AlreadyDecided) as denied:
                    session.approve("call_refund")  # its result says how it was decided
                assert (denied.value.decision.approved, denied.value.decision.by) == (False, "person")
                assert denied.value.decision.reason == "over the limit"

    def test_of_concurrent_decisions_exactly_one_wins_and_an_unknown_call_is_refused(self, tmp_path: Path) -> None:
        """Every decider's first read waits until all have read (threads alone seldom interleave between a read
        and its swap): only the compare-and-swap can refuse the others, each told the decision that won."""
        store = self.approval_store()
        sid, _, _ = self._stopped(store, tmp_path)
        session = agent.open(sid, store)
        with pytest.raises(agent.UnknownApproval):
            session.approve("call_nobody_made")
        with pytest.raises(agent.UnknownApproval):
            session.approve("call_lookup")  # a call of the reply that needs no approval
        barrier = threading.Barrier(8, timeout=30)
        deciders = [agent.open(sid, Landing(self.another(store), after={"journal": barrier.wait})) for _ in range(8)]

        def decide(i: int) -> agent.Decision | agent.AlreadyDecided:
            try:
                return deciders[i].approve("call_refund") if i % 2 else deciders[i].deny("call_refund", f"denier {i}")
            except agent.AlreadyDecided as refused:
                return refused

        outcomes = together(8, decide, 60)
        won = [o for o in outcomes if not isinstance(o, agent.AlreadyDecided)]
        refused = [o.decision for o in outcomes if isinstance(o, agent.AlreadyDecided)]
        assert len(won) == 1, outcomes
        decision = agent.approvals._journal(store, sid).approvals["call_refund"].decision  # type: ignore[union-attr]
        assert decision == won[0] and refused == [decision] * 7
        with pytest.raises(agent.AlreadyDecided, match="by a person"):
            session.approve("call_refund")

    def test_of_eight_deciding_processes_exactly_one_wins(self, tmp_path: Path) -> None:
        factory = self.factory()
        store = self.approval_store()
        sid, _, _ = self._stopped(store, tmp_path)
        outcomes = in_processes(factory, 8, _decider, sid, timeout=120)
        assert sorted(outcomes) == ["already"] * 7 + ["won"], outcomes
        i = outcomes.index("won")
        decision = agent.approvals._journal(store, sid).approvals["call_refund"].decision  # type: ignore[union-attr]
        assert decision is not None and decision.approved is (i % 2 == 1)

    # -- deadlines, steers, cancels --------------------------------------------------------------------

    @pytest.mark.parametrize("set_on", ["tool", "spec"])
    def test_a_call_undecided_past_its_deadline_counts_as_denied(self, tmp_path: Path, set_on: str) -> None:
        """Past it a person's decision is refused (decided at its deadline, not unknown), and the next run
        denies the call itself."""
        store = self.approval_store()
        if set_on == "tool":
            sid, result, spec = self._stopped(store, tmp_path, approval_deadline=0.5)
        else:
            sid, result, spec = self._stopped(store, tmp_path, deadline=0.5)
        deadline = result.pending_approvals[0].deadline
        assert deadline is not None and 0.4 < (deadline - result.pending_approvals[0].asked).total_seconds() < 0.6
        time.sleep(0.6)
        session = agent.open(sid, store)
        assert session.pending_approvals() == []
        with pytest.raises(agent.AlreadyDecided, match="deadline") as late:
            session.approve("call_refund")
        assert late.value.decision.by == "deadline"
        result = agent.Runner().run(spec, session.messages(), RefundThenAnswer(str(tmp_path / "requests")))
        assert result.stop_reason == "answered" and lines(tmp_path / "refunds") == []
        assert len(lines(tmp_path / "lookups")) == 1
        refund = next(c for c in no_orphans(store.messages(sid))[2].content if c.tool_call_id == "call_refund")
        assert refund.is_error and refund.text == EXPIRED

    # -- across processes ------------------------------------------------------------------------------

    def test_stop_approve_resume_and_a_kill_inside_the_approved_tool_across_processes(self, tmp_path: Path) -> None:
        """A stops; B approves; C resumes and is killed inside the approved refund; D resumes and runs neither
        tool again."""
        factory = self.factory()
        store = self.approval_store()
        sid = new_id("approval")
        ctx = processes.context(factory)
        out = ctx.Queue()
        work = str(tmp_path)

        def child(role: str, hang: bool = False) -> Any:
            p = ctx.Process(target=_approval_child, args=(factory, sid, work, role, hang, out))
            p.start()
            return p

        a = child("run")
        assert out.get(timeout=120) == ("run", "awaiting_approval")
        a.join(30)
        b = child("approve")
        assert out.get(timeout=120) == ("approve", "approved")
        b.join(30)
        c = child("run", hang=True)
        try:
            wait_for(lambda: len(lines(tmp_path / "refunds")) == 1, "the third process to enter the approved tool",
                     timeout=120)
            os.kill(c.pid or 0, signal.SIGKILL)
            c.join(30)
        finally:
            if c.is_alive():
                c.kill()
        d = child("run")
        assert out.get(timeout=120) == ("run", "answered")
        d.join(30)
        assert len(lines(tmp_path / "refunds")) == 1, "the approved non-idempotent tool ran again"
        assert len(lines(tmp_path / "lookups")) == 1, "a journalled result was not replayed"
        msgs = no_orphans(store.messages(sid))
        refund = next(c for c in msgs[2].content if c.tool_call_id == "call_refund")
        assert refund.is_error and refund.text == UNKNOWN_OUTCOME
        assert len(lines(tmp_path / "requests")) == 2  # the first reply, and the answer after the resume


def _decider(store: Store, i: int, barrier: Any, sid: str) -> str:
    session = agent.open(sid, store)
    try:
        session.approve("call_refund") if i % 2 else session.deny("call_refund", f"denier {i}")
        return "won"
    except agent.AlreadyDecided:
        return "already"


def _approval_child(factory: Callable[[], Store], sid: str, workdir: str, role: str, hang: bool, out: Any) -> None:
    try:
        session = agent.open(sid, factory())
        if role == "approve":
            session.approve("call_refund")
            out.put((role, "approved"))
            return
        spec = agent.Spec(session=session, tools=[lookup_tool(workdir), refund_tool(workdir, hang=hang)],
                          lease_ttl=1.0, lease_wait=30.0)
        model = RefundThenAnswer(str(Path(workdir) / "requests"))
        msgs = session.messages() or [Message.user("refund order 7")]
        out.put((role, agent.Runner().run(spec, msgs, model).stop_reason))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("error", traceback.format_exc()))
