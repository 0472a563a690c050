"""The backend contract: all a store author implements, in one file (docs/writing-a-store.md).

A store of this library is a ``BackedStore`` (``agent_sessions.backed``) over a ``Backend``: the library
decides what every operation means and says it as **one guarded write** or **one read**; the backend only
keeps what it is given and evaluates the guard. Per session id it keeps a row (``Row``, which may exist
before the session does: ``exists`` False), messages by index (opaque texts, kept byte for byte), steers and
a queue (oldest first, each id the row's ``version`` after the write that added it), accepted keys, and
events numbered by the backend. Times are seconds since 1970 on the **store's clock** (the database
server's where it has one), which also decides whether a lease has lapsed. ``storetest`` is its test.

A backend raises ``StoreError`` (``OutcomeUnknown`` when a write may or may not have happened) wrapping its
driver's exceptions, and nothing else.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from .errors import StoreError

__all__ = [
    "CANCEL",
    "Acquire",
    "Backend",
    "Change",
    "Guard",
    "Idle",
    "Open",
    "Queued",
    "Recent",
    "Release",
    "Renew",
    "Row",
    "Snapshot",
    "Steer",
    "StoreError",
    "Want",
    "Written",
    "change_json",
    "first_seq",
    "guard_json",
    "meta_index",
    "new_incarnation",
    "next_row",
]


@dataclass(frozen=True, slots=True)
class Row:
    """A session's row as stored, with ``now``: the store's clock when it was read or written."""

    session: str
    exists: bool
    """Something made the session exist (a write with ``Change.exist``); False: only steers or keys wait."""
    incarnation: str
    """A random token the backend draws when the session comes to exist ("" before): a session deleted
    and made again is another incarnation, whatever the clock did."""
    created: float
    updated: float
    version: int
    """Raised by one on every write that changes anything."""
    length: int
    """How many messages are stored."""
    edits: int
    """Raised by one on every write that changes the messages (``Change.splice``)."""
    token: str | None
    """The lease's holder token; ``None`` when the lease is free (released, or never taken)."""
    epoch: int
    """Raised by one on every ``Acquire``; kept through release and delete of the lease."""
    expires: float
    host: str
    pid: int
    spec: str | None
    """The ``spec`` of the last ``Acquire``; it stays after the release."""
    turn: str | None
    """The ``turn`` of the last ``Acquire``; it stays after the release."""
    cancelled: bool
    """The lease was asked to stop (``CANCEL``)."""
    cancelled_turn: str | None
    """The ``turn`` of the lease when it was last cancelled (``CANCEL``); it stays until the next cancel."""
    handed: bool
    """A cancel handed to this lease (or, free, to the next): see ``Acquire`` and ``Release``."""
    journal: str | None
    open_since: float | None
    metadata: str
    """The metadata as the library gave it: a JSON object's text ("{}" for none)."""
    last_seq: int
    """The last event number given; 0 before the first."""
    steers: int
    """How many steers wait."""
    queued: int
    """How many queue items wait."""
    now: float


@dataclass(frozen=True, slots=True)
class Steer:
    id: int
    text: str
    key: str | None


@dataclass(frozen=True, slots=True)
class Queued:
    id: int
    key: str
    text: str


@dataclass(frozen=True, slots=True)
class Want:
    """What ``read`` returns beside the row. Messages are read when ``start`` or ``last`` is given: those
    from index ``start`` to ``stop`` (``None``: the end), or the last ``last`` of those before ``stop``."""

    start: int | None = None
    stop: int | None = None
    last: int | None = None
    steers: bool = False
    queue: bool = False


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One ``read``, all of it from one moment of the session (one transaction, one script, one lock)."""

    row: Row
    start: int = 0
    """The index of ``messages[0]``."""
    messages: list[str] = field(default_factory=list)
    steers: list[Steer] = field(default_factory=list)
    queue: list[Queued] = field(default_factory=list)


_UNSET: object = object()


@dataclass(frozen=True, slots=True)
class Guard:
    """The conditions a write needs, all of them (an empty guard: none). Each field left at its default
    asks nothing."""

    exists: bool | None = None
    """The session exists (True) or does not (False)."""
    incarnation: str | None = None
    version: int | None = None
    length: int | None = None
    edits: int | None = None
    lease: tuple[str, int] | None = None
    """The lease is held by this (token, epoch), lapsed or not (a lapsed lease nobody took is still its
    holder's)."""
    lease_free: bool = False
    """The lease is free: no token, or its ``expires`` is not after now."""
    lease_held: bool = False
    """The lease has a token (live or lapsed)."""
    not_cancelled: bool = False
    no_steers: bool = False
    steers: tuple[int, ...] = ()
    """Each of these steers still waits."""
    journal: str | object | None = _UNSET
    """The journal is exactly this text (``None``: there is none)."""
    no_queue: bool = False
    queue_head: int | None = None
    """The oldest queue item has this id."""
    key_absent: str | None = None
    """This key was never accepted."""

    @property
    def checks_journal(self) -> bool:
        return self.journal is not _UNSET

    @property
    def reads_children(self) -> bool:
        """It asks about steers, the queue's head or a key: what the row alone does not say."""
        return bool(self.steers) or self.queue_head is not None or self.key_absent is not None

    def holds(self, row: Row, now: float, steers: Collection[int] = (), queue_head: int | None = None,
              key_present: bool = False) -> bool:
        """Does the guard hold for ``row`` (an empty one, ``exists`` False, when there is none) at the store's
        clock ``now``? ``steers``: the ids of waiting steers (at least those of ``self.steers``), ``queue_head``
        the oldest queue item's id, ``key_present`` whether ``key_absent`` was accepted. One evaluation for
        every backend that evaluates guards in Python."""
        held = row.token is not None
        return ((self.exists is None or self.exists == row.exists)
                and (self.incarnation is None or self.incarnation == row.incarnation)
                and (self.version is None or self.version == row.version)
                and (self.length is None or self.length == row.length)
                and (self.edits is None or self.edits == row.edits)
                and (self.lease is None or (row.token, row.epoch) == self.lease)
                and not (self.lease_free and held and row.expires > now)
                and not (self.lease_held and not held)
                and not (self.not_cancelled and row.cancelled)
                and not (self.no_steers and row.steers)
                and set(self.steers) <= set(steers)
                and (not self.checks_journal or self.journal == row.journal)
                and not (self.no_queue and row.queued)
                and (self.queue_head is None or self.queue_head == queue_head)
                and (self.key_absent is None or not key_present))


@dataclass(frozen=True, slots=True)
class Acquire:
    """Take the lease: ``epoch`` + 1, this holder, ``expires`` = now + ``ttl``, ``spec`` kept on the row;
    ``handed`` = ``handed or cancelled`` (a cancel of the lease it replaces, released or lapsed, is handed
    to this one); ``cancelled`` = False."""

    host: str
    pid: int
    token: str
    spec: str | None
    ttl: float
    turn: str | None = None
    """The key of the turn the holder runs, if it says (the row's ``turn``)."""


@dataclass(frozen=True, slots=True)
class Renew:
    """``expires`` = now + ``ttl``."""

    ttl: float


@dataclass(frozen=True, slots=True)
class Release:
    """Free the lease (``token`` = None; ``epoch`` kept): ``handed`` = ``handed or cancelled``,
    ``cancelled`` = False. So the next holder is handed a cancel this holder was asked for, or was handed
    and did not act on (acting on it is a write with ``Change.handed`` = False)."""


CANCEL: Literal["cancel"] = "cancel"
"""``cancelled`` = True, ``cancelled_turn`` = ``turn``."""

Lease = Acquire | Renew | Release | Literal["cancel"]


@dataclass(frozen=True, slots=True)
class Change:
    """What a write does once its guard holds, all in one atomic step. A change with nothing set changes
    nothing (the write only evaluates its guard and returns the row). Anything else raises ``version`` by
    one; and with ``exist`` the session exists from now (``created`` and ``incarnation`` set if it did not),
    and ``updated`` moves to now (never back)."""

    exist: bool = False
    splice: tuple[int, tuple[str, ...]] | None = None
    """(at, texts): the messages from index ``at`` on are replaced by ``texts``, so ``length`` = at +
    len(texts), and ``edits`` + 1. The library never splices beyond ``length``."""
    take_steers: tuple[int, ...] = ()
    """Remove these steers."""
    add_steer: tuple[str, str | None] | None = None
    """(text, key): a steer waits, its id this write's version."""
    push: tuple[str, str] | None = None
    """(key, text): a queue item, its id this write's version."""
    pop: int | None = None
    """Remove this queue item."""
    add_key: str | None = None
    drop_key: str | None = None
    """Forget this key (it was accepted; nothing else changes)."""
    journal: str | object | None = _UNSET
    lease: Lease | None = None
    turn: str | object | None = _UNSET
    """Sets the row's ``turn`` (the turn the lease's holder runs now)."""
    handed: bool | None = None
    """Sets ``handed``: False when the holder acted on the cancel it was handed."""
    open: Literal["set", "clear"] | None = None
    """"set": ``open_since`` = open_since if set, else now. "clear": ``open_since`` = None."""
    metadata: str | None = None
    """Replaces the metadata (a JSON object's text)."""
    events: tuple[str, ...] = ()
    """Appended, numbered on from ``last_seq`` (a new log from ``first_seq(now)``); then the oldest beyond
    the newest ``keep`` are dropped."""
    keep: int = 0
    delete: bool = False
    """Remove the session: its row and everything kept under its id. ``Written.row`` is the row as it was."""

    @property
    def sets_journal(self) -> bool:
        return self.journal is not _UNSET

    @property
    def sets_turn(self) -> bool:
        return self.turn is not _UNSET

    @property
    def empty(self) -> bool:
        return self == _NOTHING


_NOTHING = Change()


@dataclass(frozen=True, slots=True)
class Written:
    """What ``write`` did: ``done`` (the guard held, and the change is stored) and the row after it; or
    not done, nothing written, and the row as it stands (``None``: no row at all)."""

    done: bool
    row: Row | None


@dataclass(frozen=True, slots=True)
class Recent:
    """Rows of sessions that exist, id starting with ``prefix``, whose metadata has each ``where`` key
    with that value (``meta_index`` of the pair), newest ``updated`` first, then id descending, below
    ``after`` (an (updated, id) pair) in that order; at most ``limit``."""

    prefix: str = ""
    where: tuple[tuple[str, str], ...] = ()
    limit: int = 50
    after: tuple[float, str] | None = None


@dataclass(frozen=True, slots=True)
class Open:
    """Rows of sessions that exist with ``open_since`` set and at least ``grace`` seconds ago, oldest
    ``open_since`` first, then id, above ``after`` (an (open_since, id) pair); at most ``limit``. Read
    through an index of the open sessions alone: finished ones are never read."""

    grace: float = 0.0
    limit: int = 50
    after: tuple[float, str] | None = None


@dataclass(frozen=True, slots=True)
class Idle:
    """Rows of sessions that exist whose ``updated`` is more than ``idle_for`` seconds ago, oldest first;
    at most ``limit``."""

    idle_for: float
    limit: int


@runtime_checkable
class Backend(Protocol):
    """What a store keeps and how it answers. Every method is thread-safe and, for a store many processes
    share, safe from every process at once."""

    @property
    def identity(self) -> str:
        """A random token naming the database (drawn once, when its schema was made): what a read was read
        from, so a transcript moved to another database is a new one there, not a deleted one."""

    def read(self, session: str, want: Want) -> Snapshot | None:
        """The session's row and what ``want`` asks for, all from one moment; ``None`` when there is no row."""

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        """If ``guard`` holds, make ``change``, atomically: no other write of the session lands between the
        evaluation of the guard and the end of the change, and a write that fails half-way leaves nothing."""

    def events(self, session: str, after: int, limit: int) -> list[tuple[int, str]]:
        """The session's events numbered above ``after``, oldest first, at most ``limit``."""

    def sessions(self, query: Recent | Open | Idle) -> list[Row]:
        """The rows ``query`` describes, in its order."""

    def close(self) -> None:
        """Give back what the backend holds (connections, threads). Safe to call twice."""


@runtime_checkable
class BatchDeletes(Backend, Protocol):
    """Optional: a prune of thousands is a few commits, not one a session (``write``)."""

    def delete_many(self, guarded: Sequence[tuple[str, Guard]]) -> list[bool]:
        """Each session deleted if its guard (of the row alone) holds, as ``write(session, guard,
        Change(delete=True))`` would, all in one transaction: whether each was."""


def empty_row(session: str) -> Row:
    """The row of a session nothing was written for: what a write's guard is evaluated on, and changes."""
    return Row(session, False, "", 0.0, 0.0, 0, 0, 0, None, 0, 0.0, "", 0, None, None, False, None, False, None,
               None, "{}", 0, 0, 0, 0.0)


def new_incarnation() -> str:
    """A session's incarnation, for a backend to draw when a session comes to exist."""
    return uuid.uuid4().hex


def next_row(row: Row, change: Change, now: float, steers: int, queued: int) -> Row:
    """The row after ``change`` (not empty, not a delete) at the store's clock ``now``, given how many steers
    and queue items wait after it: the row arithmetic every backend that computes it in Python shares. The
    events it adds are numbered ``row.last_seq or first_seq(now) - 1`` + 1 on, up to the new ``last_seq``."""
    version = row.version + 1
    fields: dict[str, object] = {"version": version, "now": now, "steers": steers, "queued": queued}
    if change.exist:
        if not row.exists:
            fields.update(exists=True, incarnation=new_incarnation(), created=now)
        fields["updated"] = max(row.updated, now)
    if change.splice is not None:
        at, texts = change.splice
        fields.update(length=at + len(texts), edits=row.edits + 1)
    if change.sets_journal:
        fields["journal"] = change.journal
    lease = change.lease
    if isinstance(lease, Acquire):
        fields.update(token=lease.token, epoch=row.epoch + 1, expires=now + lease.ttl, host=lease.host,
                      pid=lease.pid, spec=lease.spec, turn=lease.turn, handed=row.handed or row.cancelled,
                      cancelled=False)
    elif isinstance(lease, Renew):
        fields["expires"] = now + lease.ttl
    elif isinstance(lease, Release):
        fields.update(token=None, handed=row.handed or row.cancelled, cancelled=False)
    elif lease == CANCEL:
        fields.update(cancelled=True, cancelled_turn=row.turn)
    if change.sets_turn:
        fields["turn"] = change.turn
    if change.handed is not None:
        fields["handed"] = change.handed
    if change.open == "set":
        fields["open_since"] = now if row.open_since is None else row.open_since
    elif change.open == "clear":
        fields["open_since"] = None
    if change.metadata is not None:
        fields["metadata"] = change.metadata
    if change.events:
        fields["last_seq"] = first_events(row, now) + len(change.events) - 1
    return replace(row, **fields)  # type: ignore[arg-type]


def first_events(row: Row, now: float) -> int:
    """The number a write's first new event gets: on from the row's ``last_seq``, or a new log's first."""
    return row.last_seq + 1 if row.last_seq else first_seq(now)


def first_seq(now: float) -> int:
    """The first number of a new event log: the store's clock ``now`` in microseconds, so a log begun again
    after its session was deleted numbers on above the old one (a follower's cursor finds no old event)."""
    return int(now * 1_000_000)


def meta_index(value: object) -> str:
    """The one text by which a metadata value is indexed and compared: its JSON form (so ``1``, ``1.0``,
    ``True`` and ``"1"`` differ), as ``Recent.where`` gives it."""
    return json.dumps(value)


def indexed(text: str) -> Sequence[tuple[str, str]]:
    """The (key, ``meta_index``) pairs of a row's metadata: what a backend indexes for ``Recent.where``."""
    data = json.loads(text)
    assert isinstance(data, dict)
    return [(k, meta_index(v)) for k, v in data.items()]


def guard_json(guard: Guard) -> dict[str, Any]:
    """``guard`` as the JSON object a server-side write reads (PostgreSQL's function, MySQL's procedure,
    Redis's script): a field is there when it asks something; a nullable value it compares is a one-element
    array ([null]: none)."""
    flags = ("lease_free", "lease_held", "not_cancelled", "no_steers", "no_queue")
    out: dict[str, Any] = {name: True for name in flags if getattr(guard, name)}
    for name in ("exists", "incarnation", "version", "length", "edits", "queue_head", "key_absent"):
        value = getattr(guard, name)
        if value is not None:
            out[name] = value
    for name in ("lease", "steers"):  # None or (): not asked
        value = getattr(guard, name)
        if value:
            out[name] = list(value)
    if guard.checks_journal:
        out["journal"] = [guard.journal]
    return out


def change_json(change: Change) -> dict[str, Any]:
    """``change`` as the JSON object a server-side write reads, in the form of ``guard_json``. Its metadata
    comes with ``meta_index``, its (name, value) pairs as ``indexed`` gives them, so the server never
    rewrites JSON."""
    out: dict[str, Any] = {name: True for name in ("exist", "delete") if getattr(change, name)}
    if change.splice is not None:
        out["splice"] = [change.splice[0], list(change.splice[1])]
    for name in ("take_steers", "add_steer", "push"):  # () or None: not asked
        value = getattr(change, name)
        if value:
            out[name] = list(value)
    for name in ("pop", "add_key", "drop_key", "open", "handed"):
        value = getattr(change, name)
        if value is not None:
            out[name] = value
    if change.metadata is not None:
        out["metadata"] = change.metadata
        out["meta_index"] = [list(pair) for pair in indexed(change.metadata)]
    if change.sets_journal:
        out["journal"] = [change.journal]
    if change.sets_turn:
        out["turn"] = [change.turn]
    lease = change.lease
    if isinstance(lease, Acquire):
        out["lease"] = {"acquire": {"host": lease.host, "pid": lease.pid, "token": lease.token, "spec": lease.spec,
                                    "ttl": lease.ttl, "turn": lease.turn}}
    elif isinstance(lease, Renew):
        out["lease"] = {"renew": lease.ttl}
    elif isinstance(lease, Release):
        out["lease"] = {"release": True}
    elif lease == CANCEL:
        out["lease"] = {"cancel": True}
    if change.events:
        out["events"], out["keep"] = list(change.events), change.keep
    return out
