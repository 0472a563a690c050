"""StoreContract: what every Store promises, as tests a store's own test class inherits.

Each test makes its store with ``make_store()`` and works on fresh, random session ids, so tests and
Hypothesis examples never see each other's data even on a shared database.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from agent_sessions import ArgumentError, Content, LifecycleStore, Message, MessageError, Role, Store

from . import strategies
from .approvals import ApprovalContract
from .between import BetweenContract
from .capabilities import Capability
from .crossprocess import assert_each_taken_once, exactly_once_across_processes
from .events import EventContract
from .fencing import FencingContract
from .identity import IdentityContract
from .lifecycle import LifecycleContract
from .meeting import MeetingContract
from .mixin import add_and_take, call, new_id, transcript
from .model import ModelContract
from .queue import QueueContract
from .runs import RunStoreContract
from .steer_keys import SteerKeyContract
from .stranded import StrandedContract
from .strategies import VERBATIM_ARGUMENTS
from .sweep import SweepContract
from .tail import TailContract

settings.register_profile(
    "storetest",
    deadline=None,  # network databases are slow and noisy; time is measured in bench/, not here
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SETTINGS = settings.get_profile("storetest")


class StoreContract(RunStoreContract, FencingContract, LifecycleContract, ApprovalContract, EventContract,
                    IdentityContract, MeetingContract, ModelContract, SteerKeyContract, TailContract,
                    StrandedContract, QueueContract, SweepContract, BetweenContract):
    """Subclass as ``Test...`` and implement ``make_store``. Override the class attributes to size the
    suite for a slow backend."""

    examples: int = 40
    """Hypothesis examples per property."""
    concurrency: int = 8
    """Threads adding and threads taking in the exactly-once test (each side)."""
    steers_per_adder: int = 25
    long_transcript: int = 2000
    huge_text_bytes: int = 10_000_000
    """A message and a steer this long must round-trip (the hostile-input check). Lower it to what the
    store documents as its largest message, if that is less (MySQL's depends on max_allowed_packet)."""

    capabilities: frozenset[Capability] = Capability.all()
    """What the store offers (see ``storetest.capabilities``): every test these imply must pass."""

    def make_store(self) -> Store:
        raise NotImplementedError("a StoreContract subclass must implement make_store()")

    def process_factory(self) -> Callable[[], Store] | None:
        """A picklable zero-argument callable that builds this store in another process. Required when
        the store declares ``Capability.PROCESSES`` (the default)."""
        return None

    def requires(self, capability: Capability) -> None:
        """Skip, saying why, unless the store declares ``capability``."""
        if capability not in self.capabilities:
            pytest.skip(f"{type(self).__name__} does not declare Capability.{capability.name}")

    def factory(self) -> Callable[[], Store]:
        """``process_factory()``, which a store declaring ``Capability.PROCESSES`` must give."""
        self.requires(Capability.PROCESSES)
        factory = self.process_factory()
        if factory is None:
            pytest.fail(f"{type(self).__name__} declares Capability.PROCESSES but process_factory() returns None; "
                        "return a picklable callable that builds the store, or remove the capability")
        return factory

    def hypothesis(self, **overrides: Any) -> settings:
        return settings(SETTINGS, **{"max_examples": self.examples, **overrides})

    # -- transcripts ---------------------------------------------------------------------------------

    def test_every_content_type_round_trips(self) -> None:
        store = self.make_store()
        sid = new_id()
        msgs = [
            Message.user("hello"),
            Message(Role.ASSISTANT, [Content.from_text("let me look"),
                                     Content.tool_call("c1", "read_file", '{"path":"a.py"}'),
                                     Content.tool_call("c2", "grep", '{"q":"x"}')]),
            Message(Role.USER, [Content.tool_result("c1", "print(1)"),
                                Content.tool_result("c2", "no such file", is_error=True)]),
            Message(Role.ASSISTANT, []),
            Message.assistant(""),
            Message.user("nul \x00 lone \ud800 \udfff astral \U0001f600 bom \ufeff"), call("c3", "{}"),
            Message(Role.USER, [Content.tool_result("c3", "\x00\x01\x1f", is_error=True)]),
        ]
        store.save(sid, msgs)
        got = store.messages(sid)
        assert got == msgs
        assert all(isinstance(m, Message) for m in got)

    def test_tool_call_arguments_are_kept_byte_for_byte(self) -> None:
        store = self.make_store()
        sid = new_id()
        msgs = [call(f"c{i}", text) for i, text in enumerate(VERBATIM_ARGUMENTS)]
        store.save(sid, msgs)
        got = [m.tool_calls[0].arguments for m in store.messages(sid)]
        for want, have in zip(VERBATIM_ARGUMENTS, got, strict=True):
            assert have == want, f"stored {want!r}, got back {have!r}"

    def test_a_tool_result_that_answers_no_call_is_refused(self) -> None:
        store = self.make_store()
        sid = new_id()
        good = [Message.user("q"), call("c1", "{}"), Message(Role.USER, [Content.tool_result("c1", "r")])]
        store.save(sid, good)
        for bad in ([Message.user("q"), Message(Role.USER, [Content.tool_result("c1", "r")])],
                    [*good[:2], Message(Role.USER, [Content.tool_result("c2", "which call?")])],
                    [*good, Message(Role.USER, [Content.tool_result("c1", "answered twice")])],
                    [Message(Role.USER, [Content.tool_result("c1", "first of all")])]):
            with pytest.raises(MessageError, match="tool result for call"):
                store.save(sid, bad)
        assert store.messages(sid) == good

    def test_save_replaces_with_shorter_longer_and_diverging_transcripts(self) -> None:
        store = self.make_store()
        sid = new_id()
        base = transcript(10)
        for msgs in (base, base[:4], base, [*base, *transcript(5, "more ")], [],
                     [*base[:6], *transcript(7, "fork ")], base[:1], transcript(3, "new ")):
            store.save(sid, msgs)
            assert store.messages(sid) == msgs

    def test_a_second_store_object_sees_and_replaces_what_the_first_saved(self) -> None:
        self.requires(Capability.DURABLE)
        first, second = self.make_store(), self.make_store()
        sid = new_id()
        first.save(sid, transcript(6))
        assert second.messages(sid) == transcript(6), (
            "the store declares Capability.DURABLE, but a second store object does not see what the first saved")
        second.save(sid, [*transcript(6), *transcript(2, "b ")])
        first.save(sid, [*transcript(6), *transcript(1, "a ")])  # first must not trust its own view
        assert second.messages(sid) == [*transcript(6), *transcript(1, "a ")]

    def test_session_ids_are_compared_exactly(self) -> None:
        store = self.make_store()
        base = new_id()
        variants = [base + "-Case", base + "-case", base + "-case ", base + "-cas\u00e9", base + "-case\u0301"]
        for i, sid in enumerate(variants):
            store.save(sid, [Message.user(str(i))])
        for i, sid in enumerate(variants):
            assert store.messages(sid) == [Message.user(str(i))], f"{sid!r} was confused with another id"

    def test_a_long_transcript_round_trips(self) -> None:
        store = self.make_store()
        sid = new_id()
        msgs = transcript(self.long_transcript)
        store.save(sid, msgs)
        assert store.messages(sid) == msgs
        msgs.append(Message.assistant("one more"))
        store.save(sid, msgs)
        assert store.messages(sid) == msgs

    # -- steers --------------------------------------------------------------------------------------

    def test_steers_come_back_oldest_first_once_and_apart_from_the_transcript(self) -> None:
        store = self.make_store()
        sid = new_id()
        assert store.take_steers(sid) == []
        store.save(sid, transcript(3))
        texts = ["'; DROP TABLE agent_steers; --", "日本語 😀 \U0001f9ea", "x" * 100_000, " spaced ", "\n",
                 *(f"steer {i}" for i in range(8))]
        for t in texts:
            store.add_steer(sid, t)
        if isinstance(store, LifecycleStore):  # shown, and left in place
            assert store.pending_steers(sid) == texts and store.pending_steers(sid) == texts
        assert store.messages(sid) == transcript(3)
        store.save(sid, transcript(4))
        assert store.take_steers(sid) == texts
        assert store.take_steers(sid) == []
        store.add_steer(sid, "after a take")
        assert store.take_steers(sid) == ["after a take"]
        assert store.messages(sid) == transcript(4)

    def test_each_steer_is_taken_exactly_once_by_concurrent_threads(self) -> None:
        store = self.make_store()
        sid = new_id()
        k, m = self.concurrency, self.steers_per_adder
        # Each taker's whole sequence must keep every sender's order: stronger than each batch alone.
        assert_each_taken_once(add_and_take(sid, [store.add_steer] * k, [store.take_steers] * k, m), "s", k, m)

    def test_each_steer_is_taken_exactly_once_by_concurrent_processes(self) -> None:
        exactly_once_across_processes(self.factory(), new_id(), adders=4, takers=4, per_adder=40)

    # -- bad input -----------------------------------------------------------------------------------

    def test_bad_input_is_a_typed_error_and_changes_nothing(self) -> None:
        store = self.make_store()
        sid = new_id()
        kept = transcript(4)
        store.save(sid, kept)
        store.add_steer(sid, "kept steer")
        bad_ids: list[Any] = ["", None, 42, b"bytes", "x" * 256, "nul\x00id", "lone\ud800"]
        for bad in bad_ids:
            with pytest.raises(ArgumentError):
                store.save(bad, kept)
            with pytest.raises(ArgumentError):
                store.messages(bad)
            with pytest.raises(ArgumentError):
                store.add_steer(bad, "x")
            with pytest.raises(ArgumentError):
                store.take_steers(bad)
        bad_transcripts: list[Any] = [
            [*kept, "not a message"], [*kept, {"role": "user", "content": []}], [None], "text", None,
            Message.user("a bare message, not a list"),
        ]
        for bad in bad_transcripts:
            with pytest.raises(ArgumentError):
                store.save(sid, bad)
        for bad_text in ["", None, 3, b"bytes", "nul\x00", "lone\ud800"]:
            with pytest.raises(ArgumentError):
                store.add_steer(sid, bad_text)  # type: ignore[arg-type]
        assert store.messages(sid) == kept
        assert store.take_steers(sid) == ["kept steer"]

    def test_ten_megabyte_texts_round_trip_and_touch_nothing_else(self) -> None:
        store = self.make_store()
        canary, sid = new_id("canary"), new_id()
        store.save(canary, transcript(3, "canary "))
        huge = "y" * self.huge_text_bytes
        msgs = [Message.user(huge), call("c", '{"blob": "' + "z" * (self.huge_text_bytes // 10) + '"}')]
        store.save(sid, msgs)
        store.add_steer(sid, huge)
        assert store.messages(sid) == msgs
        assert store.take_steers(sid) == [huge]
        assert store.messages(canary) == transcript(3, "canary ")

    # -- properties ----------------------------------------------------------------------------------

    def test_property_hostile_ids_and_texts_give_a_typed_error_or_a_verbatim_round_trip(self) -> None:
        store = self.make_store()
        canary, prefix = new_id(), uuid.uuid4().hex[:8]
        kept = transcript(4, "canary ")
        store.save(canary, kept)

        @self.hypothesis()
        @given(strategies.hostile_values, strategies.hostile_values)
        def check(raw_id: Any, text: Any) -> None:
            sid = prefix + raw_id if isinstance(raw_id, str) else raw_id
            try:
                store.save(sid, [Message.user(text if isinstance(text, str) else repr(text))])
            except ArgumentError:
                pass
            else:
                assert store.messages(sid) == [Message.user(text if isinstance(text, str) else repr(text))]
            try:
                store.add_steer(sid, text)
            except ArgumentError:
                pass
            else:
                assert store.take_steers(sid) == [text]
            assert store.messages(canary) == kept
            assert store.take_steers(canary) == []

        check()

    def test_property_any_session_id_and_steer_round_trip(self) -> None:
        store = self.make_store()
        prefix = uuid.uuid4().hex[:8]

        @self.hypothesis()
        @given(strategies.session_ids.map(lambda s: (prefix + s)[:255]), st.lists(strategies.steer_texts,
                                                                                  min_size=1, max_size=3))
        def check(sid: str, steers: list[str]) -> None:
            msgs = [Message.user(sid)]
            store.save(sid, msgs)
            for t in steers:
                store.add_steer(sid, t)
            assert store.messages(sid) == msgs
            assert store.take_steers(sid) == steers
            store.save(sid, [])

        check()

    def test_property_store_behaves_like_a_dict_and_queues(self) -> None:
        make_store = self.make_store
        ids = [new_id(str(i)) for i in range(3)]

        class Machine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.store = make_store()
                self.sessions = [f"{s}-{uuid.uuid4().hex[:6]}" for s in ids]
                self.transcripts: dict[str, list[Message]] = {}
                self.steers: dict[str, list[str]] = {}

            @rule(i=st.integers(0, 2), msgs=strategies.transcripts)
            def save(self, i: int, msgs: list[Message]) -> None:
                self.store.save(self.sessions[i], msgs)
                self.transcripts[self.sessions[i]] = list(msgs)

            @rule(i=st.integers(0, 2), extra=strategies.transcripts)
            def append(self, i: int, extra: list[Message]) -> None:
                sid = self.sessions[i]
                msgs = self.transcripts.get(sid, []) + extra
                self.store.save(sid, msgs)
                self.transcripts[sid] = msgs

            @rule(i=st.integers(0, 2), cut=st.integers(0, 5))
            def truncate(self, i: int, cut: int) -> None:
                sid = self.sessions[i]
                msgs = self.transcripts.get(sid, [])[:cut]
                self.store.save(sid, msgs)
                self.transcripts[sid] = msgs

            @rule(i=st.integers(0, 2), text=strategies.steer_texts)
            def add_steer(self, i: int, text: str) -> None:
                self.store.add_steer(self.sessions[i], text)
                self.steers.setdefault(self.sessions[i], []).append(text)

            @rule(i=st.integers(0, 2))
            def take_steers(self, i: int) -> None:
                sid = self.sessions[i]
                assert self.store.take_steers(sid) == self.steers.pop(sid, [])

            @rule(i=st.integers(0, 2))
            def messages(self, i: int) -> None:
                sid = self.sessions[i]
                assert self.store.messages(sid) == self.transcripts.get(sid, [])

            @invariant()
            def transcripts_match(self) -> None:
                for sid, msgs in self.transcripts.items():
                    assert self.store.messages(sid) == msgs

        run_state_machine_as_test(
            Machine, settings=self.hypothesis(max_examples=max(5, self.examples // 4), stateful_step_count=15)
        )
