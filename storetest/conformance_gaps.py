"""Where operations meet: concurrent first saves of a new session (PostgreSQL locked a row that did not
exist yet, and both appended), and the cancel flag every fenced save returns.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import EventStore, Holder, Message, Saved, Store
from agent_sessions.eventlog import encode

from .capabilities import Capability
from .crossprocess import in_processes, wait_for
from .mixin import ContractMixin, new_holder, new_id, together

ROUNDS = 20
"""How many new sessions each race is run on: a lost race shows in most rounds, seldom in one."""
WRITERS = 4


def _transcript(writer: int, round: int) -> list[Message]:
    """Writer ``writer``'s transcript in ``round``: its own from the first message on, several messages long,
    so two writers' rows at the same positions would mix."""
    return [Message.user(f"writer {writer} round {round} message {i}") for i in range(3 + writer % 2)]


def _first_saver(store: Store, i: int, barrier: Any, sids: list[str]) -> None:
    """One writer of the race: a first save of each round's session, all writers at once."""
    for r, sid in enumerate(sids):
        barrier.wait(120)
        store.save(sid, _transcript(i, r))


class GapsContract(ContractMixin):
    # -- concurrent first saves ------------------------------------------------------------------------

    @pytest.mark.parametrize("apart", ["threads", "processes"])
    def test_concurrent_first_saves_of_a_new_session_leave_exactly_one_of_them(self, apart: str) -> None:
        store = self.make_store()
        sids = [new_id("first") for _ in range(ROUNDS)]
        if apart == "processes":
            in_processes(self.factory(), WRITERS, _first_saver, sids, timeout=300)
        else:
            writers, barrier = [self.another(store) for _ in range(WRITERS)], threading.Barrier(WRITERS)
            together(WRITERS, lambda i: _first_saver(writers[i], i, barrier, sids), 300)
        for r, sid in enumerate(sids):
            stored = store.messages(sid)
            assert stored in [_transcript(i, r) for i in range(WRITERS)], f"round {r}: stored {stored}"

    def test_first_fenced_saves_of_successive_holders_leave_one_of_them(self) -> None:
        """Each writer takes the lease over once the previous one's lapsed (a short ttl), so their first fenced
        saves overlap: a superseded one is LeaseLost, and one whole transcript that succeeded is stored."""
        store = self.run_store()
        writers = [self.another(store) for _ in range(WRITERS)]
        for r in range(ROUNDS // 4):
            sid = new_id("fenced")

            def run(i: int, sid: str = sid, r: int = r) -> bool:
                own, mine = writers[i], new_holder()
                deadline = time.monotonic() + 60
                while (held := own.acquire(sid, mine, 0.05)).token != mine.token:
                    assert time.monotonic() < deadline, "the lease never came free"
                    time.sleep(0.01)
                try:
                    own.save_fenced(sid, held, _transcript(i, r), take_steers=True, replace=True)
                    return True
                except agent.LeaseLost:
                    return False  # taken over meanwhile: refused, which is right

            saved = [i for i, ok in enumerate(together(WRITERS, run, 90)) if ok]
            stored = store.messages(sid)
            assert saved and stored in [_transcript(i, r) for i in saved], f"round {r}: stored {stored}, saved {saved}"

    # -- the cancel flag a fenced save returns ---------------------------------------------------------

    def test_every_fenced_save_reports_a_cancel_and_a_takeover_starts_without(self) -> None:
        store = self.run_store()
        saves: list[tuple[str, dict[str, Any]]] = [("save_fenced", {})]
        if Capability.EVENTS in self.capabilities and isinstance(store, EventStore):
            saves.append(("save_fenced_events", {"events": [encode("note", {})], "keep": 100}))
        for name, extra in saves:

            def save(s: Any, sid: str, held: Holder, msgs: list[Message], take: bool,
                     name: str = name, extra: dict[str, Any] = extra) -> Saved:
                saved: Saved = getattr(s, name)(sid, held, msgs, take_steers=take, **extra)
                return saved

            for take in (True, False):
                how = f"{name}(take_steers={take})"
                sid = new_id("cancel")
                msgs = [Message.user(f"m{i}") for i in range(6)]
                a = store.acquire(sid, new_holder(), 0.3)
                assert save(store, sid, a, msgs[:1], take).cancelled is False, f"{how}: the first write"
                assert save(store, sid, a, msgs[:2], take).cancelled is False, f"{how}: an append"
                assert store.cancel(sid) is True
                assert save(store, sid, a, msgs[:3], take).cancelled is True, f"{how}: an append after a cancel"
                assert save(store, sid, a, msgs[:3], take).cancelled is True, f"{how}: nothing new after a cancel"
                cold = self.another(store)  # knows nothing: its save is a first write
                assert save(cold, sid, a, msgs[:4], take).cancelled is True, f"{how}: a first write after a cancel"
                assert store.messages(sid) == msgs[:4], f"{how}: a cancelled run's saves are still stored"
                wait_for(lambda: store.holder(sid) is None, "the lease to lapse on the store's clock")  # noqa: B023
                b = store.acquire(sid, new_holder(), 30)  # handed the cancel; its own lease starts without
                assert b.epoch > a.epoch and b.cancelled is True
                assert save(store, sid, b, msgs[:5], take).cancelled is False, f"{how}: an append after a takeover"
                assert save(store, sid, b, msgs[:5], take).cancelled is False, f"{how}: nothing new after a takeover"
                cold = self.another(store)
                assert save(cold, sid, b, msgs, take).cancelled is False, f"{how}: a first write after a takeover"
                assert store.cancel(sid) is True
                assert save(store, sid, b, [*msgs, Message.user("z")], take).cancelled is True, (
                    f"{how}: the new holder's append after a cancel")
                store.release(sid, b)
