"""What the child processes of the reliability suite run: a deterministic ReAct run on a session, so
any transcript it leaves can be checked message by message against what the run must have produced."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import agent_sessions as agent
from agent_sessions import Content, Message, Role
from agent_sessions import events as ev

QUESTION = "work through the steps"


def call(k: int) -> Message:
    return Message(Role.ASSISTANT, [Content.tool_call(f"call_{k}", "work", json.dumps({"k": k}))])


def result(k: int) -> Message:
    return Message(Role.USER, [Content.tool_result(f"call_{k}", f"result {k}")])


ANSWER = Message.assistant("done")


class Steps:
    """The model: asks for ``work(k)`` for k = 0, 1, ... ``steps - 1``, then answers "done". Each reply
    depends only on how many calls the transcript holds, so a resumed run carries on exactly."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        made = sum(1 for m in messages if m.role is Role.ASSISTANT and m.tool_calls)
        return call(made) if made < self.steps else ANSWER


class UntilSteers(Steps):
    """Keeps asking for work until the transcript holds ``expected`` steers, then answers."""

    def __init__(self, expected: int) -> None:
        super().__init__(10**9)
        self.expected = expected

    def complete(self, system: str, messages: Sequence[Message], tools: Sequence[agent.Tool]) -> Message:
        steers = sum(1 for m in messages[1:] if m.role is Role.USER and m.text)
        if steers >= self.expected:
            return ANSWER
        return super().complete(system, messages, tools)


def work_tool(pause: float) -> agent.Tool:
    def work(k: int) -> str:
        time.sleep(random.uniform(0, pause))
        return f"result {k}"

    return agent.tool(name="work")(work)


class Phases:
    """An events callback that appends where the run is to a file, so a parent that kills the process
    knows what it interrupted. O_APPEND writes, no fsync: the kernel keeps them across a SIGKILL."""

    NAMES = {ev.StepStarted: "saving", ev.Saved: "requesting", ev.ModelResponse: "answered",
             ev.ToolCalled: "in a tool", ev.ToolFinished: "after a tool", ev.Finished: "finished"}

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, event: object) -> None:
        name = self.NAMES.get(type(event))
        if name is not None:
            os.write(self.fd, name.encode() + b"\n")


def run_steps(factory: Callable[[], agent.Store], sid: str, phases: str, steps: int, lease_ttl: float) -> None:
    """Run (or resume) the session to its answer; the parent may SIGKILL this process at any moment."""
    session = agent.open(sid, factory())
    spec = agent.Spec(session=session, tools=[work_tool(0.004)], max_steps=steps * 3, lease_ttl=lease_ttl,
                      lease_wait=60)
    msgs = session.messages() or [Message.user(QUESTION)]
    agent.Runner().run(spec, msgs, Steps(steps), Phases(phases))


BARRIER_TIMEOUT = 120.0
"""Seconds a sender waits for the others (and the parent) to be ready: a sender that outlives a failed
parent gives up rather than wait forever."""


def add_steers(factory: Callable[[], agent.Store], sid: str, sender: int, count: int, barrier: Any) -> None:
    store = factory()
    barrier.wait(BARRIER_TIMEOUT)
    for j in range(count):
        store.add_steer(sid, f"p{sender}-{j:04d}")
