"""OpenTelemetry tracing for runs (the ``otel`` extra; docs/tracing.md): an ``events`` callback that turns
what a run reports into spans after the GenAI semantic conventions: ``invoke_agent`` (the run), a ``step``
per model request, in each ``chat {model}`` and an ``execute_tool {name}`` per call. Built from events
rather than by wrapping the loop, so the core imports no optional package and a run without ``events``
pays nothing; only the OpenTelemetry API is imported (without an SDK every span is a no-op).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from contextvars import Token
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode
except ImportError as exc:
    raise ImportError(
        f"agent_sessions.otel requires the OpenTelemetry API ({exc.name} is missing). "
        "Install it with: pip install 'stored-agent-sessions[otel]'"
    ) from exc

from . import __version__
from .context import prompt_tokens
from .endpoints import AnthropicMessages, OpenAIChat
from .errors import EndpointError
from .events import (
    Compacted,
    Event,
    Events,
    Failed,
    Finished,
    ModelRequest,
    ModelResponse,
    Reported,
    Saved,
    SteerApplied,
    StepStarted,
    ToolCalled,
    ToolFinished,
)

if TYPE_CHECKING:
    from .endpoints import Endpoint
    from .spec import Spec

log = logging.getLogger(__name__)

SCOPE = "agent_sessions"
"""The instrumentation scope (tracer name) of every span made here."""

# GenAI semantic-convention attributes, written out since the conventions are still in development (as of
# semconv 1.37: gen_ai.provider.name, not gen_ai.system).
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
CONVERSATION = "gen_ai.conversation.id"
AGENT_NAME = "gen_ai.agent.name"
REQUEST_MODEL = "gen_ai.request.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
CACHE_CREATION_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
TOOL_TYPE = "gen_ai.tool.type"
ERROR_TYPE = "error.type"
HTTP_STATUS = "http.response.status_code"
# This library's own, for what the conventions have no name for.
STEP = "agent_sessions.step"
STEPS = "agent_sessions.steps"
STOP_REASON = "agent_sessions.stop_reason"
MESSAGES = "agent_sessions.messages"

TOOL_ERROR = "tool_error"
"""``error.type`` of a tool call whose result is an error (the tool raised, or its call was malformed):
the model reads it and the run goes on, so only that tool's span is marked."""

OTHER_PROVIDER = "_OTHER"
MAX_DESCRIPTION = 1000
"""Characters of an error text kept in a span's status description: enough to read, not a whole page."""

_PROVIDERS = ((OpenAIChat, "openai"), (AnthropicMessages, "anthropic"))

Kind = Literal["run", "step", "chat", "tool"]


@dataclass
class _Open:
    kind: Kind
    span: Span
    token: Token[otel_context.Context]
    """From ``context.attach``: while the span is open it is the current span of the run's thread, so
    spans the endpoint's HTTP client or a tool makes (an instrumented ``requests``, a database driver)
    are its children."""


class Tracing:
    """An ``events`` callback that makes OpenTelemetry spans of a run, one run at a time; ``also`` (another
    callback) is told every event after it. What tracing raises is logged and never reaches the run
    (telemetry must not stop an agent). The run's span is a child of the span current where the Tracing was
    made, so a run started inside a request's span is part of its trace."""

    def __init__(self, *, session_id: str | None = None, model: str | None = None, provider: str = OTHER_PROVIDER,
                 agent_name: str | None = None, tracer_provider: trace.TracerProvider | None = None,
                 also: Events | None = None) -> None:
        self.session_id = session_id
        self.model = model
        self.provider = provider
        self.agent_name = agent_name
        self.also = also
        self._tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        self._parent = otel_context.get_current()
        self._lock = threading.Lock()
        self._open: list[_Open] = []
        self._thread: int | None = None
        self._warned = False
        self._failed = False
        self._usage: dict[str, int] = {}

    @classmethod
    def for_run(cls, spec: Spec, endpoint: Endpoint, *, agent_name: str | None = None,
                tracer_provider: trace.TracerProvider | None = None, also: Events | None = None) -> Tracing:
        """A Tracing with the session id of ``spec.session`` and the endpoint's model and provider (an
        ``OpenAIChat`` is ``openai`` whatever server it talks to, as the conventions ask)."""
        session_id = getattr(spec.session, "id", None)  # a Session need not have one; the library's do
        model = getattr(endpoint, "model", None)
        return cls(session_id=session_id if isinstance(session_id, str) else None,
                   model=model if isinstance(model, str) else None,
                   provider=next((name for kind, name in _PROVIDERS if isinstance(endpoint, kind)), OTHER_PROVIDER),
                   agent_name=agent_name, tracer_provider=tracer_provider, also=also)

    def __call__(self, event: Event) -> None:
        try:
            self._handle(event)
        except Exception:
            # The traceback once per Tracing: a broken exporter would otherwise log it at every event.
            level = logging.DEBUG if self._failed else logging.ERROR
            self._failed = True
            log.log(level, "tracing %s failed; the run goes on, untraced where this failed",
                    type(event).__name__, exc_info=True)
        if self.also is not None:
            self.also(event)

    def _handle(self, event: Event) -> None:
        with self._lock:
            me = threading.get_ident()
            if self._open and self._thread != me:
                if not self._warned:
                    self._warned = True
                    log.warning("one Tracing was given to two runs at once: the second one's events are not "
                                "traced (make a Tracing per run)")
                return
            if not self._open:
                self._thread = me
                self._start_run()
            self._dispatch(event)

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, StepStarted):
            while self._open[-1].kind != "run":  # a step still open when the next begins
                self._pop()
            self._start("step", "step", SpanKind.INTERNAL, {STEP: event.step})
        elif isinstance(event, ModelRequest):
            self._start("chat", f"chat {self.model}" if self.model else "chat", SpanKind.CLIENT, {
                OPERATION: "chat", PROVIDER: self.provider, STEP: event.step, MESSAGES: event.messages,
                **({REQUEST_MODEL: self.model} if self.model else {}),
            })
        elif isinstance(event, ModelResponse):
            usage = event.message.usage or {}
            for name, count in usage.items():
                self._usage[name] = self._usage.get(name, 0) + count
            chat = self._find("chat")
            if chat is not None:
                chat.span.set_attributes(usage_attributes(usage))
                self._end_through(chat)
        elif isinstance(event, ToolCalled):
            self._start("tool", f"execute_tool {event.call.name}", SpanKind.INTERNAL, {
                OPERATION: "execute_tool", TOOL_NAME: event.call.name, TOOL_CALL_ID: event.call.id,
                TOOL_TYPE: "function", STEP: event.step,
            })
        elif isinstance(event, ToolFinished):
            tool = self._find("tool")
            if tool is not None:
                if event.result.is_error:
                    text = event.result.text
                    tool.span.set_attribute(ERROR_TYPE, TOOL_ERROR)
                    tool.span.add_event("exception", {"exception.message": text[:MAX_DESCRIPTION]})
                    tool.span.set_status(Status(StatusCode.ERROR, text[:MAX_DESCRIPTION]))
                self._end_through(tool)
        elif type(event) in NOTED:
            name, prefix = NOTED[type(event)]
            attributes = noted(event, prefix)
            self._open[-1].span.add_event(name, attributes)
            if isinstance(event, Compacted):
                self._open[-1].span.set_attributes(attributes)
        elif isinstance(event, Finished):
            run = self._open[0]
            run.span.set_attributes({STEPS: event.result.steps, STOP_REASON: event.result.stop_reason})
            self._end_run()
        elif isinstance(event, Failed):
            self._fail(event.error)
        # An event this version does not know (a later one) adds nothing to the trace.

    def _start_run(self) -> None:
        attributes: dict[str, Any] = {OPERATION: "invoke_agent", PROVIDER: self.provider}
        if self.agent_name:
            attributes[AGENT_NAME] = self.agent_name
        if self.model:
            attributes[REQUEST_MODEL] = self.model
        name = f"invoke_agent {self.agent_name}" if self.agent_name else "invoke_agent"
        self._usage = {}
        self._start("run", name, SpanKind.INTERNAL, attributes, parent=self._parent)

    def _start(self, kind: Kind, name: str, span_kind: SpanKind, attributes: dict[str, Any],
               parent: otel_context.Context | None = None) -> None:
        if self.session_id is not None:
            attributes[CONVERSATION] = self.session_id
        if parent is None:
            parent = trace.set_span_in_context(self._open[-1].span, self._parent)
        span = self._tracer.start_span(name, context=parent, kind=span_kind, attributes=attributes)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        self._open.append(_Open(kind, span, token))

    def _find(self, kind: Kind) -> _Open | None:
        return next((o for o in reversed(self._open) if o.kind == kind), None)

    def _end_through(self, entry: _Open) -> None:
        while self._open:
            if self._pop() is entry:
                return

    def _pop(self) -> _Open:
        """End the innermost span: tokens are detached in the reverse of the order they were attached, as
        contextvars require."""
        entry = self._open.pop()
        entry.span.end()
        otel_context.detach(entry.token)
        return entry

    def _end_run(self) -> None:
        self._open[0].span.set_attributes(usage_attributes(self._usage))
        self._end_through(self._open[0])

    def _fail(self, error: BaseException) -> None:
        """Every open span ends with the error: it escaped each of them, innermost first."""
        kind = type(error)
        error_type = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        description = f"{kind.__name__}: {error}"[:MAX_DESCRIPTION]
        for entry in self._open:
            entry.span.record_exception(error)
            entry.span.set_attribute(ERROR_TYPE, error_type)
            entry.span.set_status(Status(StatusCode.ERROR, description))
            if entry.kind == "chat" and isinstance(error, EndpointError) and error.status is not None:
                entry.span.set_attribute(HTTP_STATUS, error.status)
        self._end_run()


NOTED: dict[type[Event], tuple[str, str]] = {
    SteerApplied: ("agent_sessions.steer", "agent_sessions.steer."),
    Compacted: ("agent_sessions.compacted", "agent_sessions.compaction."),
    Saved: ("agent_sessions.saved", "agent_sessions."),
}
"""The events that are a span event on the innermost open span (a compaction's attributes are set on its step
as well): the span event's name, and the prefix of its attributes' names."""


def noted(event: Reported, prefix: str) -> dict[str, Any]:
    """An event's fields (its ``data()``, as declared in ``events``) as span attributes named ``prefix`` and
    the field (``step``: ``agent_sessions.step``, as on every span). A ``text`` (a steer's: what a person
    wrote) is left out, as every span leaves out what anyone wrote."""
    return {STEP if name == "step" else prefix + name: value for name, value in event.data().items()
            if name != "text" and isinstance(value, (str, bool, int, float))}


def usage_attributes(usage: Mapping[str, int]) -> dict[str, int]:
    """The provider's token counts, by its own field names, as the conventions' attributes: the input total
    they ask for as ``context.prompt_tokens`` counts it (Anthropic's cached tokens added), and the cached
    ones kept apart as well."""
    out: dict[str, int] = {}
    cache_read = usage.get("cache_read_input_tokens")
    cache_creation = usage.get("cache_creation_input_tokens")
    if "prompt_tokens" in usage or "input_tokens" in usage:
        out[INPUT_TOKENS] = prompt_tokens(usage)
    if "completion_tokens" in usage:
        out[OUTPUT_TOKENS] = usage["completion_tokens"]
    elif "output_tokens" in usage:
        out[OUTPUT_TOKENS] = usage["output_tokens"]
    if cache_read is not None:
        out[CACHE_READ_TOKENS] = cache_read
    if cache_creation is not None:
        out[CACHE_CREATION_TOKENS] = cache_creation
    return out


__all__ = ["SCOPE", "Tracing", "usage_attributes"]
