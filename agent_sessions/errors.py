"""One exception family, so a caller (a Celery retry policy, a Flask error handler) catches one root."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lease import Holder


class AgentError(Exception):
    """Root of every error this library raises on purpose."""


class ArgumentError(AgentError, ValueError):
    """A caller passed something the library cannot use; the message says what and where."""


class MessageError(ArgumentError):
    """A message, or its stored JSON form, is not a valid transcript entry."""


class StoreError(AgentError):
    """A store could not do what was asked; the driver's exception is chained as ``__cause__``."""


class EndpointError(AgentError):
    """The model endpoint failed, or answered with something that is not a valid response.

    ``status`` is the HTTP status (``None`` when no response arrived at all) and ``message`` is the
    provider's own error text, so a 400 such as "assistant message prefill" reaches the caller verbatim.
    """

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        self.status = status
        self.message = message
        self.body = body
        super().__init__(f"{status}: {message}" if status is not None else message)


class ToolError(AgentError):
    """Raise it inside a tool to hand the model a clean error text (no exception type in front)."""


class RunFinished(AgentError):
    """A steer was sent to a run that has already returned: steer the session instead."""


class SessionExists(AgentError):
    """A fork's target already has a transcript: forking never overwrites a conversation."""


class SessionBusy(AgentError):
    """Another live run holds the session's lease. ``holder`` says who, and until when."""

    def __init__(self, message: str, holder: Holder) -> None:
        self.holder = holder
        super().__init__(message)


class LeaseLost(StoreError):
    """This run's lease expired or was taken over, so it stopped rather than write beside another run."""


class Unsupported(AgentError, TypeError):
    """The session's store does not implement the optional RunStore protocol this call needs."""
