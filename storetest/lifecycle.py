"""The LifecycleStore contract: listing, inspecting, labelling, deleting and retaining sessions, and the
turn that is safe to repeat (``Runner.turn``). Stores share databases with other tests, so every test
works under a prefix of its own, and ``prune`` (global) is only asked about sessions these tests made.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import (
    ArgumentError,
    LeaseLost,
    LifecycleStore,
    Message,
    SessionBusy,
    SessionInfo,
    lifecycle,
)
from agent_sessions.contract import Scalar

from .capabilities import Capability
from .mixin import HUGE, ContractMixin, new_holder, transcript
from .scripted import Answer


def _prefix() -> str:
    return f"storetest-life-{uuid.uuid4().hex[:12]}-"


LISTED = 200
"""Sessions of the listing property, made oldest first. A store may plan a filtered page by how many
sessions share the wanted value (the SQL stores walk the sessions newest first when there are at least
10 per row of the page, through at most 20 rows per row of the page: stores/_sql/listing.py): with pages
of 2 to 5, the values below (25 to 100 sessions each) fall on both sides of that, and ``old`` (the
oldest 70) is common but out of reach of a walk from the newest."""


def _listed_metadata(i: int) -> dict[str, Scalar]:
    meta: dict[str, Scalar] = {"tenant": f"t{i % 3}", "user": f"u{i // 25}", "even": i % 2 == 0}
    if i < 70:
        meta["old"] = True
    return meta


_WANTED = st.dictionaries(
    st.sampled_from(["tenant", "user", "even", "old", "absent"]),
    st.sampled_from(["t0", "t1", "t2", "t9", "u0", "u3", "u7", "u99", True, False, 1, "x"]),
    min_size=1, max_size=2,
)


def _paged(store: LifecycleStore, prefix: str, where: dict[str, Any], limit: int) -> list[SessionInfo]:
    """Every page of the listing, each checked: full but the last, which alone has no ``next``."""
    seen: list[SessionInfo] = []
    after = None
    for _ in range(LISTED + 1):
        page = store.list_sessions(prefix=prefix, where=where, limit=limit, after=after)
        seen.extend(page.sessions)
        if page.next is None:
            assert len(page) <= limit and (page.sessions or not seen), (prefix, where, limit, len(seen))
            return seen
        assert len(page) == limit, (prefix, where, limit, len(seen))
        after = page.next
    pytest.fail(f"list_sessions(prefix={prefix!r}, where={where!r}, limit={limit}) gave more pages than sessions")


def _gone(store: LifecycleStore, sid: str) -> None:
    assert store.info(sid) is None
    assert store.messages(sid) == []
    assert store.pending_steers(sid) == []


class LifecycleContract(ContractMixin):
    def lifecycle_store(self, *needs: Capability) -> LifecycleStore:
        return self.capable_store(Capability.LIFECYCLE, "check its methods and their names", *needs)

    # -- info and metadata ---------------------------------------------------------------------------

    def test_info_describes_a_saved_session_and_none_for_an_unknown_one(self) -> None:
        store = self.lifecycle_store()
        sid = _prefix() + "a"
        assert store.info(sid) is None
        store.add_steer(sid, "a steer alone does not make the session exist")
        assert store.info(sid) is None
        store.save(sid, transcript(7))
        info = store.info(sid)
        assert info is not None
        assert (info.id, info.messages, dict(info.metadata)) == (sid, 7, {})
        assert info.created.tzinfo is not None and info.created <= info.updated
        assert abs(info.updated.timestamp() - time.time()) < 60, "updated is far from now: which clock is it?"
        time.sleep(0.02)
        store.set_metadata(sid, {"k": "v"})  # keeps the transcript, and updated moves on
        after = store.info(sid)
        assert after is not None and after.created == info.created and after.updated > info.updated
        assert store.messages(sid) == transcript(7)

    def test_metadata_merges_removes_with_none_and_creates_the_session(self) -> None:
        store = self.lifecycle_store()
        sid = _prefix() + "m"
        assert store.set_metadata(sid, {"user": "u-17", "tier": 2, "vip": True, "score": 0.5}) == {
            "user": "u-17", "tier": 2, "vip": True, "score": 0.5}
        assert store.messages(sid) == []
        assert store.set_metadata(sid, {"tier": None, "title": "Refund, 'quoted' \"text\" 日本"}) == {
            "user": "u-17", "vip": True, "score": 0.5, "title": "Refund, 'quoted' \"text\" 日本"}
        info = store.info(sid)
        assert info is not None and info.messages == 0
        title = "Refund, 'quoted' \"text\" 日本"
        assert dict(info.metadata) == {"user": "u-17", "vip": True, "score": 0.5, "title": title}
        assert type(info.metadata["vip"]) is bool and type(info.metadata["score"]) is float

    @pytest.mark.parametrize("changes", [
        {"": "empty key"}, {"spa ce": 1}, {"k" * 65: 1}, {"x": [1]}, {"x": {"a": 1}}, {"x": float("nan")},
        {"x": "\x00"}, {"x": "v" * 300}, {f"k{i}": i for i in range(33)}, {1: "not a str key"},
    ])
    def test_bad_metadata_is_refused_and_nothing_changes(self, changes: Any) -> None:
        store = self.lifecycle_store()
        sid = _prefix() + "bad"
        store.set_metadata(sid, {"keep": "me"})
        with pytest.raises(ArgumentError):
            store.set_metadata(sid, changes)
        info = store.info(sid)
        assert info is not None and dict(info.metadata) == {"keep": "me"}

    @pytest.mark.parametrize("value", [HUGE, -HUGE, 10**300], ids=["huge", "-huge", "1e300"])
    def test_a_metadata_int_too_long_for_json_is_refused_naming_its_key(self, value: int) -> None:
        store = self.lifecycle_store()
        sid = _prefix() + "huge"
        store.set_metadata(sid, {"keep": "me"})
        with pytest.raises(ArgumentError, match="'count'"):
            store.set_metadata(sid, {"ok": 1, "count": value})
        with pytest.raises(ArgumentError, match="'count'"):
            store.list_sessions(where={"count": value})
        info = store.info(sid)
        assert info is not None and dict(info.metadata) == {"keep": "me"}

    # -- listing ---------------------------------------------------------------------------------------

    def test_list_is_newest_first_filtered_by_prefix_and_metadata(self) -> None:
        store = self.lifecycle_store()
        prefix = _prefix()
        for i, user in enumerate(["u-1", "u-2", "u-1", "u-1", "u-2"]):
            store.set_metadata(f"{prefix}{i}", {"user": user, "n": i, "odd": i % 2 == 1})
            time.sleep(0.01)
        store.save(f"{prefix}0", transcript(2))  # now the most recently updated
        page = store.list_sessions(prefix=prefix)
        assert [s.id for s in page] == [f"{prefix}{i}" for i in (0, 4, 3, 2, 1)]
        assert page.next is None and page.sessions[0].messages == 2
        assert [s.id for s in store.list_sessions(prefix=prefix, where={"user": "u-1"})] == [
            f"{prefix}{i}" for i in (0, 3, 2)]
        assert [s.id for s in store.list_sessions(prefix=prefix, where={"user": "u-1", "odd": True})] == [f"{prefix}3"]
        assert list(store.list_sessions(prefix=prefix, where={"n": "1"})) == []  # "1" is not 1
        assert list(store.list_sessions(prefix=prefix, where={"odd": 1})) == []  # 1 is not true
        assert list(store.list_sessions(prefix=prefix + "nobody")) == []
        odd = "%_'\"; DROP TABLE agent_sessions; --\\"  # hostile prefixes and values are data, not syntax
        store.set_metadata(prefix + odd, {"q": odd})
        assert [s.id for s in store.list_sessions(prefix=prefix + "3%")] == []  # LIKE would match "3"
        assert [s.id for s in store.list_sessions(prefix=prefix + "_")] == []
        assert [s.id for s in store.list_sessions(prefix=prefix, where={"q": odd})] == [prefix + odd]
        assert [s.id for s in store.list_sessions(prefix=prefix + odd)] == [prefix + odd]

    @pytest.mark.parametrize("kwargs", [
        {"limit": 0}, {"limit": 1001}, {"limit": True}, {"after": "not a cursor"}, {"after": 7},
        {"where": {"bad key": 1}}, {"where": {"k": None}}, {"where": ["k"]}, {"prefix": None}, {"prefix": "\x00"},
    ])
    def test_bad_listing_arguments_are_refused(self, kwargs: Any) -> None:
        store = self.lifecycle_store()
        with pytest.raises(ArgumentError):
            store.list_sessions(**kwargs)

    def test_property_filtered_pages_are_the_filter_of_all_sessions(self) -> None:
        store = self.lifecycle_store()
        prefix = _prefix()
        for i in range(LISTED):
            store.set_metadata(f"{prefix}{'abcd'[i % 4]}{i:03d}", _listed_metadata(i))
        everything = list(store.list_sessions(prefix=prefix, limit=lifecycle.MAX_PAGE))
        assert len(everything) == LISTED

        def wanted(info: SessionInfo, where: dict[str, Any]) -> bool:
            return all(k in info.metadata and lifecycle.metadata_value(k, info.metadata[k])
                       == lifecycle.metadata_value(k, v) for k, v in where.items())

        @self.hypothesis(max_examples=min(self.examples, 20))
        @given(_WANTED, st.sampled_from(["", "a", "b", "c0", "d1", "zz"]), st.sampled_from([2, 3, 5]))
        @example({"tenant": "t1"}, "", 2)  # common: 67 sessions
        @example({"user": "u3"}, "", 2)  # rare: 25
        @example({"old": True}, "", 2)  # common, and only the oldest 70 have it
        @example({"tenant": "t0", "even": True}, "", 2)  # two common keys, a sixth of all sessions
        @example({"user": "u2", "even": False}, "", 2)  # a rare key and a common one
        @example({"even": True}, "c", 3)  # a common value within a prefix
        @example({"old": True, "tenant": "t2"}, "b", 2)
        def check(where: dict[str, Any], sub: str, limit: int) -> None:
            expected = [s for s in everything if s.id.startswith(prefix + sub) and wanted(s, where)]
            assert _paged(store, prefix + sub, where, limit) == expected

        check()

    # -- the tail and the waiting steers -----------------------------------------------------------------

    def test_tail_is_the_last_messages_byte_for_byte(self) -> None:
        store = self.lifecycle_store()
        sid = _prefix() + "t"
        msgs = transcript(30)
        store.save(sid, msgs)
        assert store.tail(sid, 5) == msgs[-5:]
        assert [m.to_json() for m in store.tail(sid, 5)] == [m.to_json() for m in msgs[-5:]]
        assert store.tail(sid, 0) == []
        assert store.tail(sid, 100) == msgs
        assert store.tail(_prefix() + "none", 3) == []
        with pytest.raises(ArgumentError):
            store.tail(sid, -1)
        assert agent.open(sid, store).messages(last=2) == msgs[-2:]

    # -- delete ----------------------------------------------------------------------------------------

    def _keyed_and_queued(self, store: Any, sid: str, queue: bool = True) -> tuple[bool, bool]:
        """Give ``sid`` a keyed steer and a queued message, where the store keeps those: whether it did."""
        keyed = Capability.STEER_KEYS in self.capabilities
        queues = queue and Capability.QUEUE in self.capabilities
        if keyed:
            assert store.add_steer_once(sid, "keyed", "k") is True
        if queues:
            assert store.enqueue(sid, "q", "queued") >= 1
        return keyed, queues

    def _forgotten(self, store: Any, sid: str, keyed: bool, queues: bool) -> None:
        """The steer key and the queue went with the session: a new one of the id takes both afresh."""
        _gone(store, sid)
        assert not keyed or store.add_steer_once(sid, "keyed", "k") is True
        assert not queues or (store.queued(sid) == [] and store.enqueue(sid, "q", "a new session's") == 1)

    def test_delete_removes_everything_at_once(self) -> None:
        store = self.lifecycle_store()
        sid, alone = _prefix() + "d", _prefix() + "steers-alone"
        store.save(sid, transcript(5))
        store.set_metadata(sid, {"user": "u"})
        store.add_steer(sid, "waiting")
        kept = self._keyed_and_queued(store, sid)
        holder = store.acquire(sid, new_holder(), 30)
        store.put_journal(sid, holder, '{"journal": 1}')
        store.release(sid, holder)
        assert store.delete(sid) is True
        _gone(store, sid)
        assert store.journal(sid) is None and store.holder(sid) is None
        assert store.delete(sid) is False
        store.save(sid, transcript(2))  # the id can be used again, from nothing
        info = store.info(sid)
        assert info is not None and info.messages == 2 and dict(info.metadata) == {}
        store.delete(sid)
        self._forgotten(store, sid, *kept)
        # A session of steers alone does not exist (no info), but its steers and their keys go with it.
        keyed, _ = self._keyed_and_queued(store, alone, queue=False)
        store.add_steer(alone, "waiting")
        assert store.info(alone) is None and store.delete(alone) is True
        self._forgotten(store, alone, keyed, False)

    def test_delete_refuses_a_session_a_live_run_holds_and_force_fences_the_run_out(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        sid = _prefix() + "busy"
        holder = store.acquire(sid, new_holder(), 30)
        store.save_fenced(sid, holder, transcript(3), take_steers=False)
        keyed, queues = self._keyed_and_queued(store, sid)
        with pytest.raises(SessionBusy):
            store.delete(sid)
        assert store.messages(sid) == transcript(3)  # and its steer's key and its queue are kept
        assert not keyed or store.add_steer_once(sid, "keyed", "k") is False
        assert not queues or store.queued(sid) == ["q"]
        assert store.delete(sid, force=True) is True
        _gone(store, sid)
        for late_write in (
            lambda: store.save_fenced(sid, holder, transcript(6), take_steers=True),
            lambda: store.put_journal(sid, holder, "{}"),
            lambda: store.renew(sid, holder, 30),
            lambda: store.check(sid, holder),
        ):
            with pytest.raises(LeaseLost):
                late_write()
        store.release(sid, holder)
        _gone(store, sid)

    # -- prune -----------------------------------------------------------------------------------------

    def test_prune_deletes_idle_sessions_only_and_spares_a_held_one(self) -> None:
        store = self.lifecycle_store()
        prefix = _prefix()
        old = [f"{prefix}old{i}" for i in range(5)]
        for sid in old:
            store.save(sid, transcript(3))
            store.add_steer(sid, "stale")
        kept = self._keyed_and_queued(store, old[0])
        held = f"{prefix}held"
        holder = store.acquire(held, new_holder(), 60)
        store.save_fenced(held, holder, transcript(2), take_steers=False)
        time.sleep(1.2)
        fresh = f"{prefix}fresh"
        store.save(fresh, transcript(1))
        assert store.prune(idle_for=1.0, limit=2) <= 2
        deleted = store.prune(idle_for=1.0)
        assert deleted >= 3 or all(store.info(sid) is None for sid in old)
        for sid in old:
            _gone(store, sid)
        self._forgotten(store, old[0], *kept)
        assert store.messages(fresh) == transcript(1)
        assert store.messages(held) == transcript(2)
        store.release(held, holder)
        for bad in (-1, float("nan"), "1", None):
            with pytest.raises(ArgumentError):
                store.prune(idle_for=bad)  # type: ignore[arg-type]

    # -- turns safe to repeat ----------------------------------------------------------------------------

    def test_a_repeated_turn_returns_the_answer_without_asking_again(self) -> None:
        store = self.run_store(Capability.LIFECYCLE)
        sid = _prefix() + "turn"
        spec = agent.Spec(session=agent.open(sid, store))
        model = Answer("the answer")
        first = agent.Runner().turn(spec, "what is it?", "msg-1", model)
        again = agent.Runner().turn(spec, "what is it?", "msg-1", model)
        assert (first.text, first.steps, again.text, again.steps, model.requests) == (
            "the answer", 1, "the answer", 0, 1)
        stored = store.messages(sid)
        assert [m.key for m in stored] == ["msg-1", ""]
        nxt = agent.Runner().turn(spec, "and then?", "msg-2", model)
        assert nxt.steps == 1 and model.requests == 2 and len(store.messages(sid)) == 4
        assert agent.Runner().turn(spec, "what is it?", "msg-1", model).steps == 0  # an older turn, too
        with pytest.raises(ArgumentError, match="already used"):
            agent.Runner().turn(spec, "another text", "msg-1", model)
        store.save(sid, [*store.messages(sid), Message.user("q", key="k")])  # a worker died after saving it
        assert agent.Runner().turn(spec, "q", "k", model).steps == 1  # an unfinished turn: continued, once
        assert model.requests == 3 and [m.text for m in store.messages(sid)][-2:] == ["q", "the answer"]
