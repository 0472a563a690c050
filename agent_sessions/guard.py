"""What a run does beside saving when its session's store is a RunStore: it holds the session's lease,
watches for a cancel from any process, and journals its tool calls so a resume never repeats a
non-idempotent one."""

from __future__ import annotations

from collections.abc import Sequence

from .journal import UNKNOWN_OUTCOME, Journal, fingerprint
from .lease import Lease
from .messages import Content, Message
from .session import RunStore, Session, StoreSession
from .tools import Tool


class Guard:
    def __init__(self, store: RunStore, session: str, ttl: float, wait: float) -> None:
        self.store = store
        self.session = session
        self.lease = Lease(store, session, ttl, wait)
        self.journal: Journal | None = None

    @classmethod
    def of(cls, session: Session, ttl: float, wait: float) -> Guard | None:
        if isinstance(session, StoreSession) and isinstance(session.store, RunStore):
            return cls(session.store, session.id, ttl, wait)
        return None

    def __enter__(self) -> Guard:
        self.lease.__enter__()
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        try:
            if kind is None and self.journal is not None:
                self.store.put_journal(self.session, None)  # the final save holds its reply and results
        finally:
            self.lease.__exit__(kind, exc, tb)

    def save_with_steers(self, transcript: list[Message]) -> list[str]:
        """Take the session's steers and save them with the transcript in one step (see RunStore)."""
        return self.store.save_with_steers(self.session, transcript)

    def stop_requested(self) -> bool:
        return self.lease.check()

    def resume(self, transcript: list[Message]) -> None:
        """Put back the reply whose tools a dead run was running, if it answered this very transcript."""
        text = self.store.journal(self.session)
        if text is None:
            return
        journal = Journal.from_json(text, f"session {self.session!r}")
        if journal.answers(transcript):
            self.journal = journal
            transcript.append(journal.reply)

    def begin(self, transcript: Sequence[Message]) -> None:
        """The last message of ``transcript`` is a reply whose tool calls are about to run."""
        at = len(transcript) - 1
        if self.journal is not None and self.journal.at == at:
            return  # resuming it
        self.journal = Journal(at, fingerprint(transcript[:at]), transcript[at])

    def replay(self, call: Content, tool: Tool | None) -> Content | None:
        """The result a resumed call gets without running, or ``None`` to run it."""
        assert self.journal is not None
        done = self.journal.results.get(call.id)
        if done is not None:
            return done
        if call.id in self.journal.started and tool is not None and not tool.idempotent:
            return Content.tool_result(call.id, UNKNOWN_OUTCOME, is_error=True)
        return None

    def started(self, call: Content) -> None:
        assert self.journal is not None
        self.journal.started.append(call.id)
        self.store.put_journal(self.session, self.journal.to_json())

    def finished(self, result: Content) -> None:
        assert self.journal is not None
        self.journal.results[result.tool_call_id] = result
        self.store.put_journal(self.session, self.journal.to_json())
