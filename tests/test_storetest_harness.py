"""storetest's own harness: a failure in a child process is reported, not waited out."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from xml.etree import ElementTree

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


BUGGY = '''
import pathlib, tempfile, uuid
import storetest
from stores import sqlite


class TestANewFilePerStoreObject(storetest.StoreContract):
    """A durable store with a bug: each store object opens a file of its own. It gives no process_factory."""

    def make_store(self):
        return sqlite.open(pathlib.Path(tempfile.mkdtemp()) / f"{uuid.uuid4().hex}.db")


class TestAStoreDeclaringItLivesInOneProcess(storetest.StoreContract):
    capabilities = storetest.Capability.none_but(storetest.Capability.RUN_STORE)

    def make_store(self):
        from stores import memory
        return memory.Store()
'''


def test_a_declared_capability_the_store_does_not_deliver_fails_and_never_skips(tmp_path: Path) -> None:
    """Before capabilities, such a store passed: the tests that would catch it skipped."""
    (tmp_path / "test_buggy.py").write_text(BUGGY)
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path / "test_buggy.py"), "-q", "-p", "no:cacheprovider",
         "-k", "second_store_object or concurrent_processes or stopped_past", f"--junitxml={report}",
         "--rootdir", str(tmp_path)],
        cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=300,
    )
    cases = {c.get("classname", "").rsplit(".", 1)[-1] + "::" + c.get("name", ""): c
             for c in ElementTree.parse(report).getroot().iter("testcase")}
    buggy = {n: c for n, c in cases.items() if n.startswith("TestANewFilePerStoreObject")}
    declared = {n: c for n, c in cases.items() if n.startswith("TestAStoreDeclaringItLivesInOneProcess")}
    assert len(buggy) == 3 and len(declared) == 3, sorted(cases)
    for name, case in buggy.items():
        assert case.find("failure") is not None, f"{name} did not fail"
    assert "does not see what the first saved" in str(ElementTree.tostring(
        buggy["TestANewFilePerStoreObject::test_a_second_store_object_sees_and_replaces_what_the_first_saved"]))
    for name, case in declared.items():
        assert case.find("skipped") is not None, f"{name} should skip for a store declaring it lives in one process"


def _gapped_calls(seed: int) -> list[str]:
    """Forty backend calls of op 1 (a thread named as the model test names it) beside a running op 2: the
    pauses ``storetest.gaps`` took, as its op log says."""
    from agent_sessions.backend import Backend, Change, Guard, Want
    from stores import memory
    from storetest.gaps import Gaps

    gaps = Gaps(seed)
    store = gaps.stand(memory.Store())
    assert isinstance(store.backend, Backend) and gaps.stand(store).backend is store.backend
    beside = threading.Event()
    other = threading.Thread(target=beside.wait, args=(30,), name="model-op-2")
    other.start()
    try:
        def op() -> None:
            for _ in range(20):
                store.backend.write("gaps", Guard(), Change(exist=True))
                store.backend.read("gaps", Want())
        mine = threading.Thread(target=op, name="model-op-1")
        mine.start()
        mine.join(30)
        assert not mine.is_alive()
        op()  # the machine's own thread: never paused
    finally:
        beside.set()
        other.join(30)
    assert gaps.lines(2) == []
    return gaps.lines(1)


def test_gaps_pause_where_the_seed_says_and_say_where() -> None:
    """The model test's gaps (``AGENT_SESSIONS_MODEL_GAPS=on``) are the seed's: a replay pauses at the same
    calls for as long, each pause in the op log; none on a thread that is no op's; a store without a
    backend is left as it is."""
    from storetest.gaps import MOST, Gaps

    first = _gapped_calls(7)
    assert 1 <= len(first) <= MOST + 1 and all(line.startswith("  op 1 paused ") for line in first), first
    assert _gapped_calls(7) == first
    plain = object()
    assert Gaps(7).stand(plain) is plain and not hasattr(plain, "backend")
