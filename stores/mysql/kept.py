"""A few connections the MySQL store keeps checked out of the caller's pool, in autocommit, for its usual step.

The usual step of a run is one statement (the fenced ``INSERT ... SELECT``). Through the pool it cost
three round trips and SQLAlchemy's checkout and return around them: the statement, its ``COMMIT`` and the
``ROLLBACK`` the pool sends whenever a connection comes back. On a connection kept in autocommit it is one
round trip and no checkout: the statement is its own transaction, atomic, and its share lock on the
session row holds until it commits, so the fence holds as it did.

What that costs the caller is pool slots: a kept connection is never back in the pool while the store
lives. So the store keeps few, shared by its threads (a thread takes a spare one for the statement and gives
it back), makes one only while it has fewer than ``most``, and takes the ordinary path when all are busy.
``close`` gives them back (autocommit off again, as the pool handed them out); a forked child forgets its
parent's without sending anything on them. A connection that turns out dead is invalidated and dropped, and
the step then runs its transaction through the pool, which finds whatever the lost statement did; one that
cannot be kept (dead in the pool, or refused by the server) leaves the step to the pool too.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.pool import QueuePool

log = logging.getLogger(__name__)

MOST = 2
"""Connections kept at most by default: steps are short and seconds apart, so two serve many runs."""


def default_most(engine: Engine) -> int:
    """What a store keeps unless told: ``MOST``, and always fewer than the pool's persistent connections, so
    the pool keeps at least one for everything else (a heartbeat, a journal write). None where the pool is
    not a ``QueuePool`` of bounded size: a ``NullPool`` opens a connection per checkout (keeping one would
    be a connection the caller chose not to keep), and a static or per-thread pool would share it."""
    pool = engine.pool
    if type(pool) is not QueuePool or pool.size() < 1:
        return 0
    return max(0, min(MOST, pool.size() - 1))


class Conn:
    """One kept connection: SQLAlchemy's pool proxy, its PyMySQL connection, the store's generation it was
    kept in, and whether it was in autocommit when the pool handed it out (what ``close`` restores)."""

    __slots__ = ("error", "generation", "proxy", "raw", "was")

    def __init__(self, proxy: Any, generation: int, error: type[Exception]) -> None:
        self.proxy = proxy
        self.error = error
        """The driver's error class (PyMySQL's ``Error``)."""
        self.raw = proxy.driver_connection
        self.generation = generation
        self.was: bool = self.raw.get_autocommit()
        self.raw.autocommit(True)

    def release(self) -> None:
        """Autocommit as it was, then back to the pool (whose return sends its usual reset)."""
        try:
            self.raw.autocommit(self.was)
        except self.error as exc:  # a dead line: the pool drops it
            self.proxy.invalidate(exc)
            return
        self.proxy.close()


class Kept:
    """Up to ``most`` connections checked out of ``engine``, in autocommit; thread-safe."""

    def __init__(self, engine: Engine, most: int) -> None:
        self.engine = engine
        self.most = most
        self._lock = threading.Lock()
        self._spare: list[Conn] = []
        """Kept and not in use. Always this one list: a store dropped without ``close`` gives them back as it
        is collected (a proxy collected instead would go back to the pool still in autocommit)."""
        weakref.finalize(self, _release, self._spare)
        self._count = 0
        """Kept now, spare or in use (of this generation)."""
        self._generation = 0
        """Moved on by ``close`` and ``forget``: a connection of an older one is not taken back."""

    def take(self) -> Conn | None:
        """A kept connection, or ``None``: all ``most`` are in use (or none may be kept), or keeping one failed
        in the driver (the pool handed out a connection the server had dropped, or the server refused a new
        one: too many connections). Then the step goes through the pool, as every other statement does, and
        meets there what the pool does about it (``pool_pre_ping``, or an error the store reports as
        ``StoreError``). A pool that has nothing to give within its ``pool_timeout`` raises SQLAlchemy's
        ``TimeoutError``, as it would to the pool's path."""
        with self._lock:
            if self._spare:
                return self._spare.pop()
            if self._count >= self.most:
                return None
            self._count += 1
            generation = self._generation
        error = self.engine.dialect.loaded_dbapi.Error
        proxy = None
        try:
            proxy = self.engine.raw_connection()
            return Conn(proxy, generation, error)
        except BaseException as exc:
            with self._lock:
                if generation == self._generation:
                    self._count -= 1
            if proxy is not None:
                proxy.invalidate(exc)
            if not isinstance(exc, error):
                raise
            log.warning("MySQL store: no connection could be kept (%s); the step goes through the pool", exc)
            return None

    def give(self, conn: Conn) -> None:
        """Back to the spares after a statement, or to the pool if the store was closed meanwhile."""
        with self._lock:
            if conn.generation == self._generation:
                self._spare.append(conn)
                return
        conn.release()

    def drop(self, conn: Conn, exc: BaseException) -> None:
        """A connection that failed as a dead one does: invalidated (the pool opens a new one in its slot)."""
        log.warning("MySQL store: a kept connection was lost (%s); the step goes through the pool", exc)
        with self._lock:
            if conn.generation == self._generation:
                self._count -= 1
        conn.proxy.invalidate(exc)

    def close(self) -> None:
        """Give every spare connection back to the pool; one in use goes back when its statement ends."""
        with self._lock:
            spare = list(self._spare)
            self._spare.clear()
            self._count = 0
            self._generation += 1
        _release(spare)

    def forget(self) -> None:
        """In a forked child: the parent's connections are not ours to use, nor to close. Each is detached
        from its pool first: a pool proxy that is collected while checked out is given back to its pool,
        which resets it (a ``ROLLBACK`` on the parent's line). Detached, the proxy has no such finalizer,
        and the driver's connection, collected, closes only the child's copy of the socket."""
        with self._lock:
            spare = list(self._spare)
            self._spare.clear()
            self._count = 0
            self._generation += 1
        for conn in spare:
            conn.proxy.detach()


def _release(spare: list[Conn]) -> None:
    for conn in spare:
        conn.release()
