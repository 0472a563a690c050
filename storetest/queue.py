"""The QueueStore contract: messages queued for a busy session (``Runner.turn(if_busy="queue")``), each key
accepted once per session, kept in the order accepted, taken into the transcript one at a time by the
lease's holder, fenced. ``delete`` and ``prune`` remove the queue with the session (lifecycle's tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import (
    ArgumentError,
    LeaseLost,
    Message,
    QueueStore,
)

from . import strategies
from .capabilities import Capability
from .crossprocess import in_processes
from .meeting import Landing
from .mixin import ContractMixin, Crash, new_holder, new_id, noting, together
from .scripted import Held
from .steer_keys import KEYS


class _Counting:
    """Answers every request with "answer <n>", counting them."""

    def __init__(self) -> None:
        self.requests = 0

    def complete(self, system: str, messages: Sequence[Message], tools: object) -> Message:
        self.requests += 1
        return Message.assistant(f"answer {self.requests}")


def _enqueuer(store: QueueStore, i: int, barrier: object, sid: str, n: int) -> list[int]:
    """Process i's j-th message under the key f"q{i}-{j:04d}", each followed by the key "shared"."""
    positions = []
    for j in range(n):
        positions.append(store.enqueue(sid, f"q{i}-{j:04d}", f"message q{i}-{j:04d}"))
        positions.append(store.enqueue(sid, "shared", "one message, sent by everyone"))
    return positions


class QueueContract(ContractMixin):
    """What a ``QueueStore`` keeps (the module's docstring), checked through the store's own methods."""

    def queue_store(self, *needs: Capability) -> QueueStore:
        return self.capable_store(Capability.QUEUE, "enqueue, queued, take_queued", *needs)

    def test_an_interrupt_delivered_again_cancels_nothing_more(self) -> None:
        """An interrupt cancels the run in progress, then queues its message; its first delivery dies between
        the two. Delivered again, it must not stop another caller's turn: the interrupt was sent once."""
        store = self.queue_store(Capability.RUN_STORE)
        sid = new_id("interrupt")
        first = Held("the first answer")
        running = agent.Runner().start(agent.Spec(session=agent.open(sid, store)), [Message.user("first")], first)
        assert first.entered.wait(20)

        def dies() -> None:
            raise Crash()

        dying = agent.Spec(session=agent.open(sid, Landing(store, before={"enqueue": dies})), lease_wait=0.0)
        with pytest.raises(Crash):  # before it queues its message
            agent.Runner().turn(dying, "stop that", "k-interrupt", Held("never"), if_busy="interrupt")
        first.go.set()
        running.wait(20)  # answered: the cancel came while it waited on its model, which answered
        other = Held("the other answer", calls=True)
        theirs = agent.Runner().start(agent.Spec(session=agent.open(sid, store), tools=[noting([], "lookup", "found")]),
                                      [*store.messages(sid), Message.user("another caller's question")], other)
        assert other.entered.wait(20)
        try:
            with pytest.raises(agent.StillQueued):
                agent.Runner().turn(agent.Spec(session=agent.open(sid, store), lease_wait=0.0), "stop that",
                                    "k-interrupt", Held("never"), if_busy="interrupt")
        finally:
            other.go.set()
        got = theirs.wait(20)
        assert got.stop_reason == "answered", f"a delivery of one interrupt stopped a later turn: {got}"

    def test_a_queued_key_is_accepted_once_in_order_and_is_no_steer(self) -> None:
        store = self.queue_store()
        sid = new_id("once")
        assert [store.enqueue(sid, k, f"text {k}") for k in ("a", "b", "c")] == [1, 2, 3]
        assert store.enqueue(sid, "b", "text b") == 2  # sent again: where it stands
        assert store.queued(sid) == ["a", "b", "c"], store.queued(sid)
        with pytest.raises(ArgumentError, match="already used"):
            store.enqueue(sid, "b", "another text under the same key")
        assert store.enqueue(sid, "B", "keys compare exactly") == 4
        for bad in ("", "x" * 256, "line\n", "nul\x00", 7, None):  # a bad key or text: refused, nothing queued
            with pytest.raises(ArgumentError):
                store.enqueue(sid, bad, "never queued")  # type: ignore[arg-type]
        with pytest.raises(ArgumentError):
            store.enqueue(sid, "good", "")
        assert store.enqueue(sid, "x" * 255, "kept") == 5
        assert store.take_steers(sid) == [] and store.queued(sid) == ["a", "b", "c", "B", "x" * 255]

    def test_the_holder_takes_the_head_into_the_transcript_fenced(self) -> None:
        store = self.queue_store()
        sid = new_id("take")
        store.save(sid, [Message.user("q", key="k0"), Message.assistant("a")])
        holder = store.acquire(sid, new_holder(), 60)
        assert store.take_queued(sid, holder) is None  # nothing waits: nothing written
        store.enqueue(sid, "k1", "first")
        store.enqueue(sid, "k2", "second")
        store.put_journal(sid, holder, '{"stale": true}')
        taken = store.take_queued(sid, holder)
        assert taken == Message.user("first", key="k1")
        assert store.messages(sid)[-1] == taken and len(store.messages(sid)) == 3
        assert store.journal(sid) is None  # as a save that writes
        assert store.queued(sid) == ["k2"] and store.enqueue(sid, "k2", "second") == 1
        store.release(sid, holder)
        with pytest.raises(LeaseLost):
            store.take_queued(sid, holder)
        assert store.queued(sid) == ["k2"] and len(store.messages(sid)) == 3
        again = store.acquire(sid, new_holder(), 60)
        assert store.take_queued(sid, again, append=False) == Message.user("second", key="k2")
        assert store.queued(sid) == [] and len(store.messages(sid)) == 3
        store.release(sid, again)

    def test_a_message_sent_again_after_its_turn_is_answered_once_and_leaves_no_key(self) -> None:
        """A key's row goes with its message into the transcript, so what a session keeps of its queue is
        bounded by what waits."""
        store = self.queue_store(Capability.LIFECYCLE)
        sid = new_id("again")
        model = _Counting()
        spec = agent.Spec(session=agent.open(sid, store))
        for i in range(3):
            assert agent.Runner().turn(spec, f"question {i}", f"k{i}", model, if_busy="queue").text == f"answer {i + 1}"
        assert model.requests == 3 and store.queued(sid) == []
        backend = getattr(store, "backend", None)
        if backend is not None:  # a BackedStore: no key row of a message no longer waiting
            from agent_sessions.backend import Change, Guard

            for i in range(3):  # an empty change only evaluates its guard
                assert backend.write(sid, Guard(key_absent=f"q:k{i}"), Change()).done, i
        agent.open(sid, store).enqueue("question 1", "k1")  # delivered again, after its turn
        assert store.queued(sid) == ["k1"]
        again = agent.Runner().turn(spec, "question 1", "k1", model, if_busy="queue")
        assert again.text == "answer 2" and model.requests == 3  # its own answer, from the transcript
        assert store.queued(sid) == []  # and the copy sent again waits for nothing
        agent.open(sid, store).enqueue("question 1", "k1")
        swept = [r for r in agent.recover(store, lambda info: (spec, model) if info.id == sid else None, grace=0)
                 if r.session == sid]
        assert model.requests == 3 and store.queued(sid) == [], swept
        assert [m.key for m in store.messages(sid) if m.key] == ["k0", "k1", "k2"]
        info = store.info(sid)
        assert info is not None and info.open_since is None

    def test_threads_racing_queue_each_key_once_at_distinct_places(self) -> None:
        store = self.queue_store()
        n = max(2, self.concurrency)
        sid = new_id("threads")
        got = together(n, lambda i: [*(store.enqueue(sid, f"t{i}-{j}", f"text {i} {j}") for j in range(3)),
                                     store.enqueue(sid, "shared", "one text")])
        keys = store.queued(sid)
        assert sorted(keys) == sorted([f"t{i}-{j}" for i in range(n) for j in range(3)] + ["shared"])
        for i in range(n):
            mine = [k for k in keys if k.startswith(f"t{i}-")]
            assert mine == [f"t{i}-{j}" for j in range(3)], "one sender's messages out of order"
            assert all(p >= 1 for p in got[i])

    def test_processes_racing_queue_each_key_once_in_the_order_taken(self) -> None:
        factory = self.factory()
        store = self.queue_store()
        sid = new_id("procs")
        processes, per = 6, 5
        positions = in_processes(factory, processes, _enqueuer, sid, per)
        keys = store.queued(sid)
        assert sorted(keys) == sorted([f"q{i}-{j:04d}" for i in range(processes) for j in range(per)] + ["shared"])
        for i in range(processes):
            assert [k for k in keys if k.startswith(f"q{i}-")] == [f"q{i}-{j:04d}" for j in range(per)]
            assert all(p >= 1 for p in positions[i])
        holder = store.acquire(sid, new_holder(), 60)
        taken = []
        while (message := store.take_queued(sid, holder)) is not None:
            taken.append(message.key)
        store.release(sid, holder)
        assert taken == keys and [m.key for m in store.messages(sid)] == keys

    def test_property_queued_messages_round_trip_in_order(self) -> None:
        store = self.queue_store()

        @given(st.lists(st.tuples(strategies.steer_texts, KEYS), max_size=6, unique_by=lambda p: p[1]))
        @self.hypothesis()
        def check(queued: list[tuple[str, str]]) -> None:
            sid = new_id("prop")
            assert [store.enqueue(sid, key, text) for text, key in queued] == list(range(1, len(queued) + 1))
            assert [store.enqueue(sid, key, text) for text, key in queued] == list(range(1, len(queued) + 1))
            assert store.queued(sid) == [key for _, key in queued]
            holder = store.acquire(sid, new_holder(), 60)
            for text, key in queued:
                assert store.take_queued(sid, holder) == Message.user(text, key=key)
            assert store.take_queued(sid, holder) is None
            store.release(sid, holder)
            assert store.messages(sid) == [Message.user(text, key=key) for text, key in queued]

        check()
