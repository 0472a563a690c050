"""storetest's own harness: a failure in a child process is reported, not waited out."""

from __future__ import annotations

import time

import pytest

from agent_sessions import Store
from storetest.crossprocess import exactly_once_across_processes


def _broken_store() -> Store:
    raise RuntimeError("the store cannot be opened here")


def test_a_process_that_cannot_open_its_store_fails_the_check_at_once_with_its_error() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="the store cannot be opened here"):
        exactly_once_across_processes(_broken_store, "harness", adders=1, takers=1, per_adder=1, timeout=120)
    assert time.monotonic() - started < 60  # the barrier was aborted, not waited out for 120 s
