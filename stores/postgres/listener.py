"""Waking followers of PostgreSQL event logs: one LISTEN connection per store, fanned out to its waiters.

Every write of events runs ``pg_notify('agent_events', <session id>)`` in its transaction, so PostgreSQL
delivers the notification when the events are committed, to every connection listening on the channel.
A store that has followers keeps one such connection, in one thread, and wakes the threads waiting on the
notified session (``Store.wait_for_events``). Waits are bounded, and a waiter re-reads the session's last
number once it knows the listener is live, so a notification sent before it began waiting is not missed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CHANNEL = "agent_events"
"""The channel every event write notifies, its payload the session id."""
POLL_SECONDS = 0.5
"""How long the listener thread waits for notifications before it checks whether it should stop."""
PING_SECONDS = 30.0
"""A listener that heard nothing for this long asks the server something, so a dead line is noticed."""
OUTAGE_POLL = 0.5
"""While the listener has no connection, a waiter returns after this long at most (the follower reads)."""
RETRY_MOST = 5.0
"""The longest pause between attempts to reconnect."""


class Listener:
    """Started by the first wait and stopped by ``close``; a later wait starts it again. ``connect``
    returns an open psycopg connection this object owns and closes (one the engine made, detached from
    its pool: the engine's connect arguments, not a pooled slot)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._cond = threading.Condition()
        self._waiting: dict[str, int] = {}
        """Sessions with waiters: how many."""
        self._woken: dict[str, int] = {}
        """Notifications heard for each session with waiters: a waiter wakes when its count moves."""
        self._outages = 0
        """Connections lost (or closed): every waiter wakes and reads again."""
        self._listening = False
        """The current thread's connection LISTENs."""
        self._stop: threading.Event | None = None
        """Set to stop the current thread; ``None``: no thread (never started, or closed)."""
        self._thread: threading.Thread | None = None

    def wait(self, session: str, timeout: float, arrived: Callable[[], bool]) -> bool:
        """Wait up to ``timeout`` seconds for a notification of ``session``. ``arrived`` reads whether an
        event is there already: asked once the listener is live, for what came before it listened."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._start()
            self._waiting[session] = self._waiting.get(session, 0) + 1
            seen = (self._woken.get(session, 0), self._outages)
        try:
            with self._cond:
                live = self._cond.wait_for(lambda: self._listening, min(timeout, OUTAGE_POLL))
            if arrived():
                return True
            with self._cond:
                if not live:  # no connection yet (or the server is down): wait a little, the follower reads
                    left = min(deadline, time.monotonic() + OUTAGE_POLL) - time.monotonic()
                else:
                    left = deadline - time.monotonic()
                return self._cond.wait_for(lambda: (self._woken.get(session, 0), self._outages) != seen,
                                           max(0.0, left))
        finally:
            with self._cond:
                left_waiting = self._waiting[session] - 1
                if left_waiting:
                    self._waiting[session] = left_waiting
                else:
                    del self._waiting[session]
                    self._woken.pop(session, None)

    def close(self, wait: float = 2.0) -> None:
        """Stop the thread and close its connection (within ``POLL_SECONDS``; joined at most ``wait``)."""
        with self._cond:
            stop, thread, self._stop, self._thread = self._stop, self._thread, None, None
            self._listening = False
            self._cond.notify_all()
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait)

    def forget(self) -> None:
        """In a forked child: the parent's thread is not here and its connection is the parent's."""
        self._cond = threading.Condition()
        self._waiting, self._woken, self._listening, self._stop, self._thread = {}, {}, False, None, None

    # -- the thread --------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._stop is not None:
            return
        stop = self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stop,), name="agent-sessions-listen", daemon=True)
        self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        pause = 0.1
        while not stop.is_set():
            conn = None
            try:
                conn = self._connect()
                conn.autocommit = True
                conn.execute(f"LISTEN {CHANNEL}")
                with self._cond:
                    self._listening = self._stop is stop  # a closed listener's thread speaks for nobody
                    self._cond.notify_all()
                pause = 0.1
                self._hear(conn, stop)
            except Exception as exc:  # noqa: BLE001 - logged; the thread reconnects
                if not stop.is_set():
                    log.warning("PostgreSQL store: listening for events failed (%s: %s); followers poll until it "
                                "reconnects, in %.1f s", type(exc).__name__, exc, pause)
            finally:
                with self._cond:
                    if self._stop is stop:
                        self._listening = False
                    self._outages += 1
                    self._cond.notify_all()
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        log.debug("closing the listening connection failed", exc_info=True)
            stop.wait(pause)
            pause = min(pause * 2, RETRY_MOST)

    def _hear(self, conn: Any, stop: threading.Event) -> None:
        quiet_since = time.monotonic()
        while not stop.is_set():
            heard = False
            for note in conn.notifies(timeout=POLL_SECONDS):
                heard = True
                with self._cond:
                    if note.payload in self._waiting:
                        self._woken[note.payload] = self._woken.get(note.payload, 0) + 1
                        self._cond.notify_all()
            now = time.monotonic()
            if heard:
                quiet_since = now
            elif now - quiet_since > PING_SECONDS:
                conn.execute("SELECT 1")  # raises on a dead line; notifications meanwhile are kept
                quiet_since = now
