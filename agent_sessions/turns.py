"""A turn that is safe to repeat: what a worker runs for "answer this message of this session".

A task queue delivers a task at least once: a Celery task with ``acks_late`` is delivered again when its
worker dies, or when it finished but its ack was lost. Run naively, the repeat appends the user's message a
second time and asks the model again. ``Runner.turn`` keys the message instead: the key is stored with it,
so the repeat finds it and either continues the turn where a dead worker left it or, when the turn was
answered, returns that answer without a model request.

Two deliveries running at once cannot both append: a leased run's first write is a compare-and-swap
against the transcript it read, so the later one gets ``TranscriptConflict``, reads again, finds the key,
and waits for (or returns) the other's turn. That is why a turn needs a session over a RunStore.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import ArgumentError, TranscriptConflict
from .messages import Message, Role
from .session import is_run_session
from .spec import Spec

if TYPE_CHECKING:
    from .endpoints import Endpoint
    from .events import Events
    from .runner import Result, Runner

log = logging.getLogger(__name__)

ATTEMPTS = 5
"""Reads of the transcript a turn makes at most: each conflict means another delivery saved meanwhile."""


def turn(runner: Runner, spec: Spec, text: str, key: str, endpoint: Endpoint, events: Events | None) -> Result:
    from .runner import Result

    session = spec.session
    if session is None or not is_run_session(session):
        raise ArgumentError(
            "Runner.turn needs Spec.session over a RunStore: only a leased, fenced run can tell a repeated "
            "delivery from a new turn"
        )
    if not isinstance(key, str) or not key:
        raise ArgumentError(f"Runner.turn(key=) must be a non-empty str, got {key!r}")
    message = Message.user(text, key=key)
    conflict: TranscriptConflict | None = None
    for _ in range(ATTEMPTS):
        stored = session.messages()
        at = keyed(stored, key)
        if at is None:
            todo = [*stored, message]
        elif stored[at] != message:
            raise ArgumentError(
                f"session {session.id!r}: the turn key {key!r} is already used by message {at}, whose text "
                f"differs from this one; a key names one message"
            )
        else:
            answer = answered(stored, at)
            if answer is not None:
                log.info("session %r: turn %r was answered already; returning its answer", session.id, key)
                return Result(messages=stored, text=answer.text, steps=0, stop_reason="answered",
                              unapplied_steers=[], usage={})
            log.info("session %r: turn %r is unfinished; continuing it", session.id, key)
            todo = stored
        try:
            return runner.run(spec, todo, endpoint, events)
        except TranscriptConflict as exc:  # another delivery (or run) saved after our read: read again
            log.info("session %r: turn %r: %s", session.id, key, exc)
            conflict = exc
    assert conflict is not None
    raise conflict


def keyed(msgs: Sequence[Message], key: str) -> int | None:
    """The index of the message keyed ``key``, searched from the end (a turn is usually the latest)."""
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].key == key:
            return i
    return None


def answered(msgs: Sequence[Message], at: int) -> Message | None:
    """The reply that answered the turn starting at ``at``: the first later reply with no tool calls.
    ``None`` while the turn is unfinished (a worker died in it, or it stopped before an answer)."""
    for message in msgs[at + 1:]:
        if message.role is Role.ASSISTANT and not message.tool_calls:
            return message
    return None
