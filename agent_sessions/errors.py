"""One exception family, so a caller (a Celery retry policy, a Flask error handler) catches one root."""

from __future__ import annotations

from typing import Any, Self

from .values import Decision, Holder


class AgentError(Exception):
    """Root of every error this library raises on purpose. Each crosses a process boundary intact (a Celery
    result backend): it pickles to a call of its class with the arguments it was made with, where Python's
    default would rebuild it from the message alone (``SessionBusy`` without its holder)."""

    _made_with: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        made = super().__new__(cls, *args, **kwargs)
        made._made_with = (args, kwargs)
        return made

    def __reduce__(self) -> tuple[Any, ...]:
        args, kwargs = self._made_with
        state = {k: v for k, v in self.__dict__.items() if k != "_made_with"}
        return _rebuild, (type(self), args, kwargs), {**state, "args": self.args}


def _rebuild(cls: type[AgentError], args: tuple[Any, ...], kwargs: dict[str, Any]) -> AgentError:
    """An unpickled error: its class called as it was, so each ``__init__`` sets what it sets."""
    return cls(*args, **kwargs)


class ArgumentError(AgentError, ValueError):
    """A caller passed something the library cannot use; the message says what and where."""


class MessageError(ArgumentError):
    """A message, or its stored JSON form, is not a valid transcript entry."""


class StoresShadowed(AgentError, ImportError):
    """The package Python imports as ``stores`` is a project's own, first on ``sys.path``, hiding the
    library's stores; the message names both and what to do."""

    def __init__(self, message: str, *, found: str, expected: str) -> None:
        self.found = found
        self.expected = expected
        super().__init__(message, name="stores", path=found)


class StoreError(AgentError):
    """A store could not do what was asked: the write did not happen (or, for ``OutcomeUnknown``, may
    have). The driver's exception is chained as ``__cause__``."""


class OutcomeUnknown(StoreError):
    """A write was sent but its answer never came, so it **may have happened** (a plain ``StoreError`` means
    it did not). Read back to know, or retry only a call that is safe to repeat (docs/reliability.md)."""


class EndpointError(AgentError):
    """The model endpoint failed, or answered with something that is not a valid response. ``status`` is
    the HTTP status (``None``: no response) and ``message`` the provider's own error text, verbatim."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        self.status = status
        self.message = message
        self.body = body
        super().__init__(f"{status}: {message}" if status is not None else message)


class ContextOverflow(EndpointError):
    """The provider refused the request as longer than the model's context: retrying cannot succeed, what is
    sent must shrink (a context policy: docs/runs/context.md). ``tokens`` and ``limit``: the provider's
    count and maximum, ``None`` where its text does not say."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "", tokens: int | None = None,
                 limit: int | None = None) -> None:
        self.tokens = tokens
        self.limit = limit
        super().__init__(message, status=status, body=body)

    def hinted(self, hint: str) -> ContextOverflow:
        """This error with ``hint`` added to what it says (``message`` stays the provider's own text)."""
        again = ContextOverflow(self.message, status=self.status, body=self.body, tokens=self.tokens, limit=self.limit)
        again.args = (f"{self}{hint}",)
        return again


class ToolError(AgentError):
    """Raise it inside a tool to hand the model a clean error text (no exception type in front)."""


class RunFinished(AgentError):
    """A steer was sent to a run that has already returned: steer the session instead."""


class SessionExists(AgentError):
    """A fork's target already has a transcript: forking never overwrites a conversation."""


class Conflict(AgentError):
    """Another run got to the session first: nothing was written, and retrying later (after reloading
    the transcript) may succeed. A web app answers these with 409, apart from a ``StoreError`` (503)."""


class SessionBusy(Conflict):
    """Another live run holds the session's lease. ``holder`` says who, and until when."""

    def __init__(self, message: str, holder: Holder) -> None:
        self.holder = holder
        super().__init__(message)


class StillQueued(SessionBusy):
    """A message ``Runner.turn`` stored for a busy session was not answered within ``Spec.lease_wait``. It
    is stored and will be answered, by whichever turn holds the lease next or the same ``turn(..., key)``
    called again. ``position``: its place among the messages waiting (1: next; 0: being answered)."""

    def __init__(self, message: str, holder: Holder | None, key: str, position: int) -> None:
        self.key = key
        self.position = position
        super().__init__(message, holder)  # type: ignore[arg-type]  # None: the lease was free at the end


class SessionLocked(Conflict):
    """Another worker kept the session's row locked inside a transaction longer than the store's
    ``lock_wait`` (stalled or slow). Nothing was written; a later try gets through once the store ends that
    transaction (``transaction_timeout``)."""


class LeaseLost(Conflict):
    """Another run took this run's lease over (it had stalled past its expiry, or its renewals failed):
    the store refused the write, and the run stopped without writing anything more."""

    @classmethod
    def superseded(cls, session: str, epoch: int, token: str | None, stored_epoch: int | None) -> LeaseLost:
        """The error a store raises for a write whose lease (of ``epoch``) is no longer the stored one,
        which has ``token`` (``None``: free) at ``stored_epoch`` (``None``: the session has no lease)."""
        if stored_epoch is None:
            now = "the session has no lease"
        elif token is None:
            now = f"the lease is free, at epoch {stored_epoch}"
        else:
            now = f"held at epoch {stored_epoch} by token {token[:8]}…"
        return cls(f"session {session!r}: this run's lease (epoch {epoch}) was taken over; {now}")


class TranscriptConflict(Conflict):
    """A run's first write found a stored transcript its messages do not extend (another run saved
    meanwhile). Nothing was written: reload, append and run again, or replace the history on purpose with
    ``Spec(replace_transcript=True)``."""

    def __init__(self, session: str, stored: int, given: int) -> None:
        self.session = session
        self.stored = stored
        self.given = given
        super().__init__(f"session {session!r}: the {given} messages given do not extend the {stored} stored; another "
                         f"run saved meanwhile, or the history would be lost. Reload the transcript and try again "
                         f"(Spec(replace_transcript=True) replaces it on purpose)")


class TranscriptDeleted(TranscriptConflict):
    """A run's messages were read from a session deleted or pruned since: writing them would bring the
    erased conversation back. Nothing was written (docs/lifecycle.md)."""

    def __init__(self, session: str, stored: int, given: int) -> None:
        super().__init__(session, stored, given)
        self.args = (f"session {session!r}: the {given} messages given were read from the session before it was "
                     f"deleted or pruned; writing them would bring the erased conversation back, so nothing was "
                     f"written (it holds {stored} messages now)",)


class AlreadyDecided(Conflict):
    """A decision on a call that was decided already (by another person's concurrent decision, by its
    deadline passing, or by a cancel of the turn): ``decision`` says how; nothing was written."""

    def __init__(self, message: str, decision: Decision) -> None:
        self.decision = decision
        super().__init__(message)


class AwaitingApproval(Conflict):
    """A run was given new messages while the session's turn waits for decisions on ``calls``: a new turn
    would drop the waiting reply and its decisions. Nothing was written: decide (or cancel) them first, or
    leave the message as a steer."""

    def __init__(self, session: str, calls: list[str]) -> None:
        self.session = session
        self.calls = calls
        super().__init__(f"session {session!r}: its turn waits for decisions on calls {', '.join(map(repr, calls))}; "
                         f"this run's new messages were not written. Approve or deny them (or cancel the turn) "
                         f"first, or leave the message as a steer")


class UnknownApproval(ArgumentError):
    """A decision on a call that does not wait for one in this session (a wrong id, or the turn it
    belonged to has been closed)."""


class Unsupported(AgentError, TypeError):
    """The session's store does not implement the optional RunStore protocol this call needs."""


class SchemaMismatch(StoreError):
    """The database was made by another schema version of this library: nothing is read or written."""


class BadStoreURL(ArgumentError):
    """A store URL that names no store this process can open, or is not written as its store reads it
    (``stores.urls``)."""
