"""The run lease, on the session's row: its holder (token, host, pid), its expiry on the database's clock,
its epoch and the cancel flag. Each step is one statement or one short transaction; every fenced write of
the other parts is guarded by the same row's token and epoch (``sql.fence_params``), inside its own
statement or transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Connection

from agent_sessions import Holder, LeaseLost, StoreError, validate

from . import statements as sql
from .base import SQLBase, log

ACQUIRE_ATTEMPTS = 5
"""Times ``acquire`` makes the session's row and locks it, when a delete lands between the two steps."""


class Lease(SQLBase):
    """``RunStore``'s lease: acquire, renew, release, holder, cancel and check."""

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        validate.session_id(session)
        params = {"sid": session, "lease_token": holder.token, "lease_host": holder.host, "lease_pid": holder.pid,
                  "lease_spec": holder.spec, "ttl": float(ttl)}

        def take(conn: Connection) -> Holder | None:
            row = self.run(conn, sql.LEASE, {"sid": session}).first()
            if row is None:
                return None  # not made yet (or made just before, and deleted since by a forced delete)
            handed = False
            if row[0] is None or not row[2]:  # free, or expired on the database's clock
                self.run(conn, sql.TAKE_OVER, params)
                handed = bool(row[3])
                if row[0] is not None:
                    log.info("%s store: session %r: the lease of token %s… (epoch %d) had expired; taken over "
                             "at epoch %d", self.backend, session, str(row[0])[:8], row[1], row[1] + 1)
            current = self.run(conn, sql.CURRENT, {"sid": session}).first()
            assert current is not None
            got = holder_of(current)
            return replace(got, cancelled=True) if handed else got

        # The row locked and read first: its one transaction bounds how long it waits for a lock (another
        # worker inside a transaction on the session: ``SessionLocked``). Only when there is no row yet is it
        # made, in a statement of its own, and taken again: a transaction locking a row that is not there
        # would take a gap lock on MySQL, and concurrent first acquires would deadlock on their inserts.
        for _ in range(ACQUIRE_ATTEMPTS):
            got = self._transaction("acquire", session, take)
            if got is not None:
                return got
            self._transaction("acquire", session, lambda conn: conn.execute(self.insert_session(session)),
                              read_only=True)
        raise StoreError(f"{self.backend} store: session {session!r} was deleted under each of {ACQUIRE_ATTEMPTS} "
                         f"attempts to take its lease")

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        validate.session_id(session)
        params = {**sql.fence_params(session, holder), "ttl": float(ttl)}
        renewed = self._transaction(
            "renew", session, lambda conn: self.run(conn, sql.RENEW, params).rowcount, read_only=True
        )
        if renewed != 1:
            raise lost(session, holder, self._check_row(session))

    def release(self, session: str, holder: Holder) -> None:
        validate.session_id(session)
        params = sql.fence_params(session, holder)
        self._transaction("release", session, lambda conn: self.run(conn, sql.RELEASE, params), read_only=True)

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        current = self._transaction(
            "holder", session, lambda conn: self.run(conn, sql.HOLDER, {"sid": session}).first(),
            read_only=True, reads=True,
        )
        return None if current is None else holder_of(current)

    def cancel(self, session: str) -> bool:
        validate.session_id(session)
        cancelled = self._transaction(
            "cancel", session, lambda conn: self.run(conn, sql.CANCEL, {"sid": session}).rowcount, read_only=True
        )
        return bool(cancelled == 1)

    def check(self, session: str, holder: Holder) -> bool:
        validate.session_id(session)
        row = self._check_row(session)
        if row is None or row[0] != holder.token or row[1] != holder.epoch:
            raise lost(session, holder, row)
        return bool(row[2])

    def lease_lost(self, session: str, holder: Holder) -> LeaseLost:
        """The ``LeaseLost`` of a fenced write that matched no row, saying whose lease is stored now."""
        return lost(session, holder, self._check_row(session))

    def _check_row(self, session: str) -> Sequence[Any] | None:
        return self._transaction(
            "check", session, lambda conn: self.run(conn, sql.CHECK, {"sid": session}).first(),
            read_only=True, reads=True,
        )


def holder_of(row: Sequence[Any]) -> Holder:
    """sql.HOLDER's or sql.CURRENT's columns as a Holder."""
    host, pid, token, expires, cancelled, epoch = row
    return Holder(host, int(pid), token, float(expires), bool(cancelled), int(epoch))


def lost(session: str, holder: Holder, stored: Sequence[Any] | None) -> LeaseLost:
    """``stored``: the stored lease's token and epoch, or ``None`` when the session has no row."""
    if stored is None:
        return LeaseLost.superseded(session, holder.epoch, None, None)
    return LeaseLost.superseded(session, holder.epoch, stored[0], int(stored[1]))
