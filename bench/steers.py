"""Steer throughput: K processes adding and K taking on one session at once, with the exactly-once
check on what was taken (storetest's own)."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Callable
from typing import Any

import agent_sessions as agent
from storetest.crossprocess import assert_each_taken_once


def _adder(factory: Callable[[], agent.Store], sid: str, i: int, n: int, barrier: Any, out: Any) -> None:
    store = factory()
    barrier.wait()
    for j in range(n):
        store.add_steer(sid, f"p{i}-{j:04d}")
    out.put(("added", i, [], time.time()))


def _taker(factory: Callable[[], agent.Store], sid: str, i: int, barrier: Any, done: Any, out: Any) -> None:
    store = factory()
    barrier.wait()
    taken: list[str] = []
    while True:
        finished = done.is_set()
        batch = store.take_steers(sid)
        taken.extend(batch)
        if not batch and finished:
            break
    out.put(("taken", i, taken, time.time()))


def throughput(factory: Callable[[], agent.Store], k: int, per_adder: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    sid = f"bench-steers-{uuid.uuid4().hex}"
    barrier, done, out = ctx.Barrier(2 * k + 1), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_adder, args=(factory, sid, i, per_adder, barrier, out)) for i in range(k)]
    procs += [ctx.Process(target=_taker, args=(factory, sid, i, barrier, done, out)) for i in range(k)]
    for p in procs:
        p.start()
    barrier.wait()
    started = time.time()
    reports = [out.get(timeout=300) for _ in range(k)]
    done.set()
    reports += [out.get(timeout=300) for _ in range(k)]
    for p in procs:
        p.join(30)
    taken = [r[2] for r in reports if r[0] == "taken"]
    assert_each_taken_once(taken, "p", k, per_adder)
    seconds = max(r[3] for r in reports) - started
    total = k * per_adder
    return {"processes": 2 * k, "steers": total, "seconds": seconds, "steers_per_s": total / seconds,
            "exactly_once": True}
