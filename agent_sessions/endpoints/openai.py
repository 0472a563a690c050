"""OpenAI-compatible ``/chat/completions`` with tools: OpenAI, vLLM, llama.cpp server, Ollama."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import requests

from ..messages import Content, ContentType, Message, Role
from ..tools import Tool
from ._http import HTTPClient, malformed, usage_of


class OpenAIChat:
    """``base_url`` includes the version prefix, e.g. ``https://api.openai.com/v1`` or
    ``http://127.0.0.1:8080/v1``. ``extra`` is merged into every request body (temperature, seed, ...).

    ``headers`` go with every request and win over the endpoint's own (an auth gateway's ``authorization``).
    ``session``: your own ``requests.Session`` (proxies, certificates, auth), used by every thread; its
    thread safety is then yours. Without it each thread gets one of the endpoint's (see HTTPClient)."""

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
    ) -> None:
        auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = HTTPClient(
            base_url, {**auth, **(headers or {})}, timeout=timeout, max_retries=max_retries, backoff=backoff,
            max_backoff=max_backoff, session=session,
        )
        self.model = model
        self.extra = dict(extra or {})

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[Tool]) -> Message:
        return parse_response(self.http.post("/chat/completions", json.dumps(self.body(system, messages, tools))))

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
    texts = [c.text for c in message.content if c.type is ContentType.TEXT]
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
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise malformed(f"tool_calls[{i}] has no function name", data)
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):  # a few servers send an object; keep it as compact JSON
            arguments = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        call_id = call.get("id") or f"call_{i}"
        if not isinstance(call_id, str):
            raise malformed(f"tool_calls[{i}].id is not a string", data)
        content.append(Content.tool_call(call_id, function["name"], arguments))
    if not content:
        content.append(Content.from_text(""))
    return Message(Role.ASSISTANT, content, usage=usage_of(data))
