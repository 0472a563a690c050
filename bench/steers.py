"""Steer throughput: K processes adding and K taking on one session at once, timed by storetest's own
cross-process exactly-once check, which also checks what was taken."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import agent_sessions as agent
from storetest.crossprocess import exactly_once_across_processes


def throughput(factory: Callable[[], agent.Store], k: int, per_adder: int) -> dict[str, Any]:
    sid = f"bench-steers-{uuid.uuid4().hex}"
    seconds = exactly_once_across_processes(factory, sid, adders=k, takers=k, per_adder=per_adder, timeout=300)
    total = k * per_adder
    return {"processes": 2 * k, "steers": total, "seconds": seconds, "steers_per_s": total / seconds,
            "exactly_once": True}
