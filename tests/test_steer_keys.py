"""``Session.steer(key=)`` at the session, whatever the store: a key is checked before the store is asked,
and a store without ``SteerKeyStore`` is told so (``Unsupported``) rather than sent an unkeyed steer that a
retry would double. What each store does with a key is storetest's (storetest/steer_keys.py)."""

from __future__ import annotations

import pytest

import agent_sessions as agent
from agent_sessions import validate
from stores import memory
from tests.four_method_store import FourMethodStore


def test_a_store_without_steer_keys_refuses_a_keyed_steer_and_stores_nothing() -> None:
    store = FourMethodStore()
    assert not isinstance(store, agent.SteerKeyStore) and isinstance(memory.Store(), agent.SteerKeyStore)
    session = agent.open("s", store)
    with pytest.raises(agent.Unsupported, match="SteerKeyStore"):
        session.steer("once", key="k")
    assert store.take_steers("s") == []
    assert session.steer("unkeyed") is True  # without a key it works as it always did
    assert store.take_steers("s") == ["unkeyed"]


@pytest.mark.parametrize("bad", ["", "x" * 256, "a\nb", "\x1b[0m", "nul\x00", "\ud800", 1, b"k"])
def test_a_bad_key_is_an_argument_error_naming_where(bad: object) -> None:
    with pytest.raises(agent.ArgumentError, match=r"Session\.steer\(key=\)"):
        agent.open("s", memory.Store()).steer("text", key=bad)  # type: ignore[arg-type]
    with pytest.raises(agent.ArgumentError, match="steer key"):
        validate.steer_key(bad)


def test_a_key_may_be_any_printable_text_up_to_255_characters() -> None:
    for good in ("k", "req 8f2c/ü/😀", "x" * 255, " leading and trailing "):
        assert validate.steer_key(good) == good


def test_the_text_is_checked_before_the_key_decides_anything() -> None:
    store = memory.Store()
    session = agent.open("s", store)
    with pytest.raises(agent.ArgumentError, match="steer text"):
        session.steer("", key="k")
    assert session.steer("real", key="k") is True
