"""The run lease, on the session's document: its holder (token, host, pid), its expiry in seconds on the
server's clock (``$$NOW``), its epoch and the cancel flag. Each step is one single-document operation, and
every fenced write's filter carries the run's token and epoch, so the fencing rule holds without
transactions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from agent_sessions import Holder, LeaseLost, StoreError, validate

from .base import StoreBase, log
from .document import STAMP, TOUCH

NOW = {"$divide": [{"$toLong": "$$NOW"}, 1000]}
"""Seconds since 1970 on the server's clock (an aggregation expression: filters with $expr, pipeline updates)."""
LIVE = {"token": {"$ne": None}, "$expr": {"$gt": ["$expires", NOW]}}
NOT_LIVE = {"$or": [{"token": None}, {"$expr": {"$lte": ["$expires", NOW]}}]}
LEASE = {"host": 1, "pid": 1, "token": 1, "expires": 1, "cancelled": 1, "epoch": 1}


class Lease(StoreBase):
    """``RunStore``'s lease: acquire, renew, release, holder, cancel and check."""

    def acquire(self, session: str, holder: Holder, ttl: float) -> Holder:
        """One update with the server's clock: the lease is taken if free or expired, in a pipeline that
        raises the epoch; a live one makes the upsert collide on ``_id``, and then it is read. The document
        keeps what was taken over (``taken_from``), so an acquisition asked again after its answer was lost
        still hands on the cancel that it took over."""
        validate.session_id(session)
        take = [{"$set": {
            "token": {"$literal": holder.token}, "host": {"$literal": holder.host}, "pid": holder.pid,
            "spec": {"$literal": holder.spec},
            "expires": {"$add": [NOW, float(ttl)]}, "cancelled": False,
            "epoch": {"$add": [{"$ifNull": ["$epoch", 0]}, 1]},
            # The stage sees the old fields: who had it, and a cancel the new holder is handed.
            "taken_from": {"token": "$token", "host": "$host", "pid": "$pid", "cancelled": "$cancelled"},
            **STAMP,
        }}]
        free = {"_id": session, "$or": [{"token": None}, {"$expr": {"$lte": ["$expires", NOW]}}]}
        with self._failing("acquire", session):
            for _ in range(3):
                try:
                    taken = self._sessions.find_one_and_update(
                        free, take, upsert=True, projection={**LEASE, "taken_from": 1},
                        return_document=ReturnDocument.AFTER,
                    )
                    if taken is not None:
                        before = taken.get("taken_from") or {}
                        if before.get("token") is not None:
                            log.info("MongoDB store: session %r: the lease of pid %s on %s (token %s…) had expired; "
                                     "taken over at epoch %s", session, before.get("pid"), before.get("host"),
                                     str(before["token"])[:8], taken.get("epoch"))
                        got = holder_of(taken)
                        return replace(got, cancelled=True) if before.get("cancelled") else got
                except DuplicateKeyError:
                    pass
                current = self._sessions.find_one({"_id": session}, {**LEASE, "taken_from": 1})
                if current is not None and current.get("token") is not None:
                    got = holder_of(current)
                    if got.token == holder.token and (current.get("taken_from") or {}).get("cancelled"):
                        # This holder's own acquisition, whose answer was lost, asked again (lease.py): the
                        # cancel it took over is still to be handed on, as the lost answer would have.
                        return replace(got, cancelled=True)
                    return got
        raise StoreError(f"MongoDB store: acquire of session {session!r} kept racing with another process")

    def renew(self, session: str, holder: Holder, ttl: float) -> None:
        validate.session_id(session)
        with self._failing("renew", session):
            renewed = self._sessions.update_one(
                {"_id": session, "token": holder.token, "epoch": holder.epoch},
                [{"$set": {"expires": {"$add": [NOW, float(ttl)]}, "updated": "$$NOW"}}],
            )
            if renewed.matched_count != 1:
                raise lost(session, holder, self._sessions.find_one({"_id": session}, LEASE))

    def release(self, session: str, holder: Holder) -> None:
        validate.session_id(session)
        with self._failing("release", session):
            self._sessions.update_one(
                {"_id": session, "token": holder.token, "epoch": holder.epoch},
                {"$set": {"token": None, "host": None, "pid": None, "expires": None},  # a cancel stays: handed on
                 "$currentDate": TOUCH},
            )

    def holder(self, session: str) -> Holder | None:
        validate.session_id(session)
        with self._failing("holder", session):
            doc = self._sessions.find_one({"_id": session, **LIVE}, LEASE)
        return None if doc is None else holder_of(doc)

    def cancel(self, session: str) -> bool:
        validate.session_id(session)
        with self._failing("cancel", session):  # a lapsed lease nobody took is held too
            result = self._sessions.update_one({"_id": session, "token": {"$ne": None}},
                                               {"$set": {"cancelled": True}, "$currentDate": TOUCH})
        return result.matched_count == 1

    def check(self, session: str, holder: Holder) -> bool:
        validate.session_id(session)
        with self._failing("check", session):
            doc = self._sessions.find_one({"_id": session}, LEASE)
        if doc is None or doc.get("token") != holder.token or doc.get("epoch") != holder.epoch:
            raise lost(session, holder, doc)
        return bool(doc.get("cancelled"))


def holder_of(doc: dict[str, Any]) -> Holder:
    return Holder(doc["host"], int(doc["pid"]), doc["token"], float(doc["expires"]), bool(doc.get("cancelled")),
                  int(doc.get("epoch", 0)))


def lost(session: str, holder: Holder, doc: dict[str, Any] | None) -> LeaseLost:
    if doc is None:
        return LeaseLost.superseded(session, holder.epoch, None, None)
    return LeaseLost.superseded(session, holder.epoch, doc.get("token"), int(doc.get("epoch", 0)))
