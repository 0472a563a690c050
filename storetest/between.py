"""What lands between a store's read and its guarded write (``agent_sessions.backed``) must refuse the
write. These stand between the store and its ``Backend`` to drive that interleaving deterministically, and
check the backend's own half: every ``Guard`` field is evaluated (docs/reliability.md, "Mutants"). And a
write whose answer was lost (after the write, or the line cut before it): the library reads the session
back and settles it, landed or written again, never twice.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Holder, LeaseLost, LifecycleStore, Message, QueueStore, RunStore, TranscriptDeleted
from agent_sessions.backend import CANCEL, Acquire, Backend, Change, Guard, Idle, Release, Want

from .capabilities import Capability
from .crossprocess import wait_for
from .mixin import ContractMixin, new_holder, new_id, stand_in

QUESTION = Message.user("what expires?")
ANSWER = Message.assistant("the lease")


class _Between:
    """Stands in for ``store.backend``: after the first ``method`` call that ``when`` picks, runs ``then``
    (once), and hands back what the backend answered; every other call passes through."""

    def __init__(self, backend: Any, method: str, when: Callable[[Any], bool], then: Callable[[], None]) -> None:
        self.backend, self.method, self.when, self.then, self.done = backend, method, when, then, False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.backend, name)
        if name != self.method:
            return real

        def call(*args: Any) -> Any:
            answer = real(*args)
            if not self.done and self.when(args[-1]):
                self.done = True
                self.then()
            return answer
        return call


class _Losing:
    """``backend``, but the next write carrying events loses its answer: ``landed`` says whether it was made
    first (its answer lost) or not (cut before the server had it)."""

    def __init__(self, backend: Any, landed: bool) -> None:
        self.backend, self.landed, self.lost = backend, landed, 0

    def write(self, session: str, guard: Any, change: Any) -> Any:
        if change.events and not self.lost:
            self.lost += 1
            if self.landed:
                self.backend.write(session, guard, change)
            raise agent.OutcomeUnknown("storetest: the answer was lost")
        return self.backend.write(session, guard, change)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


class BetweenContract(ContractMixin):
    def _backed(self, *needs: Capability) -> Any:
        for capability in needs:
            self.requires(capability)
        store = self.make_store()
        if not isinstance(getattr(store, "backend", None), Backend):
            pytest.skip(f"{type(store).__name__} has no Backend to stand between: its reads and writes are its own")
        return store

    def test_every_guard_field_is_evaluated(self) -> None:
        """A field a backend leaves unevaluated is a guarantee the library counts on and the store silently
        drops (a queue's head, an incarnation)."""
        store = self._backed()
        backend: Backend = store.backend
        sid = new_id("between-guard")
        probe = Change(drop_key="storetest:never-accepted")  # changes nothing but the version

        def version() -> int:
            snap = backend.read(sid, Want())
            assert snap is not None
            return snap.row.version

        def refused(guard: Guard, why: str) -> None:
            before = version()
            assert not backend.write(sid, guard, probe).done, f"a write was let through although {why}"
            assert version() == before, f"a refused write ({why}) changed the row"

        def holds(guard: Guard) -> None:
            assert backend.write(sid, guard, probe).done, f"a write whose guard holds was refused: {guard}"

        token = uuid.uuid4().hex
        assert backend.write(sid, Guard(exists=False), Change(exist=True, splice=(0, (QUESTION.to_json(),)),
                                                              add_key="storetest:accepted")).done
        backend.write(sid, Guard(), Change(push=("k1", "first")))
        backend.write(sid, Guard(), Change(push=("k2", "second")))
        backend.write(sid, Guard(), Change(add_steer=("a steer", None)))
        backend.write(sid, Guard(), Change(lease=Acquire("storetest", 1, token, None, 60.0)))
        snap = backend.read(sid, Want(steers=True, queue=True))
        assert snap is not None and len(snap.queue) == 2 and len(snap.steers) == 1
        row, (head, second), (steer,) = snap.row, snap.queue, snap.steers
        refused(Guard(exists=False), "the session exists")
        holds(Guard(exists=True))
        refused(Guard(incarnation=f"not-{row.incarnation}"), "the incarnation differs")
        holds(Guard(incarnation=row.incarnation))
        refused(Guard(version=version() + 1), "the version differs")
        holds(Guard(version=version()))
        refused(Guard(length=row.length + 1), "the length differs")
        holds(Guard(length=row.length))
        refused(Guard(edits=row.edits + 1), "the edit count differs")
        holds(Guard(edits=row.edits))
        refused(Guard(lease=(f"other-{token}", row.epoch)), "another token holds the lease")
        refused(Guard(lease=(token, row.epoch + 1)), "the lease's epoch differs")
        holds(Guard(lease=(token, row.epoch)))
        refused(Guard(lease_free=True), "a live lease is held")
        refused(Guard(no_steers=True), "a steer waits")
        refused(Guard(steers=(steer.id, steer.id + 1)), "one of the steers named does not wait")
        holds(Guard(steers=(steer.id,)))
        refused(Guard(journal="a journal"), "there is no journal")
        holds(Guard(journal=None))
        refused(Guard(no_queue=True), "a message is queued")
        refused(Guard(queue_head=second.id), "that queue item is not the head")
        holds(Guard(queue_head=head.id))
        refused(Guard(key_absent="storetest:accepted"), "the key was accepted")
        holds(Guard(key_absent="storetest:other"))
        holds(Guard(not_cancelled=True, lease_held=True))
        backend.write(sid, Guard(), Change(lease=CANCEL, journal="a journal", take_steers=(steer.id,),
                                           pop=head.id))
        refused(Guard(not_cancelled=True), "the lease was cancelled")
        refused(Guard(journal=None), "a journal is kept")
        holds(Guard(journal="a journal", no_steers=True, queue_head=second.id))
        backend.write(sid, Guard(), Change(lease=Release(), pop=second.id))
        refused(Guard(lease_held=True), "the lease is free")
        holds(Guard(lease_free=True, no_queue=True))

    def test_a_queue_pop_whose_lease_was_taken_over_after_its_read_writes_nothing(self) -> None:
        """``take_queued`` reads the queue's head, then pops it in a write fenced by the lease: another run's
        takeover in between refuses the pop, and the message waits for the new holder."""
        store = self._backed(Capability.RUN_STORE, Capability.QUEUE)
        backend = store.backend
        assert isinstance(store, QueueStore) and isinstance(store, RunStore)
        for append in (True, False):
            sid = new_id(f"between-pop-{append}")
            store.save(sid, [QUESTION, ANSWER])
            store.enqueue(sid, "k1", "first")
            stale = store.acquire(sid, new_holder(), 0.3)
            taken: list[Holder] = []

            def take_over(sid: str = sid, taken: list[Holder] = taken) -> None:
                wait_for(lambda: store.holder(sid) is None, "the stale holder's lease to lapse")
                taken.append(store.acquire(sid, new_holder(), 60))

            with stand_in(store, _Between(backend, "read", lambda want: bool(want.queue), take_over)), \
                    pytest.raises(LeaseLost):
                store.take_queued(sid, stale, append=append)
            assert taken, "the queue was never read"
            assert store.queued(sid) == ["k1"] and store.messages(sid) == [QUESTION, ANSWER], \
                f"a holder whose lease was taken over popped the queue (append={append})"
            assert store.take_queued(sid, taken[0]) == Message.user("first", key="k1")
            store.release(sid, taken[0])

    @pytest.mark.parametrize("between", ["taken", "queued"])
    def test_a_withdrawal_removes_only_the_message_it_found_whatever_lands_after_its_read(self, between: str) -> None:
        """A run takes the item in between: the withdrawal removes nothing (the transcript answers it, once).
        Another message queued in between: the withdrawal still removes its own."""
        store = self._backed(Capability.RUN_STORE, Capability.QUEUE)
        backend = store.backend
        assert isinstance(store, QueueStore) and isinstance(store, RunStore)
        sid = new_id(f"between-withdraw-{between}")
        store.save(sid, [QUESTION, ANSWER])
        store.enqueue(sid, "k1", "first")

        def lands() -> None:
            if between == "taken":
                holder = store.acquire(sid, new_holder(), 60)
                assert store.take_queued(sid, holder) == Message.user("first", key="k1")
                store.release(sid, holder)
            else:
                store.enqueue(sid, "k2", "second")

        with stand_in(store, _Between(backend, "read", lambda want: bool(want.queue), lands)):
            withdrawn = store.withdraw(sid, "k1")
        if between == "taken":
            assert not withdrawn, "withdraw reported removing a message a run had taken after its read"
            assert store.queued(sid) == [] and store.messages(sid) == [QUESTION, ANSWER, Message.user("first",
                                                                                                      key="k1")]
        else:
            assert withdrawn and store.queued(sid) == ["k2"], \
                "a withdrawal refused by a message queued after its read did not try again, or removed the other"
            assert store.messages(sid) == [QUESTION, ANSWER]

    @pytest.mark.parametrize("between", ["saved", "leased", "steered", "saved anew", "steered anew"])
    def test_prune_spares_a_session_that_came_alive_between_its_listing_and_its_delete(self, between: str) -> None:
        """The listing's version and incarnation, and a free lease, guard each delete ("anew": deleted, then
        begun again with the version the listing saw)."""
        store = self._backed(Capability.RUN_STORE, Capability.LIFECYCLE)
        backend = store.backend
        assert isinstance(store, LifecycleStore) and isinstance(store, RunStore)
        sid = new_id(f"between-prune-{between}")
        store.save(sid, [QUESTION])
        held: list[Holder] = []

        def comes_alive() -> None:
            if between.endswith("anew"):
                store.delete(sid)
            if between.startswith("saved"):
                store.save(sid, [QUESTION] if between.endswith("anew") else [QUESTION, ANSWER])
            elif between == "leased":
                held.append(store.acquire(sid, new_holder(), 60))
            else:
                store.add_steer(sid, "one more thing")

        wait_for(lambda: sid in [r.session for r in backend.sessions(Idle(0.0, 1000))], "the session to be idle")
        with stand_in(store, _Between(backend, "sessions", lambda query: isinstance(query, Idle), comes_alive)):
            store.prune(idle_for=0)
        if between == "steered anew":
            assert store.pending_steers(sid) == ["one more thing"], "prune deleted a steer posted after its listing"
        else:
            assert store.info(sid) is not None, f"prune deleted a session {between} after its listing"
            assert store.messages(sid) == ([QUESTION, ANSWER] if between == "saved" else [QUESTION])
        if held:
            store.release(sid, held[0])

    def test_a_first_save_from_a_read_before_a_delete_is_refused_though_the_session_begun_anew_matches_it(
            self) -> None:
        """The new session has the read's length and edit count: only the incarnation tells the erased
        conversation from the new one."""
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("between-anew")
        store.save(sid, [Message.user("the erased question")])
        stale = store.messages(sid)
        assert store.delete(sid)
        anew = [Message.user("a new conversation")]
        store.save(sid, anew)
        holder = store.acquire(sid, new_holder(), 60)
        try:
            with pytest.raises(TranscriptDeleted):
                store.save_fenced(sid, holder, [*stale, ANSWER], take_steers=False)
            assert store.messages(sid) == anew, "a save of messages read before a delete wrote over a new session"
        finally:
            store.release(sid, holder)

    # -- a write whose answer was lost ----------------------------------------------------------------

    def _held(self) -> tuple[Any, Any, str, Holder]:
        """A store with a backend to stand in for, a session saved with one question, and its lease."""
        store = self._backed(Capability.EVENTS)
        sid = new_id("lost")
        store.save(sid, [Message.user("question")])
        return store, store.backend, sid, store.acquire(sid, new_holder(), 60)

    @staticmethod
    def _save_losing(store: Any, backend: Any, landed: bool, sid: str, holder: Holder, msgs: list[Message],
                     events: list[str]) -> agent.Saved:
        """``save_fenced_events`` through a backend that loses the answer of its first write with events."""
        losing = _Losing(backend, landed)
        with stand_in(store, losing):
            saved: agent.Saved = store.save_fenced_events(sid, holder, msgs, take_steers=True, events=events, keep=100)
        assert losing.lost == 1
        return saved

    @pytest.mark.parametrize("landed", [True, False], ids=["answer-lost", "cut-before"])
    def test_a_save_with_events_whose_answer_was_lost_takes_a_waiting_steer_once(self, landed: bool) -> None:
        """An events-only save guarded by "no steer waits" is refused: a read-back judging by the transcript
        alone, which already held the messages, would call it landed and leave the steer behind."""
        store, backend, sid, holder = self._held()
        msgs = store.messages(sid)
        store.add_steer(sid, "late steer")
        events = [json.dumps({"kind": "storetest", "n": n, "at": uuid.uuid4().hex}) for n in range(3)]
        saved = self._save_losing(store, backend, landed, sid, holder, msgs, events)
        assert saved.steers == ["late steer"] and store.pending_steers(sid) == []
        assert [m.text for m in store.messages(sid)] == ["question", "late steer"]
        assert [text for _, text in backend.events(sid, 0, 100)] == events
        store.release(sid, holder)

    @pytest.mark.parametrize("landed", [True, False], ids=["answer-lost", "cut-before"])
    def test_a_step_with_events_whose_answer_was_lost_is_stored_once(self, landed: bool) -> None:
        store, backend, sid, holder = self._held()
        msgs = [*store.messages(sid), Message.assistant("answer")]
        events = [json.dumps({"kind": "storetest", "n": n, "at": uuid.uuid4().hex}) for n in range(2)]
        saved = self._save_losing(store, backend, landed, sid, holder, msgs, events)
        assert saved.steers == []
        assert store.messages(sid) == msgs
        assert [text for _, text in backend.events(sid, 0, 100)] == events
        store.release(sid, holder)
