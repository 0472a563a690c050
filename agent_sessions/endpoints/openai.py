"""OpenAI-compatible ``/chat/completions`` with tools: OpenAI, vLLM, llama.cpp server, Ollama."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import requests

from ..errors import EndpointError
from ..messages import Content, ContentType, Message, Role, made_up_call_id, summary_text
from ..tools import Tool
from ._http import HTTPClient, malformed, reply, stream_error, stream_json, unstreamed, usage_of


class OpenAIChat:
    """``base_url`` includes the version prefix, e.g. ``https://api.openai.com/v1``. ``extra`` is merged into
    every request body (temperature, seed, ...); ``headers`` win over the endpoint's own; ``session``: your
    own ``requests.Session``, used by every thread. ``stream=True`` asks for server-sent events and hands
    each piece of text to ``complete``'s ``on_text``; the reply is the Message the same content gives
    without streaming (a tool call's arguments are its deltas joined, byte for byte)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        max_retries: int = 2,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        extra: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        session: requests.Session | None = None,
        stream: bool = False,
    ) -> None:
        auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = HTTPClient(
            base_url, {**auth, **(headers or {})}, timeout=timeout, max_retries=max_retries, backoff=backoff,
            max_backoff=max_backoff, session=session,
        )
        self.model = model
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
        body = self.body(system, messages, tools)
        if not self.streams:
            return parse_response(self.http.post("/chat/completions", json.dumps(body)))
        body = {"stream": True, "stream_options": {"include_usage": True}, **body}
        reader = _Stream(on_text)
        data = self.http.stream("/chat/completions", json.dumps(body), reader.handle)
        return reader.message() if data is None else unstreamed(parse_response(data), on_text)

    def body(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> dict[str, Any]:
        wire: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        for message in messages:
            wire.extend(_to_wire(message))
        body: dict[str, Any] = {"model": self.model, "messages": wire}
        if tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
                for t in tools
            ]
            body["tool_choice"] = "auto"  # llama.cpp's server ignores tools unless this is sent
        body.update(self.extra)
        return body

    def close(self) -> None:
        self.http.close()


def _to_wire(message: Message) -> list[dict[str, Any]]:
    texts = [c.text if c.type is ContentType.TEXT else summary_text(c) for c in message.content
             if c.type is ContentType.TEXT or c.type is ContentType.COMPACTION]
    if message.role is Role.ASSISTANT:
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}  # "", never null: llama.cpp
        calls = message.tool_calls
        if calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        return [out]
    # OpenAI has no is_error flag on a tool message; the text says it instead.
    wire: list[dict[str, Any]] = [
        {
            "role": "tool",
            "tool_call_id": c.tool_call_id,
            "content": f"Error: {c.text}" if c.is_error else c.text,
        }
        for c in message.content
        if c.type is ContentType.TOOL_RESULT
    ]
    if texts or not wire:
        wire.append({"role": "user", "content": "\n\n".join(texts)})
    return wire


def parse_response(data: dict[str, Any]) -> Message:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed("no choices[0]", data)
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise malformed("choices[0] has no message object", data)
    text = message.get("content")
    if text is not None and not isinstance(text, str):
        raise malformed("message.content is neither a string nor null", data)
    content: list[Content] = []
    if text:
        content.append(Content.from_text(text))
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise malformed("message.tool_calls is not a list", data)
    for i, call in enumerate(raw_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise malformed(f"tool_calls[{i}] has no function name", data)
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):  # a few servers send an object; keep it as compact JSON
            arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        call_id = call.get("id") or made_up_call_id(i)
        if not isinstance(call_id, str):
            raise malformed(f"tool_calls[{i}].id is not a string", data)
        content.append(Content.tool_call(call_id, function["name"], arguments))
    return reply(content, usage_of(data))


class _Stream:
    """A reply assembled from ``chat.completion.chunk`` events: each tool call's pieces are gathered by its
    ``index``, its id and name from the first delta that has them."""

    __slots__ = ("calls", "on_text", "text", "usage")

    def __init__(self, on_text: Callable[[str], None] | None) -> None:
        self.on_text = on_text
        self.text: list[str] = []
        self.calls: dict[int, list[Any]] = {}  # index: [id, name, [argument pieces]]
        self.usage: dict[str, int] | None = None

    def handle(self, event: str, data: str) -> bool:
        if data.strip() == "[DONE]":
            return True
        chunk = stream_json(data)
        if "error" in chunk or chunk.get("object") == "error":
            raise stream_error(chunk, data)
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage_of(chunk)
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise malformed("a chunk's choices is not a list", chunk)
        for choice in choices:
            if not isinstance(choice, dict):
                raise malformed("a chunk's choice is not an object", chunk)
            if choice.get("index", 0) != 0:
                continue  # n > 1: the reply is choice 0, as without streaming
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise malformed("a chunk's delta is not an object", chunk)
            text = delta.get("content")
            if text is not None and not isinstance(text, str):
                raise malformed("delta.content is neither a string nor null", chunk)
            if text:
                self.text.append(text)
                if self.on_text is not None:
                    self.on_text(text)
            self._calls(delta.get("tool_calls") or [], chunk)
        return False

    def _calls(self, deltas: object, chunk: dict[str, Any]) -> None:
        if not isinstance(deltas, list):
            raise malformed("delta.tool_calls is not a list", chunk)
        for delta in deltas:
            if not isinstance(delta, dict):
                raise malformed("a tool call delta is not an object", chunk)
            index = delta.get("index")
            call_id = delta.get("id")
            if type(index) is not int:  # a server that leaves index out: a new id starts a new call
                known = [c[0] for c in self.calls.values()]
                fresh = not self.calls or (isinstance(call_id, str) and call_id and call_id not in known)
                index = len(self.calls) if fresh else max(self.calls)
            call = self.calls.setdefault(index, ["", "", []])
            function = delta.get("function") or {}
            if not isinstance(function, dict):
                raise malformed("a tool call delta's function is not an object", chunk)
            name = function.get("name")
            for slot, value in ((0, call_id), (1, name)):
                if value is not None and not isinstance(value, str):
                    raise malformed("a tool call delta's id or name is not a string", chunk)
                if value and not call[slot]:
                    call[slot] = value
            arguments = function.get("arguments")
            if isinstance(arguments, (dict, list)):  # as without streaming: an object is kept as compact JSON
                arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
            if arguments is not None and not isinstance(arguments, str):
                raise malformed("a tool call delta's arguments is not a string", chunk)
            if arguments:
                call[2].append(arguments)

    def message(self) -> Message:
        content: list[Content] = []
        text = "".join(self.text)
        if text:
            content.append(Content.from_text(text))
        for i, index in enumerate(sorted(self.calls)):
            call_id, name, pieces = self.calls[index]
            if not name:
                raise EndpointError(f"malformed stream: tool call {index} has no function name", status=200)
            content.append(Content.tool_call(call_id or made_up_call_id(i), name, "".join(pieces)))
        return reply(content, self.usage)
