"""A session: one conversation of a store, addressed. ``open`` makes one; it is what ``Spec.session`` takes.
Each call that needs more of the store than the four methods of a plain ``Store`` raises ``Unsupported``
for one without them."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence

from . import approvals, context, eventlog, lifecycle, validate
from .contract import RunStore, Store
from .errors import ArgumentError, Unsupported
from .messages import Message
from .run import turns
from .values import Decision, Holder, PendingApproval, Scalar, SessionInfo, StoredEvent

ANSWER_TAIL = 64
"""Messages from the transcript's end ``StoreSession.answer`` reads first, looking for the keyed message."""


class StoreSession:
    """The Session ``open`` returns: one conversation of one store."""

    __slots__ = ("id", "store")

    def __init__(self, id: str, store: Store) -> None:
        self.id = id
        self.store = store

    def save(self, msgs: Sequence[Message]) -> None:
        self.store.save(self.id, msgs)

    def messages(self, last: int | None = None, *, recent: bool = False) -> list[Message]:
        """The stored transcript; with ``last``, only its last ``last`` messages, read without the rest.
        With ``recent=True``, what a run under ``Compaction`` needs to go on with the session, read from the
        end (``context.read_recent``): an ``agent.Tail`` to append the new message to and run, so resuming
        a long session costs about what its requests send."""
        if recent:
            if last is not None:
                raise ArgumentError("Session.messages() takes last= or recent=True, not both")
            return context.read_recent(self.store, self.id)
        if last is None:
            return self.store.messages(self.id)
        last = lifecycle.last_count(last)
        if isinstance(self.store, RunStore):
            return self.store.tail(self.id, last)
        return self.store.messages(self.id)[-last:] if last else []

    def steer(self, text: str, key: str | None = None) -> bool:
        """Leave ``text`` for the session's next model request, whichever process makes it; ``True`` when it
        was stored. With ``key``, only if no steer with that key was accepted before (``False``): a steer
        that failed with ``OutcomeUnknown``, sent again with the same key, is delivered once."""
        validate.steer_text(text)
        if key is None:
            self.store.add_steer(self.id, text)
            return True
        validate.steer_key(key, "Session.steer(key=)")
        return self._run_store("steer(key=)", "SteerKeyStore").add_steer_once(self.id, text, key)

    def enqueue(self, text: str, key: str) -> int:
        """Store ``text`` under ``key`` in the session's queue, for a turn of its own that whoever holds the
        session next runs (a ``Runner.turn``, or the sweep); nothing runs here. A key is queued once, so sending
        again after a failure is safe. Returns the message's place among those waiting (1: next);
        ``answer(key)`` reads its answer."""
        validate.steer_key(key, "Session.enqueue(key=)")
        validate.steer_text(text, "Session.enqueue(text)")
        return self._run_store("enqueue", "QueueStore").enqueue(self.id, key, text)

    def queued(self) -> list[str]:
        """The keys of the messages waiting in the session's queue for a turn of their own, oldest first."""
        return self._run_store("queued", "QueueStore").queued(self.id)

    def answer(self, key: str, timeout: float = 0.0) -> Message | None:
        """The reply that answered the turn whose message has ``key`` (``Runner.turn``, ``enqueue``), whichever
        process made it; ``None`` while there is none. With ``timeout`` (seconds), it waits that long at most,
        reading again after 0.02 s, then twice as long each time, up to 0.5 s."""
        validate.steer_key(key, "Session.answer(key)")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
            raise ArgumentError(f"Session.answer(timeout=) must be a finite number of seconds >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        pause = 0.02
        while True:
            found = self._answer(key)
            left = deadline - time.monotonic()
            if found is not None or left <= 0:
                return found
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    def take_steers(self) -> list[str]:
        return self.store.take_steers(self.id)

    def pending_steers(self) -> list[str]:
        """The steers waiting for the next model request, oldest first, without taking them."""
        return self._run_store("pending_steers", "LifecycleStore").pending_steers(self.id)

    def info(self) -> SessionInfo | None:
        """When the session was created and last updated, its length and metadata; ``None`` when it does
        not exist (nothing saved, ran on, or labelled it)."""
        return self._run_store("info", "LifecycleStore").info(self.id)

    def set_metadata(self, changes: Mapping[str, Scalar | None]) -> dict[str, Scalar]:
        """Merge ``changes`` into the session's metadata (``None`` removes a key); return it as stored.
        Creates the session if it does not exist yet: label a conversation before its first run."""
        return self._run_store("set_metadata", "LifecycleStore").set_metadata(self.id, changes)

    def delete(self, *, force: bool = False) -> bool:
        """Remove the session and everything kept for it, at once (see ``LifecycleStore.delete``)."""
        return self._run_store("delete", "LifecycleStore").delete(self.id, force=force)

    def fork(self, new_id: str, at: int | None = None, *, allow_unanswered: bool = False) -> StoreSession:
        """Start ``new_id`` from this transcript (the first ``at`` messages, or all of it). The two then
        diverge; steers waiting here stay here. A cut that would leave tool calls without their results is
        refused unless ``allow_unanswered`` (see docs/runs/fork.md)."""
        validate.session_id(new_id, "Session.fork(new_id)")
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
            raise ArgumentError(f"Session.fork(at=) must be None or an int >= 0, got {at!r}")
        self._run_store("fork").fork(self.id, new_id, at, allow_unanswered=allow_unanswered)
        return StoreSession(new_id, self.store)

    def holder(self) -> Holder | None:
        """Who runs this session now, and until when; ``None`` when no live run holds it."""
        return self._run_store("holder").holder(self.id)

    def cancel(self) -> bool:
        """Cancel the session's turn: the run holding it, in whatever process, stops before its next model
        request or tool call, and no run that goes on with that turn starts one either; a turn waiting for
        approvals is closed (its calls get error results). ``True`` when there was a run or a waiting turn
        to cancel: then no call of that turn starts after this returns. See ``approvals.cancel``."""
        return approvals.cancel(self._run_store("cancel"), self.id)

    def pending_approvals(self) -> list[PendingApproval]:
        """The calls waiting for a person's decision, in the order the model made them."""
        return approvals.pending(self._run_store("pending_approvals", "ApprovalStore"), self.id)

    def approve(self, call_id: str, reason: str = "") -> Decision:
        """Approve the waiting call ``call_id`` (``reason``: why, kept with the decision); the session's next
        run runs it (once). Exactly one of concurrent decisions on a call is stored: the others raise
        ``AlreadyDecided``, as does a call past its deadline; an id that waits for nothing raises
        ``UnknownApproval``."""
        return approvals.decide(self._run_store("approve", "ApprovalStore"), self.id, call_id, True, reason)

    def deny(self, call_id: str, reason: str = "") -> Decision:
        """Deny the waiting call ``call_id``: the next run gives it an error result carrying ``reason``,
        and the model is asked again. Errors as ``approve``."""
        return approvals.decide(self._run_store("deny", "ApprovalStore"), self.id, call_id, False, reason)

    def events(self, after: int = 0, limit: int = 100) -> list[StoredEvent]:
        """The events of the session's log numbered above ``after``, oldest first, at most ``limit``
        (runs with ``Spec(publish_events=True)`` write them; see docs/runs/events.md), each whole: the
        messages events point at are read and joined in (``eventlog.resolve``)."""
        after, limit = eventlog.check_read(after, limit)
        store = self._run_store("events", "EventStore")
        return eventlog.resolve(store, self.id, store.events(self.id, after, limit))

    def follow(self, after: int = 0, timeout: float | None = None,
               poll: tuple[float, float] = (0.02, 0.5)) -> Iterator[StoredEvent]:
        """Yield the session's events above ``after`` as they arrive, from whichever process writes them,
        for ``timeout`` seconds (``None``: until you stop iterating). Come back with the last ``seq`` you saw
        as ``after``: you miss nothing and see nothing twice (``eventlog.follow``)."""
        return eventlog.follow(self._run_store("follow", "EventStore"), self.id, after, timeout, poll)

    def _answer(self, key: str) -> Message | None:
        """``answer``'s one look: the transcript's end first (the message waited for is usually there); the
        whole transcript only when the key is neither there nor queued."""
        store = self.store
        if isinstance(store, RunStore):
            tail = store.tail(self.id, ANSWER_TAIL)
            at = turns.keyed(tail, key)
            if at is not None:
                return turns.answered(tail, at)
            if len(tail) < ANSWER_TAIL or key in store.queued(self.id):
                return None  # the tail is the whole transcript, or the message waits in the queue
        msgs = store.messages(self.id)
        at = turns.keyed(msgs, key)
        return None if at is None else turns.answered(msgs, at)

    def _run_store(self, op: str, protocol: str = "RunStore") -> RunStore:
        """Every protocol a call may need is ``RunStore``, named as the caller's docs name it."""
        if not isinstance(self.store, RunStore):
            call = op if op.endswith(")") else op + "()"
            raise Unsupported(f"Session.{call} needs a store implementing agent_sessions.{protocol}; {self.store!r} "
                              "does not")
        return self.store

    def __repr__(self) -> str:
        return f"StoreSession({self.id!r}, {self.store!r})"


def open(session_id: str, store: Store) -> StoreSession:
    """Address one conversation of ``store``. Opening touches nothing: the session may not exist yet."""
    validate.session_id(session_id, "agent.open(session_id)")
    if not isinstance(store, Store):
        raise ArgumentError(f"agent.open(store) needs a Store (save, messages, add_steer, take_steers), "
                            f"got {type(store).__name__}")
    return StoreSession(session_id, store)
