"""What the child processes of the stranded-runs test run: a keyed turn that looks something up (an
idempotent tool), charges a card (a non-idempotent one) and answers, killed anywhere; and the sweep,
``agent.recover``, run from several processes at once.

Every model request and every tool run appends a line to the session's log (O_APPEND, no fsync: the
kernel keeps it across a SIGKILL), so the parent knows where a turn was killed and can count, afterwards,
how often the card was charged and the model asked, whichever process did it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import agent_sessions as agent
from agent_sessions import Content, Message, Role
from agent_sessions import events as ev

SPEC = "stranded-test"
QUESTION = "refund order 7"
ANSWER = Message.assistant("refunded")
PAUSE = 0.03
"""Seconds the model and each tool take: the window a kill lands in."""
LEASE_TTL = 0.5
"""The killed turn's lease: how long its session stays held after the kill."""


def _log(folder: str, sid: str, line: str) -> None:
    fd = os.open(Path(folder) / f"{sid}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


def call(k: int) -> Message:
    name = ("lookup", "charge")[k]
    return Message(Role.ASSISTANT, [Content.tool_call(f"call_{k}", name, json.dumps({"order": 7}))])


class Script:
    """The model: ``lookup`` first, then ``charge``, then the answer; each reply depends only on how many
    calls the transcript holds, so whoever goes on with the turn carries on exactly."""

    def __init__(self, folder: str, sid: str) -> None:
        self.folder, self.sid = folder, sid

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        _log(self.folder, self.sid, "model")
        time.sleep(PAUSE)
        made = sum(1 for m in messages if m.role is Role.ASSISTANT and m.tool_calls)
        return call(made) if made < 2 else ANSWER


def tools(folder: str, sid: str) -> list[agent.Tool]:
    def lookup(order: int) -> str:
        """Look the order up (idempotent: a repeat is harmless)."""
        _log(folder, sid, "lookup")
        time.sleep(PAUSE)
        return f"order {order}: 12 EUR"

    def charge(order: int) -> str:
        """Refund the card (not idempotent: must never run twice)."""
        _log(folder, sid, "charge")
        time.sleep(PAUSE)
        return "refunded 12 EUR"

    return [agent.tool(idempotent=True)(lookup), agent.tool(idempotent=False)(charge)]


def spec(folder: str, sid: str, store: agent.Store, lease_ttl: float) -> agent.Spec:
    return agent.Spec(session=agent.open(sid, store), tools=tools(folder, sid), max_steps=6, lease_ttl=lease_ttl,
                      name=SPEC)


class Phases:
    """The turn's events, onto the session's log: ``after`` once a tool returned (between steps)."""

    def __init__(self, folder: str, sid: str) -> None:
        self.folder, self.sid = folder, sid

    def __call__(self, event: object) -> None:
        if isinstance(event, ev.ToolFinished):
            _log(self.folder, self.sid, "after")


def turn(factory: Callable[[], agent.Store], folder: str, sid: str) -> None:
    """A worker's turn; the parent SIGKILLs this process somewhere in it."""
    agent.Runner().turn(spec(folder, sid, factory(), LEASE_TTL), QUESTION, f"turn-{sid}", Script(folder, sid),
                        Phases(folder, sid))


def sweep(factory: Callable[[], agent.Store], folder: str, out: str, barrier: object) -> None:
    """One replica's sweep: ``recover`` with a resolve that knows the test's spec by its name; what became of
    each session goes to ``out``, a JSON line each."""
    store = factory()
    assert isinstance(store, agent.LifecycleStore)

    def resolve(info: agent.SessionInfo) -> tuple[agent.Spec, agent.Endpoint] | None:
        if info.spec != SPEC:
            return None
        return spec(folder, info.id, store, 5.0), Script(folder, info.id)

    barrier.wait(120)  # type: ignore[attr-defined]
    done = agent.recover(store, resolve, limit=1000, grace=0)
    with open(out, "w") as f:
        for r in done:
            f.write(json.dumps({"session": r.session, "outcome": r.outcome,
                                "error": None if r.error is None else repr(r.error)}) + "\n")
