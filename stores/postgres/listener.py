"""Waking followers of PostgreSQL event logs, and hearing cancels: a LISTEN connection per store and channel
(``CHANNEL``, ``CANCEL_CHANNEL``; docs/stores/postgres.md), in a thread of its own started by its first use,
fanned out to its waiters (events) or its runs' watches (cancels).

A waiter reads the session's last event number once it knows the listener is live, so a notification sent
before it began waiting is not missed. What a run may conclude from hearing no cancel depends on the
connection having listened, unbroken, since before its last read of the flag: each connection that LISTENs
gets a new number (``Watch.listening``), withdrawn as soon as it is known lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CHANNEL = "agent_events"
"""The channel every event write notifies while anything follows, its payload the session id."""
FOLLOWED = int.from_bytes(b"agentevs", "big")
"""The advisory lock (a bigint key, 7018690069353821811, written into write.sql) a connection listening on
``CHANNEL`` holds shared for as long as it listens. A write of events asks ``pg_try_advisory_xact_lock``
of it and notifies only when that fails: someone listens, or another writer holds it this instant. When
it succeeds, nobody listens, and the write holds it until its commit, so a listener starting meanwhile
waits for that commit before it LISTENs, and its waiter's first read (after the LISTEN) sees the write."""
LOCK_WAIT = "5s"
"""How long a listener waits for ``FOLLOWED`` (a write holds it for one statement) before it gives up and
connects again (logged)."""
CANCEL_CHANNEL = "agent_cancels"
"""The channel every cancel notifies, its payload the cancelled lease's epoch, a space and the session id."""
POLL_SECONDS = 0.5
"""How long the listener thread waits for notifications before it checks whether it should stop."""
PING_SECONDS = 30.0
"""A listener that heard nothing for this long asks the server something, so a dead line is noticed."""
OUTAGE_POLL = 0.5
"""While the listener has no connection, a waiter returns after this long at most (the follower reads)."""
RETRY_MOST = 5.0
"""The longest pause between attempts to reconnect."""


class Watch:
    """One run's watch of its lease (``contract.CancelWatch``): set by the listening thread, read by the run.
    Single attributes, each read or written whole, so the run's questions take no lock."""

    def __init__(self, listener: Listener, session: str, epoch: int) -> None:
        self._listener = listener
        self.session = session
        self.epoch = epoch
        self.heard = False
        """A cancel of this lease was heard."""
        self.passed = False
        """A cancel of a later lease of the session was heard: this one passed on (the run reads, and learns
        it lost the lease)."""

    def listening(self) -> int | None:
        return self._listener.live

    def cancelled(self, since: object | None) -> bool | None:
        if self.heard:
            return True
        if self.passed or since is None or since != self._listener.live:
            return None
        return False

    def close(self) -> None:
        self._listener.unwatch(self)


class Listener:
    """Started by the first wait or watch and stopped by ``close``; a later one starts it again. ``connect``
    returns an open psycopg connection this object owns and closes (one the engine made, detached from
    its pool: the engine's connect arguments, not a pooled slot). ``channel``: what it LISTENs on,
    ``CHANNEL`` (for waits) or ``CANCEL_CHANNEL`` (for watches)."""

    def __init__(self, connect: Callable[[], Any], channel: str) -> None:
        if channel not in (CHANNEL, CANCEL_CHANNEL):
            raise ValueError(f"a listener listens on {CHANNEL!r} or {CANCEL_CHANNEL!r}, not {channel!r}")
        self._connect = connect
        self.channel = channel
        self._cond = threading.Condition()
        self._waiting: dict[str, int] = {}
        """Sessions with waiters: how many."""
        self._woken: dict[str, int] = {}
        """Notifications heard for each session with waiters: a waiter wakes when its count moves."""
        self._outages = 0
        """Connections lost (or closed): every waiter wakes and reads again."""
        self.live: int | None = None
        """The number of the current thread's connection while it LISTENs (each gets a new one), unbroken
        since it began; ``None`` while none does, or from the moment one is known lost."""
        self.pid: int | None = None
        """The server process of the connection that listens (``pg_stat_activity.pid``), while ``live``."""
        self._connections = 0
        self._watches: dict[str, set[Watch]] = {}
        """Runs of this process watching their lease, by session."""
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
                live = self._cond.wait_for(lambda: self.live is not None, min(timeout, OUTAGE_POLL))
            if arrived():
                return True
            # No connection yet (or the server is down): wait a little, the follower reads.
            end = deadline if live else min(deadline, time.monotonic() + OUTAGE_POLL)
            with self._cond:
                return self._cond.wait_for(lambda: (self._woken.get(session, 0), self._outages) != seen,
                                           max(0.0, end - time.monotonic()))
        finally:
            with self._cond:
                left_waiting = self._waiting[session] - 1
                if left_waiting:
                    self._waiting[session] = left_waiting
                else:
                    del self._waiting[session]
                    self._woken.pop(session, None)

    def watch(self, session: str, epoch: int) -> Watch:
        """Keep, for a run of this process, whether a cancel of its lease (``epoch``) of ``session`` is heard."""
        watch = Watch(self, session, epoch)
        with self._cond:
            self._start()
            self._watches.setdefault(session, set()).add(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        with self._cond:
            watches = self._watches.get(watch.session)
            if watches is not None:
                watches.discard(watch)
                if not watches:
                    del self._watches[watch.session]

    def close(self, wait: float = 2.0) -> None:
        """Stop the thread and close its connection (within ``POLL_SECONDS``; joined at most ``wait``)."""
        with self._cond:
            stop, thread, self._stop, self._thread = self._stop, self._thread, None, None
            self.live = None
            self._cond.notify_all()
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait)

    def forget(self) -> None:
        """In a forked child: the parent's thread is not here and its connection is the parent's."""
        self._cond = threading.Condition()
        self._waiting, self._woken, self._watches, self._stop, self._thread = {}, {}, {}, None, None
        self.live = None

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
                if self.channel == CHANNEL:  # writers notify only while someone holds FOLLOWED (above)
                    conn.execute(f"SET lock_timeout = '{LOCK_WAIT}'")
                    conn.execute(f"SELECT pg_advisory_lock_shared({FOLLOWED})")
                conn.execute(f"LISTEN {self.channel}")
                with self._cond:
                    self._connections += 1
                    if self._stop is stop:  # a closed listener's thread speaks for nobody
                        self.live, self.pid = self._connections, conn.info.backend_pid
                    self._cond.notify_all()
                pause = 0.1
                self._hear(conn, stop)
            except Exception as exc:  # noqa: BLE001 - logged; the thread reconnects
                if self._stop is stop:
                    self.live = None  # at once, before anything else: no run relies on a connection known lost
                if not stop.is_set():
                    log.warning("PostgreSQL store: listening on %s failed (%s: %s); %s until it reconnects, in "
                                "%.1f s", self.channel, type(exc).__name__, exc,
                                "followers poll" if self.channel == CHANNEL else "runs read their cancel flag", pause)
            finally:
                with self._cond:
                    if self._stop is stop:
                        self.live = None
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
                    if note.channel == CANCEL_CHANNEL:
                        self._cancelled(note.payload)
                    elif note.payload in self._waiting:
                        self._woken[note.payload] = self._woken.get(note.payload, 0) + 1
                        self._cond.notify_all()
            now = time.monotonic()
            if heard:
                quiet_since = now
            elif now - quiet_since > PING_SECONDS:
                conn.execute("SELECT 1")  # raises on a dead line; notifications meanwhile are kept
                quiet_since = now

    def _cancelled(self, payload: str) -> None:
        """A cancel was committed: mark the watches of its lease, and those of earlier leases of its session."""
        epoch, _, session = payload.partition(" ")
        watches = self._watches.get(session)
        if not watches or not epoch.isdigit():
            return
        for watch in watches:
            if int(epoch) == watch.epoch:
                watch.heard = True
            elif int(epoch) > watch.epoch:
                watch.passed = True
