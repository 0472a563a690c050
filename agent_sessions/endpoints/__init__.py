"""Model endpoints over ``requests``. Anything with ``complete(system, messages, tools)`` is an Endpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..messages import Message
from ..tools import Tool
from .anthropic import AnthropicMessages
from .openai import OpenAIChat


@runtime_checkable
class Endpoint(Protocol):
    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        """One model request: the assistant's reply to ``messages``."""


__all__ = ["AnthropicMessages", "Endpoint", "OpenAIChat"]
