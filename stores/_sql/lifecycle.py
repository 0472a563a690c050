"""``LifecycleStore``, on the session's row (``created``, ``updated`` on the database's clock, ``metadata``) and
its tags (one row per metadata key, which ``where`` joins): sessions listed, inspected, labelled, deleted
and pruned; a transcript's last messages; the steers waiting.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Connection, Executable

from agent_sessions import Holder, Message, MessageError, SessionBusy, StoreError, lifecycle, validate
from agent_sessions.contract import Scalar, SessionInfo, SessionPage, when
from agent_sessions.messages import read_from

from . import listing
from . import statements as sql
from .base import SQLBase, log
from .lease import holder_of

NO_STOP = 2**31 - 1
"""``read_back``'s ``stop`` for the end of the transcript: above every index (an INTEGER column's largest)."""

PRUNE_BATCH = 500
"""Sessions ``prune`` deletes per transaction: a batch holds its rows' locks for milliseconds, not the
whole job's length."""
PRUNE_PAUSE = 0.02
"""Seconds prune sleeps between batches. SQLite hands its write lock to whoever asks when it is free, and a
writer asleep in its busy handler's backoff could otherwise miss every gap of a long prune (measured: a
save waiting 868 ms beside a 10,000-session prune)."""


class Lifecycle(SQLBase):
    """``LifecycleStore``, and the hooks a dialect overrides for it: ``starts_with``, ``row_values``,
    ``windowed_walk``."""

    row_values = True
    """A listing's keyset bounds are row values, ``(updated, session_id) < (:u, :id)`` (see
    ``listing.Statements``); False: MySQL, whose optimizer reads no index range for them."""
    windowed_walk = False
    """A common value's walk carries its window as a derived table cut by LIMIT (``listing``): True only
    where the database pulls that table lazily in the index's order (PostgreSQL)."""

    def list_sessions(
        self, prefix: str = "", where: Mapping[str, Scalar] | None = None, limit: int = 50, after: str | None = None,
        *, stranded: bool = False, grace: float = 0.0,
    ) -> SessionPage:
        """Unfiltered: the index (updated, session_id) read backwards. Filtered: the tags plan, or for a
        common value the walk (see ``listing``). Then the message counts of the page's rows only.
        ``stranded``: the index of the open sessions (``sql.stranded``)."""
        if stranded:
            return self._stranded(lifecycle.check_stranded(prefix, where, limit, after, grace), limit, after)
        wanted = lifecycle.check_listing(prefix, where, limit, after)
        cursor = None if after is None else lifecycle.decode_cursor(after)
        # Run by SQLAlchemy, not the raw driver: the driver keeps what it compiles for good, by the
        # statement's identity, while a listing's shapes are many (a prefix is part of one) and the least
        # used are dropped.
        rows = self._transaction("list_sessions", "", functools.partial(
            self._listing, wanted=wanted, prefix=prefix, cursor=cursor, limit=limit), read_only=True, reads=True)
        return lifecycle.page([(float(row[2]), _info(row[0], row[1:])) for row in rows], limit)

    def _listing(self, conn: Connection, *, wanted: dict[str, str], prefix: str, cursor: listing.Cursor | None,
                 limit: int) -> list[Any]:
        """``limit + 1`` rows (the extra one says a next page exists): when every wanted value is common,
        by the walk through the window of the newest ``WALK_PER_ROW * (limit + 1)`` sessions past the
        cursor, if that holds them (the window's end read first, or carried along: ``windowed_walk``, whose
        window is rounded up to a power of two, ``listing.window``);
        else by the tags plan, driven by the rarest value if it is not common."""
        statements = self._listing_statements
        rows = limit + 1
        keys = len(wanted)
        after = listing.cursor_params("after", cursor)
        rare = None
        if wanted:
            common = listing.COMMON_PER_ROW * rows
            counted = conn.execute(statements.counts(keys), listing.params(wanted, cap=common)).one()
            rarest = min(range(keys), key=counted.__getitem__)
            if counted[rarest] < common:
                rare = rarest
            elif self.windowed_walk:
                found = conn.execute(statements.windowed_walk(keys, prefix, cursor is not None),
                                     listing.params(wanted, rows=rows, window=listing.window(rows), **after)).all()
                if len(found) == rows:
                    return list(found)
            else:
                end = conn.execute(statements.window_end(cursor is not None),
                                   {"skip": listing.WALK_PER_ROW * rows - 1, **after}).first()
                bound = None if end is None else (float(end[0]), str(end[1]))
                found = conn.execute(statements.walk(keys, prefix, cursor is not None, bound is not None),
                                     listing.params(wanted, rows=rows, **after,
                                                    **listing.cursor_params("end", bound))).all()
                if len(found) == rows or bound is None:
                    return list(found)
        return list(conn.execute(statements.by_tags(keys, rare, prefix, cursor is not None),
                                 listing.params(wanted, rows=rows, **after)).all())

    @functools.cached_property
    def _listing_statements(self) -> listing.Statements:
        """This store's listing statements, each shape built at its first use."""
        return listing.Statements(self.starts_with, self.row_values)

    if TYPE_CHECKING:  # the lease's (a mixin beside this one in the store's class)
        def check(self, session: str, holder: Holder) -> bool: ...

    def _stranded(self, grace: float, limit: int, after: str | None) -> SessionPage:
        cursor = None if after is None else lifecycle.decode_cursor(after)
        params: dict[str, Any] = {"grace": grace, "rows": limit + 1}
        if cursor is not None:
            params.update(after_since=cursor[0], after_id=cursor[1])
        statement = sql.STRANDED[cursor is not None]
        rows = self._transaction("list_sessions", "", functools.partial(_all, statement, params), read_only=True,
                                 reads=True)
        return lifecycle.page([(float(row[6]), _info(row[0], row[1:])) for row in rows], limit)

    def mark_finished(self, session: str, holder: Holder, journal: str | None) -> bool:
        validate.session_id(session)
        params = {**sql.fence_params(session, holder), "seen_journal": journal}
        statement = sql.MARK_FINISHED_NO_JOURNAL if journal is None else sql.MARK_FINISHED
        marked = self._transaction(
            "mark_finished", session, lambda conn: self.run(conn, statement, params).rowcount, read_only=True
        )
        if marked != 1:
            self.check(session, holder)  # LeaseLost when the lease is not the run's; else input came meanwhile
        return marked == 1

    def info(self, session: str) -> SessionInfo | None:
        validate.session_id(session)
        row = self._transaction(
            "info", session, lambda conn: self.run(conn, sql.INFO, {"sid": session}).first(), read_only=True,
            reads=True,
        )
        return None if row is None else _info(session, row)

    def set_metadata(self, session: str, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        """Read, merge and write with the session row locked, so two concurrent changes never lose a key;
        the tags are rewritten with it."""
        validate.session_id(session)
        lifecycle.merge_metadata({}, changes)  # every key and value checked before anything is written

        def write(conn: Connection) -> dict[str, Scalar] | None:
            row = self.run(conn, sql.LOCK_METADATA, {"sid": session}).first()
            if row is None:
                return None
            before = lifecycle.decode_metadata(row[0])
            merged = lifecycle.merge_metadata(before, changes)
            stored = lifecycle.encode_metadata(merged) if merged else None
            self.run(conn, sql.SET_METADATA, {"sid": session, "metadata": stored})
            if before:  # its tags, each by its key (SQLAlchemy expands the list: not one of the driver's)
                conn.execute(sql.DROP_TAGS, {"sid": session, "names": sorted(before)})
            if merged:
                self.run(conn, sql.ADD_TAG, [
                    {"session_id": session, "name": k, "value": lifecycle.metadata_value(k, v)}
                    for k, v in sorted(merged.items())
                ])
            return merged

        for _ in range(3):
            merged = self._transaction("set_metadata", session, write)
            if merged is not None:
                return merged
            # A new session: its row first, in a statement of its own (as acquire makes it), since locking
            # a row that is not there takes a gap lock on MySQL, and concurrent first writers would
            # deadlock on their inserts; then the merge again, with the row to lock.
            self._transaction("set_metadata", session, lambda conn: conn.execute(self.insert_session(session)),
                              read_only=True)
        raise StoreError(f"{self.backend} store: set_metadata of session {session!r}: the session was deleted "
                         "each time its row was made; not retried further")

    def delete(self, session: str, *, force: bool = False) -> bool:
        """One transaction: the session row locked first (as every writer of the session does), then its
        messages, steers, steer keys, tags, events and the row itself deleted. A run holding a lease finds no
        row at its next write, which is LeaseLost, and a row-less session takes no fenced write.

        A session without a row holds nothing but waiting steers and their keys (every other write makes or
        locks the row first), so then only they go. Nothing else is deleted: ``FOR UPDATE`` of a missing row
        locks nothing on PostgreSQL, and a run that made the row and saved meanwhile (a later statement of
        this transaction would see its commit) would otherwise lose its row but keep its messages."""
        validate.session_id(session)

        def remove(conn: Connection) -> bool:
            row = self.run(conn, sql.LOCK_LEASE, {"sid": session}).first()
            if row is None:
                steered = self.run(conn, sql.DELETE_STEERS, {"sid": session}).rowcount
                queued = self.run(conn, sql.DELETE_QUEUE, {"sid": session}).rowcount
                return bool(self.run(conn, sql.DELETE_STEER_KEYS, {"sid": session}).rowcount or steered or queued)
            if row is not None and row[2] is not None and row[6] and not force:
                held = holder_of(row[:6])
                raise SessionBusy(
                    f"session {session!r} is held by a live run ({held.host}, pid {held.pid}); "
                    f"delete(force=True) deletes it anyway and the run fails with LeaseLost",
                    held,
                )
            self.run(conn, sql.CLEAR, {"sid": session})
            steered = self.run(conn, sql.DELETE_STEERS, {"sid": session}).rowcount
            self.run(conn, sql.DELETE_STEER_KEYS, {"sid": session})
            self.run(conn, sql.DELETE_QUEUE, {"sid": session})
            self.run(conn, sql.CLEAR_TAGS, {"sid": session})
            self.run(conn, sql.DELETE_EVENTS, {"sid": session})
            gone = self.run(conn, sql.DELETE_SESSION, {"sid": session}).rowcount
            return bool(gone or steered)

        try:
            return self._transaction("delete", session, remove)
        finally:
            self._known.forget(session)
            self._journaled.discard(session)
            self._event_floor.pop(session, None)

    def prune(self, idle_for: float | timedelta, limit: int | None = None) -> int:
        """Batches of at most ``PRUNE_BATCH``: the oldest idle sessions are read without locks, then
        deleted in a short transaction that locks their rows and checks again that each is still idle and
        unheld (on the database's clock), so a session saved or leased meanwhile survives. Stops early when
        a batch deletes nothing (every candidate was written meanwhile): the next run finds the rest."""
        idle = lifecycle.idle_seconds(idle_for)
        limit = lifecycle.prune_limit(limit)
        deleted = 0
        while limit is None or deleted < limit:
            batch = PRUNE_BATCH if limit is None else min(PRUNE_BATCH, limit - deleted)
            params = {"idle": idle, "batch": batch}
            found = self._transaction(
                "prune", "", functools.partial(_all, sql.IDLE_BATCH, params), read_only=True, reads=True
            )
            candidates = [str(row[0]) for row in found]
            if not candidates:
                break
            removed = self._transaction("prune", "", functools.partial(self._prune, candidates=candidates, idle=idle))
            deleted += removed
            if not removed or len(candidates) < batch:
                break
            time.sleep(PRUNE_PAUSE)  # a writer waiting for the lock gets it between batches
        if deleted:
            log.info("%s store: pruned %d sessions idle for over %.0f s", self.backend, deleted, idle)
        return deleted

    def _prune(self, conn: Connection, *, candidates: list[str], idle: float) -> int:
        ids = [str(row[0]) for row in conn.execute(sql.LOCK_IDLE, {"ids": candidates, "idle": idle}).all()]
        if ids:
            for statement in sql.PRUNE:
                conn.execute(statement, {"ids": ids})
            for session in ids:
                self._known.forget(session)
                self._journaled.discard(session)
                self._event_floor.pop(session, None)
        return len(ids)

    def tail(self, session: str, last: int) -> list[Message]:
        validate.session_id(session)
        last = lifecycle.last_count(last)
        if last == 0:
            return []
        rows = self._transaction(
            "tail", session, lambda conn: self.run(conn, sql.TAIL, {"sid": session, "last": last}).all(),
            read_only=True, reads=True,
        )
        try:
            items = [Message.from_json(body) for body, _ in reversed(rows)]
        except MessageError as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt message: {exc}") from exc
        if items:
            read_from(items, session, when(float(rows[0][1])))
        return items

    def read_back(self, session: str, stop: int | None, count: int) -> tuple[int, list[Message]]:
        """``TailStore.read_back``: one read of at most ``count`` rows by the primary key, backwards."""
        validate.session_id(session)
        validate.read_back(stop, count)
        end = NO_STOP if stop is None else min(stop, NO_STOP)
        rows = self._transaction(
            "read_back", session,
            lambda conn: self.run(conn, sql.READ_BACK, {"sid": session, "stop": end, "count": count}).all(),
            read_only=True, reads=True,
        )
        if not rows:
            return 0, []  # nothing before stop: stop is 0, or the transcript is empty
        try:
            items = [Message.from_json(body) for _, body, _ in reversed(rows)]
        except MessageError as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt message: {exc}") from exc
        read_from(items, session, when(float(rows[0][2])))
        return int(rows[-1][0]), items

    def pending_steers(self, session: str) -> list[str]:
        validate.session_id(session)
        rows = self._transaction(
            "pending_steers", session, lambda conn: self.run(conn, sql.PENDING, {"sid": session}).all(),
            read_only=True, reads=True,
        )
        return [str(text) for (text,) in rows]

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        """``column`` starts with ``prefix``: LIKE, with the prefix's own % and _ escaped (bound, never
        spliced), which is case-sensitive on PostgreSQL and on MySQL's binary session ids."""
        return column.startswith(prefix, autoescape=True)


def _all(statement: Executable, params: dict[str, Any], conn: Connection) -> Sequence[Any]:
    return conn.execute(statement, params).all()


def _info(session: str, row: Sequence[Any]) -> SessionInfo:
    """``created, updated, metadata, messages, spec_name, open_since`` as a SessionInfo."""
    created, updated, metadata, count, spec, since = row
    return SessionInfo(session, when(float(created)), when(float(updated)), int(count),
                       lifecycle.decode_metadata(metadata), None if spec is None else str(spec),
                       None if since is None else when(float(since)))
