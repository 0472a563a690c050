"""What agent-sessions costs per step.

``persistence``: what the loop asks of the store before every model request (the steers taken and
the new messages saved; for a RunStore, fenced by the run's lease), interleaved round by round with the
backend's floor so both see the same disk and the same neighbours. ``loop_step``: a whole step of the loop
(model and tool answering at once), with ``session=None`` or a store, its cancel checks and tool journal
included, with one idempotent tool call per step or one non-idempotent one.
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


def measure(store: agent.Store, floor: Floor | None, n: int, rounds: int) -> dict[str, Any]:
    """Per-step persistence, the floor and the loop step (with one idempotent and one non-idempotent tool),
    **interleaved**: blocks of ``RESET_EVERY`` persistence rounds (each beside a floor append), then a run
    of the loop with each tool, until each has ``rounds`` samples. The loop's ratios to persistence then
    compare steps taken under the same load, on a machine whose load comes and goes."""
    persist: list[float] = []
    floors: list[float] = []
    loops: dict[str, list[float]] = {"loop": [], "loop_non_idempotent": []}
    run_store = store if isinstance(store, agent.RunStore) else None  # as the loop: decided once per run
    r = 0
    while len(persist) < rounds or any(len(samples) < rounds for samples in loops.values()):
        sid = f"bench-{n}-{uuid.uuid4().hex}"
        msgs = transcript(n)
        store.save(sid, msgs)
        holder = run_store.acquire(sid, HOLDER, 600) if run_store is not None else HOLDER
        for _ in range(RESET_EVERY):
            if floor is not None:
                floors.append(clock(floor.append))
            if run_store is not None:
                step = functools.partial(_run_store_step, run_store, sid, holder, msgs, step_messages(r))
            else:
                step = functools.partial(_store_step, store, sid, msgs, step_messages(r))
            persist.append(clock(step))
            r += 1
        loops["loop"].extend(_loop_run(store, n, grep))
        loops["loop_non_idempotent"].extend(_loop_run(store, n, charge))
    out: dict[str, Any] = {"persist": summary(persist[:rounds])}
    if floors:
        out["floor"] = summary(floors[:rounds])
    out.update({kind: summary(samples[:rounds]) for kind, samples in loops.items()})
    return out


HOLDER = agent.Holder("bench", 1, "b" * 32, 0.0)


def _run_store_step(
    store: agent.RunStore, sid: str, holder: agent.Holder, msgs: list[agent.Message], step: list[agent.Message]
) -> None:
    """What the loop asks of a RunStore before each request: the new messages saved with the steers
    waiting, fenced by the run's lease, in one atomic step."""
    msgs.extend(step)
    msgs.extend(agent.Message.user(t) for t in store.save_fenced(sid, holder, msgs, take_steers=True).steers)


def _store_step(store: agent.Store, sid: str, msgs: list[agent.Message], step: list[agent.Message]) -> None:
    """The same on a plain Store: take_steers, then save."""
    msgs.extend(step)
    msgs.extend(agent.Message.user(t) for t in store.take_steers(sid))
    store.save(sid, msgs)


class InstantModel:
    """Answers at once with a call of ``tool``: the loop's own cost, with no model time in it."""

    def __init__(self, tool: str) -> None:
        self.tool = tool
        self.i = 0

    def complete(self, system: str, messages: Sequence[agent.Message], tools: Sequence[agent.Tool]) -> agent.Message:
        self.i += 1
        call = agent.Content.tool_call(f"c{self.i}", self.tool, arguments(self.i))
        return agent.Message(agent.Role.ASSISTANT, [call])


@agent.tool
def grep(path: str, pattern: str, context: int, note: str) -> str:
    """Search a file."""
    return RESULT_TEXT


@agent.tool(idempotent=False)
def charge(path: str, pattern: str, context: int, note: str) -> str:
    """A tool with an effect: journalled before it runs and after."""
    return RESULT_TEXT


class StepClock:
    """An events callback noting when each step starts."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def __call__(self, event: object) -> None:
        if isinstance(event, ev.StepStarted):
            self.starts.append(time.perf_counter())


def loop_step(store: agent.Store | None, n: int, rounds: int, tool: agent.Tool = grep) -> dict[str, Any]:
    samples: list[float] = []
    while len(samples) < rounds:
        samples.extend(_loop_run(store, n, tool))
    return {"loop_step": summary(samples[:rounds])}


def _loop_run(store: agent.Store | None, n: int, tool: agent.Tool, steps_per_run: int = 11) -> list[float]:
    """One run of the loop on a fresh session of ``n`` messages: the times between its steps' starts."""
    steps = StepClock()
    session = None
    msgs = transcript(n)
    if store is not None:
        session = agent.open(f"bench-loop-{n}-{uuid.uuid4().hex}", store)
        session.save(msgs)
    spec = agent.Spec(session=session, tools=[tool], max_steps=steps_per_run)
    agent.Runner().run(spec, msgs, InstantModel(tool.name), steps)
    return [(b - a) * 1000 for a, b in itertools.pairwise(steps.starts)]
