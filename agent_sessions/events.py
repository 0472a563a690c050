"""What a run reports as it goes. ``events`` is ``None`` or a callable taking these; with ``None`` the
loop builds none of them (its sink is ``SILENT``).

Each event class is also the one declaration of its kind in a session's durable log (``Spec(publish_events=
True)``, docs/runs/events.md): ``kind``, its name there; ``data()``, its fields there; ``points``, the field
holding a message of the transcript. The publisher (``run.publisher``), the log's format and its join
(``eventlog``), the tracing (``otel``) and the docs' table of kinds (tests/test_docs.py checks it) all take
them from here, so a new kind is a class here (one of ``Event``), a method of ``Sink`` (and ``SILENT``'s) for
the loop to call, and its row in the docs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, fields
from typing import Any, ClassVar, Literal

from .messages import Content, Message
from .result import Result

log = logging.getLogger(__name__)


class Reported:
    """What every event declares of itself, once (see the module's docstring)."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    kind: ClassVar[str] = ""
    """Its name in a session's log; "" for an event that stays in process."""
    points: ClassVar[str] = ""
    """The field of its ``data()`` holding a message of the transcript (the model's reply, one of its calls,
    their results): the write that stores that message stores the event with a pointer in its place
    (``ref``), which a reader of the log gets joined back (``eventlog.resolve``)."""

    def data(self) -> dict[str, Any]:
        """Its ``data`` in the log, field by field, in order: its own fields, unless it says otherwise; a
        message, call or result as the object (``eventlog.part`` says what the log keeps of it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class StepStarted(Reported):
    kind = "step_started"

    step: int


@dataclass(frozen=True, slots=True)
class SteerApplied(Reported):
    kind = "steer_applied"

    step: int
    text: str
    index: int
    """Where in the transcript the steer now stands."""
    source: Literal["run", "session"]


@dataclass(frozen=True, slots=True)
class Saved(Reported):
    step: int
    messages: int


@dataclass(frozen=True, slots=True)
class ModelRequest(Reported):
    step: int
    messages: int


@dataclass(frozen=True, slots=True)
class Compacted(Reported):
    """The context policy appended a compaction record (docs/runs/context.md) before the step's request:
    a summary of the transcript's messages ``[start, end)``, standing at ``index``. ``tokens_before`` and
    ``tokens_after`` are the policy's estimates of the step's request without and with it."""

    kind = "compacted"

    step: int
    start: int
    end: int
    index: int
    tokens_before: int
    tokens_after: int


@dataclass(frozen=True, slots=True)
class ModelResponse(Reported):
    kind = "model_response"
    points = "message"

    step: int
    message: Message
    seconds: float

    @property
    def usage(self) -> Mapping[str, int] | None:
        """The token counts the provider reported for this request (``message.usage``)."""
        return self.message.usage


@dataclass(frozen=True, slots=True)
class TextDelta(Reported):
    """A piece of the model's reply text as it arrives, from an endpoint that streams (``stream=True``).
    A step's pieces joined are the text of its ModelResponse's message, which comes after them. The log
    gets them batched (``text`` events: ``run.publisher``)."""

    kind = "text"

    step: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCalled(Reported):
    kind = "tool_called"
    points = "call"

    step: int
    call: Content


@dataclass(frozen=True, slots=True)
class ToolFinished(Reported):
    kind = "tool_finished"
    points = "result"

    step: int
    call: Content
    result: Content
    seconds: float

    def data(self) -> dict[str, Any]:
        """The call's id and name, not the call: the log has it in the ``tool_called`` event."""
        return {"step": self.step, "call_id": self.call.id, "name": self.call.name, "result": self.result,
                "seconds": self.seconds}


@dataclass(frozen=True, slots=True)
class Finished(Reported):
    kind = "finished"

    result: Result

    def data(self) -> dict[str, Any]:
        """What the run returned, but its transcript (the session has it) and its steers left unapplied."""
        result = self.result
        return {"stop_reason": result.stop_reason, "steps": result.steps, "text": result.text,
                "usage": dict(result.usage), "pending_approvals": [p.call_id for p in result.pending_approvals]}


@dataclass(frozen=True, slots=True)
class ApprovalRequested(Reported):
    """A call that needs a person's decision: the run stops before it (``awaiting_approval``)."""

    kind = "approval_requested"

    step: int
    call: Content


@dataclass(frozen=True, slots=True)
class ApprovalDecided(Reported):
    """The run found the decision on a call it had asked about, and acts on it: runs it or denies it.
    ``by`` is ``"person"``, or ``"deadline"`` (undecided past its deadline: denied)."""

    kind = "approval_decided"

    step: int
    call: Content
    approved: bool
    reason: str
    by: str


@dataclass(frozen=True, slots=True)
class Failed(Reported):
    """The run raised ``error`` (an EndpointError, a LeaseLost, a store's error...) and re-raises it: the
    last event of a run that ends without ``Finished``, so a listener can close what it opened."""

    kind = "failed"

    error: BaseException

    def data(self) -> dict[str, Any]:
        """The error's qualified class name and its text."""
        kind = type(self.error)
        return {"type": f"{kind.__module__}.{kind.__qualname__}", "message": str(self.error)}


Event = (StepStarted | SteerApplied | TextDelta | ModelResponse | ToolCalled | ToolFinished | ApprovalRequested
         | ApprovalDecided | Compacted | Finished | Failed | Saved | ModelRequest)
"""Every event a run reports; those with a ``kind`` in the log's order (docs/runs/events.md), then those
that stay in process."""
Events = Callable[[Event], None]


class Sink:
    """Builds each event and hands it to the run's ``events`` callback. The loop talks to a Sink, never to
    the callback, so it has no ``if events is not None`` of its own; ``SILENT`` builds nothing."""

    __slots__ = ("events",)

    def __init__(self, events: Events) -> None:
        self.events = events

    def step_started(self, step: int) -> None:
        self.events(StepStarted(step))

    def steer_applied(self, step: int, text: str, index: int, source: Literal["run", "session"]) -> None:
        self.events(SteerApplied(step, text, index, source))

    def saved(self, step: int, messages: int) -> None:
        self.events(Saved(step, messages))

    def compacted(self, step: int, start: int, end: int, index: int, before: int, after: int) -> None:
        self.events(Compacted(step, start, end, index, before, after))

    def model_request(self, step: int, messages: int) -> float:
        """Returns the clock reading ``model_response`` measures from."""
        self.events(ModelRequest(step, messages))
        return time.perf_counter()

    def model_response(self, step: int, message: Message, started: float) -> None:
        self.events(ModelResponse(step, message, time.perf_counter() - started))

    def text_delta(self, step: int, text: str) -> None:
        self.events(TextDelta(step, text))

    def tool_called(self, step: int, call: Content) -> float:
        self.events(ToolCalled(step, call))
        return time.perf_counter()

    def tool_returned(self, started: float) -> float:
        """The seconds the tool took, since ``started`` (what ``tool_called`` returned): read as it returns,
        before its result is recorded, so that ``ToolFinished`` measures the tool alone."""
        return time.perf_counter() - started

    def tool_finished(self, step: int, call: Content, result: Content, seconds: float) -> None:
        self.events(ToolFinished(step, call, result, seconds))

    def approval_requested(self, step: int, call: Content) -> None:
        self.events(ApprovalRequested(step, call))

    def approval_decided(self, step: int, call: Content, approved: bool, reason: str, by: str) -> None:
        self.events(ApprovalDecided(step, call, approved, reason, by))

    def finished(self, result: Result) -> None:
        self.events(Finished(result))

    def failed(self, error: BaseException) -> None:
        """Never raises: what the callback raises here is logged, so it cannot take the run's error's place."""
        try:
            self.events(Failed(error))
        except Exception:
            log.exception("the events callback raised on Failed; the run's own error follows")


class _Silent(Sink):
    """Each method of ``Sink`` does nothing, and a clock reading is 0.0."""

    __slots__ = ()

    def __init__(self) -> None:
        pass


def _nothing(*args: object, **kwargs: object) -> float:
    return 0.0


for _name in [name for name in vars(Sink) if not name.startswith("_") and name != "events"]:
    setattr(_Silent, _name, _nothing)

SILENT: Sink = _Silent()
"""The sink of a run without ``events``: builds no event and reads no clock."""


def sink(events: Events | None) -> Sink:
    return SILENT if events is None else Sink(events)
