"""The statements a store runs on every step, built once.

Building a Core statement costs more than running it on SQLite (construction plus its cache key, about
0.1 ms each): statements built per call made a save several times the raw INSERT + COMMIT floor.
Values are bound by name at execution.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    BindParameter,
    Boolean,
    ColumnElement,
    Double,
    Integer,
    String,
    TextClause,
    and_,
    bindparam,
    case,
    delete,
    exists,
    false,
    func,
    insert,
    null,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.sql.dml import Update
from sqlalchemy.sql.selectable import Select

from agent_sessions import Holder, Message

from .clock import db_micros, db_now
from .tables import LongText, SessionId, events, messages, queue, sessions, steer_keys, steers, tags

S, M = sessions.c, messages.c
SID: BindParameter[str] = bindparam("sid", type_=SessionId)
FENCE = and_(S.token == bindparam("lease_token"), S.epoch == bindparam("lease_epoch"))
"""The write's lease is still the stored one: the fencing check, inside every write of a leased run."""
UNTIL = db_now() + bindparam("ttl", type_=Double())
NOW = db_now()
"""What every write of the session row sets ``updated`` to (a new row gets it from the column default)."""

# -- schema 5: the open turn (stranded runs) ------------------------------------------------------------------

def input_waits(session: ColumnElement[Any]) -> ColumnElement[bool]:
    """Input waits for ``session`` (``SID``, or the session column of the row a statement reads), a steer or
    a queued message: a save that answers its turn leaves it open while this holds (PostgreSQL's
    one-statement append says the same: stores/postgres ``OPEN_SINCE``)."""
    return or_(exists().where(steers.c.session_id == session),
               exists().where(and_(queue.c.session_id == session, queue.c.taken == false())))


WAITING = input_waits(SID)
OPEN_SINCE = case(
    (or_(bindparam("open", type_=Boolean()), WAITING), func.coalesce(S.open_since, db_now())), else_=null()
)
"""What a save sets ``open_since`` to: kept (or now) when the transcript it leaves is open (``:open``,
``messages.turn_open``) or input waits, NULL when it closes the turn."""
OPENED = case((bindparam("open", type_=Boolean()), func.coalesce(S.open_since, db_now())), else_=null())
"""``OPEN_SINCE`` for a writer that read, with the session row locked, whether input waits, and folded it into
``:open``: no subquery in its ``UPDATE`` (MySQL reads one with locks, which reach the steers and queue of the
sessions beside this one)."""
SET_OPEN = update(sessions).where(S.session_id == SID).values(open_since=OPEN_SINCE)
"""An append that opens or closes the turn: the second statement of its transaction. Like the append, it
leaves ``updated`` (the heartbeat's renewal moves it)."""
REOPEN = update(sessions).where(S.session_id == SID).values(open_since=func.coalesce(S.open_since, db_now()),
                                                             updated=NOW)
"""A write that brings input (a keyed steer, a decision on a waiting call): the turn is open."""
_SEEN_JOURNAL = bindparam("seen_journal", type_=LongText)
MARK_FINISHED = update(sessions).where(and_(
    S.session_id == SID, FENCE, ~WAITING, S.journal == _SEEN_JOURNAL,
    func.length(S.journal) == func.length(_SEEN_JOURNAL),
)).values(open_since=null())
"""``mark_finished``: fenced, and only while the journal is the one read and no input waits."""
MARK_FINISHED_NO_JOURNAL = update(sessions).where(and_(S.session_id == SID, FENCE, ~WAITING, S.journal.is_(None))
                                                   ).values(open_since=null())

TRIM = delete(messages).where(and_(M.session_id == SID, M.seq >= bindparam("start")))
CLEAR = delete(messages).where(M.session_id == SID)
APPEND = insert(messages)
BODIES_FROM = select(M.seq, M.body).where(and_(M.session_id == SID, M.seq >= bindparam("start"))).order_by(M.seq)

LOAD = (
    select(S.version, S.created, M.body)
    .select_from(sessions.outerjoin(messages, M.session_id == S.session_id))
    .where(S.session_id == SID)
    .order_by(M.seq)
)
LENGTH = select(func.count()).select_from(messages).where(M.session_id == SID)

LOCK = select(S.version, S.token, S.epoch, S.cancelled).where(S.session_id == SID).with_for_update()
"""The session row, locked for a save's transaction (SQLite: the transaction's BEGIN IMMEDIATE locks)."""
STATE = select(
    S.version, S.token, S.epoch, S.cancelled,
    exists().where(steers.c.session_id == SID).label("steers"),
    exists().where(and_(M.session_id == SID, M.seq == bindparam("length"))).label("longer"),
).where(S.session_id == SID)
"""What a fenced save with nothing new to write needs to know, in one read."""
SET_VERSION = update(sessions).where(S.session_id == SID).values(
    version=bindparam("version"), journal=null(), updated=NOW, open_since=OPEN_SINCE
)
SET_VERSION_OPENED = update(sessions).where(S.session_id == SID).values(
    version=bindparam("version"), journal=null(), updated=NOW, open_since=OPENED
)
"""``SET_VERSION`` with ``OPENED``: ``:open`` says whether the turn stays open, input waiting included."""
DROP_JOURNAL = update(sessions).where(S.session_id == SID).values(journal=null(), updated=NOW)

# -- the lease -------------------------------------------------------------------------------------------

LEASE = (
    select(S.token, S.epoch, (S.expires > db_now()).label("live"), S.cancelled)
    .where(S.session_id == SID)
    .with_for_update()
)
"""The lease as ``acquire`` judges it, the row locked; ``cancelled`` is a cancel the new holder is handed."""
TAKE_OVER = (
    update(sessions)
    .where(S.session_id == SID)
    .values(token=bindparam("lease_token"), host=bindparam("lease_host"), pid=bindparam("lease_pid"), expires=UNTIL,
            epoch=S.epoch + 1, cancelled=false(), updated=NOW, spec_name=bindparam("lease_spec", type_=String()))
)
RENEW = update(sessions).where(and_(S.session_id == SID, FENCE)).values(expires=UNTIL, updated=NOW)
RELEASE = (
    update(sessions)
    .where(and_(S.session_id == SID, FENCE))
    .values(token=null(), host=null(), pid=null(), expires=null(), updated=NOW)
)
"""Frees the lease and keeps a cancel it had: the next holder is handed it (``RunStore.acquire``)."""
CURRENT = select(S.host, S.pid, S.token, S.expires, S.cancelled, S.epoch).where(S.session_id == SID)
HOLDER = CURRENT.where(and_(S.token.is_not(None), S.expires > db_now()))
"""The live lease, on the database's clock."""
CANCEL = update(sessions).where(and_(S.session_id == SID, S.token.is_not(None))).values(cancelled=true(),
                                                                                         updated=NOW)
"""A lapsed lease nobody took is still its holder's (the run may be renewing late): it is cancelled too."""
CHECK = select(S.token, S.epoch, S.cancelled).where(S.session_id == SID)

# -- the journal -----------------------------------------------------------------------------------------

JOURNAL = select(S.journal).where(S.session_id == SID)
PUT_JOURNAL = update(sessions).where(and_(S.session_id == SID, FENCE, S.cancelled == false())).values(
    journal=bindparam("body", type_=LongText), updated=NOW
)
"""The usual journal write: matched only while the run is not cancelled, so a match says so too."""
PUT_JOURNAL_CANCELLED = update(sessions).where(and_(S.session_id == SID, FENCE)).values(
    journal=bindparam("body", type_=LongText), updated=NOW
)
_EXPECTED = bindparam("expected", type_=LongText)
SWAP_JOURNAL = update(sessions).where(
    # The lengths too: MySQL's collations compare with PAD SPACE ('a' = 'a '), and the text is the guard.
    and_(S.session_id == SID, S.journal == _EXPECTED, func.length(S.journal) == func.length(_EXPECTED))

).values(journal=bindparam("body", type_=LongText), updated=NOW, open_since=func.coalesce(S.open_since, db_now()))
"""A decision on a waiting call (ApprovalStore): the journal replaced only if it is still the text read; the
turn can go on, so it is open (``open_since``)."""

MAX_APPEND = 100
"""Messages one append statement carries; a save adding more runs the general transaction."""


class Step(NamedTuple):
    """An appending save, as a dialect's ``append`` is given it: ``items[start:]`` are new, and the stored
    transcript is ``known`` (a version) if nothing changed meanwhile. A named tuple, not a frozen dataclass:
    the usual step builds one each time, and a frozen dataclass sets each of its fields through
    ``object.__setattr__`` (3.3 µs against 0.5)."""

    session: str
    known: str
    items: tuple[Message, ...]
    start: int
    unsteered: bool
    """The save takes steers: append only while none waits (otherwise the transaction takes them)."""
    holder: Holder | None
    """A leased run's save: append only while the lease is still this one, and not cancelled."""
    drop_journal: bool
    """The session has a journal (this process wrote it): the append drops it too, in the same step."""
    events: tuple[str, ...] = ()
    """Events to append in the same step (``EventStore.save_fenced_events``); only a dialect whose append
    can store them in its one statement takes a step with events (PostgreSQL), others leave it to the
    transaction."""
    keep: int = 0
    """With ``events``: the log's cap."""
    offset: int = 0
    """The stored index of ``items[0]`` (a ``TailStore`` save's ``start``): message ``i`` is stored at
    ``offset + i``."""
    opened: bool = False
    """The transcript this save leaves is open (``messages.turn_open``): what ``open_since`` becomes."""
    turning: bool = False
    """``opened`` differs from the known transcript's: the append sets ``open_since`` too (``SET_OPEN``),
    in the same step; otherwise the stored mark already says it (no write of the row)."""


@functools.lru_cache(maxsize=16 * MAX_APPEND)
def append_if_current(count: int, unsteered: bool, fenced: bool, journal_free: bool, lock: str = "") -> TextClause:
    """Insert ``count`` new messages (``:q0``/``:b0`` ...) in one statement, only while the session still
    has the version this process knows (when ``unsteered``, no steer waits; when ``fenced``, the lease is
    still ``:lease_token``/``:lease_epoch`` and not cancelled; when ``journal_free``, it has no journal to
    drop): the usual step, whole. Anything else (a steer, a cancel, a journal, a lost lease) inserts
    nothing and the save runs its transaction, which sorts out which. The version is not replaced: an
    append changes no message another writer knows, and a second writer appending at the same positions
    fails on the primary key instead. ``lock``: what makes the read of the session row a locking one
    where the statement's reads would not be (MySQL's LOCK IN SHARE MODE), so a takeover cannot commit
    between the check and the insert."""
    guard = " AND NOT EXISTS (SELECT 1 FROM agent_steers WHERE agent_steers.session_id = :sid)" if unsteered else ""
    fence = " AND s.token = :lease_token AND s.epoch = :lease_epoch AND NOT s.cancelled" if fenced else ""
    journal = " AND s.journal IS NULL" if journal_free else ""
    rows = " UNION ALL ".join(f"SELECT :q{i} AS seq, :b{i} AS body" for i in range(count))
    statement = text(
        "INSERT INTO agent_messages (session_id, seq, body) "
        f"SELECT s.session_id, v.seq, v.body FROM agent_sessions AS s JOIN ({rows}) AS v ON 1 = 1 "
        f"WHERE s.session_id = :sid AND s.version = :known{journal}{fence}{guard}{lock}"
    )
    types: list[BindParameter[Any]] = [bindparam("sid", type_=SessionId)]
    types += [bindparam(f"q{i}", type_=Integer()) for i in range(count)]
    types += [bindparam(f"b{i}", type_=LongText) for i in range(count)]
    return statement.bindparams(*types)


def append_params(step: Step) -> dict[str, Any]:
    """The values of ``step``'s append (``append_if_current``, or a dialect's own)."""
    params: dict[str, Any] = {"sid": step.session, "known": step.known}
    if step.holder is not None:
        params["lease_token"] = step.holder.token
        params["lease_epoch"] = step.holder.epoch
    items, start = step.items, step.start
    for i in range(len(items) - start):
        params[f"q{i}"] = step.offset + start + i
        params[f"b{i}"] = items[start + i].to_json()
    return params


def fence_params(session: str, holder: Holder) -> dict[str, Any]:
    return {"sid": session, "lease_token": holder.token, "lease_epoch": holder.epoch}


ADD_STEER = insert(steers)
STEER_KEY: BindParameter[str] = bindparam("key", type_=SessionId)
"""A steer's key (``add_steer_once``): each dialect inserts it with ``SID`` unless it is there (its
``add_steer_key``)."""
ANY_STEER = select(steers.c.id).where(steers.c.session_id == SID).limit(1)
TAKE_STEERS = delete(steers).where(steers.c.session_id == SID).returning(steers.c.id, steers.c.text)
LOCK_STEERS = (
    select(steers.c.id, steers.c.text).where(steers.c.session_id == SID).order_by(steers.c.id).with_for_update()
)


# -- the queue (agent_sessions.QueueStore) --------------------------------------------------------------

Q = queue.c
QUEUE_KEY: BindParameter[str] = bindparam("key", type_=SessionId)
"""A queued message's key (``enqueue``): each dialect inserts it with ``SID`` and ``:text`` unless it is there
(its ``add_queued``)."""
QUEUE_TEXT: BindParameter[str] = bindparam("text", type_=LongText)
QUEUED_ROW = select(Q.id, Q.taken, Q.text).where(and_(Q.session_id == SID, Q.turn_key == QUEUE_KEY))
QUEUE_WAITING = and_(Q.session_id == SID, Q.taken == false())
QUEUE_POSITION = select(func.count()).where(and_(QUEUE_WAITING, Q.id <= bindparam("qid", type_=BigInteger())))
QUEUED_KEYS = select(Q.turn_key).where(QUEUE_WAITING).order_by(Q.id)
QUEUE_HEAD = select(Q.id, Q.turn_key, Q.text).where(QUEUE_WAITING).order_by(Q.id).limit(1)
TAKE_QUEUED = update(queue).where(Q.id == bindparam("qid", type_=BigInteger())).values(taken=true(), text="")
"""The row stays for its key (accepted once for the session's life); its text, in the transcript now, goes."""
DELETE_QUEUE = delete(queue).where(Q.session_id == SID)


# -- the lifecycle (agent_sessions.LifecycleStore) ---------------------------------------------------------

T = tags.c
COUNT = select(func.count()).where(M.session_id == S.session_id).scalar_subquery()
"""The session's message count, per row: read by the primary key of agent_messages, for a page's rows only."""
INFO = select(S.created, S.updated, S.metadata, COUNT, S.spec_name, S.open_since).where(S.session_id == SID)
LOCK_METADATA = select(S.metadata).where(S.session_id == SID).with_for_update()
SET_METADATA = update(sessions).where(S.session_id == SID).values(
    metadata=bindparam("metadata", type_=LongText), updated=NOW
)
CLEAR_TAGS = delete(tags).where(T.session_id == SID)
DROP_TAGS = delete(tags).where(and_(T.session_id == SID, T.name.in_(bindparam("names", expanding=True))))
"""The tags of these keys (a session's tags are its metadata's keys): each row by its primary key, so on MySQL
the DELETE locks them alone, not (as ``CLEAR_TAGS``'s range does) the next session's first tag as well."""
ADD_TAG = insert(tags)
LOCK_LEASE = (
    select(S.host, S.pid, S.token, S.expires, S.cancelled, S.epoch, (S.expires > db_now()).label("live"))
    .where(S.session_id == SID)
    .with_for_update()
)
"""The lease as ``delete`` judges it, the row locked: the columns of ``CURRENT``, and whether it is live."""
DELETE_SESSION = delete(sessions).where(S.session_id == SID)
DELETE_STEERS = delete(steers).where(steers.c.session_id == SID)
DELETE_STEER_KEYS = delete(steer_keys).where(steer_keys.c.session_id == SID)
READ_BACK = (
    select(M.seq, M.body, S.created)
    .select_from(messages.join(sessions, S.session_id == M.session_id))
    .where(and_(M.session_id == SID, M.seq < bindparam("stop", type_=Integer())))
    .order_by(M.seq.desc())
    .limit(bindparam("count", type_=Integer()))
)
"""``TailStore.read_back``: the messages before ``:stop``, newest first, by the primary key read backwards,
with their index and the session's ``created`` (``messages.read_from``)."""
HAS = select(M.seq).where(and_(M.session_id == SID, M.seq == bindparam("seq", type_=Integer())))
"""Is message ``:seq`` stored? (A save from an index needs the messages before it.)"""
TAIL = (
    select(M.body, S.created)
    .select_from(messages.join(sessions, S.session_id == M.session_id))
    .where(M.session_id == SID)
    .order_by(M.seq.desc())
    .limit(bindparam("last", type_=Integer()))
)
"""The last messages, newest first, by the primary key (session_id, seq) read backwards; with the session's
``created``, which marks what a read returns (``messages.read_from``)."""
PENDING = select(steers.c.text).where(steers.c.session_id == SID).order_by(steers.c.id)

_AFTER_SINCE: BindParameter[float] = bindparam("after_since", type_=Double())
_AFTER_ID: BindParameter[str] = bindparam("after_id", type_=SessionId)


def stranded(cursor: bool) -> Select[Any]:
    """``list_sessions(stranded=True)``: ``INFO``'s columns and the id, oldest ``open_since`` first, by the
    index of the open sessions (``open_since IS NOT NULL`` is the partial index's own condition). A cancelled
    session is left out unless a queued message waits: the cancel stopped a run, not the queue."""
    where: list[ColumnElement[bool]] = [
        S.open_since.is_not(None),
        S.open_since <= db_now() - bindparam("grace", type_=Double()),
        or_(S.token.is_(None), S.expires <= db_now()),
        or_(S.cancelled == false(), exists().where(and_(queue.c.session_id == S.session_id, queue.c.taken == false()))),
    ]
    if cursor:
        where.append(or_(S.open_since > _AFTER_SINCE, and_(S.open_since == _AFTER_SINCE, S.session_id > _AFTER_ID)))
    return (select(S.session_id, S.created, S.updated, S.metadata, COUNT, S.spec_name, S.open_since)
            .where(and_(*where)).order_by(S.open_since, S.session_id).limit(bindparam("rows", type_=Integer())))


STRANDED = (stranded(False), stranded(True))


IDS: BindParameter[str] = bindparam("ids", expanding=True, type_=SessionId)
IDLE = and_(
    S.updated < db_now() - bindparam("idle", type_=Double()),
    or_(S.token.is_(None), S.expires <= db_now()),
)
"""Not written for ``:idle`` seconds, and no live lease (a lapsed one is nobody's run any more)."""
IDLE_BATCH = select(S.session_id).where(IDLE).order_by(S.updated).limit(bindparam("batch", type_=Integer()))
"""The oldest idle sessions, read without locks: the candidates of one prune batch."""
LOCK_IDLE = select(S.session_id).where(and_(S.session_id.in_(IDS), IDLE)).with_for_update()
"""The candidates still idle, their rows locked: a save or a lease that came meanwhile keeps its session."""
PRUNE = tuple(delete(t).where(t.c.session_id.in_(IDS))
              for t in (messages, steers, steer_keys, queue, tags, events, sessions))


# -- the event log (agent_sessions.EventStore) -------------------------------------------------------------

E = events.c


def _claim_where(save: bool, unsteered: bool, drop_journal: bool) -> list[ColumnElement[bool]]:
    """What a claim of event numbers matches: the session's row under the writer's lease; with ``save``, also
    the conditions of ``append_if_current`` (the version ``:known``, not cancelled, no steer waiting when
    ``unsteered``, no journal unless ``drop_journal``)."""
    where = [S.session_id == SID, FENCE]
    if save:
        where += [S.version == bindparam("known", type_=S.version.type), S.cancelled == false()]
        if unsteered:
            where.append(~exists().where(steers.c.session_id == SID))
        if not drop_journal:
            where.append(S.journal.is_(None))
    return where


@functools.lru_cache(maxsize=32)
def claim_events(
    *, save: bool = False, unsteered: bool = False, drop_journal: bool = False, returning: bool = False,
    last_insert_id: bool = False,
) -> Update:
    """Give out the session's next ``:n`` numbers (a new log's first is ``first_seq`` of the database's
    clock), fenced: no row matched means the lease is not the writer's. The row stays locked to the
    transaction's end, so the next claim of the session waits for these events to be stored.

    ``save``: the claim of a leased run's usual save with its events (``SQLStore.append``), matched only
    under the conditions of ``append_if_current`` (``_claim_where``; ``drop_journal`` drops the journal),
    so a match says the messages may be appended, and no match that the save runs its transaction.
    ``returning``: the statement returns the last number given (PostgreSQL); ``last_insert_id``: MySQL's
    way to the same without a second statement, ``LAST_INSERT_ID(expr)``, which the server hands back in
    the reply's insert id. (SQLite numbers its log without writing the row: ``number_events``.)"""
    claimed = func.coalesce(S.event_seq, db_micros() - 1) + bindparam("n", type_=BigInteger())
    values: dict[str, Any] = {"event_seq": func.last_insert_id(claimed) if last_insert_id else claimed}
    if save and drop_journal:
        values.update(journal=null(), updated=NOW)
    statement = update(sessions).where(and_(*_claim_where(save, unsteered, drop_journal))).values(**values)
    return statement.returning(S.event_seq) if returning else statement


@functools.lru_cache(maxsize=32)
def number_events(*, save: bool = False, unsteered: bool = False, drop_journal: bool = False) -> Select[tuple[int]]:
    """SQLite's claim: the last of the session's next ``:n`` numbers, read from the log itself (after its
    newest event; else after ``event_seq``, where earlier versions numbered it; else from ``:clock``, the
    host's clock in microseconds, ``first_seq``, which the store reads: SQLite's own ``julianday('now')``
    counts milliseconds, so a session deleted and made again within one began its new log at its old
    log's first number), where ``claim_events`` matches; no row when it does not. Only a write transaction may run
    it (``BEGIN IMMEDIATE``: SQLite has one writer at a time, so no other can take the same numbers between
    this read and the insert), and the session row is not written: a step with events writes the events
    table's pages and no more. The cap never drops a log's newest event (``_log_events``), so a number once
    given is never given again while the session lives; a session deleted and made again starts from the
    clock, above its old log, as with ``claim_events``."""
    newest = select(func.max(E.seq)).where(E.session_id == SID).scalar_subquery()
    last = func.coalesce(newest, S.event_seq, bindparam("clock", type_=BigInteger()) - 1) + bindparam(
        "n", type_=BigInteger())
    return select(last).where(and_(*_claim_where(save, unsteered, drop_journal)))


LAST_EVENT = select(S.event_seq).where(S.session_id == SID)
FIRST_EVENT = select(func.min(E.seq)).where(E.session_id == SID)
"""The oldest event the session's log holds (``None``: none), by the primary key: read once per session by a
store, which then knows when the cap has anything to drop."""
OLDEST_EVENT_ROW = select(E.seq, E.body).where(E.session_id == SID).order_by(E.seq).limit(1)
"""The row of the oldest event, for a store whose rows may be batches (``events.unbatched``)."""
EVENT_ROW_AFTER = (
    select(E.seq, E.body)
    .where(and_(E.session_id == SID, E.seq > bindparam("after", type_=BigInteger())))
    .order_by(E.seq)
    .limit(1)
)
CUT_EVENT_ROW = (
    update(events)
    .where(and_(E.session_id == SID, E.seq == bindparam("row_seq", type_=BigInteger())))
    .values(body=bindparam("row_body"))
)
ADD_EVENTS = insert(events)
DROP_EVENTS = delete(events).where(and_(E.session_id == SID, E.seq <= bindparam("cut", type_=BigInteger())))
"""The events beyond the newest ``keep``: a log's numbers are consecutive, so those at or below ``last - keep``."""
READ_EVENTS = (
    select(E.seq, E.body)
    .where(and_(E.session_id == SID, E.seq > bindparam("after", type_=BigInteger())))
    .order_by(E.seq)
    .limit(bindparam("limit", type_=Integer()))
)
DELETE_EVENTS = delete(events).where(E.session_id == SID)
