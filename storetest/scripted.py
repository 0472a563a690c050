"""Stand-in models: storetest checks stores, not endpoints, so a script maps the transcript to the next reply."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Sequence

from agent_sessions import Content, Message, Role, Tool


class ToolsThenAnswer:
    """Asks for ``calls`` (tool names) in one reply on every request until ``rounds`` replies have
    been made, then answers with what the last results said. Picklable, for child processes."""

    def __init__(self, calls: Sequence[str], rounds: int = 1, log: str | None = None,
                 before: Callable[[Sequence[Message]], object] | None = None, arguments: str | None = None) -> None:
        self.calls = list(calls)
        self.rounds = rounds
        self.arguments = arguments
        """Every call's arguments (by default ``{"n": <its place in the reply>}``)."""
        self.log = log
        """A file to which every request appends a line: how a parent process counts requests."""
        self.before = before
        """Runs first, inside each request: where a test makes something happen while the run waits."""
        self.requests = 0
        """Requests made so far (in this process)."""

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        self.requests += 1
        if self.before is not None:
            self.before(messages)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write("request\n")
        made = sum(1 for m in messages if m.role is Role.ASSISTANT and m.tool_calls)
        if made >= self.rounds:
            results = [c.text for c in messages[-1].content] if messages else []
            return Message.assistant("done: " + json.dumps(results))
        return Message(
            Role.ASSISTANT,
            [Content.tool_call(f"call_{made}_{i}", name, self.arguments or json.dumps({"n": i}))
             for i, name in enumerate(self.calls)],
        )


class Answer:
    """Answers ``text`` to every request; ``before`` (if given) runs first, inside the request, which is
    where a test makes something happen while the run waits on its model."""

    def __init__(self, text: str, before: Callable[[Sequence[Message]], object] | None = None) -> None:
        self.text = text
        self.before = before
        self.requests = 0

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        self.requests += 1
        if self.before is not None:
            self.before(messages)
        return Message.assistant(self.text)


class Replies:
    """Replies with ``replies`` in turn (read off the transcript, so a resumed run gets the one it is at), then
    answers with what the last results said. ``requests`` keeps each request's transcript."""

    def __init__(self, *replies: Message) -> None:
        self.replies = list(replies)
        self.requests: list[list[Message]] = []

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        self.requests.append(list(messages))
        made = sum(1 for m in messages if m.role is Role.ASSISTANT and m.tool_calls)
        if made < len(self.replies):
            return self.replies[made]
        return Message.assistant("done: " + " | ".join(c.text for c in messages[-1].content))


class Held:
    """Answers ``text`` once let go (``go``), saying when it was asked (``entered``); with ``calls``, its first
    reply calls ``lookup`` (so a cancel that came meanwhile stops the run before the tool)."""

    def __init__(self, text: str, calls: bool = False) -> None:
        self.text, self.calls, self.entered, self.go = text, calls, threading.Event(), threading.Event()

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        self.entered.set()
        self.go.wait(20)
        if self.calls and not any(m.tool_calls for m in messages):
            return Message(Role.ASSISTANT, [Content.tool_call(f"c-{uuid.uuid4().hex[:6]}", "lookup", "{}")])
        return Message.assistant(self.text)
