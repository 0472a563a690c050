"""What a run returns: its ``Result``, and why it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .messages import Message
from .values import PendingApproval

StopReason = Literal["answered", "max_steps", "cancelled", "awaiting_approval", "superseded"]
"""Why a run stopped. ``"superseded"`` only from ``Runner.turn``: the turn's message was followed by a later
turn's before it was answered, so that turn takes it up (see ``run.turns``)."""


@dataclass(frozen=True)
class Result:
    messages: list[Message]
    """The whole transcript, the final answer included."""
    text: str
    """The final answer; empty when the run stopped without one."""
    steps: int
    """Model requests made."""
    stop_reason: StopReason
    unapplied_steers: list[str]
    """Steers that reached this run's in-memory box and never made it onto a request. A steer still in
    the store was never taken: it stays there for the next run."""
    usage: dict[str, int] = field(default_factory=dict)
    """Token counts the provider reported, summed over this run's requests, by the provider's own field
    names (OpenAI: ``prompt_tokens``, ``completion_tokens``...; Anthropic: ``input_tokens``...)."""
    pending_approvals: list[PendingApproval] = field(default_factory=list)
    """With ``stop_reason == "awaiting_approval"``: the calls waiting for a person's decision. The reply
    that made them waits beside the stored transcript (``messages`` ends before it)."""

    def __repr__(self) -> str:
        """A summary: a run's ``Finished`` event holds its Result, and a log line or a debugger printing the
        event must not print the whole transcript (anyone's words, and megabytes of it)."""
        return (f"Result(stop_reason={self.stop_reason!r}, steps={self.steps}, text=<{len(self.text)} chars>, "
                f"messages=<{len(self.messages)}>, usage={self.usage!r}, "
                f"unapplied_steers=<{len(self.unapplied_steers)}>, "
                f"pending_approvals={[p.call_id for p in self.pending_approvals]!r})")
