"""How a run keeps its transcript, chosen once per run so the loop reads straight through.

- ``NOT_KEPT`` (``Spec.session is None``): every step is a no-op; no store call, no allocation.
- ``Kept`` (a plain Session): the waiting steers are taken and the transcript saved before every model
  request, and once more when the run returns.
- ``Leased`` (a session over a RunStore): the run holds the session's lease, and every write carries it
  (see ``lease``). Its first write is a compare-and-swap against the stored transcript; the write before
  each request also takes the steers and tells whether the run was cancelled; tool calls are journalled
  where that buys something (see ``journal``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .errors import TranscriptConflict
from .journal import UNKNOWN_OUTCOME, Journal, fingerprint
from .lease import Lease
from .messages import Content, Message, unanswered
from .session import RunSession, Saved, Session, is_run_session
from .spec import Spec
from .tools import Tool

_NOTHING: tuple[Sequence[str], bool] = ((), False)


class Keeping(Protocol):
    saves: bool
    """Whether ``before_request`` and ``finish`` write anything (for the Saved events)."""

    def __enter__(self) -> Keeping: ...

    def __exit__(self, kind: object, exc: object, tb: object) -> None: ...

    def resume(self, transcript: list[Message]) -> None:
        """Before the loop starts: put back a reply whose tools a dead run was running."""

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        """Take the steers waiting, append them to ``transcript`` and save it; return those steers and
        whether somebody asked the run to stop."""

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        """The last message of ``transcript`` is a reply whose tool calls are about to run."""

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        """The result a resumed call gets without running, or ``None`` to run it."""

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        """Immediately before a tool runs: ``False`` when the run was asked to stop."""

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None: ...

    def finish(self, transcript: list[Message]) -> None:
        """The run returns: save what the last request's reply (and anything since) added."""


class _NotKept:
    saves = False

    def __enter__(self) -> _NotKept:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        pass

    def resume(self, transcript: list[Message]) -> None:
        pass

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        return _NOTHING

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        pass

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        return None

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        return True

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None:
        pass

    def finish(self, transcript: list[Message]) -> None:
        pass


NOT_KEPT = _NotKept()


class Kept(_NotKept):
    """A plain Session: saves == requests + 1. Nothing fences it: two runs of one session both write."""

    saves = True

    def __init__(self, session: Session) -> None:
        self.session = session

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        steers = self.session.take_steers()
        transcript.extend(Message.user(t) for t in steers)
        self.session.save(transcript)
        return steers, False

    def finish(self, transcript: list[Message]) -> None:
        self.session.save(transcript)


class Leased:
    """A session over a RunStore. Per step: one fenced save before the request (which takes the steers and
    reports a cancel); before each tool call a cancel check, which for a non-idempotent tool is the journal
    write recording that it started (and carrying the results so far); after a non-idempotent tool that is
    not the reply's last call, a journal write of its result. Every other result rides with the next
    write."""

    saves = True

    def __init__(self, session: RunSession, spec: Spec) -> None:
        self.store = session.store
        self.session = session.id
        self.lease = Lease(self.store, self.session, spec.lease_ttl, spec.lease_wait)
        self.replace = spec.replace_transcript
        self.written = -1
        """The length of the transcript as this run last wrote it; -1 before its first write (the CAS)."""
        self.journal: Journal | None = None
        self.fresh: bool | None = None
        """The cancel flag a journal write just returned, with no tool run since: the next call's check."""

    def __enter__(self) -> Leased:
        self.lease.__enter__()
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self.lease.__exit__(kind, exc, tb)

    def resume(self, transcript: list[Message]) -> None:
        """Tools may run before the first request: so the compare-and-swap comes first here, without
        writing a reply that waits for its results (the loop never stores a tool call without them)."""
        text = self.store.journal(self.session)
        journal = None if text is None else Journal.from_json(text, f"session {self.session!r}")
        if journal is not None and journal.answers(transcript) and self._is_stored(transcript):
            self.journal = journal  # the reply waits in the journal: finish it
            transcript.append(journal.reply)
            return
        if not unanswered(transcript):
            return
        if (journal is not None and transcript[-1] == journal.reply and journal.answers(transcript[:-1])
                and self._is_stored(transcript)):
            self.journal = journal  # the reply is stored with its calls (a cut fork, a plain save): finish it
            return
        try:
            self._save(transcript[:-1], take_steers=False)
        except TranscriptConflict as exc:
            if exc.stored != len(transcript):
                raise
            self._save(transcript, take_steers=False)  # stored with its calls already, and no journal

    def _is_stored(self, msgs: Sequence[Message]) -> bool:
        """The compare-and-swap of a run that finishes a journalled reply: ``msgs`` must be exactly what is
        stored, so nothing is written and the journal stays until the results are saved. ``False`` when it
        is not but the run replaces the history on purpose (its first save then drops the journal)."""
        try:
            self._save(msgs, take_steers=False, replace=False)
        except TranscriptConflict:
            if self.replace:
                return False
            raise
        return True

    def before_request(self, transcript: list[Message]) -> tuple[Sequence[str], bool]:
        saved = self._save(transcript, take_steers=True)
        transcript.extend(Message.user(t) for t in saved.steers)
        self.journal = None  # the save holds the reply and its results: the store dropped the journal
        return saved.steers, saved.cancelled

    def begin_tools(self, transcript: Sequence[Message]) -> None:
        at = len(transcript) - 1
        if self.journal is not None and self.journal.at == at:
            return  # resuming it
        self.journal = Journal(at, fingerprint(transcript[:at]), transcript[at])
        self.fresh = None

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        assert self.journal is not None
        done = self.journal.results.get(call.id)
        if done is not None:
            return done
        if call.id in self.journal.started and tool is not None and not tool.idempotent:
            return Content.tool_result(call.id, UNKNOWN_OUTCOME, is_error=True)
        return None

    def may_run(self, call: Content, tool: Tool | None) -> bool:
        assert self.journal is not None
        if tool is not None and not tool.idempotent:
            self.journal.started.append(call.id)
            cancelled = self.store.put_journal(self.session, self.lease.holder, self.journal.to_json(),
                                               unless_cancelled=True)
            if cancelled:  # nothing was written: the call never starts, and the journal never says it did
                self.journal.started.pop()
        elif self.fresh is not None:
            cancelled = self.fresh
        else:
            cancelled = self.store.check(self.session, self.lease.holder)
        self.fresh = None
        return not cancelled

    def ran(self, call: Content, tool: Tool | None, result: Content) -> None:
        assert self.journal is not None
        self.journal.results[result.tool_call_id] = result
        if tool is not None and not tool.idempotent and call.id != self.journal.reply.tool_calls[-1].id:
            # Other calls run before the next save: journal this result, so a crash among them replays it
            # rather than call its outcome unknown. After the reply's last call the save comes at once and
            # carries it.
            self.fresh = self.store.put_journal(self.session, self.lease.holder, self.journal.to_json())

    def finish(self, transcript: list[Message]) -> None:
        if len(transcript) != self.written:
            self._save(transcript, take_steers=False)

    def _save(self, msgs: Sequence[Message], take_steers: bool, replace: bool | None = None) -> Saved:
        """``replace``: by default, the spec's, for the run's first write only."""
        if replace is None:
            replace = self.replace and self.written < 0
        saved = self.store.save_fenced(self.session, self.lease.holder, msgs, take_steers=take_steers, replace=replace)
        self.written = len(msgs) + len(saved.steers)
        return saved


def keeping(spec: Spec) -> Keeping:
    session = spec.session
    if session is None:
        return NOT_KEPT
    if is_run_session(session):
        return Leased(session, spec)
    return Kept(session)

