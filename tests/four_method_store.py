"""A third-party store with only the core protocol (``agent.Store``'s four methods, over a memory store):
no lease, journal, lifecycle, approvals or event log. What the library does without the optional
protocols is tested with it."""

from __future__ import annotations

from collections.abc import Sequence

import agent_sessions as agent
from stores import memory


class FourMethodStore:
    def __init__(self) -> None:
        self.inner = memory.Store()

    def save(self, session: str, msgs: Sequence[agent.Message]) -> None:
        self.inner.save(session, msgs)

    def messages(self, session: str) -> list[agent.Message]:
        return self.inner.messages(session)

    def add_steer(self, session: str, text: str) -> None:
        self.inner.add_steer(session, text)

    def take_steers(self, session: str) -> list[str]:
        return self.inner.take_steers(session)
