"""The tests' model server: ``agent_sessions.testing.model_server`` (one implementation, shipped in the
wheel) answering from a queue the test fills with ``push``, and recording every request body byte for byte."""

from __future__ import annotations

from agent_sessions.testing.model_server import (
    ModelServer as _Served,
)
from agent_sessions.testing.model_server import (
    Reply,
    Request,
    Script,
    anthropic,
    context_length_exceeded,
    openai,
    openai_raw,
    prompt_too_long,
    sse,
    windowed,
)

__all__ = ["ModelServer", "Reply", "Request", "Script", "anthropic", "context_length_exceeded", "openai", "openai_raw",
           "prompt_too_long", "sse", "windowed"]

_NOTHING_LEFT = Reply({"error": {"message": "the test script has no reply left"}}, status=599)


class ModelServer(_Served):
    """``push`` replies (or callables building one from the request); each request takes the next."""

    def __init__(self) -> None:
        self._script: list[Script] = []
        super().__init__(lambda request: _NOTHING_LEFT)

    def take(self, request: Request) -> Script:
        return self._script.pop(0) if self._script else _NOTHING_LEFT

    def push(self, *steps: Script) -> None:
        with self._lock:
            self._script.extend(steps)
