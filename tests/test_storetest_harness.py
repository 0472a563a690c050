"""storetest's own harness: a failure in a child process is reported, not waited out."""

from __future__ import annotations

import subprocess
import sys
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
