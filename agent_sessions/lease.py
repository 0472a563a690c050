"""Who holds a run: a lease in the store, renewed by a heartbeat thread while the run lives (docs/runs/leases.md).

Each time the lease passes to a new holder the store raises the session's *epoch*, and every write of the
run carries its token and epoch, applied only while the stored lease still has both: a run that stalled
past its expiry and was taken over can never write again (``LeaseLost``). Expiry is the store's clock,
never a replica's, so clock skew cannot hand a live lease to a second run; only the heartbeat renews.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import replace

from .contract import RunStore
from .errors import LeaseLost, OutcomeUnknown, SessionBusy, SessionLocked, StoreError
from .values import Holder

log = logging.getLogger(__name__)

HEARTBEAT_JOIN = 5.0
"""Seconds a returning run waits for its heartbeat thread, which may be inside a slow store call; after
that the (daemon) thread is left to finish on its own, and its late renewal is refused by the fence."""

ACQUIRE_RETRIES = 2
"""Times an acquisition whose answer was lost is asked again, with its own token, before its error is raised."""


def claimant() -> Holder:
    """A new would-be holder: this process, a fresh token. The store sets expiry and epoch."""
    return Holder(socket.gethostname(), os.getpid(), secrets.token_hex(16), 0.0)


class Lease:
    """The lease of one run: taken on entry, renewed every ``ttl / 3`` on a daemon thread, released on exit.

    ``holder`` is what the run's writes carry."""

    def __init__(self, store: RunStore, session: str, ttl: float, wait: float, spec: str | None = None,
                 turn: str | None = None) -> None:
        self.store = store
        self.session = session
        self.ttl = ttl
        self.wait = wait
        self.holder = replace(claimant(), spec=spec, turn=turn)
        """``spec``: the run's ``Spec.name``, which ``acquire`` records on the session; ``turn``: the key of
        the turn it runs, recorded with the lease (``Holder.turn``)."""
        self.lost: LeaseLost | None = None
        """Set by the heartbeat when a renewal found the lease taken over."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed = False
        """``__exit__`` ran: the lease was given back (or lost)."""

    def __enter__(self) -> Lease:
        if self._thread is not None:
            return self  # taken already, by a turn that waited for it, and handed to its run (``busy``)
        started = time.monotonic()
        deadline = started + self.wait
        pause = 0.02
        unanswered = 0
        waiting = False
        while True:
            refused: Exception
            try:
                got = self.store.acquire(self.session, self.holder, self.ttl)
            except SessionLocked as exc:
                # Another worker is inside a transaction on the session (taking it, say): busy, as a held
                # lease is, for as long as the run may wait; then that is the error.
                refused, why = exc, f"locked by another worker's transaction ({exc})"
            except OutcomeUnknown as exc:
                # It may have taken the lease: the same acquisition again (same token) finds it ours, where
                # a new one would find the session held, by this very process, for the whole ttl.
                unanswered += 1
                if unanswered > ACQUIRE_RETRIES:
                    raise
                log.warning("session %r: acquiring the lease went unanswered (%s); asking again with the same "
                            "token (%d of %d)", self.session, exc, unanswered, ACQUIRE_RETRIES)
                time.sleep(min(pause, 0.1))
                continue
            else:
                if got.token == self.holder.token:
                    self.holder = got
                    break
                refused, why = self.busy(got), f"held by {got.describe()}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise refused
            if not waiting:
                log.info("session %r is %s; waiting up to %g s for it (lease_wait)", self.session, why, self.wait)
                waiting = True
            # Backoff rather than the holder's expiry: that is on the store's clock, not this one.
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)
        if waiting:
            log.info("session %r: got the lease after waiting %.1f s (epoch %d)", self.session,
                     time.monotonic() - started, self.holder.epoch)
        log.debug("session %r: lease taken, epoch %d", self.session, self.holder.epoch)
        self._thread = threading.Thread(target=self._heartbeat, name="agent-lease", daemon=True)
        self._thread.start()
        return self

    def busy(self, got: Holder) -> SessionBusy:
        """The error when ``got`` still holds the session after the run's ``lease_wait``: who, until when,
        and how a caller waits longer (a dead holder's lease runs out at ``expires``; a live one renews it)."""
        return SessionBusy(
            f"session {self.session!r} is held by {got.describe()}: its lease ends then unless that run, while "
            f"it lives, renews it. This run waited {self.wait:g} s (Spec.lease_wait={self.wait:g}); to wait for "
            f"the holder to finish, or for a dead holder's lease to run out, give Spec(lease_wait=seconds) "
            f"more than the holder's Spec.lease_ttl", got)

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(HEARTBEAT_JOIN)
            if self._thread.is_alive():
                log.warning("session %r: the lease heartbeat is still inside a store call after %.1f s; "
                            "leaving it behind", self.session, HEARTBEAT_JOIN)
        if self.lost is not None or isinstance(exc, LeaseLost):
            return  # not ours any more: nothing to release
        try:
            self._release()
        except StoreError:
            if kind is None:
                raise
            # The run is failing already (often because the store is down): that error is the one to
            # report. The lease is left to expire.
            log.warning("session %r: could not release the lease; it will expire", self.session, exc_info=True)

    def _release(self) -> None:
        """Release; when its answer was lost, once more: finding the lease no longer ours then means the
        first one released it (the run's turn is over either way, so it must not fail for that)."""
        try:
            self.store.release(self.session, self.holder)
        except OutcomeUnknown as exc:
            log.warning("session %r: releasing the lease went unanswered (%s); releasing again", self.session, exc)
            try:
                self.store.release(self.session, self.holder)
            except LeaseLost:
                pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.store.renew(self.session, self.holder, self.ttl)
            except LeaseLost as exc:
                if not self._stop.is_set():  # else the run released it meanwhile
                    self.lost = exc
                    log.warning("session %r: lease lost: %s", self.session, exc)
                return
            except StoreError as exc:
                # The store may be back before the lease runs out; the run's own writes fail if it is not.
                log.warning("session %r: lease renewal failed (%s); retrying in %.1f s", self.session, exc,
                            self.ttl / 3)
            except Exception:  # a store's bug must not end the heartbeat silently
                log.exception("session %r: lease renewal raised", self.session)
