"""The reply whose tool calls a leased run is running, and its journal: which calls started, their results,
and the decisions people made on those that needed one (``journal``, ``approvals``).

A non-idempotent call is journalled as started before it runs (the write that also reads the cancel flag),
and its result after it when other calls follow; every other result rides with the run's next save. A call
needing a decision stops the run before any call of its reply runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from .. import approvals
from ..contract import PendingApproval
from ..errors import StoreError
from ..events import Sink
from ..journal import UNKNOWN_OUTCOME, Approval, Journal, fingerprint
from ..messages import Content, Message
from ..spec import Spec
from ..tools import Tool
from ..values import Decision
from .writes import Writes

log = logging.getLogger(__name__)

NO_APPROVALS: tuple[list[Content], bool] = ([], False)


class NoCalls:
    """How a run that keeps no journal (``NOT_KEPT``, a plain Session) runs a reply's calls: each runs as it
    comes, none waits for a decision. ``Calls`` is a leased run's."""

    def approvals(self, spec: Spec, step: int, emit: Sink) -> tuple[list[Content], bool]:
        """Before any call of the reply runs: the calls still waiting for a person's decision, and whether
        the run was asked to stop meanwhile."""
        return NO_APPROVALS

    def pending(self, calls: Sequence[Content]) -> list[PendingApproval]:
        return []

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        """The result a call gets without running (a resumed call's, a denied one's), or ``None`` to run it."""
        return None

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        """Immediately before a tool runs: ``False`` when the run was asked to stop."""
        return True

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None:
        pass


NO_CALLS = NoCalls()


class Calls(NoCalls):
    """The run's journal of the reply it is running, written through ``writes``."""

    def __init__(self, writes: Writes) -> None:
        self.writes = writes
        self.session = writes.session
        self.journal: Journal | None = None
        self.text: str | None = None
        """The journal's text as stored, when the run read it (a resume) or swapped it: a change to its
        approvals is a compare-and-swap against it, since people may be deciding meanwhile."""
        self.closing = False
        """The reply is a cancelled turn's, closed unrun (``replay``): the run was handed that cancel."""
        self.fresh: bool | None = None
        """The cancel flag the run's last read found, when no tool ran since: the next call's check."""
        self.unwritten = False
        """A non-idempotent call's result is in the journal but in no write yet (the reply's last call: the
        next save carries it); a run failing before that save journals it on its way out (``keep_results``)."""

    def resumed(self, journal: Journal, text: str | None) -> None:
        """The run goes on with the reply that waits in ``journal`` (stored as ``text``)."""
        self.journal, self.text = journal, text

    def saved(self) -> None:
        """A save holds the reply and its results now: the store dropped the journal."""
        self.journal = None
        self.unwritten = False

    def begin(self, transcript: Sequence[Message], checked: bool) -> None:
        """The last message of ``transcript`` is a reply whose calls are about to run. ``checked``: the save
        before its request read the cancel flag and found none, and that read is the first call's check."""
        at = len(transcript) - 1
        if self.journal is not None and self.journal.at == self.writes.start + at:
            return  # resuming it
        self.journal = Journal(self.writes.start + at, fingerprint(transcript, at), transcript[at])
        self.text = None
        self.fresh = False if checked else None

    # -- a call ------------------------------------------------------------------------------------------------

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        assert self.journal is not None
        if self.closing:  # the resumed reply of a cancelled turn: nothing of it runs
            return closing(self.journal, call)
        done = self.journal.results.get(call.id)
        if done is not None:
            return done
        if call.id in self.journal.started and tool is not None and not tool.idempotent:
            return Content.tool_result(call.id, UNKNOWN_OUTCOME, is_error=True)
        approval = self.journal.approvals.get(call.id)
        if approval is not None and approval.decision is None:  # reached only once cancelled
            return Content.tool_result(call.id, approvals.CANCELLED_WAITING, is_error=True)
        if approval is not None and approval.decision is not None and not approval.decision.approved:
            return Content.tool_result(call.id, approvals.result_text(approval.decision), is_error=True)
        return None

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        assert self.journal is not None
        if tool is not None and not tool.idempotent:
            self.journal.started.append(call.id)
            # Not listening: what the watch would say before this write is never asked (the tool's own
            # journal write, ``ran``, or the save after the reply's last call, is the next read).
            cancelled = self.writes.put_journal(self.journal.to_json(), unless_cancelled=True, listen=False)
            if cancelled:  # nothing was written: the call never starts, and the journal never says it did
                self.journal.started.pop()
        elif self.fresh is not None:
            cancelled = self.fresh
        else:
            cancelled = self.writes.cancelled()
        self.fresh = None
        return not cancelled

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None:
        assert self.journal is not None
        self.journal.results[result.tool_call_id] = result
        if tool is None or tool.idempotent:
            return
        if call.id != self.journal.reply.tool_calls[-1].id:
            # Other calls run before the next save: journal this result, so a crash among them replays it
            # rather than call its outcome unknown. After the reply's last call the save comes at once and
            # carries it (or, should the run fail first, ``keep_results`` journals it).
            self.fresh = self.writes.put_journal(self.journal.to_json())
        else:
            self.unwritten = True

    def keep_results(self) -> None:
        """The run fails after a non-idempotent tool ran and before the save that would carry its result:
        journal the result, so a resume replays it rather than call its outcome unknown. Best effort."""
        if not self.unwritten or self.journal is None:
            return
        try:
            self.writes.store.put_journal(self.session, self.writes.lease.holder, self.journal.to_json())
        except Exception as exc:  # noqa: BLE001 - a resume then says the outcome is unknown, as after a crash
            log.warning("session %r: the results of the failing run's tools could not be journalled (%s: %s)",
                        self.session, type(exc).__name__, exc)

    # -- decisions ---------------------------------------------------------------------------------------------

    def approvals(self, spec: Spec, step: int, emit: Sink) -> tuple[list[Content], bool]:
        """``NoCalls.approvals``, asking for the calls not asked yet, and counting those past their deadline as
        denied."""
        for _ in range(approvals.ATTEMPTS):  # each look again follows a change by someone else: bounded
            outcome = self._approvals_once(spec, step, emit)
            if outcome is not None:
                return outcome
        raise StoreError(f"session {self.session!r}: the journal changed under each of {approvals.ATTEMPTS} "
                         f"looks at its approvals")

    def _approvals_once(self, spec: Spec, step: int, emit: Sink) -> tuple[list[Content], bool] | None:
        """``approvals``, or ``None`` to look again (the journal changed under a write)."""
        journal = self.journal
        assert journal is not None
        if self.closing:
            return NO_APPROVALS  # a cancelled turn's reply: its calls are closed unrun (``replay``)
        needing = [c for c in journal.reply.tool_calls if c.id in journal.approvals or _asks(spec, c, journal)]
        if not needing:
            return NO_APPROVALS
        new = [c for c in needing if c.id not in journal.approvals]
        if new:
            now = time.time()
            for call in new:
                tool = spec.tool(call.name)
                seconds = None if tool is None else spec.deadline_seconds(tool)
                journal.approvals[call.id] = Approval(now, None if seconds is None else now + seconds)
            if not self._store_approvals():
                return None  # decided meanwhile: look again
            if self.fresh:
                return [], True
            for call in new:
                emit.approval_requested(step, call)
        elif any(approvals.expired(journal.approvals[c.id], time.time()) for c in needing):
            self._expire()
            return None
        assert self.journal is not None
        waiting = [c for c in needing if self.journal.approvals[c.id].decision is None]
        if waiting:
            if self.fresh is None and self.writes.check():
                # A cancel reached this run (so session.cancel() did not close the turn itself): close it here,
                # deciding the undecided calls "cancel" by compare-and-swap, as close_waiting does.
                approvals._decide_rest(self.writes.store, self.session)
                self._reload()
                return [], True
            return waiting, False
        for call in needing:
            decision = self.journal.approvals[call.id].decision
            assert decision is not None
            emit.approval_decided(step, call, decision.approved, decision.reason, decision.by)
        return NO_APPROVALS

    def _store_approvals(self) -> bool:
        """Write the journal naming the calls that wait. ``False`` when a resumed journal changed under it
        (then it is read again). Sets ``fresh`` to the cancel flag the write returned."""
        assert self.journal is not None
        text = self.journal.to_json()
        if self.text is None:
            self.fresh = self.writes.put_journal(text, unless_cancelled=True)
            self.text = None if self.fresh else text
            return True
        if self.writes.store.swap_journal(self.session, self.text, text):
            self.text = text
            return True
        self._reload()
        return False

    def _expire(self) -> None:
        """Count the calls undecided past their deadline as denied, by compare-and-swap (a person's decision
        stored first stands)."""
        assert self.journal is not None
        for _ in range(approvals.ATTEMPTS):
            now = time.time()
            for approval in self.journal.approvals.values():
                if approvals.expired(approval, now):
                    approval.decision = Decision(False, "the approval deadline passed", now, "deadline")
            text = self.journal.to_json()
            if self.text is not None and self.writes.store.swap_journal(self.session, self.text, text):
                self.text = text
                return
            self._reload()
        raise StoreError(f"session {self.session!r}: the journal kept changing while its expired approvals were "
                         f"denied")

    def _reload(self) -> None:
        assert self.journal is not None
        text = self.writes.store.journal(self.session)
        journal = Journal.of(text, self.session)
        if journal is None or (journal.at, journal.digest) != (self.journal.at, self.journal.digest):
            raise StoreError(f"session {self.session!r}: the journal of the reply being run vanished while this "
                             f"run held the session")
        self.journal, self.text = journal, text

    def pending(self, calls: Sequence[Content]) -> list[PendingApproval]:
        if not calls:
            return []
        assert self.journal is not None
        return [approvals.waiting(call, self.journal.approvals[call.id]) for call in calls]


def closing(journal: Journal, call: Content) -> Content:
    """The result a call of a cancelled turn's reply gets when the turn is closed: what it had, or that it was
    not run (``approvals.closing_result``)."""
    approval = journal.approvals.get(call.id)
    if call.id not in journal.results and approval is not None and approval.decision is None:
        return Content.tool_result(call.id, approvals.CANCELLED_WAITING, is_error=True)
    return approvals.closing_result(journal, call)


def _asks(spec: Spec, call: Content, journal: Journal) -> bool:
    """Does ``call`` need a decision it was not asked for yet? Not once it has started or has a result."""
    if call.id in journal.results or call.id in journal.started:
        return False
    tool = spec.tool(call.name)
    return tool is not None and tool.asks_approval(call)
