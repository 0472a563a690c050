"""``ApprovalStore``: a decision on a waiting tool call swaps the journal, guarded by its text, not by a
lease (agent_sessions.approvals)."""

from __future__ import annotations

from agent_sessions import validate

from . import statements as sql
from .base import SQLBase


class Approvals(SQLBase):
    """The one write of a process holding no lease."""

    def swap_journal(self, session: str, expected: str, journal: str) -> bool:
        """One statement whose WHERE holds the expected text (ApprovalStore): no lease, the text guards."""
        validate.session_id(session)
        params = {"sid": session, "expected": expected, "body": journal}
        return self._transaction(
            "swap_journal", session, lambda conn: self.run(conn, sql.SWAP_JOURNAL, params).rowcount, read_only=True
        ) == 1
