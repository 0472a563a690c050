"""The transcript's vocabulary, and the one JSON form every store keeps.

Messages are immutable so a store may remember which ones it has already written (by identity) and
append only the new ones, and so a transcript handed to a store can never change under it.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import MessageError

log = logging.getLogger(__name__)


class Role(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"


class ContentType(StrEnum):
    TEXT = "text"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    COMPACTION = "compaction"
    """A summary of the transcript's messages ``[start, end)``, appended by a context policy
    (docs/runs/context.md): a request sends it in their place."""


def summary_text(c: Content) -> str:
    """What a request says for a compaction record: its summary, said to be one (sent as a user's text)."""
    return f"A summary of the conversation before this point:\n\n{c.text}"


# The fields each content type uses; the others must stay at their defaults so that the JSON form,
# which writes only these, gives back an equal Content.
_FIELDS: dict[ContentType, tuple[str, ...]] = {
    ContentType.TEXT: ("text",),
    ContentType.TOOL_CALL: ("id", "name", "arguments"),
    ContentType.TOOL_RESULT: ("tool_call_id", "text", "is_error"),
    ContentType.COMPACTION: ("text", "start", "end"),
}
_REQUIRED_NON_EMPTY: dict[ContentType, tuple[str, ...]] = {
    ContentType.TEXT: (),
    ContentType.TOOL_CALL: ("id", "name"),
    ContentType.TOOL_RESULT: ("tool_call_id",),
    ContentType.COMPACTION: ("end",),
}
_KEYS: dict[ContentType, frozenset[str]] = {kind: frozenset({"type", *fields}) for kind, fields in _FIELDS.items()}
"""What a content block's JSON form may hold, per type."""
_TYPES: dict[object, ContentType] = {kind.value: kind for kind in ContentType}
_ROLES: dict[object, Role] = {role.value: role for role in Role}
"""Looked up by value: calling an Enum to convert costs more than the rest of a block's checks."""
_STR_FIELDS = ("text", "id", "name", "arguments", "tool_call_id")
_INT_FIELDS = ("start", "end")
MAX_KEY_LENGTH = 255


@dataclass(frozen=True, slots=True)
class Content:
    """One block of a message: text, a tool call, or a tool result.

    ``arguments`` is the raw JSON text the model produced, kept as a ``str`` and never re-encoded: a model
    can emit duplicate keys, odd spacing or even invalid JSON, and the transcript must say what it said.
    """

    type: ContentType
    text: str = ""
    id: str = ""
    name: str = ""
    arguments: str = ""
    tool_call_id: str = ""
    is_error: bool = False
    start: int = 0
    end: int = 0
    """A compaction's range: it summarises the transcript's messages ``[start, end)``."""

    def __post_init__(self) -> None:
        kind = _TYPES.get(self.type) if isinstance(self.type, str) else None
        if kind is None:
            raise MessageError(f"Content.type must be one of {[t.value for t in ContentType]}, got {self.type!r}")
        object.__setattr__(self, "type", kind)
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise MessageError(f"Content.{name} must be a str, got {type(value).__name__}")
        if not isinstance(self.is_error, bool):
            raise MessageError(f"Content.is_error must be a bool, got {type(self.is_error).__name__}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise MessageError(f"Content.{name} must be an int >= 0, got {value!r}")
        if self.end and self.start >= self.end:
            raise MessageError(f"a compaction's range [start, end) must not be empty, got [{self.start}, {self.end})")
        used = _FIELDS[kind]
        for name in (*_STR_FIELDS, "is_error", *_INT_FIELDS):
            if name not in used and getattr(self, name):
                raise MessageError(f"Content.{name} is not used by {kind.value} content")
        for name in _REQUIRED_NON_EMPTY[kind]:
            if not getattr(self, name):
                raise MessageError(f"{kind.value} content needs a non-empty {name}")

    @classmethod
    def from_text(cls, text: str) -> Content:
        return cls(ContentType.TEXT, text=text)

    @classmethod
    def tool_call(cls, id: str, name: str, arguments: str) -> Content:
        return cls(ContentType.TOOL_CALL, id=id, name=name, arguments=arguments)

    @classmethod
    def tool_result(cls, tool_call_id: str, text: str, is_error: bool = False) -> Content:
        return cls(ContentType.TOOL_RESULT, tool_call_id=tool_call_id, text=text, is_error=is_error)

    @classmethod
    def compaction(cls, summary: str, start: int, end: int) -> Content:
        """A summary of the transcript's messages ``[start, end)``, which requests send in their place."""
        return cls(ContentType.COMPACTION, text=summary, start=start, end=end)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type.value}
        for name in _FIELDS[self.type]:
            out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Content:
        if not isinstance(data, Mapping):
            raise MessageError(f"content must be a JSON object, got {type(data).__name__}")
        kind = _TYPES.get(str(data.get("type")))
        if kind is None:
            raise MessageError(f"unknown content type {data.get('type')!r}")
        if not _KEYS[kind].issuperset(data):
            raise MessageError(f"{kind.value} content has unknown fields {sorted(set(data) - _KEYS[kind])}")
        return cls(kind, **{k: v for k, v in data.items() if k != "type"})


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of the transcript. ``content`` may be given as any iterable; it is kept as a tuple."""

    role: Role
    content: tuple[Content, ...] = ()
    key: str = ""
    """A caller's idempotency key for the message ("" for none): ``Runner.turn`` appends a keyed user
    message only if no message with that key is stored, so a repeated task does not ask twice. Stored
    with the message; never sent to a model."""
    steer: bool = field(default=False, compare=False)
    """A user message that came as a steer (``Run.steer``, ``session.steer``, taken before a model request):
    it joins the turn in progress, and begins none of its own. Stored with the message; not compared (how a
    message came is not what it says)."""
    usage: Mapping[str, int] | None = field(default=None, repr=False, compare=False, hash=False)
    """The token counts the provider reported for the request that produced this reply (its own field
    names), or ``None``. Not part of the message: not compared, not stored."""
    _json: str | None = field(default=None, init=False, repr=False, compare=False, hash=False)
    _origin: tuple[str, object, int] | None = field(default=None, init=False, repr=False, compare=False, hash=False)
    """Where a store read this message from: (session, the session's incarnation, its index there or -1),
    set by ``read_from``."""

    def __init__(self, role: Role | str, content: Iterable[Content] = (), *, key: str = "", steer: bool = False,
                 usage: Mapping[str, int] | None = None) -> None:
        checked = _ROLES.get(role) if isinstance(role, str) else None
        if checked is None:
            raise MessageError(f"Message.role must be one of {[r.value for r in Role]}, got {role!r}")
        object.__setattr__(self, "role", checked)
        if isinstance(content, (str, bytes, Content)):
            raise MessageError("Message.content must be a list of Content, not a single value")
        items = tuple(content)
        for i, item in enumerate(items):
            if not isinstance(item, Content):
                raise MessageError(f"Message.content[{i}] must be a Content, got {type(item).__name__}")
        object.__setattr__(self, "content", items)
        if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH or "\x00" in key:
            raise MessageError(f"Message.key must be a str of at most {MAX_KEY_LENGTH} characters without NUL, "
                               f"got {key!r}")
        object.__setattr__(self, "key", key)
        if type(steer) is not bool or (steer and checked is not Role.USER):
            raise MessageError(f"Message.steer must be a bool, and True only for a user message, got {steer!r}")
        object.__setattr__(self, "steer", steer)
        object.__setattr__(self, "usage", usage)
        object.__setattr__(self, "_json", None)
        object.__setattr__(self, "_origin", None)

    @classmethod
    def user(cls, text: str, *, key: str = "", steer: bool = False) -> Message:
        return cls(Role.USER, [Content.from_text(text)], key=key, steer=steer)

    @classmethod
    def assistant(cls, text: str) -> Message:
        return cls(Role.ASSISTANT, [Content.from_text(text)])

    @property
    def text(self) -> str:
        """The message's text blocks joined: the answer, for an assistant message."""
        return "".join(c.text for c in self.content if c.type is ContentType.TEXT)

    @property
    def tool_calls(self) -> tuple[Content, ...]:
        return tuple(c for c in self.content if c.type is ContentType.TOOL_CALL)

    def to_dict(self) -> dict[str, Any]:
        head: dict[str, Any] = {"role": self.role.value, "key": self.key} if self.key else {"role": self.role.value}
        if self.steer:
            head["steer"] = True
        return {**head, "content": [c.to_dict() for c in self.content]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Message:
        """Check ``data`` (the JSON form, decoded) and build the message; each failure its own
        ``MessageError``."""
        if not isinstance(data, Mapping):
            raise MessageError(f"a message must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"role", "key", "steer", "content"}
        if unknown:
            raise MessageError(f"message has unknown fields {sorted(unknown)}")
        content = data.get("content", [])
        if not isinstance(content, list):
            raise MessageError("message content must be a JSON array")
        key = data.get("key", "")
        if not isinstance(key, str) or ("key" in data and not key):
            raise MessageError(f"message key must be a non-empty string, got {key!r}")
        steer = data.get("steer", False)
        if "steer" in data and steer is not True:
            raise MessageError(f"message steer must be true when present, got {steer!r}")
        return cls(data.get("role", ""), [Content.from_dict(c) for c in content], key=key, steer=steer)

    def to_json(self) -> str:
        """The stored form: ``to_dict`` as compact JSON. ASCII-only on purpose: it survives any column charset,
        and lone surrogates or NUL in a text round-trip as escapes instead of failing inside a driver. A
        message read from a store keeps the text it was read from (``from_json``), byte for byte."""
        cached = self._json
        if cached is None:
            cached = json.dumps(self.to_dict(), separators=(",", ":"))
            object.__setattr__(self, "_json", cached)
        return cached

    @classmethod
    def from_json(cls, text: str | bytes) -> Message:
        """The message ``to_json`` wrote, checked as ``from_dict`` checks."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise MessageError(f"stored message is not valid JSON: {exc}") from exc
        message = cls.from_dict(data)
        if isinstance(text, str):
            object.__setattr__(message, "_json", text)
        return message


# -- where a transcript was read from ------------------------------------------------------------------------
#
# An empty transcript is a prefix of anything: a run holding messages read just before a ``delete`` would
# pass its first write's compare-and-swap and write the erased conversation back. So a store marks what it
# reads with the session's *incarnation* (a session deleted and begun anew has another), and a leased run's
# save checks the mark. Messages made by the caller carry none: a new conversation under the id is written.


def read_from(msgs: Iterable[Message], session: str, incarnation: object, start: int | None = None) -> None:
    """Mark ``msgs`` as read from ``session`` in its incarnation ``incarnation`` (the mark is not part of the
    message: not compared, not stored); ``start``: the index of the first of them, when the store says."""
    for i, m in enumerate(msgs):
        object.__setattr__(m, "_origin", (session, incarnation, -1 if start is None else start + i))


def origin(message: Message) -> tuple[str, object, int] | None:
    """Where ``message`` was read from (``read_from``), or ``None``."""
    return message._origin


def incarnations_read(msgs: Iterable[Message], session: str) -> set[object]:
    """The incarnations of ``session`` that messages of ``msgs`` were read from (empty: none was read from
    it)."""
    return {o[1] for m in msgs if (o := m._origin) is not None and o[0] == session}


class Tail(list[Message]):
    """The end of a stored transcript: its messages from index ``start`` on, read without those before
    (``session.messages(recent=True)``: from the newest compaction record's range on). A run given one
    goes on from there: its indexes (a steer's, a journal's, a record's range) stay those of the stored
    transcript, and its saves append after the stored messages it was not given (docs/runs/context.md)."""

    __slots__ = ("start",)

    def __init__(self, msgs: Iterable[Message] = (), start: int = 0) -> None:
        super().__init__(msgs)
        self.start = start

    def __repr__(self) -> str:
        return f"Tail(start={self.start}, {super().__repr__()})"

    def __add__(self, other: Iterable[Message]) -> Tail:  # type: ignore[override]
        """``tail + [message]`` is a Tail still (unpacking, ``[*tail, message]``, makes a plain list: the
        whole transcript, which a save then finds does not extend the stored one)."""
        return Tail([*self, *other], self.start)


def start_of(msgs: Sequence[Message]) -> int:
    """The index in the stored transcript of ``msgs[0]``: a ``Tail``'s ``start``, else 0."""
    return msgs.start if isinstance(msgs, Tail) else 0


def unanswered(transcript: Sequence[Message]) -> bool:
    """Does the transcript end with tool calls that have no results yet?"""
    return bool(transcript) and transcript[-1].role is Role.ASSISTANT and bool(transcript[-1].tool_calls)


def turn_open(transcript: Sequence[Message]) -> bool:
    """Does the transcript leave its turn open: not empty, and not ending with an answer (a reply of the
    model without tool calls)? What a store's save records as the session's ``open_since``."""
    if not transcript:
        return False
    last = transcript[-1]
    return not (last.role is Role.ASSISTANT and not last.tool_calls)


def orphaned_tool_calls(msgs: Sequence[Message]) -> list[Content]:
    """Tool calls with no result anywhere after them: a transcript holding one makes every later request
    fail at the provider (a 400), so the loop never stores one."""
    answered: set[str] = set()
    orphans: list[Content] = []
    for m in reversed(msgs):
        for c in m.content:
            if c.type is ContentType.TOOL_RESULT:
                answered.add(c.tool_call_id)
            elif c.type is ContentType.TOOL_CALL and c.id not in answered:
                orphans.append(c)
    return orphans[::-1]


def made_up_call_id(index: int) -> str:
    """An id the library gives the tool call at ``index`` of a reply that came without one, or with an earlier
    call's: unique, since results, journals and approval decisions find their call by id."""
    return f"call_{index}_{secrets.token_hex(8)}"


def distinct_call_ids(reply: Message) -> Message:
    """``reply`` with every tool call's id its own (a repeated one made up), or ``reply`` itself: two calls
    sharing an id would share one result and one decision. The loop applies it to each reply as it arrives."""
    seen: set[str] = set()
    content: list[Content] | None = None
    calls = 0
    for i, c in enumerate(reply.content):
        if c.type is not ContentType.TOOL_CALL:
            continue
        if c.id in seen:
            new = made_up_call_id(calls)
            log.warning("the model's reply holds a second tool call with id %r (%s); it gets the id %r",
                        c.id, c.name, new)
            if content is None:
                content = list(reply.content)
            content[i] = c = Content.tool_call(new, c.name, c.arguments)
        seen.add(c.id)
        calls += 1
    if content is None:
        return reply
    return Message(reply.role, content, key=reply.key, usage=reply.usage)
