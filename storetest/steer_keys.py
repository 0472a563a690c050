"""The SteerKeyStore contract: a steer sent with a key is stored once per session, and the key is remembered
for as long as the session exists: what makes a steer safe to send again after ``OutcomeUnknown``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import agent_sessions as agent
from agent_sessions import ArgumentError, Message, SteerKeyStore

from . import strategies
from .capabilities import Capability
from .crossprocess import in_processes
from .mixin import ContractMixin, new_id, together
from .scripted import Answer, Held

KEYS = st.text(st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"),
                             include_characters=" "), min_size=1, max_size=255)
"""Keys a caller may use: printable characters, 1 to 255 of them."""

def _keyed_sender(store: SteerKeyStore, i: int, barrier: object, sid: str, key: str) -> bool:
    return store.add_steer_once(sid, f"from process {i}", key)


class SteerKeyContract(ContractMixin):
    """Mixed into StoreContract; ``make_store``, ``requires``, ``factory`` and ``hypothesis`` come from there."""

    def steer_key_store(self, *needs: Capability) -> SteerKeyStore:
        return self.capable_store(Capability.STEER_KEYS, "add_steer_once", *needs)

    def test_a_keyed_steer_is_stored_once_per_session_and_its_key_outlives_its_delivery(self) -> None:
        store = self.steer_key_store()
        sid, other = new_id("once"), new_id("other")
        assert store.add_steer_once(sid, "check the expiry", "k-1") is True
        assert store.add_steer_once(sid, "check the expiry", "k-1") is False
        assert store.add_steer_once(sid, "another text, the same key", "k-1") is False
        store.add_steer(sid, "two")
        assert store.add_steer_once(sid, "three", "b") is True
        store.add_steer(sid, "two")  # without a key, sending again stores again
        assert store.add_steer_once(sid, "four", "K-1") is True  # keys compare exactly: case
        assert store.add_steer_once(sid, "five", "k-1 ") is True  # and a trailing space
        assert store.add_steer_once(other, "for the other session", "k-1") is True
        assert store.take_steers(sid) == ["check the expiry", "two", "three", "two", "four", "five"]
        assert store.add_steer_once(sid, "check the expiry", "k-1") is False  # delivered: still remembered
        assert store.take_steers(sid) == [] and store.take_steers(other) == ["for the other session"]
        session = agent.open(other, store)  # through a session: whether it was stored
        assert (session.steer("first", key="req-1"), session.steer("first", key="req-1")) == (True, False)
        assert session.steer("first") is True  # no key: stored again
        with pytest.raises(ArgumentError, match="key"):
            session.steer("x", key="")
        assert session.take_steers() == ["first", "first"]
        for bad in ("", "x" * 256, "line\n", "tab\there", "nul\x00", "lone \ud800", 7, None, b"bytes"):
            with pytest.raises(ArgumentError):  # a bad key is refused and nothing is stored
                store.add_steer_once(other, "never stored", bad)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError):
            store.add_steer_once(other, "", "good key")
        assert store.add_steer_once(other, "kept", "x" * 255) is True
        assert store.add_steer_once(other, "the key of the refused empty text was not taken", "good key") is True
        assert store.take_steers(other) == ["kept", "the key of the refused empty text was not taken"]

    def test_threads_racing_one_key_store_it_exactly_once(self) -> None:
        store = self.steer_key_store()
        n = max(2, self.concurrency)
        for round in range(5):
            sid = new_id(f"race{round}")
            results = together(n, lambda i: store.add_steer_once(sid, f"from thread {i}", "the key"))  # noqa: B023
            assert sorted(results) == [False] * (n - 1) + [True], results
            taken = store.take_steers(sid)
            assert len(taken) == 1 and taken[0].startswith("from thread "), taken

    def test_processes_racing_one_key_store_it_exactly_once(self) -> None:
        factory = self.factory()
        self.steer_key_store()
        sid = new_id("procs")
        results = in_processes(factory, 6, _keyed_sender, sid, "the key")
        assert sorted(results) == [False] * 5 + [True], results
        assert len(self.make_store().take_steers(sid)) == 1

    def test_property_keyed_steers_round_trip_once(self) -> None:
        store = self.steer_key_store()

        @given(st.lists(st.tuples(strategies.steer_texts, KEYS), max_size=6, unique_by=lambda p: p[1]))
        @self.hypothesis()
        def check(steers: list[tuple[str, str]]) -> None:
            sid = new_id("prop")
            for text, key in steers:
                assert store.add_steer_once(sid, text, key) is True
            for text, key in steers:
                assert store.add_steer_once(sid, text, key) is False
            assert store.take_steers(sid) == [text for text, _ in steers]

        check()

    def test_a_keyed_steer_joins_the_turn_it_lands_in_and_its_redelivery_is_answered(self) -> None:
        """The run that took the steer with the turn's own message fails: taking the steer for a later turn
        would leave it ``superseded`` and unanswered."""
        store = self.steer_key_store(Capability.RUN_STORE)
        sid = new_id("joins")
        assert store.add_steer_once(sid, "and mind the expiry", "steer-key") is True
        spec = agent.Spec(session=agent.open(sid, store))

        class Down:
            def complete(self, system: str, messages: object, tools: object) -> Message:
                raise agent.EndpointError("the model is down")

        with pytest.raises(agent.EndpointError):
            agent.Runner().turn(spec, "the question", "turn-key", Down())
        stored = store.messages(sid)
        assert [(m.text, m.key, m.steer) for m in stored] == [("the question", "turn-key", False),
                                                             ("and mind the expiry", "steer-key", True)]
        again = agent.Runner().turn(spec, "the question", "turn-key", Answer("both answered"))
        assert (again.stop_reason, again.text) == ("answered", "both answered")

    def test_a_steered_turn_retried_gets_its_own_answer_never_an_earlier_one_of_the_same_text(self) -> None:
        """The session holds an earlier "yes", answered, while the retried turn's "yes" waits as a keyed steer:
        identity, not text, says which message is the caller's."""
        store = self.steer_key_store(Capability.RUN_STORE)
        sid = new_id("yes")
        session = agent.open(sid, store)
        first = agent.Runner().run(agent.Spec(session=session), [Message.user("yes")], Answer("the first answer"))
        assert first.text == "the first answer"
        held = Held("more")
        holding = agent.Runner().start(agent.Spec(session=session, lease_ttl=30),
                                       [*session.messages(), Message.user("tell me more")], held)
        try:
            assert held.entered.wait(20), "the holding run never asked its model"
            spec = agent.Spec(session=agent.open(sid, store), lease_wait=0.0)
            for _ in range(2):  # the turn, then its retry while its steer still waits
                with pytest.raises(agent.StillQueued):
                    agent.Runner().turn(spec, "yes", "k-yes-2", Answer("never asked"), if_busy="steer")
        finally:
            held.go.set()
        assert holding.wait(20).text == "more"
        mine = agent.Runner().turn(agent.Spec(session=agent.open(sid, store), lease_wait=10.0), "yes", "k-yes-2",
                                   Answer("the second answer"), if_busy="steer")
        assert mine.text == "the second answer"
        again = agent.Runner().turn(agent.Spec(session=agent.open(sid, store), lease_wait=0.0), "yes", "k-yes-2",
                                    Answer("never asked"), if_busy="steer")
        assert (again.text, again.steps) == ("the second answer", 0)
