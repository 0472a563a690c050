"""The tool journal: what a run has started and finished of one model reply's tool calls (docs/runs/journal.md).

The stored transcript never holds a tool call without its result, so a reply whose tools are running is kept
beside it, in the journal, until the next save carries the reply and all its results. A resume finishes it:
journalled results are replayed, and a non-idempotent tool that started but never finished is not run again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import MessageError, StoreError
from .messages import Content, Message, Role
from .values import Decision

UNKNOWN_OUTCOME = ("the outcome of this call is unknown: the run that made it stopped while the tool ran, and the "
                   "tool is not idempotent, so it was not run again")
NOT_RUN_SUPERSEDED = ("no result: the run that made this call stopped before this call's result was kept, and the "
                      "conversation went on with a new message, so it was not run again")
"""A call of a reply left in the journal by a run that stopped (its lease lapsed), when a run with new input
comes first: the reply goes back in its place with its calls closed (``persistence.Leased.resume``)."""


TAIL = 2
"""Messages before a reply that its fingerprint covers."""


def fingerprint(prefix: Sequence[Message], end: int | None = None) -> str:
    """Which transcript a reply answered: with its length, a hash of the stored form of the messages just
    before it (the new user message or the previous results). Hashing all of it would cost a step
    O(transcript); a different transcript of the same length almost always differs at its end. ``end``:
    of ``prefix[:end]``, without copying the transcript to say so (the step before each tool call asks)."""
    end = len(prefix) if end is None else end
    h = hashlib.sha256()
    for m in prefix[max(0, end - TAIL):end]:
        h.update(m.to_json().encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass
class Approval:
    """A call of the journal's reply that needs a person's decision: when it was asked for, until when it
    may wait, and the decision once there is one."""

    asked: float
    deadline: float | None = None
    decision: Decision | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"asked": self.asked, "deadline": self.deadline,
                "decision": None if self.decision is None else self.decision.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Approval:
        decision = data.get("decision")
        deadline = data.get("deadline")
        return cls(float(data["asked"]), None if deadline is None else float(deadline),
                   None if decision is None else Decision.from_dict(decision))


EXPIRED = "past its approval deadline, undecided: the next run denies it"
"""How the CLI and the console say an ``expired`` stage."""


@dataclass(frozen=True)
class Stage:
    """Where a call of the journal's reply stands (``Journal.stages``): ``done`` (with its ``result``),
    ``running`` (its tool entered, no result yet), ``waiting`` for a person's decision, ``expired``
    (undecided past its deadline: the next run denies it), ``approved`` or ``denied`` (with the
    ``decision``; not run yet), ``not started``."""

    call: Content
    name: str
    result: Content | None = None
    decision: Decision | None = None


@dataclass
class Journal:
    at: int
    """Where the reply stands in the transcript."""
    digest: str
    """``fingerprint(transcript[:at])``."""
    reply: Message
    started: list[str] = field(default_factory=list)
    """Tool call ids whose tool has been entered."""
    results: dict[str, Content] = field(default_factory=dict)
    approvals: dict[str, Approval] = field(default_factory=dict)
    """Calls waiting for (or given) a person's decision, by call id (see agent_sessions.approvals)."""

    def answers(self, transcript: Sequence[Message], start: int = 0) -> bool:
        """Does the reply answer ``transcript`` (the stored one from index ``start`` on: it must hold the
        ``TAIL`` messages before the reply)?"""
        return start + len(transcript) == self.at and fingerprint(transcript) == self.digest

    def stages(self, now: float) -> list[Stage]:
        """Where each call of the reply stands, in the order the model made them."""
        found = []
        for call in self.reply.tool_calls:
            approval = self.approvals.get(call.id)
            if call.id in self.results:
                found.append(Stage(call, "done", result=self.results[call.id]))
            elif call.id in self.started:
                found.append(Stage(call, "running"))
            elif approval is None:
                found.append(Stage(call, "not started"))
            elif approval.decision is not None:
                stage = "approved" if approval.decision.approved else "denied"
                found.append(Stage(call, stage, decision=approval.decision))
            elif approval.deadline is not None and now >= approval.deadline:
                found.append(Stage(call, "expired"))
            else:
                found.append(Stage(call, "waiting"))
        return found

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "at": self.at,
            "digest": self.digest,
            "reply": self.reply.to_json(),
            "started": self.started,
            "results": Message(Role.USER, self.results.values()).to_json(),
        }
        if self.approvals:
            data["approvals"] = {call: a.to_dict() for call, a in self.approvals.items()}
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def of(cls, text: str | None, session: str) -> Journal | None:
        """The journal ``session``'s store holds as ``text`` (``None``: none)."""
        return None if text is None else cls.from_json(text, f"session {session!r}")

    @classmethod
    def from_json(cls, text: str, where: str) -> Journal:
        try:
            data = json.loads(text)
            results = Message.from_json(data["results"]).content
            return cls(at=int(data["at"]),
                       digest=str(data["digest"]),
                       reply=Message.from_json(data["reply"]),
                       started=[str(s) for s in data["started"]],
                       results={r.tool_call_id: r for r in results},
                       approvals={str(k): Approval.from_dict(v) for k, v in data.get("approvals", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError, MessageError) as exc:
            raise StoreError(f"{where}: the stored tool journal is corrupt: {exc}") from exc
