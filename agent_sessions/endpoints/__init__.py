"""Model endpoints over ``requests``. Anything with ``complete(system, messages, tools)`` is an Endpoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from ..messages import Message
from ..tools import Tool

if TYPE_CHECKING:
    from .anthropic import AnthropicMessages
    from .openai import OpenAIChat


@runtime_checkable
class Endpoint(Protocol):
    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        """One model request: the assistant's reply to ``messages``."""


class StreamingEndpoint(Endpoint, Protocol):
    """An Endpoint that says ``streams = True`` takes ``on_text`` too, and calls it with each piece of
    the reply's text as it arrives. The attribute is what the loop checks (once per run), so that an
    Endpoint written before streaming, with the three-argument ``complete``, keeps working."""

    streams: bool

    def complete(
        self,
        system: str,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        on_text: Callable[[str], None] | None = None,
    ) -> Message:
        """The reply, as ``Endpoint.complete``; ``on_text`` is given its text piece by piece as it arrives, on
        this thread (a callback that raises ends the request with its exception)."""


def streaming(endpoint: Endpoint) -> StreamingEndpoint | None:
    """``endpoint`` if it streams (its ``streams`` is True), else None."""
    return cast(StreamingEndpoint, endpoint) if getattr(endpoint, "streams", False) is True else None


def __getattr__(name: str) -> Any:
    """The two HTTP endpoints, imported when first named: they load ``requests``, a tenth of a second that the
    CLI, a store's process and a worker with an endpoint of its own never need."""
    if name == "AnthropicMessages":
        from .anthropic import AnthropicMessages

        return AnthropicMessages
    if name == "OpenAIChat":
        from .openai import OpenAIChat

        return OpenAIChat
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AnthropicMessages", "Endpoint", "OpenAIChat", "StreamingEndpoint", "streaming"]
