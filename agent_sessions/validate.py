"""Argument checks, made before anything touches a backend: bad input fails with an ``ArgumentError`` and
nothing stored changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .errors import ArgumentError, MessageError
from .messages import ContentType, Message, Role

# 255 characters fit a utf8mb4 VARCHAR primary key on InnoDB (1,020 bytes of a 3,072-byte limit).
MAX_SESSION_ID_LENGTH = 255


def encodable(value: str) -> bool:
    """No NUL (PostgreSQL text refuses it) and no lone surrogates (not encodable as UTF-8)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def session_id(value: object, where: str = "session id") -> str:
    if not isinstance(value, str):
        raise ArgumentError(f"{where} must be a str, got {type(value).__name__}")
    if not value:
        raise ArgumentError(f"{where} must not be empty")
    if len(value) > MAX_SESSION_ID_LENGTH:
        raise ArgumentError(f"{where} is {len(value)} characters long; at most {MAX_SESSION_ID_LENGTH} are allowed")
    if not encodable(value):
        raise ArgumentError(f"{where} {value!r} contains NUL or a lone surrogate")
    return value


def steer_text(value: object, where: str = "steer") -> str:
    if not isinstance(value, str):
        raise ArgumentError(f"{where} text must be a str, got {type(value).__name__}")
    if not value:
        raise ArgumentError(f"{where} text must not be empty")
    if not encodable(value):
        raise ArgumentError(f"{where} text contains NUL or a lone surrogate")
    return value


MAX_STEER_KEY_LENGTH = 255
"""As a message's key (``messages.MAX_KEY_LENGTH``): a SQL store keeps it in a 255-character key column."""


def steer_key(value: object, where: str = "steer key") -> str:
    """A steer's idempotency key (``SteerKeyStore``), or a turn's (``QueueStore.enqueue``, stored the same
    way): a non-empty str of at most 255 printable characters, an id the caller made (a request id, a UUID),
    never text: a key with a newline or a control character in it is most likely a mistake (a line read with
    its end), refused before it names a steer."""
    if not isinstance(value, str):
        raise ArgumentError(f"{where} must be a str, got {type(value).__name__}")
    if not value:
        raise ArgumentError(f"{where} must not be empty")
    if len(value) > MAX_STEER_KEY_LENGTH:
        raise ArgumentError(f"{where} is {len(value)} characters long; at most {MAX_STEER_KEY_LENGTH} are allowed")
    if not value.isprintable() or not encodable(value):
        raise ArgumentError(f"{where} {value!r} contains a control character or a lone surrogate; a key must be "
                            "printable")
    return value


def messages(value: object, where: str = "messages", trusted: Sequence[Message] = ()) -> tuple[Message, ...]:
    """``trusted`` is a transcript already checked (what a store last saved): when ``value`` starts with
    it, only the rest is checked, so an appending save does not re-check the whole transcript."""
    return messages_after(value, trusted, where)[0]


def messages_after(value: object, trusted: Sequence[Message],
                   where: str = "messages") -> tuple[tuple[Message, ...], int]:
    """``messages``, also saying how many leading messages are ``trusted`` ones: ``len(trusted)`` when
    ``value`` extends it, else 0. A store asks this on every save, of the whole transcript, so it copies
    ``value`` once and looks at only the messages that are not trusted."""
    if type(value) is not list and (isinstance(value, (str, bytes, Message)) or not isinstance(value, Iterable)):
        raise ArgumentError(f"{where} must be a list of Message, got {type(value).__name__}")
    items = tuple(value)
    start = len(trusted) if is_extension(trusted, items) else 0
    for i in range(start, len(items)):
        item = items[i]
        if not isinstance(item, Message):
            raise ArgumentError(f"{where}[{i}] must be a Message, got {type(item).__name__}")
        for c in item.content:
            if c.type is _TOOL_RESULT:
                _answers(item, items[i - 1] if i else None, where, i)
                break
    return items, start


_TOOL_RESULT = ContentType.TOOL_RESULT
_TOOL_CALL = ContentType.TOOL_CALL


def _answers(results: Message, before: Message | None, where: str, index: int) -> None:
    """A tool result must answer a call of the message just before it: every provider refuses anything
    else, so a transcript holding one could never be sent again."""
    calls = set()
    if before is not None and before.role is Role.ASSISTANT:
        calls = {c.id for c in before.content if c.type is _TOOL_CALL}
    for c in results.content:
        if c.type is _TOOL_RESULT and c.tool_call_id not in calls:
            raise MessageError(f"{where}[{index}] holds a tool result for call {c.tool_call_id!r}, but the message "
                               f"before it makes no call with that id (a result must directly follow the reply that "
                               f"called it)")


def distinct_call_ids(msgs: Sequence[Message], where: str = "messages") -> None:
    """No message makes two tool calls with one id: their results (and approval decisions, and journal
    entries) find their call by id, so they could not be told apart. The loop gives a model's duplicate a
    made-up id as the reply arrives (``messages.distinct_call_ids``); a transcript handed in is refused."""
    for i, m in enumerate(msgs):
        seen: set[str] = set()
        for c in m.tool_calls:
            if c.id in seen:
                raise MessageError(f"{where}[{i}] makes two tool calls with id {c.id!r}: their results could not be "
                                   f"told apart (give each call of a message its own id)")
            seen.add(c.id)


def is_extension(prefix: Sequence[object], items: tuple[object, ...]) -> bool:
    """Does ``items`` start with ``prefix``? Asked on every save, so done in C without copying: ``prefix <=
    items`` compares pair by pair (identity, then equality), True once all of the shorter ``prefix`` matched;
    at the first pair that differs it asks that pair's ``<=``, which messages lack (``TypeError``). About 4 µs
    for 1,000 messages, against 15 µs for ``items[:len(prefix)] == prefix``."""
    if len(items) < len(prefix):
        return False
    try:
        return tuple(prefix) <= items
    except TypeError:
        return False


def stored_size(items: Sequence[Message], limit: int | None, store: str) -> None:
    """Each message fits what ``store`` can keep (``limit`` bytes of stored JSON)."""
    if limit is None:
        return
    for i, message in enumerate(items):
        size = len(message.to_json())
        if size > limit:
            raise ArgumentError(f"messages[{i}] is {size:,} bytes as stored (JSON, non-ASCII escaped); the {store} "
                                f"keeps messages of at most {limit:,} bytes")


def deliverable_steer(text: str, limit: int | None, store: str) -> None:
    """A steer is delivered as a user message: refuse one the store could take but never deliver (its
    stored form is larger than its text: each non-ASCII character becomes an escape of up to 12 bytes)."""
    if limit is None:
        return
    size = len(Message.user(text, steer=True).to_json())
    if size > limit:
        raise ArgumentError(f"the steer is {size:,} bytes as it would be stored (JSON, non-ASCII escaped); the "
                            f"{store} keeps messages of at most {limit:,} bytes, so it could never be delivered")


def fork_cut(last_kept: Message | None, at: int, source: str, allow_unanswered: bool) -> None:
    """A cut right after a reply with tool calls leaves calls without results: refused unless asked for,
    since the fork's next run runs them again (its journal is the original's, not the fork's)."""
    if allow_unanswered or last_kept is None or not last_kept.tool_calls:
        return
    raise ArgumentError(f"cannot fork session {source!r} at {at}: message {at - 1} has tool calls whose results "
                        f"would be cut off, and the fork's next run would run them again (non-idempotent ones "
                        f"included); cut at {at - 1} or {at + 1}, or pass allow_unanswered=True")


def fork_index(at: object, length: int, source: str) -> None:
    """``at`` cuts the transcript before message ``at``: 0 (nothing) up to its length (everything)."""
    if at is None:
        return
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= length:
        raise ArgumentError(f"cannot fork session {source!r} at {at!r}: its transcript has {length} messages, so at "
                            f"must be None or an int from 0 to {length}")


def read_back(stop: object, count: object) -> None:
    """The arguments of ``TailStore.read_back``, checked before any query."""
    if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or stop < 0):
        raise ArgumentError(f"read_back(stop=) must be None or an int >= 0, got {stop!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ArgumentError(f"read_back(count=) must be an int >= 1, got {count!r}")


def save_start(start: object, replace: object, take_steers: object) -> int:
    """A fenced save's arguments beside the transcript: ``take_steers`` and ``replace`` bools (a truthy string
    is refused, not read one way by one store and another by the next), ``start`` an int >= 0, and none for
    a replacing save, which writes the whole transcript."""
    for name, flag in (("take_steers", take_steers), ("replace", replace)):
        if type(flag) is not bool:
            raise ArgumentError(f"save_fenced({name}=) must be a bool, got {flag!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ArgumentError(f"save_fenced(start=) must be an int >= 0, got {start!r}")
    if start and replace:
        raise ArgumentError("save_fenced(replace=True) replaces the whole transcript: it takes no start")
    return start
