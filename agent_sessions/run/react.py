"""The ReAct loop: ask the model, run the tools it calls, repeat until it answers.

Immediately before every request the loop appends the steers (the Run's box first, then the session's) and
saves the transcript; it saves once more when it returns, else the model's last reply would only be written
by a request that never comes. How the run keeps its transcript is chosen once (``persistence``) and what it
reports goes to a ``Sink``, so the loop has no branch on either. A run ends with exactly one of ``Finished``
and ``Failed``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from functools import partial

from ..context import Compacts, ContextPolicy
from ..endpoints import Endpoint, StreamingEndpoint, streaming
from ..errors import ContextOverflow, EndpointError, OutcomeUnknown, TranscriptDeleted
from ..events import SILENT, Events, Sink, sink
from ..lease import Lease
from ..messages import Content, Message, Role, distinct_call_ids, start_of, unanswered
from ..result import Result, StopReason
from ..spec import Spec
from ..tools import Tool
from .persistence import Keeping, keeping
from .steerbox import SteerBox
from .turns import running

CANCELLED = "not run: the run was cancelled before this tool call"

log = logging.getLogger(__name__)
"""At INFO a run's start, its end and a failure with its cause; at DEBUG each step and tool call. Names,
counts and sizes only, never what a message or a tool's arguments or result say (they may be anyone's)."""


def run(spec: Spec, transcript: list[Message], endpoint: Endpoint, events: Events | None, box: SteerBox,
        cancelled: threading.Event, continuing: bool = False, lease: Lease | None = None) -> Result:
    """Run the loop on ``transcript``; ``continuing``: it goes on with a turn already begun (``keeping``);
    ``lease``: the session's lease, taken already by the caller and handed to the run, which releases it."""
    emit = sink(events)
    taken: list[str] = []  # steers of the box in the transcript, in no stored transcript yet
    sid = keep_id(spec)
    started = time.monotonic()
    try:
        with keeping(spec, continuing=continuing, start=start_of(transcript), lease=lease,
                     turn=running(transcript, continuing)) as keep:
            log.info("run of session %r starts: %s, epoch %s, %d messages, max_steps %d, tools %s",
                     sid, "continuing its turn" if continuing else "new", keep.epoch, len(transcript),
                     spec.max_steps, [t.name for t in spec.toolbox])
            try:
                emit = keep.publishing(emit)
                keep.resume(transcript)
                if keep.stopped:  # its turn was cancelled before it: it starts nothing
                    cancelled.set()
                result = _loop(spec, transcript, endpoint, emit, box, cancelled, keep, taken)
            except BaseException as exc:
                _give_back(keep, exc, transcript, taken, box.close())
                raise
    except BaseException as exc:  # reported, then re-raised: a listener closes what it opened (a span)
        log.info("run of session %r failed after %.3f s: %s", sid, time.monotonic() - started, _cause(exc))
        emit.failed(exc)
        raise
    log.info("run of session %r ended: %s after %d step%s in %.3f s, tokens %s, %d messages",
             sid, result.stop_reason, result.steps, "" if result.steps == 1 else "s", time.monotonic() - started,
             result.usage or "not reported", len(result.messages))
    emit.finished(result)  # once the lease is released: a release that fails makes this run Failed instead
    return result


def _loop(spec: Spec, transcript: list[Message], endpoint: Endpoint, emit: Sink, box: SteerBox,
          cancelled: threading.Event, keep: Keeping, taken: list[str]) -> Result:
    steps = 0
    reply: Message | None = None
    usage: dict[str, int] = {}
    stop: StopReason
    streams = streaming(endpoint) if emit is not SILENT else None  # text deltas: only for someone listening
    waiting: list[Content] = []
    compacts = getattr(spec.context_policy, "compact", None) if spec.context_policy is not None else None
    if unanswered(transcript):  # a resumed run: finish the reply's tool calls before asking again
        waiting = _run_tools(spec, steps, transcript, emit, cancelled, keep)
    while not waiting:
        if cancelled.is_set():
            stop = "cancelled"
            break
        if steps == spec.max_steps:
            stop = "max_steps"
            break
        step = steps + 1
        emit.step_started(step)
        if compacts is not None:
            _compact(compacts, spec, endpoint, transcript, step, emit)
        taken += _collect(step, transcript, box.drain(), emit)
        steers, stop_asked = keep.before_request(transcript)  # steers taken and saved in one step
        if keep.saves:
            taken.clear()  # stored: a resume has them
        _applied(step, transcript, steers, emit)
        if keep.saves:
            emit.saved(step, start_of(transcript) + len(transcript))
        if stop_asked:
            cancelled.set()
            stop = "cancelled"
            break
        log.debug("session %r step %d: model request with %d messages", keep_id(spec), step, len(transcript))
        policy = spec.context_policy
        if policy is None:
            started = emit.model_request(step, len(transcript))
            try:
                reply = _complete(spec, endpoint, streams, transcript, step, emit)
            except ContextOverflow as exc:
                raise exc.hinted(f"; the run sent all {len(transcript)} messages of the session: "
                                 f"Spec(context_window=TOKENS), the model's context, sends only what fits") from exc
        else:
            reply, started = _within(policy, spec, endpoint, streams, transcript, step, emit)
        reply = distinct_call_ids(reply)  # before anything stores, journals or matches a call by its id
        taken.clear()  # the model has read them
        steps = step
        transcript.append(reply)
        emit.model_response(step, reply, started)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("session %r step %d: model replied %d chars of text, tool calls %s, usage %s",
                      keep_id(spec), step, len(reply.text), [c.name for c in reply.tool_calls], reply.usage)
        if reply.usage:
            for name, count in reply.usage.items():
                usage[name] = usage.get(name, 0) + count
        if not reply.tool_calls:
            stop = "answered"
            break
        waiting = _run_tools(spec, step, transcript, emit, cancelled, keep)
    if waiting:
        stop = "awaiting_approval"
    result = Result(messages=transcript, text=reply.text if stop == "answered" and reply is not None else "",
                    steps=steps, stop_reason=stop, unapplied_steers=box.close(), usage=usage,
                    pending_approvals=keep.calls.pending(waiting))
    keep.finish(transcript, result)
    if keep.saves:
        emit.saved(steps, start_of(transcript) + len(transcript))
    return result


def _complete(spec: Spec, endpoint: Endpoint, streams: StreamingEndpoint | None, messages: Sequence[Message],
              step: int, emit: Sink) -> Message:
    if streams is None:
        return endpoint.complete(spec.system, messages, spec.toolbox)
    return streams.complete(spec.system, messages, spec.toolbox, on_text=partial(emit.text_delta, step))


def _compact(compacts: Compacts, spec: Spec, endpoint: Endpoint, transcript: list[Message], step: int,
             emit: Sink) -> None:
    """Append the policy's compaction record, if it makes one, to ``transcript`` (the save before the request
    stores it). A summary request that fails appends nothing, and the run goes on: ``select`` sends what fits."""
    try:
        record = compacts(spec.system, transcript, spec.toolbox, endpoint)
    except EndpointError as exc:
        log.warning("session %r step %d: the summary request failed, nothing compacted: %s", keep_id(spec), step,
                    _cause(exc))
        return
    if record is None:
        return
    policy = spec.context_policy
    if policy is None or emit is SILENT:
        transcript.append(record)
        return
    before = policy.select(spec.system, transcript, spec.toolbox).tokens
    transcript.append(record)
    after = policy.select(spec.system, transcript, spec.toolbox).tokens
    block = record.content[0]
    emit.compacted(step, block.start, block.end, start_of(transcript) + len(transcript) - 1, before, after)


def _within(policy: ContextPolicy, spec: Spec, endpoint: Endpoint, streams: StreamingEndpoint | None,
            transcript: list[Message], step: int, emit: Sink) -> tuple[Message, float]:
    """The reply to what ``policy`` sends of ``transcript``, and the clock reading of its request. A
    request the provider refuses as too long is narrowed by the policy and sent once more (the error
    came before any of the reply did, so nothing was handed on)."""
    sent = policy.select(spec.system, transcript, spec.toolbox)
    started = emit.model_request(step, len(sent.messages))
    try:
        reply = _complete(spec, endpoint, streams, sent.messages, step, emit)
    except ContextOverflow as exc:
        again = policy.overflowed(exc, sent, spec.system, transcript, spec.toolbox)
        if again is None:
            raise exc.hinted(f"; the context policy sent the last {len(sent.messages)} of {len(transcript)} "
                             f"messages and can leave nothing more out") from exc
        log.info("session %r step %d: the provider refused %d messages as too long; sending the last %d",
                 keep_id(spec), step, len(sent.messages), len(again.messages))
        refused, sent = sent, again
        started = emit.model_request(step, len(sent.messages))
        try:
            reply = _complete(spec, endpoint, streams, sent.messages, step, emit)
        except ContextOverflow as second:
            raise second.hinted(f"; the context policy had narrowed the request from {len(refused.messages)} to "
                                f"{len(sent.messages)} messages after the provider refused the first") from second
    policy.observe(sent, reply.usage)
    return reply, started


def _run_tools(spec: Spec, step: int, transcript: list[Message], emit: Sink, cancelled: threading.Event,
               keep: Keeping) -> list[Content]:
    """Answer every tool call of the last message, in one message of results: a call never stands in the
    transcript without its result, whatever stops the run. Once a cancel is seen, every call left gets an
    error result saying so. While a call waits for a person's decision none of the reply's calls runs: the
    reply leaves the transcript (it waits in the journal) and the calls waiting are returned."""
    keep.begin_tools(transcript)
    if not cancelled.is_set():
        waiting, stop_asked = keep.calls.approvals(spec, step, emit)
        if stop_asked:
            cancelled.set()
        elif waiting:
            transcript.pop()
            return waiting
    results: list[Content] = []
    for call in transcript[-1].tool_calls:
        tool = spec.tool(call.name)
        result = keep.calls.replay(call, tool)
        if result is None:
            if not cancelled.is_set() and not keep.calls.may_run(call, tool):
                cancelled.set()
            if cancelled.is_set():
                result = Content.tool_result(call.id, CANCELLED, is_error=True)
            else:
                started = emit.tool_called(step, call)
                log.debug("session %r step %d: tool %s [%s] called with %d chars of arguments", keep_id(spec),
                          step, call.name, call.id, len(call.arguments))
                result = _invoke(tool, call)
                seconds = emit.tool_returned(started)
                log.debug("session %r step %d: tool %s [%s] returned %d chars%s", keep_id(spec), step,
                          call.name, call.id, len(result.text), " (an error)" if result.is_error else "")
                keep.calls.ran(call, tool, result)  # kept before a callback hears of it: one that raises loses nothing
                emit.tool_finished(step, call, result, seconds)
        results.append(result)
    transcript.append(Message(Role.USER, results))
    return []


def _collect(step: int, transcript: list[Message], steers: list[str], emit: Sink) -> list[str]:
    """Append the steers of the run's own box; return them."""
    for text in steers:
        transcript.append(Message.user(text, steer=True))
        emit.steer_applied(step, text, start_of(transcript) + len(transcript) - 1, "run")
    return steers


def _give_back(keep: Keeping, exc: BaseException, transcript: list[Message], taken: list[str],
               left: list[str]) -> None:
    """A failing run keeps the steers it was given (``Run.steer``) that no stored transcript holds: they become
    the session's waiting steers, which a resume takes (after an unanswered save, ``stored_as`` tells whether
    it landed with them). What cannot be stored or checked is handed back on the exception, in order, as
    ``exc.unapplied_steers``."""
    if not taken and not left:
        return
    maybe: list[str] = []
    if taken and isinstance(exc, OutcomeUnknown):
        landed = keep.stored_as(transcript)
        if landed is None:
            maybe = taken  # cannot tell: the caller decides
        elif landed:
            taken = []  # the save landed: a resume has them
    sure = [*taken, *left] if not maybe else list(left)
    unstored = sure if isinstance(exc, TranscriptDeleted) else keep.store_steers(sure)
    back = [*maybe, *unstored]
    if back:
        try:
            exc.unapplied_steers = back  # type: ignore[attr-defined]
        except AttributeError:  # an exception type that takes no attributes: say so, at least
            log.error("%d steer(s) given to the failed run are lost: %r", len(back), back)


def _applied(step: int, transcript: list[Message], steers: Sequence[str], emit: Sink) -> None:
    """Report the session's steers, which the save appended: they are the last ``len(steers)`` messages."""
    first = start_of(transcript) + len(transcript) - len(steers)
    for i, text in enumerate(steers):
        emit.steer_applied(step, text, first + i, "session")


def keep_id(spec: Spec) -> str | None:
    return getattr(spec.session, "id", None)


def _cause(exc: BaseException) -> str:
    """The error and the chain under it, one line: ``LeaseLost: ... (caused by OperationalError: ...)``."""
    text = f"{type(exc).__name__}: {exc}"
    under, seen = exc.__cause__ or exc.__context__, 0
    while under is not None and seen < 5:
        text += f" (caused by {type(under).__name__}: {under})"
        under, seen = under.__cause__ or under.__context__, seen + 1
    return text


def _invoke(tool: Tool | None, call: Content) -> Content:
    if tool is None:
        return Content.tool_result(call.id, f"there is no tool named {call.name!r}", is_error=True)
    return tool.invoke(call)
