"""Anthropic ``/v1/messages`` with ``tool_use`` / ``tool_result`` blocks."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from itertools import groupby
from json.encoder import encode_basestring_ascii as _string
from operator import attrgetter
from typing import Any

import requests

from ..messages import Content, ContentType, Message, summary_text
from ..tools import Tool, _not_json
from ._http import HTTPClient, malformed, reply, stream_error, stream_json, unstreamed, usage_of

API_VERSION = "2023-06-01"


class AnthropicMessages:
    """``base_url`` is the host, e.g. ``https://api.anthropic.com``; ``extra``, ``headers``, ``session`` and
    ``stream`` as ``OpenAIChat``'s. Streamed, a tool call's arguments are its ``input_json_delta`` pieces
    joined, byte for byte, where without streaming the API's ``input`` object is written as compact JSON
    (the same JSON value, spaced otherwise)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        max_tokens: int = 4096,
        timeout: float = 120.0,
        max_retries: int = 2,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        extra: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        session: requests.Session | None = None,
        stream: bool = False,
    ) -> None:
        own = {"anthropic-version": API_VERSION}
        if api_key:
            own["x-api-key"] = api_key
        self.http = HTTPClient(
            base_url, {**own, **(headers or {})}, timeout=timeout, max_retries=max_retries, backoff=backoff,
            max_backoff=max_backoff, session=session,
        )
        self.model = model
        self.max_tokens = max_tokens
        self.extra = dict(extra or {})
        self.streams = bool(stream)

    def complete(
        self,
        system: str,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        on_text: Callable[[str], None] | None = None,
    ) -> Message:
        if not self.streams:
            return parse_response(self.http.post("/v1/messages", self.body(system, messages, tools)))
        reader = _Stream(on_text)
        data = self.http.stream("/v1/messages", self.body(system, messages, tools, stream=True), reader.handle)
        return reader.message() if data is None else unstreamed(parse_response(data), on_text)

    def body(self, system: str, messages: Sequence[Message], tools: Sequence[Tool], *, stream: bool = False) -> str:
        """The request as JSON text. Tool-use ``input`` must be the stored arguments text itself, so that
        what the model produced goes back byte for byte instead of through a dict, and json.dumps cannot
        embed raw JSON: the messages are written from encoded pieces, joined once, and put in front of
        the rest of the body, which json.dumps writes."""
        head: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens}
        if stream:
            head["stream"] = True
        if system:
            head["system"] = system
        if tools:
            head["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters} for t in tools
            ]
        head.update(self.extra)
        rest = json.dumps(head)
        if "messages" in head:  # extra replaced them
            return rest
        return '{"messages": ' + _messages(messages) + ", " + rest[1:]

    def close(self) -> None:
        self.http.close()


def _messages(messages: Sequence[Message]) -> str:
    """The JSON array of messages, neighbours of one role merged: the API wants user and assistant to
    alternate, and a steer or a tool result may follow a user message."""
    return "[" + ", ".join(
        '{"role": "' + role + '", "content": [' + ", ".join(_block(c) for m in group for c in m.content) + "]}"
        for role, group in groupby(messages, key=attrgetter("role"))
    ) + "]"


def _block(c: Content) -> str:
    if c.type is ContentType.TEXT:
        return '{"type": "text", "text": ' + _string(c.text) + "}"
    if c.type is ContentType.COMPACTION:
        return '{"type": "text", "text": ' + _string(summary_text(c)) + "}"
    if c.type is ContentType.TOOL_CALL:
        return ('{"type": "tool_use", "id": ' + _string(c.id) + ', "name": ' + _string(c.name)
                + ', "input": ' + _input(c.arguments) + "}")
    error = ', "is_error": true' if c.is_error else ""
    return ('{"type": "tool_result", "tool_use_id": ' + _string(c.tool_call_id) + ', "content": '
            + _string(c.text) + error + "}")


def _input(arguments: str) -> str:
    """The arguments text itself when it is a JSON object; otherwise ``{}``, since the API takes nothing
    else as ``input`` (the model is told what was wrong by the tool result that follows).

    One exception to byte for byte: half a surrogate pair (a model's ``"\\ud800"``, read and stored) has no
    UTF-8 form, so it goes back as that escape, the same JSON value; it can only stand inside a string."""
    if not _is_json_object(arguments):
        return "{}"
    if arguments.isascii():
        return arguments
    return arguments.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_json_object(text: str) -> bool:
    """Strict JSON: Python also reads NaN and Infinity (an Anthropic ``input`` holding 1e999 is stored as
    Infinity), and spliced into the body they would make every later request of the run a 400."""
    try:
        return isinstance(json.loads(text, parse_constant=_not_json), dict)
    except ValueError:
        return False


def _named(block: dict[str, Any]) -> bool:
    call_id, name = block.get("id"), block.get("name")
    return isinstance(call_id, str) and isinstance(name, str) and bool(call_id and name)


def parse_response(data: dict[str, Any]) -> Message:
    blocks = data.get("content")
    if not isinstance(blocks, list):
        raise malformed("no content list", data)
    content: list[Content] = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            if block["text"]:
                content.append(Content.from_text(block["text"]))
        elif kind == "tool_use":
            if not _named(block):
                raise malformed(f"content[{i}] tool_use without id or name", data)
            # The API hands input over as an object; compact JSON is the closest text to what was said.
            arguments = json.dumps(block.get("input", {}), separators=(",", ":"), ensure_ascii=False)
            content.append(Content.tool_call(block["id"], block["name"], arguments))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise malformed(f"content[{i}] is not a text or tool_use block", data)
    return reply(content, usage_of(data))


class _Stream:
    """A reply assembled from the Messages API's events: the usage of ``message_start`` updated by
    ``message_delta``'s (which holds the final counts); thinking blocks left out, as without streaming."""

    __slots__ = ("blocks", "on_text", "usage")

    def __init__(self, on_text: Callable[[str], None] | None) -> None:
        self.on_text = on_text
        self.blocks: dict[int, list[Any]] = {}  # index: [type, id, name, [pieces], input at the start]
        self.usage: dict[str, Any] = {}

    def handle(self, event: str, data: str) -> bool:
        body = stream_json(data)
        kind = body.get("type", event)
        if kind == "message_stop":
            return True
        if kind == "error":
            raise stream_error(body, data)
        if kind == "message_start":
            message = body.get("message")
            self._usage(message if isinstance(message, dict) else {})
        elif kind == "message_delta":
            self._usage(body)
        elif kind == "content_block_start":
            self._start(body)
        elif kind == "content_block_delta":
            self._delta(body)
        return False  # ping, content_block_stop, and what a later API version may add

    def _usage(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("usage"), dict):
            self.usage.update(data["usage"])

    def _start(self, body: dict[str, Any]) -> None:
        index, block = body.get("index"), body.get("content_block")
        if type(index) is not int or not isinstance(block, dict):
            raise malformed("content_block_start without an index or a content_block", body)
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            self.blocks[index] = ["text", "", "", [block["text"]] if block["text"] else [], None]
            if block["text"] and self.on_text is not None:
                self.on_text(block["text"])
        elif kind == "tool_use":
            if not _named(block):
                raise malformed(f"content block {index}: tool_use without id or name", body)
            self.blocks[index] = ["tool_use", block["id"], block["name"], [], block.get("input", {})]
        elif kind in ("thinking", "redacted_thinking"):
            self.blocks[index] = [kind, "", "", [], None]
        else:
            raise malformed(f"content block {index} is not a text or tool_use block", body)

    def _delta(self, body: dict[str, Any]) -> None:
        index, delta = body.get("index"), body.get("delta")
        block = self.blocks.get(index) if type(index) is int else None
        if block is None or not isinstance(delta, dict):
            raise malformed("content_block_delta for no started block", body)
        kind = delta.get("type")
        if block[0] == "text" and kind == "text_delta":
            text = delta.get("text")
            if not isinstance(text, str):
                raise malformed("text_delta without text", body)
            if text:
                block[3].append(text)
                if self.on_text is not None:
                    self.on_text(text)
        elif block[0] == "tool_use" and kind == "input_json_delta":
            piece = delta.get("partial_json")
            if not isinstance(piece, str):
                raise malformed("input_json_delta without partial_json", body)
            block[3].append(piece)
        # thinking_delta, signature_delta, citations_delta: nothing the transcript keeps

    def message(self) -> Message:
        content: list[Content] = []
        for index in sorted(self.blocks):
            kind, call_id, name, pieces, start = self.blocks[index]
            if kind == "text" and pieces:
                content.append(Content.from_text("".join(pieces)))
            elif kind == "tool_use":
                content.append(Content.tool_call(call_id, name, _arguments("".join(pieces), start)))
        return reply(content, usage_of({"usage": self.usage}))


def _arguments(joined: str, start: object) -> str:
    """A streamed tool call's arguments: its ``partial_json`` pieces joined, byte for byte; for a call
    with none (a tool without parameters), its ``content_block_start`` ``input`` written as
    ``parse_response`` writes ``input``."""
    if joined:
        return joined
    return json.dumps(start if start is not None else {}, separators=(",", ":"), ensure_ascii=False)
