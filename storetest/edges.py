"""The EdgeContract: hostile numbers at a store's edges. An event log's ``after`` is a seq, which every store
keeps as a signed 64-bit integer: anything above is an ``ArgumentError`` before any query.
"""

from __future__ import annotations

import pytest

import agent_sessions as agent
from agent_sessions import EventStore, LifecycleStore
from agent_sessions.eventlog import MAX_SEQ, encode

from .capabilities import Capability
from .mixin import ContractMixin, new_holder, new_id

HUGE = 10**5000
"""More digits than ``int()`` and ``str()`` accept by default (4,300): its repr alone raises ValueError."""


class EdgeContract(ContractMixin):
    def _events_with_a_log(self) -> tuple[EventStore, str]:
        self.requires(Capability.EVENTS)
        store = self.make_store()
        assert isinstance(store, EventStore)
        sid = new_id("after")
        holder = store.acquire(sid, new_holder(), 30)
        store.append_events(sid, holder, [encode("note", {"n": 1})], keep=10)
        return store, sid

    def test_the_largest_seq_reads_nothing_rather_than_overflowing(self) -> None:
        store, sid = self._events_with_a_log()
        assert MAX_SEQ == 2**63 - 1
        assert store.events(sid, MAX_SEQ, 10) == []
        assert store.events(new_id("none"), MAX_SEQ, 10) == []
        session = agent.open(sid, store)
        assert session.events(after=MAX_SEQ) == []
        assert list(session.follow(after=MAX_SEQ, timeout=0)) == []
        assert [e.data for e in session.events(after=0)] == [{"n": 1}]

    @pytest.mark.parametrize("after", [2**63, 2**64, 10**30, HUGE, -HUGE], ids=["2**63", "2**64", "1e30", "huge",
                                                                               "-huge"])
    def test_an_after_beyond_a_seq_is_refused_before_any_query(self, after: int) -> None:
        store, sid = self._events_with_a_log()
        session = agent.open(sid, store)
        with pytest.raises(agent.ArgumentError, match="after="):
            store.events(sid, after, 10)
        with pytest.raises(agent.ArgumentError, match="after="):
            session.events(after=after)
        with pytest.raises(agent.ArgumentError, match="after="):
            session.follow(after=after, timeout=0)
        assert [e.data for e in session.events(after=0)] == [{"n": 1}]  # the store still answers

    @pytest.mark.parametrize("value", [HUGE, -HUGE, 10**300], ids=["huge", "-huge", "1e300"])
    def test_a_metadata_int_too_long_for_json_is_refused_naming_its_key(self, value: int) -> None:
        self.requires(Capability.LIFECYCLE)
        store = self.make_store()
        assert isinstance(store, LifecycleStore)
        sid = new_id("meta")
        store.set_metadata(sid, {"keep": "me"})
        with pytest.raises(agent.ArgumentError, match="'count'"):
            store.set_metadata(sid, {"ok": 1, "count": value})
        with pytest.raises(agent.ArgumentError, match="'count'"):
            store.list_sessions(where={"count": value})
        info = store.info(sid)
        assert info is not None and dict(info.metadata) == {"keep": "me"}
