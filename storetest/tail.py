"""The TailStore contract: a transcript read from its end a page at a time (``read_back``), and a leased
run's save from an index on (``save_fenced(start=)``): how a run resumes a long compacted session reading
about what its requests send (docs/runs/context.md)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_sessions import ArgumentError, Holder, Message, TailStore, TranscriptConflict

from .capabilities import Capability
from .mixin import ContractMixin, new_holder, new_id


def _said(n: int, tag: str = "") -> list[Message]:
    return [Message.user(f"{tag}question {i}") if i % 2 == 0 else Message.assistant(f"{tag}answer {i}")
            for i in range(n)]


class TailContract(ContractMixin):
    def tail_store(self, *needs: Capability) -> TailStore:
        return self.capable_store(Capability.TAIL, "read_back, save_fenced(start=)", *needs)

    def stored(self, tag: str, length: int) -> tuple[TailStore, str, list[Message], Holder]:
        """A TailStore holding a new session of ``length`` messages, its id, them, and its lease."""
        store = self.tail_store()
        sid = new_id(tag)
        said = _said(length)
        store.save(sid, said)
        return store, sid, said, store.acquire(sid, new_holder(), 30)

    def test_read_back_reads_pages_from_the_end(self) -> None:
        store = self.tail_store()
        sid = new_id("pages")
        stored = _said(100)
        store.save(sid, stored)
        assert store.read_back(sid, None, 30) == (70, stored[70:])
        assert store.read_back(sid, 70, 30) == (40, stored[40:70])
        assert store.read_back(sid, 10, 30) == (0, stored[:10])
        assert store.read_back(sid, 0, 30) == (0, [])
        assert store.read_back(sid, 500, 3) == (97, stored[97:])
        assert store.read_back(new_id("never"), None, 5) == (0, [])
        for stop, count in ((None, 0), (-1, 3), (True, 3), (None, "3")):
            with pytest.raises(ArgumentError):
                store.read_back(sid, stop, count)  # type: ignore[arg-type]

    def test_a_save_from_an_index_appends_after_the_messages_it_was_not_given(self) -> None:
        store = self.tail_store()

        @given(length=st.integers(1, 80), cut=st.integers(0, 80), added=st.integers(0, 5), steps=st.integers(1, 3))
        @self.hypothesis()
        def check(length: int, cut: int, added: int, steps: int) -> None:
            sid = new_id("from")
            stored = _said(length)
            store.save(sid, stored)
            start = min(cut, length)
            holder = store.acquire(sid, new_holder(), 30)
            first, tail = store.read_back(sid, None, length - start) if start < length else (length, [])
            assert first == start
            msgs = list(tail)
            for step in range(steps):  # a run's saves, each of the transcript from its start on
                msgs += _said(added, f"step {step} ")
                store.save_fenced(sid, holder, msgs, take_steers=False, start=start)
            assert store.messages(sid) == stored + msgs[len(tail):]
            store.release(sid, holder)

        check()

    def test_a_save_from_an_index_takes_the_steers_after_its_messages(self) -> None:
        store, sid, stored, holder = self.stored("steers", 40)
        store.add_steer(sid, "meanwhile")
        saved = store.save_fenced(sid, holder, [*stored[30:], Message.user("new")], take_steers=True, start=30)
        assert saved.steers == ["meanwhile"]
        assert store.messages(sid) == [*stored, Message.user("new"), Message.user("meanwhile")]
        later = [*stored[30:], Message.user("new"), Message.user("meanwhile"), Message.assistant("ok")]
        store.save_fenced_events(sid, holder, later, take_steers=False, start=30, events=[], keep=10)
        assert store.messages(sid)[-1] == Message.assistant("ok") and len(store.messages(sid)) == 43

    def test_a_save_from_an_index_is_refused_when_the_stored_messages_differ(self) -> None:
        store, sid, stored, holder = self.stored("conflict", 20)
        with pytest.raises(TranscriptConflict):  # the stored messages from 10 on are not these
            store.save_fenced(sid, holder, [Message.user("another"), *stored[11:], Message.user("x")],
                              take_steers=False, start=10)
        with pytest.raises(TranscriptConflict):  # fewer than 30 are stored
            store.save_fenced(sid, holder, [Message.user("x")], take_steers=False, start=30)
        with pytest.raises(TranscriptConflict):  # more are stored than the save holds
            store.save_fenced(sid, holder, stored[10:15], take_steers=False, start=10)
        with pytest.raises(ArgumentError):
            store.save_fenced(sid, holder, stored[10:], take_steers=False, start=10, replace=True)
        assert store.messages(sid) == stored
