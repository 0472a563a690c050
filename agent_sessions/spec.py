"""What a run is asked to do."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .context import ContextPolicy, policy_of
from .contract import Session
from .errors import ArgumentError
from .tools import Tool, as_tool


class Pattern(StrEnum):
    REACT = "react"


@dataclass(frozen=True)
class Spec:
    """``session`` is ``None`` by default, and then the run touches no store at all."""

    pattern: Pattern = Pattern.REACT
    max_steps: int = 8
    session: Session | None = None
    tools: Sequence[Tool | Callable[..., Any]] = ()
    system: str = ""
    lease_ttl: float = 30.0
    """Seconds a run's lease on its session lasts unless renewed (every third of it, while the run
    lives): how long a dead worker's session stays blocked before another may take it over."""
    lease_wait: float = 0.0
    """Seconds to wait for another live run's lease to end; 0 fails at once with SessionBusy."""
    replace_transcript: bool = False
    """Let the run's first save replace whatever transcript the session holds. By default (``False``) a
    run over a RunStore only ever extends the stored transcript, and fails with ``TranscriptConflict``,
    before any model request, when its messages do not start with it."""
    approval_deadline: float | None = None
    """Seconds a call needing approval may wait for its decision (a tool's own ``approval_deadline``
    wins); undecided past it, it counts as denied. ``None``: no deadline."""
    publish_events: bool = False
    """Write the run's events to the session's log (``agent_sessions.eventlog``), so any process can read
    and follow them (``session.follow``). Needs a session over an ``EventStore``; off, it costs nothing."""
    events_kept: int = 10_000
    """With ``publish_events``: how many of the session's newest events its log keeps (each append drops
    the oldest beyond them)."""
    context_window: int | None = None
    """The model's context, in tokens: turns on the default context policy, so each request sends what
    fits of the transcript (the store keeps all of it): a ``Compaction`` sending at most 80% of it, which
    summarises the oldest messages into a stored record as it fills (docs/runs/context.md). ``None``:
    every request sends the whole transcript."""
    context: ContextPolicy | None = None
    """A context policy of your own choosing (``Window(max_tokens=...)``, or any ``ContextPolicy``), instead
    of ``context_window``'s default; not both."""
    name: str | None = None
    """What the application calls this spec (1 to 255 characters): a run records it on its session when it
    takes the lease (``SessionInfo.spec``), so ``agent.recover``'s ``resolve`` can pick the spec to finish a
    stranded session with from the application's own registry. ``None``: none recorded."""
    context_policy: ContextPolicy | None = field(init=False, repr=False, compare=False)
    """The policy the run uses: ``context``, or ``context_window``'s default, or ``None``."""
    toolbox: tuple[Tool, ...] = field(init=False, repr=False, compare=False)
    """``tools`` as Tool objects (plain functions wrapped by ``@agent.tool``): what the model is offered."""
    _tools_by_name: dict[str, Tool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "pattern", Pattern(self.pattern))
        except ValueError:
            raise ArgumentError(f"Spec.pattern must be one of {[p.value for p in Pattern]}") from None
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 0:
            raise ArgumentError(f"Spec.max_steps must be an int >= 0, got {self.max_steps!r}")
        if self.session is not None and not isinstance(self.session, Session):
            raise ArgumentError(f"Spec.session must be a Session (see agent.open), got {type(self.session).__name__}")
        for name in ("lease_ttl", "lease_wait"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ArgumentError(f"Spec.{name} must be a finite number of seconds >= 0, got {value!r}")
        if not self.lease_ttl > 0:
            raise ArgumentError(f"Spec.lease_ttl must be > 0, got {self.lease_ttl!r}")
        deadline = self.approval_deadline
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not 0 < deadline < math.inf):
            raise ArgumentError(f"Spec.approval_deadline must be None or seconds > 0, got {deadline!r}")
        for name in ("replace_transcript", "publish_events"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentError(f"Spec.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.events_kept, bool) or not isinstance(self.events_kept, int) or self.events_kept < 1:
            raise ArgumentError(f"Spec.events_kept must be an int >= 1, got {self.events_kept!r}")
        if self.name is not None and (not isinstance(self.name, str) or not 1 <= len(self.name) <= 255
                                      or "\x00" in self.name):
            raise ArgumentError(
                f"Spec.name must be None or a str of 1 to 255 characters without NUL, got {self.name!r}")
        if not isinstance(self.system, str):
            raise ArgumentError(f"Spec.system must be a str, got {type(self.system).__name__}")
        object.__setattr__(self, "context_policy", policy_of(self.context, self.context_window))
        tools = tuple(as_tool(t) for t in self.tools)
        by_name: dict[str, Tool] = {}
        for t in tools:
            if t.name in by_name:
                raise ArgumentError(f"Spec.tools has two tools named {t.name!r}")
            by_name[t.name] = t
        object.__setattr__(self, "toolbox", tools)
        object.__setattr__(self, "_tools_by_name", by_name)

    def tool(self, name: str) -> Tool | None:
        return self._tools_by_name.get(name)

    def deadline_seconds(self, tool: Tool) -> float | None:
        """How long a call of ``tool`` may wait for its decision: the tool's deadline, else the spec's."""
        return tool.approval_deadline if tool.approval_deadline is not None else self.approval_deadline

    @property
    def asks_approval(self) -> bool:
        """Does any tool need approval for some call? Then the run needs a store that keeps decisions."""
        return any(t.needs_approval is not False for t in self.toolbox)
