"""A run that stalls, in one process: ``Stalled`` passes every call to the store under test, but ``renew``
can be made to wait (the heartbeat stops renewing, as a stopped process's would), and ``on_acquire`` runs
right after a lease is taken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from agent_sessions import Holder, RunStore


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

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        got = self.store.acquire(session, holder, ttl)
        if got.token == holder.token and self.on_acquire is not None:
            self.on_acquire(session, got)
        return got

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        self._running.wait(60)
        self.store.renew(session, holder, ttl)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)  # everything else: the store under test, as it is
