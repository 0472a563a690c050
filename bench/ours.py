"""What agent-sessions costs per step.

``persistence``: what the loop asks of the store before every model request (the steers taken and
the new messages saved), interleaved round by round with the backend's floor so both see the same disk and
the same neighbours. ``loop_step``: a whole step of the loop (model and tool answering at once), with
``session=None`` or a store, lease check and tool journal included.
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from collections.abc import Sequence
from typing import Any

import agent_sessions as agent
from agent_sessions import events as ev

from .floors import Floor
from .workload import RESULT_TEXT, arguments, clock, step_messages, summary, transcript

RESET_EVERY = 10
"""Rounds before a fresh session of N messages, so "at N" stays within N + 20."""


def persistence(store: agent.Store, floor: Floor | None, n: int, rounds: int) -> dict[str, Any]:
    ours: list[float] = []
    floors: list[float] = []
    msgs: list[agent.Message] = []
    sid = ""
    step_of = _run_store_step if isinstance(store, agent.RunStore) else _store_step  # as the loop: once per run
    for r in range(rounds):
        if r % RESET_EVERY == 0:
            sid = f"bench-{n}-{uuid.uuid4().hex}"
            msgs = transcript(n)
            store.save(sid, msgs)
        if floor is not None:
            floors.append(clock(floor.append))
        ours.append(clock(functools.partial(step_of, store, sid, msgs, step_messages(r))))
    out: dict[str, Any] = {"persist": summary(ours)}
    if floors:
        out["floor"] = summary(floors)
    return out


def _run_store_step(store: Any, sid: str, msgs: list[agent.Message], step: list[agent.Message]) -> None:
    """What the loop asks of a RunStore before each request: the new messages saved with the steers
    waiting, in one atomic step."""
    msgs.extend(step)
    msgs.extend(agent.Message.user(t) for t in store.save_with_steers(sid, msgs))


def _store_step(store: agent.Store, sid: str, msgs: list[agent.Message], step: list[agent.Message]) -> None:
    """The same on a plain Store: take_steers, then save."""
    msgs.extend(step)
    msgs.extend(agent.Message.user(t) for t in store.take_steers(sid))
    store.save(sid, msgs)


class InstantModel:
    """Answers at once with a tool call: the loop's own cost, with no model time in it."""

    def __init__(self) -> None:
        self.i = 0

    def complete(self, system: str, messages: Sequence[agent.Message], tools: Sequence[agent.Tool]) -> agent.Message:
        self.i += 1
        return agent.Message(agent.Role.ASSISTANT, [agent.Content.tool_call(f"c{self.i}", "grep", arguments(self.i))])


@agent.tool
def grep(path: str, pattern: str, context: int, note: str) -> str:
    """Search a file."""
    return RESULT_TEXT


class StepClock:
    """An events callback noting when each step starts."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def __call__(self, event: object) -> None:
        if isinstance(event, ev.StepStarted):
            self.starts.append(time.perf_counter())


def loop_step(store: agent.Store | None, n: int, rounds: int, steps_per_run: int = 11) -> dict[str, Any]:
    samples: list[float] = []
    while len(samples) < rounds:
        steps = StepClock()
        session = None
        msgs = transcript(n)
        if store is not None:
            session = agent.open(f"bench-loop-{n}-{uuid.uuid4().hex}", store)
            session.save(msgs)
        spec = agent.Spec(session=session, tools=[grep], max_steps=steps_per_run)
        agent.Runner().run(spec, msgs, InstantModel(), steps)
        samples.extend((b - a) * 1000 for a, b in itertools.pairwise(steps.starts))
    return {"loop_step": summary(samples[:rounds])}
