"""A run that stalls, in one process: its lease renewals held back, as a stopped process's would be.

``Stalled`` wraps the store under test and passes every call through; only ``renew`` can be made to wait
(the heartbeat thread then stops renewing, while the test decides what the run's own thread does), and
``on_acquire`` runs right after a lease is taken. The store does all the work; the cross-process tests
(``crossprocess``) stop a real process with SIGSTOP instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from agent_sessions import Holder, Message, RunStore, Saved


class Stalled:
    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.on_acquire: Callable[[str, Holder], None] | None = None
        self._running = threading.Event()
        self._running.set()

    def freeze(self) -> None:
        """Renewals wait from now on (up to a minute each), as if the process had been stopped."""
        self._running.clear()

    def thaw(self) -> None:
        self._running.set()

    # -- Store ---------------------------------------------------------------------------------------

    def save(self, session: str, msgs: Sequence[Message]) -> None:
        self.store.save(session, msgs)

    def messages(self, session: str) -> list[Message]:
        return self.store.messages(session)

    def add_steer(self, session: str, text: str) -> None:
        self.store.add_steer(session, text)

    def take_steers(self, session: str) -> list[str]:
        return self.store.take_steers(session)

    # -- RunStore ------------------------------------------------------------------------------------

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        got = self.store.acquire(session, holder, ttl)
        if got.token == holder.token and self.on_acquire is not None:
            self.on_acquire(session, got)
        return got

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        self._running.wait(60)
        self.store.renew(session, holder, ttl)

    def release(self, session: str, holder: Holder) -> None:
        self.store.release(session, holder)

    def holder(self, session: str) -> Holder | None:
        return self.store.holder(session)

    def cancel(self, session: str) -> bool:
        return self.store.cancel(session)

    def check(self, session: str, holder: Holder) -> bool:
        return self.store.check(session, holder)

    def save_fenced(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False
    ) -> Saved:
        return self.store.save_fenced(session, holder, msgs, take_steers=take_steers, replace=replace)

    def journal(self, session: str) -> str | None:
        return self.store.journal(session)

    def put_journal(self, session: str, holder: Holder, journal: str, *, unless_cancelled: bool = False) -> bool:
        return self.store.put_journal(session, holder, journal, unless_cancelled=unless_cancelled)

    def fork(self, source: str, target: str, at: int | None, *, allow_unanswered: bool = False) -> None:
        self.store.fork(source, target, at, allow_unanswered=allow_unanswered)
