"""Hypothesis strategies for what stores keep: contents, messages, transcripts, steers, session ids."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from agent_sessions import Content, Message, Role
from agent_sessions.validate import MAX_SESSION_ID_LENGTH

# Any Unicode a model or user can produce, NUL and astral characters included, lone surrogates too:
# a message's text is arbitrary data, and its stored form must round-trip all of it.
any_text = st.text(
    alphabet=st.characters(exclude_categories=()) | st.sampled_from(["\x00", "\ud800", "\U0001f600", '"', "\\"]),
    max_size=60,
)

session_ids = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\x00"),
    min_size=1,
    max_size=MAX_SESSION_ID_LENGTH,
)
steer_texts = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1,
                      max_size=200)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def raw_arguments(draw: st.DrawFn) -> str:
    """Tool-call arguments as a model writes them: JSON in any spacing, or not JSON at all."""
    value = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
    indent = draw(st.sampled_from([None, 0, 1, 4]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    text = json.dumps(value, indent=indent, separators=separators, ensure_ascii=draw(st.booleans()))
    return draw(st.sampled_from([text, text[: len(text) // 2], f"  {text}\n", draw(any_text)]))


ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=24)
texts = st.builds(Content.from_text, any_text)
calls = st.builds(Content.tool_call, ids, st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,20}", fullmatch=True),
                  raw_arguments())

contents = st.one_of(
    texts,
    calls,
    st.builds(Content.tool_result, ids, any_text, st.booleans()),
    st.builds(lambda text, start, span: Content.compaction(text, start, start + span), any_text,
              st.integers(0, 10**6), st.integers(1, 10**6)),
)

messages = st.builds(Message, st.sampled_from(list(Role)), st.lists(contents, max_size=4))
"""Any message on its own (its JSON form round-trips); in a transcript, see ``transcripts``."""

keys = st.one_of(st.just(""), st.text(alphabet=st.characters(exclude_characters="\x00"), min_size=1, max_size=20))
"""A user message's turn key (``Runner.turn``): mostly none."""


@st.composite
def _turn(draw: st.DrawFn) -> list[Message]:
    """A user message; or a reply, with tool calls or not, and the results of some of its calls."""
    if draw(st.booleans()):
        return [Message(Role.USER, draw(st.lists(texts, max_size=3)), key=draw(keys))]
    called = draw(st.lists(calls, max_size=3, unique_by=lambda c: c.id))
    reply = Message(Role.ASSISTANT, draw(st.permutations([*draw(st.lists(texts, max_size=2)), *called])))
    if not called or not draw(st.booleans()):
        return [reply]
    answered = draw(st.lists(st.sampled_from(called), min_size=1, unique_by=lambda c: c.id))
    results = [Content.tool_result(c.id, draw(any_text), draw(st.booleans())) for c in answered]
    return [reply, Message(Role.USER, [*results, *draw(st.lists(texts, max_size=1))])]


transcripts = st.lists(_turn(), max_size=6).map(lambda turns: [m for turn in turns for m in turn])
"""Transcripts as a run builds them: a tool result always follows the reply that made its call."""

# What a hostile caller may pass where a session id or a steer goes: SQL and JSON metacharacters, NUL,
# lone surrogates, over-long strings, and things that are not strings at all.
_metachars = st.sampled_from(["'", '"', ";", "--", "/*", "*/", "\\", "%", "_", "$", "{", "}", "\x00", "\ud800",
                              "' OR '1'='1", "'); DROP TABLE agent_sessions; --", '{"$gt": ""}', " ", "\n"])
hostile_strings = st.one_of(
    st.lists(_metachars | st.text(max_size=4), max_size=8).map("".join),
    st.text(alphabet=st.characters(exclude_categories=()), max_size=40),
    st.integers(250, 300).map(lambda n: "x" * n),
)
hostile_values = st.one_of(
    hostile_strings,
    st.none(), st.integers(), st.floats(allow_nan=True), st.binary(max_size=8), st.booleans(),
    st.lists(st.text(max_size=3), max_size=2), st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=1),
)


# Tool-call arguments a store must keep byte for byte, and which a JSON column type would rewrite.
ODD_JSON = '{"z":1,"a":[1, 2],"z":3}'

VERBATIM_ARGUMENTS = [
    ODD_JSON,  # duplicate key, unsorted, inner spacing: jsonb and MySQL JSON rewrite all three
    '  {  "a" :  1 ,"b":\t[ ]\n}  ',
    '{"text":"日本語 ünïcödé","emoji":"😀"}',
    '{"esc":"\\u00e9\\n\\t\\"quoted\\" \\\\ \\/"}',
    '{"astral":"\\ud83d\\ude00 𝄞 \U0001f9ea"}',
    '{"lone":"\\ud800"}',
    '{"big":1e400,"neg0":-0.0,"long":1.00000000000000000000001,"int":123456789012345678901234567890}',
    '{"truncated": [1, 2',
    "not json at all",
    "",
    "[1, 2, 3]",
    '{"nul":"\\u0000","raw_nul":"\x00"}',
]
