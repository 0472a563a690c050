"""The stored JSON form of a message: the text every store keeps."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import messages, validate
from agent_sessions.errors import MessageError
from storetest import strategies


@given(strategies.messages)
def test_to_json_is_json_dumps_of_to_dict(message: agent.Message) -> None:
    """to_json writes the text itself (it is on every step's path); it must be exactly what json.dumps
    gives, so transcripts stored before and after read the same."""
    expected = json.dumps(message.to_dict(), separators=(",", ":"))
    assert agent.Message(message.role, message.content).to_json() == expected
    assert expected.isascii()


@given(strategies.messages)
def test_to_json_round_trips(message: agent.Message) -> None:
    assert agent.Message.from_json(message.to_json()) == message


# -- the fast decoding path agrees with the checked one -------------------------------------------------------

_NAMES = ("role", "key", "content", "type", "text", "id", "name", "arguments", "tool_call_id", "is_error", "start",
          "end", "usage")
_SUBSTITUTES = ["", "x", "\x00", "k" * 256, 0, 1, 1.0, True, False, None, [], {}, "user", "assistant", "text",
                "tool_call", "tool_result", "compaction", -1, 2**63, [{"type": "text", "text": "t"}]]
"""What a field's value becomes: empty, of another type, another role or content type, too long."""
_VALUES = (st.sampled_from(_SUBSTITUTES) | strategies.json_values).map(copy.deepcopy)
"""A copy each time: the example changes what it was given in place (a block ``{}`` then gets a field), and a
substitute shared between examples made Hypothesis draw differently on replaying one (FlakyStrategyDefinition)."""


def _dicts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The message's object and its blocks' (those still objects)."""
    blocks = data.get("content")
    return [data, *(b for b in blocks if isinstance(b, dict))] if isinstance(blocks, list) else [data]


@st.composite
def _message_data(draw: st.DrawFn) -> object:
    """A message's JSON form, valid or changed in a few places: a field's value replaced, a field added or
    removed, a block replaced; or any JSON value."""
    if draw(st.integers(0, 9)) == 0:
        return draw(strategies.json_values)
    data = draw(strategies.messages).to_dict()
    if draw(st.booleans()):
        data["key"] = draw(st.sampled_from(["k-1", "", "a\x00b", "k" * 255, "k" * 256]) | strategies.any_text)
    for _ in range(draw(st.integers(0, 3))):
        places = [(d, k) for d in _dicts(data) for k in sorted(d)]
        action = draw(st.sampled_from(["change", "change", "add", "delete", "block"]))
        if action == "change" and places:
            target, name = draw(st.sampled_from(places))
            target[name] = draw(_VALUES)
        elif action == "add":
            target = draw(st.sampled_from(_dicts(data)))
            target[draw(st.sampled_from(_NAMES) | strategies.any_text)] = draw(_VALUES)
        elif action == "delete" and places:
            target, name = draw(st.sampled_from(places))
            del target[name]
        elif action == "block" and isinstance(data.get("content"), list) and data["content"]:
            data["content"][draw(st.integers(0, len(data["content"]) - 1))] = draw(_VALUES)
    return data


def _outcome(decode: Callable[[], agent.Message]) -> tuple[object, ...]:
    """What a decoding gave, down to each field's type (``1`` equals ``True``; a ``Role`` equals its str)."""
    try:
        m = decode()
    except MessageError as exc:
        return ("MessageError", str(exc))
    blocks = tuple(
        tuple((getattr(c, f), type(getattr(c, f))) for f in ("type", *_CONTENT_FIELDS)) for c in m.content
    )
    return (type(m), m.role, type(m.role), m.key, type(m.key), type(m.content), m.usage, m._json, blocks)


_CONTENT_FIELDS = ("text", "id", "name", "arguments", "tool_call_id", "is_error", "start", "end")


def _agree(data: object, text: str) -> None:
    assert _outcome(lambda: agent.Message.from_json(text)) == _outcome(lambda: agent.Message._checked_json(text))
    assert _outcome(lambda: agent.Message.from_dict(data)) == _outcome(  # type: ignore[arg-type]
        lambda: agent.Message._checked(data))  # type: ignore[arg-type]


@settings(max_examples=500)
@given(_message_data(), st.sampled_from(["", "", "", " ", "\n", "\ufeff"]),
       st.sampled_from(["", "", "", " ", "x", "}"]), st.booleans())
def test_fast_decoding_agrees_with_the_checks(data: object, before: str, after: str, ascii: bool) -> None:
    """from_json and from_dict take a fast path on the shapes to_json writes: on anything, they give what
    the full checks give (the same message, fields of the same types, the same stored text), or the same
    MessageError."""
    _agree(data, before + json.dumps(data, separators=(",", ":"), ensure_ascii=ascii) + after)


_EVERY_BLOCK = agent.Message(agent.Role.ASSISTANT, [
    agent.Content.from_text("t"), agent.Content.tool_call("c1", "grep", "{}"),
    agent.Content.tool_result("c1", "r", True), agent.Content.compaction("s", 2, 5)], key="k-1")


@pytest.mark.parametrize("base", [_EVERY_BLOCK, agent.Message.user("q")], ids=["every-block", "plain"])
def test_each_single_change_decodes_as_the_checks_say(base: agent.Message) -> None:
    """Every field of every kind of block (and of the message) replaced by each of the usual wrong values,
    removed, or joined by an extra field: each a single change the fast path must notice, or decode as
    the checks do. Exhaustive, where the property above samples."""
    cases = 0
    for place in range(len(_dicts(base.to_dict()))):
        names = sorted(_dicts(base.to_dict())[place])
        for name in [*names, "extra"]:
            for value in [*_SUBSTITUTES, _DELETE]:
                data = base.to_dict()
                target = _dicts(data)[place]
                if value is _DELETE:
                    target.pop(name, None)
                else:
                    target[name] = value
                _agree(data, json.dumps(data, separators=(",", ":")))
                cases += 1
    assert cases > len(_SUBSTITUTES) * 3


_DELETE = object()


@given(strategies.messages, st.sampled_from(["", "k-1", "k" * 255]))
def test_stored_messages_take_the_fast_path(message: agent.Message, key: str) -> None:
    """What to_json writes is what the fast path recognises (else it would never run), and it builds the
    message to_json came from."""
    stored = agent.Message(message.role, message.content, key=key).to_json()
    fast = messages._from_text(stored)
    assert fast is not None
    assert _outcome(lambda: fast) == _outcome(lambda: agent.Message._checked_json(stored))
    assert fast.to_json() is stored


# -- the prefix check of every save (validate.is_extension, compared in C without a copy) ------------------------


_Case = tuple[tuple[agent.Message, ...], tuple[object, ...]]


@st.composite
def _prefix_and_items(draw: st.DrawFn) -> _Case:
    """A transcript and a list that may extend it: the same objects, equal copies, other messages, other
    objects (an int, None, a str), cut short or made longer."""
    prefix = tuple(draw(st.lists(strategies.messages, max_size=6)))
    same = st.sampled_from(["same", "copy", "other", "foreign"])
    items: list[object] = []
    for m in prefix[: draw(st.integers(0, len(prefix)))]:
        how = draw(same)
        items.append(m if how == "same" else agent.Message.from_json(m.to_json()) if how == "copy"
                     else draw(strategies.messages) if how == "other" else draw(st.sampled_from([0, None, "x"])))
    items += draw(st.lists(strategies.messages, max_size=3))
    return prefix, tuple(items)


@settings(max_examples=500)
@given(_prefix_and_items())
def test_is_extension_is_the_prefix_compared_by_equality(case: _Case) -> None:
    prefix, items = case
    expected = items[: len(prefix)] == prefix
    assert validate.is_extension(prefix, items) is expected
    assert validate.is_extension(list(prefix), items) is expected  # the memory store passes a list
    if all(isinstance(m, agent.Message) for m in items):
        try:
            got, start = validate.messages_after(list(items), prefix)
        except MessageError:  # a tool result that answers no call: refused however the prefix compares
            return
        assert got == items and start == (len(prefix) if expected else 0)
