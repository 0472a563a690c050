"""The README's main command: examples/sessions, three replica processes over one SQLite file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_the_sessions_example_tells_the_design_notes_story() -> None:
    # In a session of its own, so a timeout (or Ctrl-C) ends the example's replicas and model server too.
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples/sessions/main.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)  # about 5 s; a bound for a loaded machine, not a budget
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert "a fixed script, not a language model" in out
    assert any(line.startswith("replica B   left a steer in sessions.db, holding no run") for line in lines)
    assert any(line.startswith("replica A   ran 2 steps and was never told replica B existed") for line in lines)
    assert "transcript  4 messages, and the steer is message 0 of them" in lines
    assert "renewLease returns a nil lease when the lease has expired: lease.go line 22" in out
    assert any(line.startswith("replica C   resumed from 4 messages it never produced, and answered")
               for line in lines)
    assert "checkToken returns the token error: token.go line 13" in out
    assert "steers      0 left in the store: it was handed over exactly once" in lines
