"""What a run reports as it goes. ``events`` is ``None`` or a callable taking these; with ``None`` the
loop builds none of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .messages import Content, Message

if TYPE_CHECKING:
    from .runner import Result


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
class ModelResponse:
    step: int
    message: Message
    seconds: float


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


Event = StepStarted | SteerApplied | Saved | ModelRequest | ModelResponse | ToolCalled | ToolFinished | Finished
Events = Callable[[Event], None]
