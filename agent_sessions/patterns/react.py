"""The ReAct loop: ask the model, run the tools it calls, repeat until it answers.

Immediately before every request the loop collects steers (the Run's box first, then the session's
store) and appends them where the run has got to; with a session it then saves the transcript. It saves
once more when it returns, because the model's last reply would otherwise only be written by a request
that never comes: saves == requests + 1.

A run whose transcript ends with tool calls (a resume) answers them first. With a RunStore session the
loop also holds the session's lease, stops on a cancel from any process (checked before every request
and every tool call), and journals tool calls (see ``journal``).
"""

from __future__ import annotations

import threading
import time
from typing import Literal

from ..endpoints import Endpoint
from ..events import (
    Events,
    Finished,
    ModelRequest,
    ModelResponse,
    Saved,
    SteerApplied,
    StepStarted,
    ToolCalled,
    ToolFinished,
)
from ..guard import Guard
from ..messages import Content, Message, Role
from ..runner import Result, StopReason
from ..spec import Spec
from ..steerbox import SteerBox
from ..tools import Tool


def run(
    spec: Spec,
    transcript: list[Message],
    endpoint: Endpoint,
    events: Events | None,
    box: SteerBox,
    cancelled: threading.Event,
) -> Result:
    guard = None if spec.session is None else Guard.of(spec.session, spec.lease_ttl, spec.lease_wait)
    if guard is None:
        return _loop(spec, transcript, endpoint, events, box, cancelled, None)
    with guard:
        guard.resume(transcript)
        return _loop(spec, transcript, endpoint, events, box, cancelled, guard)


def _loop(
    spec: Spec,
    transcript: list[Message],
    endpoint: Endpoint,
    events: Events | None,
    box: SteerBox,
    cancelled: threading.Event,
    guard: Guard | None,
) -> Result:
    session = spec.session
    steps = 0
    reply: Message | None = None
    stop: StopReason
    if unanswered(transcript):  # a resumed run: finish the reply's tool calls before asking again
        _run_tools(spec, steps, transcript, events, cancelled, guard)
    while True:
        if cancelled.is_set() or (guard is not None and guard.stop_requested()):
            stop = "cancelled"
            break
        if steps == spec.max_steps:
            stop = "max_steps"
            break
        steps += 1
        if events is not None:
            events(StepStarted(steps))
        _collect(steps, transcript, box.drain(), "run", events)
        if guard is not None:  # taken and saved atomically: a crash cannot lose a steer in between
            _collect(steps, transcript, guard.save_with_steers(transcript), "session", events)
        elif session is not None:
            _collect(steps, transcript, session.take_steers(), "session", events)
            session.save(transcript)
        if session is not None:
            if events is not None:
                events(Saved(steps, len(transcript)))
        if events is not None:
            events(ModelRequest(steps, len(transcript)))
            started = time.perf_counter()
        reply = endpoint.complete(spec.system, transcript, spec.toolbox)
        transcript.append(reply)
        if events is not None:
            events(ModelResponse(steps, reply, time.perf_counter() - started))
        if not reply.tool_calls:
            stop = "answered"
            break
        _run_tools(spec, steps, transcript, events, cancelled, guard)
    if session is not None:
        session.save(transcript)
        if events is not None:
            events(Saved(steps, len(transcript)))
    result = Result(
        messages=transcript,
        text=reply.text if stop == "answered" and reply is not None else "",
        steps=steps,
        stop_reason=stop,
        unapplied_steers=box.close(),
    )
    if events is not None:
        events(Finished(result))
    return result


def unanswered(transcript: list[Message]) -> bool:
    """Does the transcript end with tool calls that have no results yet?"""
    return bool(transcript) and transcript[-1].role is Role.ASSISTANT and bool(transcript[-1].tool_calls)


def _run_tools(
    spec: Spec,
    step: int,
    transcript: list[Message],
    events: Events | None,
    cancelled: threading.Event,
    guard: Guard | None,
) -> None:
    """Answer every tool call of the last message, in one message of results: a call never stands in the
    transcript without its result, whatever stops the run. A cancel seen before a call skips it (and
    every later one) with an error result saying so."""
    if guard is not None:
        guard.begin(transcript)
    results: list[Content] = []
    for call in transcript[-1].tool_calls:
        if not cancelled.is_set() and guard is not None and guard.stop_requested():
            cancelled.set()
        if cancelled.is_set():
            results.append(Content.tool_result(call.id, CANCELLED, is_error=True))
            continue
        tool = spec.tool(call.name)
        replayed = None if guard is None else guard.replay(call, tool)
        if replayed is not None:
            results.append(replayed)
            continue
        if guard is not None:
            guard.started(call)
        result = _call_tool(tool, step, call, events)
        if guard is not None:
            guard.finished(result)
        results.append(result)
    transcript.append(Message(Role.USER, results))


CANCELLED = "not run: the run was cancelled before this tool call"


def _collect(
    step: int, transcript: list[Message], steers: list[str],
    source: Literal["run", "session"],
    events: Events | None,
) -> None:
    for text in steers:
        transcript.append(Message.user(text))
        if events is not None:
            events(SteerApplied(step, text, len(transcript) - 1, source))


def _call_tool(tool: Tool | None, step: int, call: Content, events: Events | None) -> Content:
    if events is not None:
        events(ToolCalled(step, call))
        started = time.perf_counter()
    if tool is None:
        result = Content.tool_result(call.id, f"there is no tool named {call.name!r}", is_error=True)
    else:
        result = tool.invoke(call)
    if events is not None:
        events(ToolFinished(step, call, result, time.perf_counter() - started))
    return result
