"""The values the library and its stores exchange: plain records, below everything else of the core, so
that an error can carry one (``SessionBusy.holder``) and every layer can name them."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# -- a run's lease and writes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Holder:
    """A lease as stored: who took it (host, pid, a random token), until when (epoch seconds on the
    store's clock), whether somebody asked that run to stop, and the session's epoch when it was taken."""

    host: str
    pid: int
    token: str
    expires: float
    cancelled: bool = False
    epoch: int = 0
    """Raised by the store each time the lease passes to a new holder; with ``token``, what every write of
    the run carries and the store checks."""
    spec: str | None = None
    """The run's ``Spec.name``: ``acquire`` records it on the session (``SessionInfo.spec``), for a sweep to
    know what to finish it with. Stores return ``None`` here: it is written, not read back."""
    turn: str | None = None
    """The key of the turn the holding run runs, recorded with the lease so a cancel says which turn it
    stopped; on a lease ``acquire`` returns with ``cancelled=True``, the turn that cancel was of."""

    def describe(self) -> str:
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.expires))
        return f"pid {self.pid} on {self.host} (epoch {self.epoch}, token {self.token[:8]}…, until {until} UTC)"


@dataclass(frozen=True, slots=True)
class Saved:
    """What a fenced save did beside saving: the steers it took (appended to the transcript, in order) and
    whether somebody asked the run to stop."""

    steers: list[str]
    cancelled: bool
    keys: list[str] | None = field(default=None, compare=False)
    """The keys the steers were left with ("" for none), in order, where the store keeps them in the
    transcript (``Message.user(text, key=key)``); ``None``: the store appends them without."""
    began: bool = field(default=False, compare=False)
    """The first steer began a turn (none was in progress: the last had ended), so it is stored as that turn's
    message, with no ``steer`` mark; the others join it."""


# -- the lifecycle ---------------------------------------------------------------------------------------------


Scalar = str | int | float | bool
"""A metadata value: a JSON scalar. Values compare by their JSON form, so ``1``, ``1.0``, ``True`` and
``"1"`` are four different values to ``where``."""


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """One session as ``list_sessions`` and ``info`` describe it. ``created`` and ``updated`` are aware
    UTC datetimes from the store's clock (the database's where it has one)."""

    id: str
    created: datetime
    updated: datetime
    messages: int
    metadata: Mapping[str, Scalar] = field(default_factory=dict)
    spec: str | None = None
    """The ``Spec.name`` of the last run that took the session's lease (``None``: none named one)."""
    open_since: datetime | None = None
    """Since when the session's last turn has been open (a message waiting for its answer), on the store's
    clock; ``None`` when it is finished. A hint kept by every write: it may say open for a finished turn
    (``agent.recover`` clears it), never finished for an open one."""
    holder: Holder | None = None
    """The live lease (a run holds the session now), or ``None``."""
    cancelled: bool = False
    """A cancel was asked of the session's run and no run has acted on it yet (it stops whichever run goes
    on with that turn)."""
    steers: int = 0
    """Steers waiting for the session's next model request."""
    queued: int = 0
    """Messages queued for the session (``Runner.turn(if_busy="queue")``), waiting for a turn each."""

    @property
    def stranded(self) -> bool:
        """Its turn is open and nothing will answer it unless something does (``agent.recover``): no live run
        holds it, and no cancel stopped it (unless messages are queued behind the cancelled turn)."""
        return self.open_since is not None and self.holder is None and (not self.cancelled or self.queued > 0)


@dataclass(frozen=True, slots=True)
class SessionPage:
    """A page of ``list_sessions``, newest update first. ``next`` is the cursor to pass as ``after=`` for
    the following page, ``None`` on the last one."""

    sessions: list[SessionInfo]
    next: str | None

    def __iter__(self) -> Iterator[SessionInfo]:
        return iter(self.sessions)

    def __len__(self) -> int:
        return len(self.sessions)


def when(seconds: float) -> datetime:
    """A stored time (seconds since 1970 on the store's clock) as ``SessionInfo`` shows it."""
    return datetime.fromtimestamp(seconds, UTC)


# -- approvals ---------------------------------------------------------------------------------------------------


@dataclass
class Decision:
    """A person's decision on a call that waited for approval (``by="person"``), or what stood in for one:
    its deadline passing (``"deadline"``) or a cancel of the waiting turn (``"cancel"``)."""

    approved: bool
    reason: str
    at: float
    """When, in seconds since 1970, by the clock of the process that decided."""
    by: str = "person"

    def to_dict(self) -> dict[str, Any]:
        return {"approved": self.approved, "reason": self.reason, "at": self.at, "by": self.by}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        return cls(bool(data["approved"]), str(data["reason"]), float(data["at"]), str(data["by"]))


@dataclass(frozen=True, slots=True)
class PendingApproval:
    """A call waiting for a decision: ``arguments`` as the model wrote them; ``asked`` and ``deadline``
    aware UTC datetimes (``deadline`` ``None``: none)."""

    call_id: str
    tool: str
    arguments: str
    asked: datetime
    deadline: datetime | None


# -- the event log -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as its log holds it: ``seq`` given by the store, ``at`` when the run reported it (its
    host's clock, an aware UTC datetime), ``data`` the kind's JSON object (docs/runs/events.md)."""

    seq: int
    kind: str
    at: datetime
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form: what the SSE route sends as ``data``."""
        return {"seq": self.seq, "kind": self.kind, "at": self.at.isoformat(), "data": dict(self.data)}
