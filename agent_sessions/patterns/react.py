"""The ReAct loop: ask the model, run the tools it calls, repeat until it answers.

Immediately before every request the loop collects steers (the Run's box first, then the session's
store) and appends them where the run has got to; with a session it then saves the transcript. It saves
once more when it returns, because the model's last reply would otherwise only be written by a request
that never comes: saves == requests + 1.
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
from ..messages import Content, Message, Role
from ..runner import Result, StopReason
from ..spec import Spec
from ..steerbox import SteerBox


def run(
    spec: Spec,
    transcript: list[Message],
    endpoint: Endpoint,
    events: Events | None,
    box: SteerBox,
    cancelled: threading.Event,
) -> Result:
    session = spec.session
    steps = 0
    reply: Message | None = None
    stop: StopReason
    while True:
        if cancelled.is_set():
            stop = "cancelled"
            break
        if steps == spec.max_steps:
            stop = "max_steps"
            break
        steps += 1
        if events is not None:
            events(StepStarted(steps))
        _collect(steps, transcript, box.drain(), "run", events)
        if session is not None:
            _collect(steps, transcript, session.take_steers(), "session", events)
            session.save(transcript)
            if events is not None:
                events(Saved(steps, len(transcript)))
        if events is not None:
            events(ModelRequest(steps, len(transcript)))
            started = time.perf_counter()
        reply = endpoint.complete(spec.system, transcript, spec.toolbox)
        transcript.append(reply)
        if events is not None:
            events(ModelResponse(steps, reply, time.perf_counter() - started))
        calls = reply.tool_calls
        if not calls:
            stop = "answered"
            break
        transcript.append(Message(Role.USER, [_call_tool(spec, steps, call, events) for call in calls]))
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


def _collect(
    step: int, transcript: list[Message], steers: list[str],
    source: Literal["run", "session"],
    events: Events | None,
) -> None:
    for text in steers:
        transcript.append(Message.user(text))
        if events is not None:
            events(SteerApplied(step, text, len(transcript) - 1, source))


def _call_tool(spec: Spec, step: int, call: Content, events: Events | None) -> Content:
    if events is not None:
        events(ToolCalled(step, call))
        started = time.perf_counter()
    tool = spec.tool(call.name)
    if tool is None:
        result = Content.tool_result(call.id, f"there is no tool named {call.name!r}", is_error=True)
    else:
        result = tool.invoke(call)
    if events is not None:
        events(ToolFinished(step, call, result, time.perf_counter() - started))
    return result
