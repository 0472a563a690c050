"""What a run reports as it goes. ``events`` is ``None`` or a callable taking these; with ``None`` the
loop builds none of them (its sink is ``SILENT``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from .messages import Content, Message
from .result import Result

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepStarted:
    step: int


@dataclass(frozen=True, slots=True)
class SteerApplied:
    step: int
    text: str
    index: int
    """Where in the transcript the steer now stands."""
    source: Literal["run", "session"]


@dataclass(frozen=True, slots=True)
class Saved:
    step: int
    messages: int


@dataclass(frozen=True, slots=True)
class ModelRequest:
    step: int
    messages: int


@dataclass(frozen=True, slots=True)
class Compacted:
    """The context policy appended a compaction record (docs/runs/context.md) before the step's request:
    a summary of the transcript's messages ``[start, end)``, standing at ``index``. ``tokens_before`` and
    ``tokens_after`` are the policy's estimates of the step's request without and with it."""

    step: int
    start: int
    end: int
    index: int
    tokens_before: int
    tokens_after: int


@dataclass(frozen=True, slots=True)
class ModelResponse:
    step: int
    message: Message
    seconds: float

    @property
    def usage(self) -> Mapping[str, int] | None:
        """The token counts the provider reported for this request (``message.usage``)."""
        return self.message.usage


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the model's reply text as it arrives, from an endpoint that streams (``stream=True``).
    A step's pieces joined are the text of its ModelResponse's message, which comes after them."""

    step: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCalled:
    step: int
    call: Content


@dataclass(frozen=True, slots=True)
class ToolFinished:
    step: int
    call: Content
    result: Content
    seconds: float


@dataclass(frozen=True, slots=True)
class Finished:
    result: Result


@dataclass(frozen=True, slots=True)
class ApprovalRequested:
    """A call that needs a person's decision: the run stops before it (``awaiting_approval``)."""

    step: int
    call: Content


@dataclass(frozen=True, slots=True)
class ApprovalDecided:
    """The run found the decision on a call it had asked about, and acts on it: runs it or denies it.
    ``by`` is ``"person"``, or ``"deadline"`` (undecided past its deadline: denied)."""

    step: int
    call: Content
    approved: bool
    reason: str
    by: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The run raised ``error`` (an EndpointError, a LeaseLost, a store's error...) and re-raises it: the
    last event of a run that ends without ``Finished``, so a listener can close what it opened."""

    error: BaseException


Event = (
    StepStarted | SteerApplied | Saved | ModelRequest | ModelResponse | ToolCalled | ToolFinished | Finished | Failed
    | TextDelta | ApprovalRequested | ApprovalDecided | Compacted
)
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
    __slots__ = ()

    def __init__(self) -> None:
        pass

    def step_started(self, step: int) -> None:
        pass

    def steer_applied(self, step: int, text: str, index: int, source: Literal["run", "session"]) -> None:
        pass

    def saved(self, step: int, messages: int) -> None:
        pass

    def compacted(self, step: int, start: int, end: int, index: int, before: int, after: int) -> None:
        pass

    def model_request(self, step: int, messages: int) -> float:
        return 0.0

    def model_response(self, step: int, message: Message, started: float) -> None:
        pass

    def text_delta(self, step: int, text: str) -> None:
        pass

    def tool_called(self, step: int, call: Content) -> float:
        return 0.0

    def tool_returned(self, started: float) -> float:
        return 0.0

    def tool_finished(self, step: int, call: Content, result: Content, seconds: float) -> None:
        pass

    def approval_requested(self, step: int, call: Content) -> None:
        pass

    def approval_decided(self, step: int, call: Content, approved: bool, reason: str, by: str) -> None:
        pass

    def finished(self, result: Result) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass


SILENT: Sink = _Silent()
"""The sink of a run without ``events``: builds no event and reads no clock."""


def sink(events: Events | None) -> Sink:
    return SILENT if events is None else Sink(events)
