"""What a run sends the model of its transcript: a context policy (``Spec(context=...)``), kept apart from
what is stored, which is every message whatever is sent. docs/runs/context.md says what each policy
guarantees; without one the whole transcript is sent and nothing here runs.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .contract import Store, TailStore
from .errors import ArgumentError, ContextOverflow, EndpointError
from .journal import TAIL
from .messages import Content, ContentType, Message, Role, Tail, start_of
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
    """What one model request sends: ``messages``; ``start``, the transcript index of the first of them; and
    ``tokens``, the policy's estimate of the whole request before any correction (the provider's count is
    compared with it)."""

    messages: Sequence[Message]
    start: int
    tokens: int


@runtime_checkable
class ContextPolicy(Protocol):
    """Chooses what each model request of a run sends. One policy object serves every run of the Spec, on
    any thread, so what it learns (``Window``'s correction) is shared by them."""

    def select(self, system: str, transcript: Sequence[Message], tools: Sequence[Tool]) -> Selection:
        """What the next request sends of ``transcript`` (the run's, whole)."""

    def observe(self, sent: Selection, usage: Mapping[str, int] | None) -> None:
        """The usage the provider reported for the request that sent ``sent``."""

    def overflowed(self, error: ContextOverflow, sent: Selection, system: str, transcript: Sequence[Message],
                   tools: Sequence[Tool]) -> Selection | None:
        """The provider refused ``sent`` as too long: a smaller request to send instead, or ``None`` (the
        error ends the run)."""


class Window:
    """Sends the system prompt, the tools and the newest messages that fit in ``max_tokens``, starting at a
    user message (so no call goes without its result); when not even the newest such start fits, it is sent
    anyway. Tokens are ``estimate``d, scaled by the largest ratio yet seen of the provider's count to the
    estimate, and the window lowered to a maximum a ``ContextOverflow`` reports: the correction only tightens
    (docs/runs/context.md)."""

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

    def select(self, system: str, transcript: Sequence[Message], tools: Sequence[Tool], reserve: int = 0) -> Selection:
        """``reserve``: tokens of the budget kept for something sent besides (``Compaction``'s summary)."""
        fixed = (self.estimate(system) if system else 0) + (self.estimate(_tools_json(tools)) if tools else 0)
        fixed += reserve
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
        return Selection(transcript[start:] if start else transcript, start_of(transcript) + start, fixed + kept)

    def observe(self, sent: Selection, usage: Mapping[str, int] | None) -> None:
        counted = prompt_tokens(usage)
        if counted and sent.tokens > 0:
            self._tighten(counted / sent.tokens)

    def overflowed(self, error: ContextOverflow, sent: Selection, system: str, transcript: Sequence[Message],
                   tools: Sequence[Tool]) -> Selection | None:
        self.learn(error, sent)
        again = self.select(system, transcript, tools)
        return again if len(again.messages) < len(sent.messages) else None  # None: nothing more to leave out

    def learn(self, error: ContextOverflow, sent: Selection) -> None:
        """Tighten by what the provider's refusal of ``sent`` says: its maximum, and its count over the
        estimate (a quarter more, when it gives no count)."""
        with self._lock:
            if error.limit is not None and error.limit < self.limit:
                self.limit = error.limit
        if error.tokens and sent.tokens > 0:
            self._tighten(error.tokens / sent.tokens)
        else:
            self._tighten(self.scale * 1.25)

    def scaled(self, tokens: int) -> float:
        """``tokens`` of the estimate as the provider would count them, by what it has reported."""
        return tokens * self.scale

    def _tighten(self, ratio: float) -> None:
        with self._lock:
            if ratio > self.scale:
                self.scale = ratio


Compacts = Callable[[str, Sequence[Message], Sequence[Tool], "Completes"], "Message | None"]
"""A policy's ``compact(system, transcript, tools, endpoint)``: the compaction record to append before the
next request, or None. Optional: the loop calls it when the policy has it (``Compaction`` does)."""


class Completes(Protocol):
    """What a compaction asks for its summary: an endpoint (``agent_sessions.endpoints.Endpoint``)."""

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        """The reply to ``messages``."""


SUMMARY_SYSTEM = ("You write the summary that replaces the older part of a long conversation between a user and an "
                  "assistant using tools. Keep every fact, decision, name, number, file, open question and promise "
                  "that a later turn may need; leave out pleasantries. Write it as notes, in the conversation's "
                  "language.")
SUMMARY_ASK = ("Summarise the conversation above (and any earlier summary in it) for the assistant to carry on "
               "from. Answer with the summary only; call no tool.")


class Compaction(Window):
    """Sends what fits, as ``Window`` does, and keeps what it leaves out: past ``threshold`` of ``max_tokens``,
    the run first asks the model (``endpoint``, or the run's own) for a summary of the oldest messages, up to
    ``keep`` of the threshold from the end, and appends it as a compaction record; a request is then the
    newest summary and what follows its range. A summary over ``summary`` of ``max_tokens`` counts as a
    failed request (docs/runs/context.md)."""

    def __init__(self, max_tokens: int, *, threshold: float = 0.8, keep: float = 0.5, summary: float = 0.25,
                 endpoint: Completes | None = None, estimate: Estimate = bytes_over_4) -> None:
        for name, value in (("threshold", threshold), ("keep", keep), ("summary", summary)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ArgumentError(f"Compaction.{name} must be a fraction in (0, 1], got {value!r}")
        if endpoint is not None and not callable(getattr(endpoint, "complete", None)):
            raise ArgumentError(f"Compaction.endpoint must be an Endpoint, got {type(endpoint).__name__}")
        super().__init__(max_tokens, estimate=estimate)
        self.threshold = float(threshold)
        self.keep = float(keep)
        self.summary = float(summary)
        self.endpoint = endpoint

    def __repr__(self) -> str:
        return (f"Compaction(max_tokens={self.max_tokens}, threshold={self.threshold}, keep={self.keep}, "
                f"summary={self.summary})")

    def select(self, system: str, transcript: Sequence[Message], tools: Sequence[Tool], reserve: int = 0) -> Selection:
        view, where = _view(transcript)
        if view is transcript:
            return super().select(system, transcript, tools, reserve)
        record = view[0]
        reserve += self.estimate(record.to_json())
        chosen = super().select(system, view[1:], tools, reserve)  # the summary is always sent
        return Selection([record, *chosen.messages], start_of(transcript) + where[0], chosen.tokens)

    def compact(self, system: str, transcript: Sequence[Message], tools: Sequence[Tool],
                endpoint: Completes) -> Message | None:
        """The compaction record to append before the next request, or None when what would be sent is
        within the threshold (or nothing can be summarised). Asks ``self.endpoint`` (else ``endpoint``,
        the run's) for the summary; what that request raises is the caller's."""
        estimate = self.estimate
        view, where = _view(transcript)
        fixed = (estimate(system) if system else 0) + (estimate(_tools_json(tools)) if tools else 0)
        costs = [estimate(m.to_json()) for m in view]
        allowed = self.threshold * self.limit
        if self.scaled(fixed + sum(costs)) <= allowed:
            return None
        summarised = 1 if view is not transcript else 0  # the view starts with the newest record
        base = where[summarised] if summarised < len(where) else len(transcript)
        # the range ends at a request start: the earliest whose rest fits in keep of the threshold...
        target = self.keep * allowed / self.scale - fixed
        end, rest = None, 0
        for i in range(len(view) - 1, summarised, -1):
            rest += costs[i]
            if _starts(view[i]):
                if end is None or rest <= target:
                    end = i
                if rest > target:
                    break
        if end is None:
            return None  # no start after the last summary: nothing to summarise yet
        # ...and at most what one summary request can carry
        cap = self.summary * self.limit  # the summary's tokens, as the provider counts them
        ask = f"{SUMMARY_ASK} Keep it under {max(1, int(cap / self.scale * 0.75))} words."
        budget = allowed / self.scale - estimate(SUMMARY_SYSTEM) - estimate(ask) - fixed
        total, fits = 0, None
        for i in range(0, end + 1):
            if i > summarised and _starts(view[i]) and total <= budget:
                fits = i
            total += costs[i] if i < end else 0
        end = min(end, fits) if fits is not None else end
        asked = [*view[:end], Message.user(ask)]
        reply = (self.endpoint or endpoint).complete(SUMMARY_SYSTEM, asked, tools)
        if not reply.text.strip():
            raise EndpointError("the summary request was answered with no text (a tool call, or nothing)")
        size = self.scaled(estimate(reply.text))
        if size > cap:
            raise EndpointError(f"the summary came back {size:.0f} tokens long, over its cap of {cap:.0f} "
                                f"(Compaction(summary={self.summary}) of {self.limit} tokens)")
        offset = start_of(transcript)  # a Tail's indexes are the stored transcript's from its start on
        base, stop = offset + base, offset + where[end]
        log.info("compaction: messages [%d, %d) summarised in %d characters", base, stop, len(reply.text))
        return Message(Role.USER, [Content.compaction(reply.text, base, stop)])


def _view(transcript: Sequence[Message]) -> tuple[Sequence[Message], Sequence[int]]:
    """What a request may send of ``transcript``: its newest compaction record, then the messages after
    its range that are not records themselves; and the index in ``transcript`` of each of them. Without a
    record, the transcript itself."""
    for r in range(len(transcript) - 1, -1, -1):
        if is_record(transcript[r]):
            break
    else:
        return transcript, range(len(transcript))
    end = max(transcript[r].content[0].end - start_of(transcript), 0)
    where = [r, *(i for i in range(end, len(transcript)) if not is_record(transcript[i]))]
    return [transcript[i] for i in where], where


def is_record(message: Message) -> bool:
    """Is ``message`` a compaction record (a user message whose content is one compaction block)?"""
    content = message.content
    return len(content) == 1 and content[0].type is ContentType.COMPACTION


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
    ``context_window`` (a ``Compaction`` sending at most ``DEFAULT_SHARE`` of it), or None."""
    if context is not None and context_window is not None:
        raise ArgumentError("Spec takes context or context_window, not both: context_window=N is the default "
                            "policy for a model's context of N tokens, context= any other")
    if context_window is not None:
        if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 1:
            raise ArgumentError(f"Spec.context_window must be an int >= 1 (the model's context in tokens), "
                                f"got {context_window!r}")
        return Compaction(max(1, int(context_window * DEFAULT_SHARE)))
    if context is not None and not isinstance(context, ContextPolicy):
        raise ArgumentError(f"Spec.context must be a context policy (Window, or an object with select, observe "
                            f"and overflowed), got {type(context).__name__}")
    return context


FIRST_PAGE = 256
"""Messages the first page of ``read_recent`` reads from the end; each further page reads four times the last."""


def read_recent(store: Store, session: str) -> list[Message]:
    """What a run needs of a session's stored transcript to go on with it under ``Compaction``, as a
    ``Tail``: the messages from the newest compaction record's range on, and the journal's ``TAIL`` before
    them, never starting at a tool result. Read from the end a page at a time until that record is found
    (a store that is no ``TailStore``: whole). A transcript rewritten between two pages may read as neither
    version: the run's first save then refuses it, as it refuses any stale read."""
    if not isinstance(store, TailStore):
        return store.messages(session)
    first, msgs = store.read_back(session, None, FIRST_PAGE)
    scanned, count = len(msgs), FIRST_PAGE
    want: int | None = None  # where the Tail starts, once the newest record is found
    while True:
        if want is None:
            for i in range(scanned - 1, -1, -1):
                if is_record(msgs[i]):
                    want = max(msgs[i].content[0].end - TAIL, 0)
                    break
        if want is not None:
            while first <= want and want > 0 and _has_result(msgs[want - first]):
                want -= 1  # a result is read with its call
            if first <= want:
                return Tail(msgs[want - first:], want)
            need = first - want
        elif first == 0:
            return Tail(msgs, 0)
        else:
            count *= 4
            need = count
        before, more = store.read_back(session, first, need)
        if not more:  # shortened meanwhile: the run's first save will say so
            return Tail(msgs, first)
        first, msgs, scanned = before, [*more, *msgs], len(more)


def _has_result(message: Message) -> bool:
    return any(c.type is ContentType.TOOL_RESULT for c in message.content)
