"""The stranded-runs contract: every write keeps the session's ``open_since``, and
``list_sessions(stranded=True)`` lists the sessions whose turn is open, whose lease is free or lapsed and
not cancelled, oldest first. Other tests share the database: these look only at their own sessions.
"""

from __future__ import annotations

import time

import pytest

from agent_sessions import (
    ArgumentError,
    Content,
    LeaseLost,
    LifecycleStore,
    Message,
    Role,
)

from .capabilities import Capability
from .mixin import ContractMixin, new_holder, new_id

QUESTION = Message.user("what expires?", key="turn-1")
CALL = Message(Role.ASSISTANT, [Content.tool_call("c1", "read_file", '{"path": "lease.go"}')])
RESULT = Message(Role.USER, [Content.tool_result("c1", "package lease")])
ANSWER = Message.assistant("the lease")


def stranded_ids(store: LifecycleStore, grace: float = 0.0) -> list[str]:
    """Every stranded session's id, in listing order (all pages)."""
    ids: list[str] = []
    after = None
    for _ in range(100):
        page = store.list_sessions(limit=1000, after=after, stranded=True, grace=grace)
        ids.extend(info.id for info in page)
        if page.next is None:
            return ids
        after = page.next
    raise AssertionError("over 100,000 stranded sessions: the listing never ends")


class StrandedContract(ContractMixin):

    def test_a_plain_save_marks_an_open_turn_an_answer_clears_it_and_a_fork_keeps_its_own(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("plain")
        store.save(sid, [QUESTION])
        info = store.info(sid)
        assert info is not None and info.open_since is not None
        assert abs(info.open_since.timestamp() - time.time()) < 600
        assert sid in stranded_ids(store)
        store.save(sid, [QUESTION, CALL])  # tool calls without results: still open, since the same time
        again = store.info(sid)
        assert again is not None and again.open_since == info.open_since
        store.save(sid, [QUESTION, CALL, RESULT, ANSWER])
        closed = store.info(sid)
        assert closed is not None and closed.open_since is None
        # A fork exists from the fork on: cut where its turn is open (tool results waiting for the model),
        # that turn waits for its answer like any other, so the sweep sees it; a fork of an answer does not.
        open_fork, closed_fork = new_id("fork-open"), new_id("fork-closed")
        store.fork(sid, open_fork, 3)
        store.fork(sid, closed_fork, 4)
        opened, closed = store.info(open_fork), store.info(closed_fork)
        assert opened is not None and opened.open_since is not None
        assert closed is not None and closed.open_since is None
        ids = stranded_ids(store)
        assert sid not in ids and open_fork in ids and closed_fork not in ids

    def test_info_says_who_holds_the_session_what_waits_and_whether_it_is_stranded(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("info")
        store.save(sid, [QUESTION])
        info = store.info(sid)
        assert info is not None and (info.holder, info.cancelled, info.steers, info.queued) == (None, False, 0, 0)
        assert info.stranded
        holder = store.acquire(sid, new_holder(spec="support-agent"), 30)
        store.add_steer(sid, "one more thing")
        held = store.info(sid)
        assert held is not None and held.holder is not None and held.holder.token == holder.token
        assert held.steers == 1 and not held.stranded
        assert store.cancel(sid) is True
        store.release(sid, holder)
        cancelled = store.info(sid)
        assert cancelled is not None and cancelled.cancelled and cancelled.holder is None and not cancelled.stranded

    def test_every_fenced_save_keeps_the_mark_and_a_live_lease_hides_the_session(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("fenced")
        holder = store.acquire(sid, new_holder(spec="support-agent"), 30)
        for step in ([QUESTION], [QUESTION, CALL], [QUESTION, CALL, RESULT]):  # appends, as a run's steps are
            store.save_fenced(sid, holder, step, take_steers=True)
            info = store.info(sid)
            assert info is not None and info.open_since is not None and info.spec == "support-agent"
        assert sid not in stranded_ids(store)  # a live run holds it
        store.release(sid, holder)
        assert sid in stranded_ids(store)  # its worker is gone: stranded
        holder = store.acquire(sid, new_holder(), 30)
        store.save_fenced(sid, holder, [QUESTION, CALL, RESULT, ANSWER], take_steers=True)
        store.release(sid, holder)
        info = store.info(sid)
        assert info is not None and info.open_since is None and info.spec is None  # the last run named none
        assert sid not in stranded_ids(store)

    def test_a_lapsed_lease_is_stranded_and_a_cancelled_one_is_not(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        lapsed, cancelled = new_id("lapsed"), new_id("cancelled")
        for sid in (lapsed, cancelled):
            holder = store.acquire(sid, new_holder(), 0.5)
            store.save_fenced(sid, holder, [QUESTION], take_steers=False)
        assert store.cancel(cancelled) is True
        time.sleep(1.0)
        found = stranded_ids(store)
        assert lapsed in found and cancelled not in found

    def test_oldest_first_with_grace_and_pages(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        ids = [new_id(f"order-{i}") for i in range(3)]
        for sid in ids:
            store.save(sid, [QUESTION])
            time.sleep(0.02)
        found = stranded_ids(store)
        assert [sid for sid in found if sid in ids] == ids
        assert not set(ids) & set(stranded_ids(store, grace=3600))  # open for less than the grace
        page = store.list_sessions(limit=1, stranded=True)
        assert len(page) == 1 and page.next is not None
        first = page.sessions[0].open_since
        later = store.list_sessions(limit=1, after=page.next, stranded=True)
        assert len(later) <= 1 and all(s.open_since is not None and first is not None and s.open_since >= first
                                       for s in later)
        for bad in ({"prefix": "x"}, {"where": {"user": "u"}}, {"grace": -1}, {"grace": float("nan")}):
            with pytest.raises(ArgumentError):  # the stranded listing takes no prefix or where
                store.list_sessions(stranded=True, **bad)

    def test_a_closing_save_keeps_the_turn_open_while_input_waits(self) -> None:
        """A fenced or a plain save that ends the turn while a message or a steer waits: nobody else would
        answer it if the run's worker died before taking it."""
        store = self.run_store(Capability.LIFECYCLE)
        for kind in ("queue", "steer"):
            for how in ("fenced", "plain"):
                sid = new_id(f"close-{kind}-{how}")
                store.save(sid, [QUESTION])
                holder = store.acquire(sid, new_holder(), 30) if how == "fenced" else None
                if kind == "queue":
                    assert store.enqueue(sid, "turn-2", "and the renewal?") == 1
                else:
                    store.add_steer(sid, "and the renewal?")
                if holder is None:
                    store.save(sid, [QUESTION, ANSWER])
                else:
                    store.save_fenced(sid, holder, [QUESTION, ANSWER], take_steers=False)
                    store.release(sid, holder)
                info = store.info(sid)
                assert info is not None and info.open_since is not None, (kind, how)
                assert sid in stranded_ids(store), (kind, how)

    def test_a_cancelled_session_is_listed_only_while_a_message_is_queued(self) -> None:
        """A cancel stops the turn in progress, not the messages queued behind it."""
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("cancelled")
        store.save(sid, [QUESTION])
        holder = store.acquire(sid, new_holder(), 30)
        assert store.cancel(sid) is True
        store.release(sid, holder)
        assert sid not in stranded_ids(store)
        assert store.enqueue(sid, "turn-2", "and the renewal?") == 1
        assert sid in stranded_ids(store)
        taker = store.acquire(sid, new_holder(), 30)
        assert taker.cancelled  # the cancel is handed to the next holder, still
        assert store.take_queued(sid, taker) == Message.user("and the renewal?", key="turn-2")
        store.cancel(sid)  # handed on again, as a run that stops does
        store.release(sid, taker)
        assert sid not in stranded_ids(store)

    def test_taking_a_queued_message_keeps_the_mark_its_enqueue_set(self) -> None:
        """The sweep's ``grace`` and its order count from when the message was accepted."""
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("keep")
        store.save(sid, [QUESTION, ANSWER])
        assert store.enqueue(sid, "turn-2", "and the renewal?") == 1
        before = store.info(sid)
        assert before is not None and before.open_since is not None
        time.sleep(0.05)
        holder = store.acquire(sid, new_holder(), 30)
        assert store.take_queued(sid, holder) is not None
        store.release(sid, holder)
        after = store.info(sid)
        assert after is not None and after.open_since == before.open_since

    def test_mark_finished_is_fenced_and_refused_while_input_waits(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        sid = new_id("mark")
        store.save(sid, [QUESTION, ANSWER])
        holder = store.acquire(sid, new_holder(), 30)
        store.save_fenced(sid, holder, [QUESTION, ANSWER, Message.user("more")], take_steers=False)
        with pytest.raises(LeaseLost):
            store.mark_finished(sid, new_holder(), None)
        store.add_steer(sid, "waiting")
        assert store.mark_finished(sid, holder, None) is False  # a steer waits: the turn stays open
        assert store.take_steers(sid) == ["waiting"]
        assert store.mark_finished(sid, holder, "not the journal") is False
        assert store.mark_finished(sid, holder, None) is True
        store.release(sid, holder)
        info = store.info(sid)
        assert info is not None and info.open_since is None and sid not in stranded_ids(store)
