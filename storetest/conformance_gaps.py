"""Where operations meet: concurrent first saves of a new session, the cancel flag every fenced save
returns, and a non-idempotent call's result journalled while more calls of its reply follow.

Each test here was added because a plausible bug passed the rest of the suite: first saves that both
append from the start (PostgreSQL locked a row that did not exist yet), a fenced append that ignored the
cancel flag, and a run that journalled a non-idempotent result only when its call was the reply's last.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import EventStore, Holder, Message, RunStore, Saved, Store
from agent_sessions.eventlog import encode
from agent_sessions.journal import UNKNOWN_OUTCOME

from . import processes
from .capabilities import Capability
from .crossprocess import wait_for
from .scripted import ToolsThenAnswer

ROUNDS = 20
"""How many new sessions each race is run on: a lost race shows in most rounds, seldom in one."""
WRITERS = 4


class _Crash(BaseException):
    """Stands in for a worker dying inside a tool: nothing in the loop catches it."""


def _sid(tag: str) -> str:
    return f"storetest-gaps-{tag}{uuid.uuid4().hex}"


def _claimant() -> Holder:
    return Holder("storetest", 2468, uuid.uuid4().hex, 0.0)


def _transcript(writer: int, round: int) -> list[Message]:
    """Writer ``writer``'s transcript in ``round``: its own from the first message on, several messages long,
    so two writers' rows at the same positions would mix."""
    return [Message.user(f"writer {writer} round {round} message {i}") for i in range(3 + writer % 2)]


def _first_saver(factory: Callable[[], Store], sids: list[str], i: int, barrier: Any, out: Any) -> None:
    """One process of the race: a first save of each round's session, all processes at once."""
    try:
        store = factory()
        for r, sid in enumerate(sids):
            barrier.wait(120)
            store.save(sid, _transcript(i, r))
        out.put(("saved", i, ""))
    except BaseException:  # noqa: BLE001 - reported by the parent
        out.put(("error", i, traceback.format_exc()))
        barrier.abort()


_Save = Callable[[RunStore, str, Holder, list[Message], bool], Saved]
"""A fenced save of ``(store, session, holder, transcript, take_steers)``."""


def _lapsed(store: RunStore, sid: str) -> bool:
    return store.holder(sid) is None


def _join(threads: list[threading.Thread], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), f"thread {t.name} did not finish within {timeout} s"


class GapsContract:
    """Mixed into StoreContract; ``make_store``, ``requires``, ``factory``, ``run_store`` and ``another``
    come from there."""

    capabilities: frozenset[Capability]

    def make_store(self) -> Store:
        raise NotImplementedError

    def requires(self, capability: Capability) -> None:
        raise NotImplementedError

    def factory(self) -> Callable[[], Store]:
        raise NotImplementedError

    def run_store(self) -> RunStore:
        raise NotImplementedError

    def another(self, store: RunStore) -> RunStore:
        raise NotImplementedError

    def _other(self, store: Store) -> Store:
        """Another store object on the same data where the store has such (another worker)."""
        return self.make_store() if Capability.DURABLE in self.capabilities else store

    # -- concurrent first saves ------------------------------------------------------------------------

    def test_concurrent_first_saves_of_a_new_session_leave_exactly_one_of_them(self) -> None:
        store = self.make_store()
        writers = [self._other(store) for _ in range(WRITERS)]
        for r in range(ROUNDS):
            sid = _sid("first-")
            barrier = threading.Barrier(WRITERS)
            errors: list[str] = []

            def save(i: int, sid: str = sid, barrier: threading.Barrier = barrier, r: int = r,
                     errors: list[str] = errors) -> None:
                try:
                    barrier.wait(30)
                    writers[i].save(sid, _transcript(i, r))
                except BaseException:  # noqa: BLE001 - reported below
                    errors.append(traceback.format_exc())

            threads = [threading.Thread(target=save, args=(i,)) for i in range(WRITERS)]
            for t in threads:
                t.start()
            _join(threads)
            assert not errors, f"round {r}: a first save failed:\n{errors[0]}"
            stored = store.messages(sid)
            assert stored in [_transcript(i, r) for i in range(WRITERS)], f"round {r}: stored {stored}"

    def test_first_saves_of_a_new_session_from_several_processes_leave_exactly_one_of_them(self) -> None:
        factory = self.factory()
        store = self.make_store()
        sids = [_sid("first-proc-") for _ in range(ROUNDS)]
        ctx = processes.context(factory)
        barrier = ctx.Barrier(WRITERS)
        out = ctx.Queue()
        procs = [ctx.Process(target=_first_saver, args=(factory, sids, i, barrier, out)) for i in range(WRITERS)]
        for p in procs:
            p.start()
        try:
            reports = [out.get(timeout=300) for _ in procs]
        except queue.Empty:
            raise AssertionError("the saving processes did not report within 300 s") from None
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        errors = [detail for kind, _, detail in reports if kind == "error"]
        assert not errors, f"a first save failed in another process:\n{errors[0]}"
        for r, sid in enumerate(sids):
            stored = store.messages(sid)
            assert stored in [_transcript(i, r) for i in range(WRITERS)], f"round {r}: stored {stored}"

    def test_first_fenced_saves_of_successive_holders_leave_one_of_them(self) -> None:
        """Each writer takes the lease over once the previous one's lapsed (a short ttl), so their first
        fenced saves (replacing: none knows what is stored) overlap: a superseded one is LeaseLost, every
        other succeeds, and what is stored is one whole transcript of a save that succeeded."""
        store = self.run_store()
        writers = [self.another(store) for _ in range(WRITERS)]
        for r in range(ROUNDS // 4):
            sid = _sid("fenced-")
            barrier = threading.Barrier(WRITERS)
            errors: list[str] = []
            saved: list[int] = []

            def run(i: int, sid: str = sid, barrier: threading.Barrier = barrier, r: int = r,
                    errors: list[str] = errors, saved: list[int] = saved) -> None:
                try:
                    barrier.wait(30)
                    own = writers[i]
                    deadline = time.monotonic() + 60
                    mine = _claimant()
                    while (held := own.acquire(sid, mine, 0.05)).token != mine.token:
                        assert time.monotonic() < deadline, "the lease never came free"
                        time.sleep(0.01)
                    try:
                        own.save_fenced(sid, held, _transcript(i, r), take_steers=True, replace=True)
                        saved.append(i)
                    except agent.LeaseLost:
                        pass  # taken over meanwhile: refused, which is right
                except BaseException:  # noqa: BLE001 - reported below
                    errors.append(traceback.format_exc())

            threads = [threading.Thread(target=run, args=(i,)) for i in range(WRITERS)]
            for t in threads:
                t.start()
            _join(threads)
            assert not errors, f"round {r}: a fenced first save failed:\n{errors[0]}"
            stored = store.messages(sid)
            assert saved and stored in [_transcript(i, r) for i in saved], f"round {r}: stored {stored}, saved {saved}"

    # -- the cancel flag a fenced save returns ---------------------------------------------------------

    def _saves(self, store: RunStore) -> list[tuple[str, _Save]]:
        def plain(s: RunStore, sid: str, held: Holder, msgs: list[Message], take: bool) -> Saved:
            return s.save_fenced(sid, held, msgs, take_steers=take)

        def with_events(s: RunStore, sid: str, held: Holder, msgs: list[Message], take: bool) -> Saved:
            assert isinstance(s, EventStore)
            return s.save_fenced_events(sid, held, msgs, take_steers=take, events=[encode("note", {"n": len(msgs)})],
                                        keep=100)

        saves: list[tuple[str, _Save]] = [("save_fenced", plain)]
        if Capability.EVENTS in self.capabilities and isinstance(store, EventStore):
            saves.append(("save_fenced_events", with_events))
        return saves

    def test_every_fenced_save_reports_a_cancel_and_a_takeover_starts_without(self) -> None:
        store = self.run_store()
        for name, save in self._saves(store):
            for take in (True, False):
                how = f"{name}(take_steers={take})"
                sid = _sid("cancel-")
                msgs = [Message.user(f"m{i}") for i in range(6)]
                a = store.acquire(sid, _claimant(), 0.3)
                assert save(store, sid, a, msgs[:1], take).cancelled is False, f"{how}: the first write"
                assert save(store, sid, a, msgs[:2], take).cancelled is False, f"{how}: an append"
                assert store.cancel(sid) is True
                assert save(store, sid, a, msgs[:3], take).cancelled is True, f"{how}: an append after a cancel"
                assert save(store, sid, a, msgs[:3], take).cancelled is True, f"{how}: nothing new after a cancel"
                cold = self.another(store)  # knows nothing: its save is a first write
                assert save(cold, sid, a, msgs[:4], take).cancelled is True, f"{how}: a first write after a cancel"
                assert store.messages(sid) == msgs[:4], f"{how}: a cancelled run's saves are still stored"
                wait_for(functools.partial(_lapsed, store, sid), "the lease to lapse on the store's clock")
                b = store.acquire(sid, _claimant(), 30)  # handed the cancel; its own lease starts without
                assert b.epoch > a.epoch and b.cancelled is True
                assert save(store, sid, b, msgs[:5], take).cancelled is False, f"{how}: an append after a takeover"
                assert save(store, sid, b, msgs[:5], take).cancelled is False, f"{how}: nothing new after a takeover"
                cold = self.another(store)
                assert save(cold, sid, b, msgs, take).cancelled is False, f"{how}: a first write after a takeover"
                assert store.cancel(sid) is True
                assert save(store, sid, b, [*msgs, Message.user("z")], take).cancelled is True, (
                    f"{how}: the new holder's append after a cancel")
                store.release(sid, b)

    # -- a non-idempotent result journalled before the reply's other calls ------------------------------

    def test_a_crash_after_a_non_idempotent_call_replays_its_result_when_more_calls_followed(self) -> None:
        """The reply is [charge (not idempotent), refresh, lookup]: the worker dies inside refresh. The
        resume must replay charge's real result (it ran: never run it again, and its outcome is known)."""
        store = self.run_store()
        sid = _sid("journal-")
        ran: list[str] = []

        @agent.tool(idempotent=False)
        def charge(n: int) -> str:
            """Not idempotent: runs once, first."""
            ran.append("charge")
            return f"charged {n}"

        @agent.tool
        def refresh(n: int) -> str:
            """Idempotent: the worker dies in it the first time."""
            ran.append("refresh")
            if ran.count("refresh") == 1:
                raise _Crash
            return "refreshed"

        @agent.tool
        def lookup(n: int) -> str:
            """Idempotent."""
            ran.append("lookup")
            return "looked up"

        model = ToolsThenAnswer(["charge", "refresh", "lookup"])
        spec = agent.Spec(session=agent.open(sid, store), tools=[charge, refresh, lookup])
        with pytest.raises(_Crash):
            agent.Runner().run(spec, [Message.user("go")], model)
        assert ran == ["charge", "refresh"]
        worker = self.another(store)  # the redelivered task, in another worker
        result = agent.Runner().run(agent.Spec(session=agent.open(sid, worker), tools=[charge, refresh, lookup]),
                                    worker.messages(sid), model)
        assert ran.count("charge") == 1, "the non-idempotent tool ran again after the resume"
        assert result.stop_reason == "answered"
        results = {c.tool_call_id: c for c in worker.messages(sid)[2].content}
        assert results["call_0_0"].text != UNKNOWN_OUTCOME, "the journalled result of charge was not replayed"
        assert results["call_0_0"].text == "charged 0" and not results["call_0_0"].is_error
        assert results["call_0_1"].text == "refreshed" and results["call_0_2"].text == "looked up"
        assert not agent.orphaned_tool_calls(worker.messages(sid))
