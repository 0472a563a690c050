"""The event log (``EventStore``), in ``agent_events``, numbered on the session's row (SQLite: from the log).

An append claims the next numbers on the session row, fenced by the lease (the row stays locked to the
transaction's end, so concurrent appenders queue), then stores the events and drops those beyond the newest
``keep``. ``save_fenced_events`` is the store's save (store.py) carrying the append in the same step: the
claim rides the usual append's transaction (``_append_logged``), or the save's general transaction. SQLite
overrides ``claim`` to read the numbers from the log inside its write transaction instead of writing them
on the row (``statements.number_events``), and runs the usual step with events on its driver.

A row holds one event, or (a store with ``batches``: SQLite) up to ``BATCH_MAX`` of one write's events, a
*batch*: its body ``BATCH`` followed by their texts, each after a ``BATCH``, numbered up to the row's seq. A
step's four events are then one row, not four: one cell in the table and one in its key's index instead of
four each (in the loop, SQLite's step with the log on 1.25-1.28x the step without, against 1.30x:
docs/performance.md). No JSON text holds ``BATCH`` (a control character: escaped inside a string, not allowed
outside one), and every append refuses a text that does (``eventlog.check_append``), so a batch splits back
into the very texts written. Readers take both forms (``unbatched``), so a log written a row per event goes
on as it was; the cap drops whole rows and cuts the batch it falls inside (``_cut``), rewriting at most
``BATCH_MAX`` events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from agent_sessions import Holder, Message, Saved, StoreError, eventlog, validate
from agent_sessions.contract import StoredEvent

from . import statements as sql
from .base import SQLBase
from .lease import lost

BATCH = "\x1e"
"""What a batch row's body begins with and separates its events by (ASCII's record separator)."""


BATCH_MAX = 64
"""The most events one row holds: a cut inside a batch rewrites the row (``_cut``), so a write of thousands
of events is rows of this many, not one row every later trimming write would rewrite."""


def batch(texts: Sequence[str]) -> str | None:
    """One body for ``texts``, some of a write's events (two to ``BATCH_MAX``; otherwise ``None``). None holds
    ``BATCH``: every append checks that (``eventlog.check_append``)."""
    return BATCH + BATCH.join(texts) if 1 < len(texts) <= BATCH_MAX else None


def unbatched(seq: int, body: str) -> list[tuple[int, str]]:
    """The events a row holds, ``(seq, text)`` each, oldest first: a batch's numbered up to ``seq``."""
    if not body.startswith(BATCH):
        return [(seq, body)]
    texts = body[1:].split(BATCH)
    first = seq - len(texts) + 1
    return [(first + i, text) for i, text in enumerate(texts)]


class EventLog(SQLBase):
    """``EventStore``, and the hooks a dialect overrides for it: ``claim``, ``add_events`` and ``notify``."""

    batches = False
    """A write's events are stored in one row (``batch``), where more than one (SQLite)."""

    if TYPE_CHECKING:  # what this part needs of the store that joins it, for the type checker only
        def _save(
            self, session: str, msgs: Sequence[Message], holder: Holder | None, take: bool, replace: bool,
            events: list[str] | None = None, keep: int = 0, offset: int = 0,
        ) -> Saved:
            """The store's save, appending ``events`` in the same step (store.py)."""
            ...

    def save_fenced_events(
        self, session: str, holder: Holder, msgs: Sequence[Message], *, take_steers: bool, replace: bool = False,
        events: Sequence[str], keep: int, start: int = 0,
    ) -> Saved:
        """The save and the append in one step: the dialect's one-statement append where it can carry the
        events (PostgreSQL), otherwise the save's transaction, which appends them after its write."""
        validate.session_id(session)
        start = validate.save_start(start, replace, take_steers)
        records = eventlog.check_append(events, keep) if events else []
        eventlog.check_keep(keep)
        return self._save(session, msgs, holder, take=take_steers, replace=replace, events=records, keep=keep,
                          offset=start)

    def append_events(self, session: str, holder: Holder, events: Sequence[str], *, keep: int) -> int:
        validate.session_id(session)
        records = eventlog.check_append(events, keep)
        last, floor = self._transaction(
            "append_events", session, lambda conn: self._append_events(conn, session, holder, records, keep)
        )
        self._floor(session, floor)
        return last

    def _append_events(
        self, conn: Connection, session: str, holder: Holder, records: list[str], keep: int
    ) -> tuple[int, int]:
        """In the caller's transaction: claim the next numbers on the session row (fenced; the row stays
        locked, so concurrent appenders queue), then ``_log_events``. Returns the last number given and the
        log's floor after it (``_floor`` it once the transaction commits)."""
        last = self.claim(conn, {**sql.fence_params(session, holder), "n": len(records)})
        if last is None:
            raise lost(session, holder, self.run(conn, sql.CHECK, {"sid": session}).first())
        return last, self._log_events(conn, session, last, records, keep)

    def _log_events(self, conn: Connection, session: str, last: int, records: Sequence[str], keep: int) -> int:
        """Store ``records`` under the numbers just claimed (up to ``last``), drop the log's events beyond the
        newest ``keep`` (only when it holds any: ``_event_floor``), and wake the followers (``notify``).
        Returns the log's floor after this write."""
        n = len(records)
        # Never the newest, whatever ``keep`` says: a log's next numbers go on from it (SQLite reads them there).
        first, cut = last - n + 1, last - max(keep, 1)
        floor = self._event_floor.get(session)
        if floor is None:
            oldest = self._oldest(conn, session)
            floor = first if oldest is None else oldest
        numbered = [(first + i, text) for i, text in enumerate(records) if first + i > cut]
        if numbered:
            self.add_events(conn, session, numbered)
        if cut >= floor:
            self._cut(conn, session, cut)
            floor = cut + 1
        self.notify(conn, session)
        return floor

    def add_events(self, conn: Connection, session: str, numbered: list[tuple[int, str]]) -> None:
        """Insert ``session``'s events, ``(seq, text)`` each, consecutive, in the caller's transaction: in one
        row where the store ``batches`` them."""
        self.run(conn, sql.ADD_EVENTS, [{"session_id": session, "seq": seq, "body": text}
                                        for seq, text in self.rows_of(numbered)])

    def rows_of(self, numbered: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The rows that store ``numbered`` (consecutive events, ``(seq, text)`` each): where the store
        ``batches`` them, batches of up to ``BATCH_MAX``, each under its last number; else a row each."""
        if not self.batches or len(numbered) < 2:
            return numbered
        rows = []
        for at in range(0, len(numbered), BATCH_MAX):
            part = numbered[at:at + BATCH_MAX]
            joined = batch([text for _, text in part])
            rows.append(part[-1] if joined is None else (part[-1][0], joined))
        return rows

    def _oldest(self, conn: Connection, session: str) -> int | None:
        """The number of the oldest event the session's log holds (``None``: none)."""
        if not self.batches:
            oldest = self.run(conn, sql.FIRST_EVENT, {"sid": session}).scalar()
            return None if oldest is None else int(oldest)  # type: ignore[call-overload]
        row = self.run(conn, sql.OLDEST_EVENT_ROW, {"sid": session}).first()
        return None if row is None else unbatched(int(row[0]), str(row[1]))[0][0]

    def _cut(self, conn: Connection, session: str, cut: int) -> None:
        """Drop the session's events numbered ``cut`` or below: the rows wholly below, and (``batches``) the
        older part of the batch the cut falls inside, rewritten with the rest."""
        self.run(conn, sql.DROP_EVENTS, {"sid": session, "cut": cut})
        if not self.batches:
            return
        row = self.run(conn, sql.EVENT_ROW_AFTER, {"sid": session, "after": cut}).first()
        if row is None:
            return
        held = unbatched(int(row[0]), str(row[1]))
        kept = [(seq, text) for seq, text in held if seq > cut]
        if len(kept) < len(held):  # a batch the cut falls inside: the rest of it, as a write of them stores it
            [(_, body)] = self.rows_of(kept)
            self.run(conn, sql.CUT_EVENT_ROW, {"sid": session, "row_seq": int(row[0]), "row_body": body})

    def _floor(self, session: str, floor: int) -> None:
        """Remember the log's floor, a transaction having committed it."""
        self._remember(self._event_floor, session, floor)

    def _remember(self, memory: dict[str, int], session: str, value: int) -> None:
        """``memory[session] = value``, the memory bounded like ``_known``: emptied when it is full."""
        if len(memory) >= self._known.size and session not in memory:
            memory.clear()
        memory[session] = value

    def claim(self, conn: Connection, params: dict[str, Any], **shape: bool) -> int | None:
        """Claim ``params["n"]`` event numbers (``sql.claim_events`` of ``shape``): the last number given, or
        ``None`` when the row did not match. One statement where UPDATE ... RETURNING is there."""
        if self.engine.dialect.update_returning:
            row = self.run(conn, sql.claim_events(returning=True, **shape), params).first()
            return None if row is None else int(row[0])
        if self.run(conn, sql.claim_events(**shape), params).rowcount != 1:
            return None
        last: int = int(self.run(conn, sql.LAST_EVENT, {"sid": params["sid"]}).scalar())  # type: ignore[call-overload]
        return last

    def events(self, session: str, after: int, limit: int) -> list[StoredEvent]:
        validate.session_id(session)
        after, limit = eventlog.check_read(after, limit)
        rows = self._transaction(
            "events", session,
            lambda conn: self.run(conn, sql.READ_EVENTS, {"sid": session, "after": after, "limit": limit}).all(),
            read_only=True, reads=True,
        )
        try:
            # Each row holds at least one event above ``after``: ``limit`` rows hold enough.
            stored = [(number, text) for seq, body in rows
                      for number, text in unbatched(int(seq), str(body)) if number > after][:limit]
            return [eventlog.decode(number, text) for number, text in stored]
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{self.backend} store: session {session!r} holds a corrupt event: {exc}") from exc

    def notify(self, conn: Connection, session: str) -> None:
        """Events of ``session`` are being written in ``conn``'s transaction: wake its followers when it
        commits, where the database can (PostgreSQL's NOTIFY); elsewhere they poll."""

    def _append_logged(self, step: sql.Step) -> str | None:
        """A leased run's usual save with its events (``save_fenced_events``), in one transaction: the claim
        of the event numbers on the session row, guarded as ``append_if_current`` guards the append (so it
        also locks the row, and a takeover waits for it or it for the takeover, which it then sees); if it
        matched, the new messages and the events (``_log_events``). Three statements (SQLite: each some
        microseconds, one BEGIN IMMEDIATE and one COMMIT), where the general path took ten. Anything the
        claim does not match (a steer, a cancel, a lost lease, another version) writes nothing and the save
        runs its transaction, which sorts out which, as after a plain append."""
        holder = step.holder
        assert holder is not None  # save_fenced_events
        params = {**sql.fence_params(step.session, holder), "known": step.known, "n": len(step.events)}
        rows = [{"session_id": step.session, "seq": step.offset + i, "body": step.items[i].to_json()}
                for i in range(step.start, len(step.items))]

        def write(conn: Connection) -> int | None:
            last = self.claim(conn, params, save=True, unsteered=step.unsteered, drop_journal=step.drop_journal)
            if last is None:
                return None
            self.run(conn, sql.APPEND, rows)
            if step.turning:
                self.run(conn, sql.SET_OPEN, {"sid": step.session, "open": step.opened})
            return self._log_events(conn, step.session, last, step.events, step.keep)

        floor = self._append_transaction(step.session, write)
        if floor is None:
            return None
        self._floor(step.session, floor)
        return step.known
