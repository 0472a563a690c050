"""What a run sends the model of its transcript: a context policy, kept apart from what is stored.

A session lives for weeks and a model's context does not, so a long conversation cannot be sent whole.
The store keeps every message whatever is sent (``session.messages()``, fork and the CLI see them all);
a policy (``Spec(context=...)``) chooses, before each model request, which of the transcript's messages
that request sends. docs/runs/context.md says what each policy guarantees. Without a policy the whole
transcript is sent, as before, and nothing here runs.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .errors import ArgumentError, ContextOverflow
from .messages import ContentType, Message, Role
from .tools import Tool

log = logging.getLogger(__name__)

Estimate = Callable[[str], int]
"""Tokens of a text, estimated: ``bytes_over_4`` by default; a tokenizer's count where one is installed
(``lambda text: len(encoding.encode(text))`` with tiktoken)."""


def bytes_over_4(text: str) -> int:
    """A token per 4 bytes of UTF-8, rounded up: close for English prose and code, on the high side for
    JSON's punctuation, and needing no tokenizer. A provider that counts more corrects it (``Window``)."""
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    return -(-size // 4)


@dataclass(frozen=True, slots=True)
class Selection:
    """What one model request sends: ``messages``, the transcript's from index ``start`` on, and
    ``tokens``, the policy's estimate of the whole request (system prompt and tools included) before any
    correction, which the provider's reported count is compared with."""

    messages: Sequence[Message]
    start: int
    tokens: int


@runtime_checkable
class ContextPolicy(Protocol):
    """Chooses what each model request of a run sends (``Spec(context=...)``). One policy object serves
    every run of the Spec, on any thread, so what it learns (``Window``'s correction) is shared by them.

    The loop calls ``select`` before each request, ``observe`` with the usage the provider reported for
    its reply, and ``overflowed`` when the provider refused it as too long (``ContextOverflow``): a
    Selection returned then is sent once more; ``None`` lets the error end the run."""

    def select(self, system: str, transcript: Sequence[Message], tools: Sequence[Tool]) -> Selection:
        """What the next request sends of ``transcript`` (the run's, whole)."""

    def observe(self, sent: Selection, usage: Mapping[str, int] | None) -> None:
        """The provider's count for the request that sent ``sent`` (its ``usage``, ``None`` if none)."""

    def overflowed(
        self, error: ContextOverflow, sent: Selection, system: str, transcript: Sequence[Message],
        tools: Sequence[Tool],
    ) -> Selection | None:
        """The provider refused ``sent`` as too long: a smaller request to send instead, or ``None``."""


class Window:
    """Sends the system prompt and the newest messages that fit in ``max_tokens`` (what is sent: the
    system prompt, the tools and the messages; leave the reply's room out of it). A request never starts
    with a tool result or an assistant message, so a tool call is never sent without its result nor a
    result without its call; it starts at a user message of the person (or a steer).

    When even the newest such message and what follows it do not fit, they are sent anyway: the provider
    then decides (a ``ContextOverflow``, if it agrees they do not).

    Tokens are ``estimate``d per message, from its stored JSON form. The estimate is corrected by what the
    provider reports: the window is scaled by the largest ratio yet seen of the provider's count
    (``usage``'s prompt or input tokens) to the estimate, and lowered to the provider's maximum when a
    ``ContextOverflow`` reports one. The correction only tightens the window, and is shared by every run
    of the policy object (the same model counts the same way)."""

    def __init__(self, max_tokens: int, *, estimate: Estimate = bytes_over_4) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ArgumentError(f"Window.max_tokens must be an int >= 1, got {max_tokens!r}")
        if not callable(estimate):
            raise ArgumentError(f"Window.estimate must be a function of a text, got {type(estimate).__name__}")
        self.max_tokens = max_tokens
        self.estimate = estimate
        self.scale = 1.0
        """The provider's tokens per estimated token: the largest ratio seen, 1.0 until one is."""
        self.limit = max_tokens
        """``max_tokens``, or the provider's maximum once an overflow reported a smaller one."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Window(max_tokens={self.max_tokens}, scale={self.scale:.3f}, limit={self.limit})"

    def select(self, system: str, transcript: Sequence[Message], tools: Sequence[Tool]) -> Selection:
        fixed = (self.estimate(system) if system else 0) + (self.estimate(_tools_json(tools)) if tools else 0)
        budget = self.limit / self.scale - fixed
        total = 0  # the messages' estimate from i on
        fits: int | None = None  # the earliest start found that fits
        newest: int | None = None  # the latest start: sent when none fits
        kept = 0
        for i in range(len(transcript) - 1, -1, -1):
            message = transcript[i]
            total += self.estimate(message.to_json())
            if total > budget and newest is not None:
                break
            if _starts(message):
                if newest is None:
                    newest = i
                if total <= budget:
                    fits, kept = i, total
        start = fits if fits is not None else newest if newest is not None else 0
        if fits is None:
            kept = sum(self.estimate(m.to_json()) for m in transcript[start:])
            log.debug("no start of the transcript fits %d tokens (scale %.3f): sending its last %d messages",
                      self.limit, self.scale, len(transcript) - start)
        return Selection(transcript[start:] if start else transcript, start, fixed + kept)

    def observe(self, sent: Selection, usage: Mapping[str, int] | None) -> None:
        counted = prompt_tokens(usage)
        if counted and sent.tokens > 0:
            self._tighten(counted / sent.tokens)

    def overflowed(
        self, error: ContextOverflow, sent: Selection, system: str, transcript: Sequence[Message],
        tools: Sequence[Tool],
    ) -> Selection | None:
        with self._lock:
            if error.limit is not None and error.limit < self.limit:
                self.limit = error.limit
        if error.tokens and sent.tokens > 0:
            self._tighten(error.tokens / sent.tokens)
        else:  # no count to learn from: narrow by a quarter, so the next try sends less
            self._tighten(self.scale * 1.25)
        again = self.select(system, transcript, tools)
        if again.start <= sent.start:
            return None  # nothing more can be left out
        log.info("the provider refused %d messages as too long (%s of %s tokens); sending the last %d",
                 len(sent.messages), error.tokens, error.limit, len(again.messages))
        return again

    def _tighten(self, ratio: float) -> None:
        with self._lock:
            if ratio > self.scale:
                self.scale = ratio


def prompt_tokens(usage: Mapping[str, int] | None) -> int:
    """What the provider counted for a request's prompt: OpenAI's ``prompt_tokens``; Anthropic's
    ``input_tokens`` and the cached ones it counts apart. 0 when ``usage`` says neither."""
    if not usage:
        return 0
    if "prompt_tokens" in usage:
        return usage["prompt_tokens"]
    return (usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
            + usage.get("cache_creation_input_tokens", 0))


def _starts(message: Message) -> bool:
    """May a request start here? At a user message holding no tool result."""
    return message.role is Role.USER and all(c.type is not ContentType.TOOL_RESULT for c in message.content)


def _tools_json(tools: Sequence[Tool]) -> str:
    return json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools])


DEFAULT_SHARE = 0.8
"""The part of ``Spec(context_window=N)`` a request may fill: the rest is the reply's room, and the margin
for an estimate that counts low before the provider's usage has corrected it."""


def policy_of(context: ContextPolicy | None, context_window: int | None) -> ContextPolicy | None:
    """The policy a Spec's two options ask for: ``context`` as given, or the default for
    ``context_window`` (a ``Window`` of ``DEFAULT_SHARE`` of it, until compaction is built), or None."""
    if context is not None and context_window is not None:
        raise ArgumentError("Spec takes context or context_window, not both: context_window=N is the default "
                            "policy for a model's context of N tokens, context= any other")
    if context_window is not None:
        if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 1:
            raise ArgumentError(f"Spec.context_window must be an int >= 1 (the model's context in tokens), "
                                f"got {context_window!r}")
        return Window(max(1, int(context_window * DEFAULT_SHARE)))
    if context is not None and not isinstance(context, ContextPolicy):
        raise ArgumentError(f"Spec.context must be a context policy (Window, or an object with select, observe "
                            f"and overflowed), got {type(context).__name__}")
    return context
