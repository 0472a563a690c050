"""Who holds a run: a lease in the store, renewed by a heartbeat thread while the run lives.

Two replicas picking up one session must not both drive it. A run with a RunStore session takes the
session's lease before its first request and gives it back when it returns; a worker that dies simply
stops renewing, and once the lease has expired another worker may take it over. Expiry is compared with
each process's wall clock, so replicas need synchronised clocks (NTP) and a ttl well above their skew.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .errors import LeaseLost, SessionBusy, StoreError

if TYPE_CHECKING:
    from .session import RunStore


@dataclass(frozen=True, slots=True)
class Holder:
    """A lease as stored: who took it (host, pid, a random token), until when (epoch seconds), and
    whether somebody has asked that run to stop."""

    host: str
    pid: int
    token: str
    expires: float
    cancelled: bool = False

    def live(self, now: float | None = None) -> bool:
        return self.expires > (time.time() if now is None else now)


def new_holder(ttl: float) -> Holder:
    return Holder(socket.gethostname(), os.getpid(), secrets.token_hex(16), time.time() + ttl)


class Lease:
    """The lease of one run: taken on entry, renewed every ``ttl / 3`` on a daemon thread, released on exit."""

    def __init__(self, store: RunStore, session: str, ttl: float, wait: float) -> None:
        self.store = store
        self.session = session
        self.ttl = ttl
        self.wait = wait
        self.mine = new_holder(ttl)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None

    def __enter__(self) -> Lease:
        deadline = time.monotonic() + self.wait
        pause = 0.02
        while True:
            now = time.time()
            self.mine = replace(self.mine, expires=now + self.ttl)
            got = self.store.acquire(self.session, self.mine, now)
            if got.token == self.mine.token:
                break
            if time.monotonic() >= deadline:
                raise SessionBusy(
                    f"session {self.session!r} is held by pid {got.pid} on {got.host} until "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(got.expires))} (token {got.token[:8]}…)",
                    got,
                )
            # Wake when the holder's lease runs out (a dead holder's never renews) or after the backoff.
            until_expiry = max(0.0, got.expires - time.time()) + 0.001
            time.sleep(min(pause, until_expiry, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)
        self._thread = threading.Thread(target=self._heartbeat, name="agent-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost is None:
            try:
                self.store.release(self.session, self.mine.token)
            except StoreError:
                if kind is None:
                    raise
                # The run is failing already (often because the store is down): that error is the one to
                # report. The lease is left to expire.

    def check(self) -> bool:
        """Raise if the lease is gone; return whether somebody asked this run to stop."""
        now = time.time()
        # Late renewals (a loaded machine, a slow store) are harmless unless another run took the lease
        # over meanwhile: renew it here, and find out.
        if self._lost is None and now >= self.mine.expires and self._renew(now):
            return self.mine.cancelled
        if self._lost is not None:
            raise LeaseLost(f"the run of session {self.session!r} lost its lease: {self._lost}")
        current = self.store.holder(self.session)
        if current is None or current.token != self.mine.token:
            self._lost = "another run took it over"
            raise LeaseLost(f"the run of session {self.session!r} lost its lease: {self._lost}")
        return current.cancelled

    def _renew(self, now: float) -> bool:
        """Extend the lease; ``False``, with the lease marked lost, when another run holds it now."""
        got = self.store.acquire(self.session, replace(self.mine, expires=now + self.ttl), now)
        if got.token != self.mine.token:
            self._lost = f"pid {got.pid} on {got.host} took it over"
            return False
        self.mine = got
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if not self._renew(time.time()):
                    return
            except StoreError:
                continue  # the store may be back before the lease runs out; check() notices if not
