"""What a store says it can do, once, so the suite knows which tests must pass rather than guess.

Everything is on by default (SQLAlchemy's ``testing/requirements.py`` style): a store's test class
removes what it does not offer, e.g. ``capabilities = Capability.none_but(Capability.RUN_STORE)`` for a
store living in one process.
"""

from __future__ import annotations

from enum import StrEnum


class Capability(StrEnum):
    DURABLE = "durable"
    """A second store object (another ``make_store()``: another worker) sees what the first wrote."""
    PROCESSES = "processes"
    """Other processes reach the same data: ``process_factory()`` builds the store in a spawned process."""
    RUN_STORE = "run_store"
    """It implements ``agent_sessions.RunStore``: leases and fencing, the journal, cancel, fork."""
    APPROVALS = "approvals"
    """It implements ``agent_sessions.ApprovalStore`` (a journal compare-and-swap): tool calls a
    person approves from any process."""
    EVENTS = "events"
    """It implements ``agent_sessions.EventStore``: a session's event log, fenced appends, the cap, and
    runs with ``Spec(publish_events=True)`` followed from another thread."""
    LIFECYCLE = "lifecycle"
    """It implements ``agent_sessions.LifecycleStore``: list, info, metadata, delete, prune, tail."""
    STEER_KEYS = "steer_keys"
    """It implements ``agent_sessions.SteerKeyStore``: a steer sent with a key is stored once per session."""
    QUEUE = "queue"
    """It implements ``agent_sessions.QueueStore``: messages queued for a busy session, each key once, taken
    into the transcript in the order accepted."""
    TAIL = "tail"
    """It implements ``agent_sessions.TailStore``: a transcript read from its end, saved from an index."""

    @classmethod
    def all(cls) -> frozenset[Capability]:
        return frozenset(cls)

    @classmethod
    def none_but(cls, *kept: Capability) -> frozenset[Capability]:
        return frozenset(kept)
