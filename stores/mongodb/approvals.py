"""``ApprovalStore``: a decision on a waiting tool call swaps the journal, guarded by its text, not by a
lease (agent_sessions.approvals)."""

from __future__ import annotations

from agent_sessions import validate

from .base import StoreBase
from .document import TOUCH


class Approvals(StoreBase):
    """The one write of a process holding no lease."""

    def swap_journal(self, session: str, expected: str, journal: str) -> bool:
        """One update whose filter holds the expected text: a decision on a waiting call (ApprovalStore)."""
        validate.session_id(session)
        with self._failing("swap_journal", session):
            return self._sessions.update_one({"_id": session, "journal": expected},
                                             {"$set": {"journal": journal},
                                              "$currentDate": {**TOUCH, "open_since": True}}).matched_count == 1
