"""Anthropic ``/v1/messages`` with ``tool_use`` / ``tool_result`` blocks."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from itertools import groupby
from json.encoder import encode_basestring_ascii as _string
from operator import attrgetter
from typing import Any

import requests

from ..messages import Content, ContentType, Message, Role
from ..tools import Tool
from ._http import HTTPClient, malformed, usage_of

API_VERSION = "2023-06-01"


class AnthropicMessages:
    """``base_url`` is the host, e.g. ``https://api.anthropic.com``; the path ``/v1/messages`` is added.
    ``extra`` is merged into every request body.

    ``headers`` go with every request and win over the endpoint's own (an auth gateway's ``x-api-key``).
    ``session``: your own ``requests.Session`` (proxies, certificates, auth), used by every thread; its
    thread safety is then yours. Without it each thread gets one of the endpoint's (see HTTPClient)."""

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

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        return parse_response(self.http.post("/v1/messages", self.body(system, messages, tools)))

    def body(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> str:
        """The request as JSON text. Tool-use ``input`` must be the stored arguments text itself, so that
        what the model produced goes back byte for byte instead of through a dict, and json.dumps cannot
        embed raw JSON: the messages are written from encoded pieces, joined once, and put in front of
        the rest of the body, which json.dumps writes."""
        head: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens}
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


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


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
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise malformed(f"content[{i}] tool_use without id or name", data)
            # The API hands input over as an object; compact JSON is the closest text to what was said.
            arguments = json.dumps(block.get("input", {}), separators=(",", ":"), ensure_ascii=False)
            content.append(Content.tool_call(block["id"], block["name"], arguments))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise malformed(f"content[{i}] is not a text or tool_use block", data)
    if not content:
        content.append(Content.from_text(""))
    return Message(Role.ASSISTANT, content, usage=usage_of(data))
