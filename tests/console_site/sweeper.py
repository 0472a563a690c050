"""A process that continues every decided or stranded turn it finds, as a deployment's worker does: a loop
of ``agent.recover`` (a decision on a call makes its turn open again, so the sweep runs it). It prints one
JSON line per session it acted on. It stops when killed, or after its time limit (the first argument,
seconds). Used by tests/test_console.py to continue, in another process, a turn the console approved."""

from __future__ import annotations

import json
import sys
import time

import agent_sessions as agent
from tests.console_site.agent import resolve, store


def main() -> None:
    deadline = time.monotonic() + float(sys.argv[1] if len(sys.argv) > 1 else 120)
    made = store()
    print(json.dumps({"sweeping": True}), flush=True)
    while time.monotonic() < deadline:
        for done in agent.recover(made, resolve, grace=0.0):
            if done.outcome != "skipped":
                print(json.dumps({"session": done.session, "outcome": done.outcome,
                                  "stop_reason": None if done.result is None else done.result.stop_reason,
                                  "error": None if done.error is None else repr(done.error)}), flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
