"""A write whose answer was lost (after the write, or the line cut before it): the library reads the session
back and settles it, landed or written again, never twice.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from agent_sessions import Holder, Message, OutcomeUnknown, RunStore, Saved

from .capabilities import Capability
from .mixin import ContractMixin, new_holder, new_id, stand_in


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
            raise OutcomeUnknown("storetest: the answer was lost")
        return self.backend.write(session, guard, change)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


class LostAnswersContract(ContractMixin):
    def _held(self) -> tuple[Any, Any, str, Holder]:
        """A store with a backend to stand in for, a session saved with one question, and its lease."""
        self.requires(Capability.EVENTS)
        store = self.make_store()
        backend = getattr(store, "backend", None)
        if backend is None:
            pytest.skip("not a BackedStore: no backend to lose an answer of")
        assert isinstance(store, RunStore)
        sid = new_id("lost")
        store.save(sid, [Message.user("question")])
        return store, backend, sid, store.acquire(sid, new_holder(), 60)

    @staticmethod
    def _save_losing(store: Any, backend: Any, landed: bool, sid: str, holder: Holder, msgs: list[Message],
                     events: list[str]) -> Saved:
        """``save_fenced_events`` through a backend that loses the answer of its first write with events."""
        losing = _Losing(backend, landed)
        with stand_in(store, losing):
            saved: Saved = store.save_fenced_events(sid, holder, msgs, take_steers=True, events=events, keep=100)
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
