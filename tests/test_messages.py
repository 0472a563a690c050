"""The stored JSON form of a message: the text every store keeps."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import validate
from agent_sessions.errors import MessageError
from storetest import strategies

_EVERY_BLOCK = agent.Message(agent.Role.ASSISTANT, [
    agent.Content.from_text("t \ud800 \x00 \u00e9 \U0001F600\n"),
    agent.Content.tool_call("c1", "gr\u00e9p", '{"z":1,"a":[1, 2],"z":3}'),
    agent.Content.tool_result("c1", 'r "q" \\', True), agent.Content.compaction("s", 2, 5)], key="k-1")


def test_the_stored_form_is_the_same_bytes() -> None:
    """What every store keeps of a message: these bytes, as every version has written them (a transcript
    stored before reads the same, and a pointer's digest of it still matches); the model's arguments as it
    wrote them, inside a JSON string."""
    assert _EVERY_BLOCK.to_json() == (
        '{"role":"assistant","key":"k-1","content":['
        '{"type":"text","text":"t \\ud800 \\u0000 \\u00e9 \\ud83d\\ude00\\n"},'
        '{"type":"tool_call","id":"c1","name":"gr\\u00e9p","arguments":"{\\"z\\":1,\\"a\\":[1, 2],\\"z\\":3}"},'
        '{"type":"tool_result","tool_call_id":"c1","text":"r \\"q\\" \\\\","is_error":true},'
        '{"type":"compaction","text":"s","start":2,"end":5}]}')
    assert agent.Message.user("q").to_json() == '{"role":"user","content":[{"type":"text","text":"q"}]}'


@given(strategies.messages)
def test_to_json_round_trips(message: agent.Message) -> None:
    assert agent.Message.from_json(message.to_json()) == message


# -- any input: a message, or a MessageError ---------------------------------------------------------------

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
    """What a decoding gave: a MessageError and its text, or a message whose every field has its own type
    (``1`` equals ``True``, a ``Role`` its str: not enough). Any other exception fails the test."""
    try:
        m = decode()
    except MessageError as exc:
        return ("MessageError", str(exc))
    assert type(m) is agent.Message and type(m.role) is agent.Role and type(m.key) is str
    assert type(m.content) is tuple and m.usage is None
    for c in m.content:
        assert type(c.type) is agent.ContentType and type(c.is_error) is bool
        assert all(type(getattr(c, f)) is str for f in ("text", "id", "name", "arguments", "tool_call_id"))
        assert type(c.start) is int and type(c.end) is int
    return ("Message", m.to_dict())


def _decoded(data: object, text: str) -> tuple[object, ...]:
    """``from_json(text)``, which must say what ``from_dict`` says of what ``text`` decodes to."""
    outcome = _outcome(lambda: agent.Message.from_json(text))
    try:
        decoded = json.loads(text)
    except ValueError:
        assert outcome[0] == "MessageError" and str(outcome[1]).startswith("stored message is not valid JSON")
        return outcome
    assert outcome == _outcome(lambda: agent.Message.from_dict(decoded))
    return outcome


@settings(max_examples=500)
@given(_message_data(), st.sampled_from(["", "", "", " ", "\n", "\ufeff"]),
       st.sampled_from(["", "", "", " ", "x", "}"]), st.booleans())
def test_any_input_is_a_message_or_a_message_error(data: object, before: str, after: str, ascii: bool) -> None:
    """from_json and from_dict on anything (a stored form changed in a few places, any JSON value, text around
    it): a message of well-typed fields, or a MessageError saying what is wrong; never another exception."""
    _decoded(data, before + json.dumps(data, separators=(",", ":"), ensure_ascii=ascii) + after)


@pytest.mark.parametrize("base", [_EVERY_BLOCK, agent.Message.user("q")], ids=["every-block", "plain"])
def test_each_single_change_is_refused_as_before(base: agent.Message) -> None:
    """Every field of every kind of block (and of the message) replaced by each of the usual wrong values,
    removed, or joined by an extra field: each decodes to a message of well-typed fields or is refused with a
    MessageError, and all of them as before (the digest of their outcomes, errors' texts included, is the one
    an earlier version gave). Exhaustive, where the property above samples."""
    outcomes = []
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
                outcomes.append(_decoded(data, json.dumps(data, separators=(",", ":"))))
    assert len(outcomes) > len(_SUBSTITUTES) * 3
    assert hashlib.sha256(repr(outcomes).encode()).hexdigest() == _SINGLE_CHANGES[base is _EVERY_BLOCK]


_SINGLE_CHANGES = {True: "c4358ce6fca2a4edcbfbee1aac1d72ee0fb2668d744d1c7dc3b9cd3788b2b8a9",
                   False: "86dd6584ce6430aa228403b13fb97b68ac80baf55382b7f1acb8a39aa5c83c96"}
_DELETE = object()


@pytest.mark.parametrize(("data", "error"), [
    ([], "a message must be a JSON object, got list"),
    ({"role": "user", "content": [], "usage": {}}, "message has unknown fields ['usage']"),
    ({"role": "system", "content": []}, "Message.role must be one of ['user', 'assistant'], got 'system'"),
    ({"role": "user", "content": {}}, "message content must be a JSON array"),
    ({"role": "user", "key": "", "content": []}, "message key must be a non-empty string, got ''"),
    ({"role": "user", "key": "k" * 256, "content": []}, "Message.key must be a str of at most 255 characters"),
    ({"role": "user", "content": [{"type": "image"}]}, "unknown content type 'image'"),
    ({"role": "user", "content": [{"type": "text", "text": 1}]}, "Content.text must be a str, got int"),
    ({"role": "user", "content": [{"type": "tool_result", "tool_call_id": "c", "text": "", "is_error": 1}]},
     "Content.is_error must be a bool, got int"),
    ({"role": "user", "content": [{"type": "text", "text": "", "id": "c"}]}, "text content has unknown fields"),
    ({"role": "user", "content": [{"type": "tool_call", "id": "", "name": "n", "arguments": ""}]},
     "tool_call content needs a non-empty id"),
    ({"role": "user", "content": [{"type": "compaction", "text": "", "start": True, "end": 2}]},
     "Content.start must be an int >= 0, got True"),
    ({"role": "user", "content": [{"type": "compaction", "text": "", "start": 3, "end": 2}]},
     "a compaction's range [start, end) must not be empty"),
])
def test_hostile_input_is_refused_with_a_message_error(data: object, error: str) -> None:
    for decode in (lambda: agent.Message.from_dict(data), lambda: agent.Message.from_json(json.dumps(data))):  # type: ignore[arg-type]
        with pytest.raises(MessageError) as caught:
            decode()
        assert str(caught.value).startswith(error)
    with pytest.raises(MessageError, match="not valid JSON"):
        agent.Message.from_json('{"role":"user","content":[]} x')


@given(strategies.messages, st.sampled_from(["", "k-1", "k" * 255]))
def test_a_stored_message_reads_back_with_its_stored_text(message: agent.Message, key: str) -> None:
    """What to_json writes reads back as the message it came from, keeping that very text as its stored form
    (what a pointer's digest is taken of)."""
    stored = agent.Message(message.role, message.content, key=key).to_json()
    read = agent.Message.from_json(stored)
    assert read == agent.Message(message.role, message.content, key=key)
    assert read.to_json() is stored


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
